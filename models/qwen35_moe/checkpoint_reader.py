"""Validated, lazy access to the tensors of an HF safetensors checkpoint directory (one file, or index + shards).

Construction opens every shard's header (no tensor data) and checks the directory as a whole, so each defect is
reported once, up front, with the file that has it:
- shard names in the index are relative paths inside the directory. Symlinked files are followed (the HF hub cache
  stores a snapshot as links into its blob store); only the *name* may not leave the directory;
- every needed file exists and is a regular file; a symlink loop or a dangling link is reported as such;
- every header parses (a truncated or foreign file is named);
- every tensor lives in exactly one file, the one the index names.
Tensors are then read one at a time (`fetch`, optionally a row slice), so host memory never holds the checkpoint.
Keeping every shard open from the start also pins the files this reader saw: a save that replaces the directory
after construction cannot mix its shards into this read.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path, PurePosixPath

import numpy as np
from safetensors import SafetensorError, safe_open

from models.qwen35_moe.checkpoint_errors import (
    CheckpointError,
    CorruptShardError,
    DuplicateTensorError,
    MissingShardError,
    ShardIndexError,
    ShardPathError,
    SymlinkLoopError,
)

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


def check_file(path: Path, what: str) -> bool:
    """True if `path` is a regular file, False if nothing is there; raises for a symlink loop, a dangling symlink
    or something that is not a file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SymlinkLoopError(f"{path} ({what}) is a symlink loop ({_link_chain(path)}): no file at its end; "
                                   f"point the link at the real file, or replace it with the file") from None
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                raise MissingShardError(f"{path} ({what}) is a symlink to {os.readlink(path)}, which does not "
                                        f"exist; re-download the file or fix the link") from None
            return False
        raise CheckpointError(f"cannot read {path} ({what}): {error}; check its permissions") from None
    if not stat.S_ISREG(mode):
        raise CorruptShardError(f"{path} ({what}) is not a regular file; move it aside and restore the file")
    return True


