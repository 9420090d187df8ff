"""What a remote URI (`gs://bucket/path`, any `scheme://` epath reads) must be before epath touches it: a path with
no `.` or `..` segment (an object store keeps them as written: `gs://b/runs/../x` is not `gs://b/x`), and a scheme
this Python can open. Without TensorFlow, epath opens `gs://` through fsspec, which needs the optional `gcsfs`
package (not in requirements.txt: it pulls in google-auth and aiohttp, and local runs never need it).

    check_remote("gs://bucket/runs/grpo", what="--workdir")   # RemotePathError naming the fix, else None
"""
from __future__ import annotations

import importlib.util
import os

import fsspec

# What to install for a scheme whose fsspec filesystem is missing.
PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}


class RemotePathError(ValueError):
    """A remote URI that cannot be used as written; the message names it and the fix."""


def is_remote(location: str | os.PathLike) -> bool:
    """A `scheme://` URI other than `file://`."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def check_remote(location: str | os.PathLike, what: str = "path", *, filesystem: bool = True) -> None:
    """RemotePathError when `location` is a remote URI with a `.` / `..` segment or (`filesystem`: before it is
    read or written) a scheme nothing here opens. `filesystem=False` checks the spelling alone: naming a remote
    path needs no package."""
    text = os.fspath(location)
    if not is_remote(text):
        return
    scheme, _, rest = text.partition("://")
    segments = rest.split("/")
    if any(segment in (".", "..") for segment in segments[1:]):
        raise RemotePathError(f"{what} {text}: a remote path must not hold '.' or '..' segments (object stores keep "
                              f"them as written); write it out, e.g. {scheme}://{_normalised(segments)}")
    missing = _missing_package(scheme) if filesystem else None
    if missing:
        raise RemotePathError(f"{what} {text}: {scheme}:// paths need the optional package {missing}, which is "
                              f"not installed; run `pip install {missing}` (and authenticate, e.g. `gcloud auth "
                              f"application-default login`), or use a local path")


def _normalised(segments: list[str]) -> str:
    """bucket/a/../b/./c as bucket/b/c (never above the bucket)."""
    kept = [segments[0]]
    for segment in segments[1:]:
        if segment == "..":
            if len(kept) > 1:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    return "/".join(kept)


def _missing_package(scheme: str) -> str | None:
    """The package `scheme://` needs that is not installed (None: epath can open it: TensorFlow's gfile, or an
    fsspec filesystem registered or importable for the scheme)."""
    if _epath_uses_tensorflow():
        return None
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        return PACKAGES.get(scheme, f"the fsspec filesystem for {scheme}://")
    except ValueError:  # a scheme fsspec does not know
        return f"an fsspec filesystem for {scheme}://"
    return None


def _epath_uses_tensorflow() -> bool:
    """epath reads remote URIs through TensorFlow's gfile when TensorFlow is installed (unless EPATH_USE_TF=0)."""
    if os.environ.get("EPATH_USE_TF", "").lower() in ("false", "no", "f", "0"):
        return False
    return importlib.util.find_spec("tensorflow") is not None
