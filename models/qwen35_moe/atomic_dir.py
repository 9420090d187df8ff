"""Replace a directory all at once: a reader sees the old contents or the new, never a mix, even after SIGKILL.

Protocol for target `P/T` (one writer per target at a time), with two sibling names in the same parent `P`:
staging `P/.T.save-new` and backup `P/.T.save-old`.

  write   0. `recover(T)` (below); 1. write the whole new directory into staging, fsync every file and
          directory in it; 2. rename T -> backup (if T exists); 3. rename staging -> T; 4. fsync P;
          5. delete backup.
  read    `committed_dir(T)`: T if it exists; else, if a backup exists, staging when present (a kill between
          steps 2 and 3: staging was complete before step 2 began, so it is the new version), otherwise backup.
  recover on the next write: if T is missing and a backup exists, finish the interrupted swap (staging -> T, or
          backup -> T when there is no staging); then delete any staging (an unfinished step 1) and any backup
          (an unfinished step 5).

Every kill point: during 0-1, T is the old version (staging is partial and ignored); between 2 and 3, T is
missing and readers take the complete staging (new); from 3 on, T is the new version (a half-deleted backup is
ignored). Renames within one directory are atomic on POSIX, and each step leaves a state the rules above read
correctly, so the next write always starts from one complete version and leaves no staging or backup behind.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def staging_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.save-new"


def backup_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.save-old"


def committed_dir(target: str | Path) -> Path:
    """The directory that holds `target`'s committed contents (see the module docstring); read-only."""
    target = Path(os.path.realpath(target)) if os.path.islink(target) else Path(target)
    if os.path.lexists(target) or not backup_dir(target).is_dir():
        return target
    return staging_dir(target) if staging_dir(target).is_dir() else backup_dir(target)


def recover(target: Path) -> None:
    """Bring `target` back to one committed version after an interrupted replace and delete the leftovers."""
    staging, backup = staging_dir(target), backup_dir(target)
    if not os.path.lexists(target) and backup.is_dir():
        os.rename(staging if staging.is_dir() else backup, target)
        _fsync_dir(target.parent)
    for leftover in (staging, backup):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover)


def resolve_target(target: str | Path) -> Path:
    """The absolute path the protocol renames: a symlinked target is followed, so the link keeps pointing at the
    replaced directory."""
    target = Path(target)
    return Path(os.path.realpath(target)) if os.path.islink(target) else Path(os.path.abspath(target))


@contextlib.contextmanager
def replace_directory(target: str | Path, keep_old: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """`with replace_directory(T) as new: <write into new>` makes `new` the contents of T atomically on exit.

    Entries of the old T whose name `keep_old` accepts are linked (or copied) into `new` before the block runs.
    On an exception inside the block the staging directory is deleted and T is left as it was.
    """
    target = resolve_target(target)
    if os.path.lexists(target) and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; pass a directory path (or move the file)")
    recover(target)
    staging = staging_dir(target)
    staging.mkdir(parents=True)
    try:
        carry_over(target, staging, keep_old)
        yield staging
        fsync_tree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for _, step in replace_steps(target):
        step()


def replace_steps(target: Path) -> list[tuple[str, Callable[[], None]]]:
    """Steps 2-5 of the protocol as (description, action), in order; each is one atomic state change."""
    staging, backup = staging_dir(target), backup_dir(target)
    steps = []
    if os.path.lexists(target):
        steps.append(("rename the old directory to the backup", lambda: os.rename(target, backup)))
    steps += [("rename staging to the target", lambda: os.rename(staging, target)),
              ("fsync the parent directory", lambda: _fsync_dir(target.parent)),
              ("delete the backup", lambda: shutil.rmtree(backup, ignore_errors=True))]
    return steps


def carry_over(source: Path, staging: Path, keep: Callable[[str], bool]) -> None:
    """Hard-link (or copy, where links fail) the entries of `source` named `keep(name)` into `staging`."""
    if not source.is_dir():
        return
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        if not keep(entry.name):
            continue
        destination = staging / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), destination)
        elif entry.is_dir():
            shutil.copytree(entry.path, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, destination)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (children before parents), so a power loss after the
    rename cannot expose a directory whose files are not on disk."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