class CheckpointReader:
    """Lazy access to the tensors of one checkpoint directory; `close()` releases the shard files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        try:
            index = self.path / INDEX_NAME
            if check_file(index, "the shard index"):
                self.name_to_file = self._open_indexed(index)
            else:
                self.name_to_file = self._open_unindexed()
        except BaseException:
            self.close()
            raise
        self.skipped = sorted(n for n in self.name_to_file if n.startswith(SKIPPED_PREFIXES))
        if self.skipped:
            towers = sorted({n.split(".")[0] if n.startswith("mtp.") else ".".join(n.split(".")[:2])
                             for n in self.skipped})
            log.info("skipping %d tensors of non-text towers (%s)", len(self.skipped), ", ".join(towers))
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.")
                                                     for n in self.name_to_file) else "model."
        self.used: set[str] = set()

    def full_name(self, name: str, layer_prefix: str = "") -> str:
        return name[1:] if name.startswith("/") else self.prefix + layer_prefix + name

    def has(self, name: str) -> bool:
        return name in self.name_to_file

    def file_of(self, full_name: str) -> Path:
        return self.name_to_file[full_name]

    def shape(self, full_name: str) -> tuple[int, ...]:
        return tuple(self._handle(full_name).get_slice(full_name).get_shape())

    def dtype(self, full_name: str) -> str:
        """The safetensors dtype code of a tensor ("BF16", "F32", "I32", "BOOL", ...)."""
        return self._handle(full_name).get_slice(full_name).get_dtype()

    def fetch(self, full_name: str, rows: tuple[int, int] | None = None, axis: int = 0) -> np.ndarray:
        handle = self._handle(full_name)
        self.used.add(full_name)
        try:
            if rows is None:
                return handle.get_tensor(full_name)
            return handle.get_slice(full_name)[(slice(None),) * axis + (slice(*rows),)]
        except SafetensorError as error:
            raise CorruptShardError(f"cannot read tensor {full_name} from {self.file_of(full_name)} ({error}); the "
                                    f"file is damaged: re-download or re-export it") from None

    def unused(self) -> list[str]:
        return sorted(set(self.name_to_file) - self.used - set(self.skipped))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    # ------------------------------------------------------------------------------------------------ opening
    def _handle(self, full_name: str):
        if full_name not in self.name_to_file:
            raise KeyError(full_name)
        return self._handles[self.name_to_file[full_name]]

    def _open(self, file: Path) -> set[str]:
        """Open one shard's header and return the tensor names it holds."""
        try:
            handle = safe_open(file, framework="numpy").__enter__()
        except SafetensorError as error:
            raise CorruptShardError(f"{file} is not a readable safetensors file ({error}); it is truncated or "
                                    f"damaged: re-download or re-export it") from None
        self._handles[file] = handle
        return set(handle.keys())

    def _open_unindexed(self) -> dict[str, Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise MissingShardError(f"no *.safetensors files and no {INDEX_NAME} in {self.path}; pass the directory "
                                    f"that holds the checkpoint's weights")
        name_to_file: dict[str, Path] = {}
        for file in files:
            check_file(file, "a weight file")
            for name in sorted(self._open(file)):
                if name in name_to_file:
                    raise DuplicateTensorError(
                        f"tensor {name} is stored in both {name_to_file[name]} and {file}; which copy to load is "
                        f"unknown: delete the stray file (an older export's shard?) or add an {INDEX_NAME} that "
                        f"maps each tensor to one file")
                name_to_file[name] = file
        return name_to_file

    def _open_indexed(self, index: Path) -> dict[str, Path]:
        weight_map = _read_weight_map(index)
        by_file: dict[str, set[str]] = {}
        for name, rel in weight_map.items():
            by_file.setdefault(rel, set()).add(name)
        for rel, names in by_file.items():
            if rel == "" or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
                raise ShardPathError(f"{index} maps tensor {min(names)} to {rel!r}, a path outside {self.path}; "
                                     f"shard names must be files inside the checkpoint directory: fix the index")
        missing = sorted(rel for rel in by_file if not check_file(self.path / rel, f"a shard listed in {index.name}"))
        if missing:
            raise MissingShardError(f"{index} lists shard files that do not exist: {missing}; re-download them, or "
                                    f"regenerate the index if the checkpoint was re-sharded")
        held = {rel: self._open(self.path / rel) for rel in sorted(by_file)}
        for rel in sorted(by_file):
            for name in sorted(held[rel] - by_file[rel]):
                listed = weight_map.get(name)
                if listed is None:
                    raise ShardIndexError(f"{self.path / rel} holds tensor {name}, which {index} does not list; "
                                          f"regenerate the index (or remove the tensor from the shard)")
                if name in held[listed]:
                    raise DuplicateTensorError(
                        f"tensor {name} is stored in {self.path / rel} and in {self.path / listed} (where "
                        f"{index.name} points); which copy to load is unknown: remove the stray copy or regenerate "
                        f"the index")
                raise ShardIndexError(f"{index} maps tensor {name} to {listed}, but it is stored in {rel}; "
                                      f"regenerate the index")
        for rel in sorted(by_file):
            absent = sorted(by_file[rel] - held[rel])
            if absent:
                raise ShardIndexError(f"{index} maps {absent[:5]}{' ...' if len(absent) > 5 else ''} to "
                                      f"{self.path / rel}, which does not hold them; re-download the shard or "
                                      f"regenerate the index")
        return {name: self.path / rel for name, rel in weight_map.items()}


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map with normalised shard names; a tensor listed twice (two files) is an error."""
    duplicates: list[tuple[str, str, str]] = []

    def keep_pairs(pairs):
        obj: dict = {}
        for key, value in pairs:
            if key in obj and obj[key] != value:
                duplicates.append((key, obj[key], value))
            obj[key] = value
        return obj

    try:
        data = json.loads(index.read_text(), object_pairs_hook=keep_pairs)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ShardIndexError(f"{index} is not valid JSON ({error}); re-download it, or delete it if the directory "
                              f"holds a single model.safetensors") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ShardIndexError(f"{index} has no weight_map of tensor name -> shard file name; re-download it")
    for name, first, second in duplicates:
        if name in weight_map:
            raise DuplicateTensorError(f"{index} lists tensor {name} twice, in {first} and in {second}; which copy "
                                       f"to load is unknown: keep one entry")
    return {name: str(PurePosixPath(rel)) if rel else rel for name, rel in weight_map.items()}


def _link_chain(path: Path, hops: int = 4) -> str:
    chain, current = [str(path)], str(path)
    for _ in range(hops):
        try:
            current = os.path.join(os.path.dirname(current), os.readlink(current))
        except OSError:
            return " -> ".join(chain) + " (a directory on this path is a looping link)"
        chain.append(current)
    return " -> ".join(chain) + " -> ..."
