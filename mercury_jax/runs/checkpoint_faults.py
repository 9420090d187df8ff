"""What can be wrong with an Orbax checkpoint step on disk, and how a failure reads: one line, not a traceback.

A step directory `STEP/` of the trainer's checkpoints holds `arrays/` (an OCDBT array store: `_METADATA`,
`manifest.ocdbt`, data files under `d/` and `ocdbt.process_N/`) and `meta/metadata` (JSON with the step). A save
killed part-way, a disk that filled up or a copy that lost files can leave a directory that Orbax lists but cannot
restore. `unreadable_reason` checks the files every process can see (the same verdict on every process, so a
multi-process resume picks the same step everywhere); a damaged data file is only found by reading it, which
`Checkpointer.restore_latest` does. `describe` and `os_error` turn Orbax/tensorstore errors (a message with the
store's whole JSON spec appended) into one line; `summarise_orbax_tracebacks` does the same for the tracebacks that
Orbax's background save threads log before the error reaches the caller.
"""
from __future__ import annotations

import errno as errno_codes
import json
import logging
import os
import re

from etils import epath

from mercury_jax.runs.checkpoint_roles import is_arrays_item

_SPEC = re.compile(r" \[(tensorstore_spec|source_locations)=.*$")
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
_QUOTED_PATH = re.compile(r'"((?:/|[a-z][a-z0-9+.-]*://)[^"]+)"')
# What to do about the OS errors a save meets, by errno name.
FIXES = {"ENOSPC": "free space on that filesystem", "EDQUOT": "free space or raise the disk quota",
         "EFBIG": "raise the file-size limit (`ulimit -f`) or use a filesystem that allows larger files",
         "EACCES": "make the checkpoint directory writable", "EPERM": "make the checkpoint directory writable",
         "EROFS": "point the run at a writable filesystem"}


class CheckpointRestoreError(RuntimeError):
    """No checkpoint step of a run can be restored; the message lists each step and why."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (disk full, file too large, permissions); the message names the step, the path, the
    OS error and the last step that is committed on disk. `cause` is Orbax's original exception."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def unreadable_reason(step_dir: epath.Path) -> str | None:
    """Why the step directory cannot be a complete checkpoint, from its files alone (None: it looks complete)."""
    if not step_dir.is_dir():
        return "it is not a directory"
    if not any(True for _ in step_dir.iterdir()):
        return "the directory is empty (a save that never wrote anything)"
    items = sorted(p.name for p in step_dir.iterdir() if is_arrays_item(p.name))
    for item in items or ["arrays"]:
        arrays_metadata = step_dir / item / "_METADATA"
        if not arrays_metadata.exists():
            return f"{item}/_METADATA is missing (the array store was never committed or was damaged)"
        try:
            store = json.loads(arrays_metadata.read_text())
        except (ValueError, OSError) as error:
            return f"{item}/_METADATA is unreadable ({type(error).__name__}: {error})"
        uses_ocdbt = not isinstance(store, dict) or store.get("use_ocdbt", True)
        if uses_ocdbt and not (step_dir / item / "manifest.ocdbt").exists():
            return f"{item}/manifest.ocdbt is missing (the index of the array store)"
    meta = step_dir / "meta" / "metadata"
    if not meta.exists():
        return "meta/metadata is missing"
    try:
        step = json.loads(meta.read_text()).get("step")
    except (ValueError, OSError, AttributeError) as error:
        return f"meta/metadata is unreadable ({type(error).__name__}: {error})"
    if not isinstance(step, int):
        return "meta/metadata has no integer step"
    return None


def describe(error: BaseException, limit: int = 500) -> str:
    """`Type: first line of the message`, without tensorstore's appended JSON spec, at most `limit` characters."""
    lines = str(error).strip().splitlines()
    text = _SPEC.sub("", lines[0]) if lines else ""
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def os_error(error: BaseException) -> int | None:
    """The errno behind `error`: an OSError in its chain, or the code tensorstore reports as `[os_error_code='28']`."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno
        match = _OS_ERROR_CODE.search(str(error))
        if match:
            return int(match.group(1))
        error = error.__cause__ or error.__context__
    return None


def errno_text(code: int) -> str:
    """`ENOSPC (No space left on device)`."""
    return f"{errno_codes.errorcode.get(code, f'errno {code}')} ({os.strerror(code)})"


def named_file(error: BaseException) -> str | None:
    """The innermost file a tensorstore error names (the data file it failed to write): the last quoted absolute
    path or URI in its first line that is not a directory (a read error often names only the store's directory)."""
    lines = str(error).splitlines()
    files = [f for f in _QUOTED_PATH.findall(_SPEC.sub("", lines[0])) if not f.endswith("/")] if lines else []
    return files[-1] if files else None


class _OrbaxTracebackSummary(logging.Filter):
    """Turns an Orbax ERROR record that carries a traceback into one line: its first line and the exception's.

    Orbax logs a failed background save from each of its threads (hundreds of lines for one full disk) before the
    error reaches `Checkpointer`, which raises it as one named error; nothing is dropped, only the tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and _is_orbax(record.pathname):
            error = record.exc_info[1]
            first = record.getMessage().strip().splitlines()[0] if record.getMessage().strip() else ""
            record.msg = f"{first[:200]} [{describe(error, 200)}; traceback omitted]" if error else first[:200]
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


_SUMMARY = _OrbaxTracebackSummary()


def summarise_orbax_tracebacks() -> None:
    """Install the one-line summary on the `absl` logger Orbax writes to (idempotent)."""
    logger = logging.getLogger("absl")
    if _SUMMARY not in logger.filters:
        logger.addFilter(_SUMMARY)


def _is_orbax(pathname: str) -> bool:
    return f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in (pathname or "")
