"""A corpus's fingerprint: its files with their sizes and modification times, so that a resumed SFT run can tell
that it reads the records it started on (record ids name chats by position; a corpus rewritten between a kill and
the resume would put other chats under the same ids). A stat per file, no read: cheap for any corpus size.

    saved = corpus_fingerprint("gs://bucket/sft/*.jsonl")   # {"spec": ..., "files": [{"file", "bytes", "mtime"}]}
    fingerprint_changes(saved, corpus_fingerprint(spec))    # [] or one line per file added, removed or changed
"""
from __future__ import annotations

import os
import time

from etils import epath

from mercury_jax.data.corpus import corpus_files


def corpus_fingerprint(spec: str) -> dict:
    """The files `spec` names (`corpus_files`), each with its size in bytes and modification time (nanoseconds
    since the epoch for a local file, whole seconds as an object store reports them)."""
    return {"spec": spec, "files": [file_stamp(name) for name in corpus_files(spec)]}


def file_stamp(name: str) -> dict:
    if "://" not in name:
        stat = os.stat(name)
        return {"file": name, "bytes": stat.st_size, "mtime": stat.st_mtime_ns}
    stat = epath.Path(name).stat()
    return {"file": name, "bytes": int(stat.length), "mtime": int(stat.mtime) * 1_000_000_000}


def fingerprint_changes(saved: dict, current: dict) -> list[str]:
    """What differs between two fingerprints, one line per file: gone, new, or another size / modification time."""
    before = {entry["file"]: entry for entry in saved.get("files", [])}
    after = {entry["file"]: entry for entry in current.get("files", [])}
    changes = [f"{name} is gone" for name in before if name not in after]
    changes += [f"{name} is new" for name in after if name not in before]
    for name in before.keys() & after.keys():
        old, new = before[name], after[name]
        if (old["bytes"], old["mtime"]) != (new["bytes"], new["mtime"]):
            changes.append(f"{name} had {old['bytes']} bytes, modified {_when(old['mtime'])}; now {new['bytes']} "
                           f"bytes, modified {_when(new['mtime'])}")
    if not changes and [e["file"] for e in saved.get("files", [])] != [e["file"] for e in current.get("files", [])]:
        changes.append("the same files in another order")
    return sorted(changes)


def _when(mtime_ns: int) -> str:
    seconds, fraction = divmod(int(mtime_ns), 1_000_000_000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{fraction // 1_000_000:03d} UTC"
