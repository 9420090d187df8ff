"""`gs://` URIs served from a local folder, through the same `etils.epath` code that reads a real bucket.

epath (without TensorFlow) opens `gs://` paths with fsspec's "gcs" filesystem; registering this one under that name
(`serve_buckets(root)`) makes `gs://bucket/a/b` the local `root/bucket/a/b`. Orbax's array reads go through
tensorstore's own GCS driver instead, which this does not reach: use it where no checkpoint array is read.
"""
from __future__ import annotations

from pathlib import Path

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class LocalBuckets(DirFileSystem):
    protocol = ("gs", "gcs")
    root = ""

    def __init__(self, *args, finalize_on_close=None, **kwargs):  # epath passes finalize_on_close for GCS
        if not self.root:
            raise RuntimeError("LocalBuckets.root is unset: call serve_buckets(root) first")
        super().__init__(path=self.root, fs=LocalFileSystem(), **kwargs)


def serve_buckets(root: Path) -> None:
    """Serve `gs://...` from `root` for the rest of the process (epath caches the filesystem it first opens)."""
    if LocalBuckets.root and LocalBuckets.root != str(root):
        raise RuntimeError(f"gs:// is already served from {LocalBuckets.root}")
    LocalBuckets.root = str(root)
    for name in LocalBuckets.protocol:
        fsspec.register_implementation(name, LocalBuckets, clobber=True)
