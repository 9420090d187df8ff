"""Sharded safetensors files written tensor by tensor in bounded host memory.

`ShardedSafetensors(directory, limit)` takes tensors one at a time (`add`) and writes the HF sharded layout:
`model.safetensors` when everything fits in one shard, else `model-0000i-of-0000N.safetensors` and
`model.safetensors.index.json`. A tensor starts a new shard when the current one is non-empty and the tensor would
take it past `limit` bytes. Each file is byte for byte what `safetensors.numpy.save_file(shard, path,
metadata={"format": "pt"})` writes for the same tensors: a little-endian u64 header length, the JSON header
(`__metadata__` first, then the tensors by dtype, larger dtypes first, then by name; compact separators; padded with
spaces to a multiple of 8 bytes), then the data in header order.

Host memory holds one tensor (the caller's) and a fixed copy buffer, never a shard: a shard's tensors are spooled to
a temporary file in arrival order, and when the shard is complete its final file is written as header + data copied
from the spool in the library's order; the spool is then deleted (disk holds one spool beyond the finished shards).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from models.qwen35_moe.checkpoint_reader import INDEX_NAME

# safetensors' dtype codes in the order of its (Rust) dtype enum; a file stores larger codes first
DTYPE_ORDER = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
DTYPE_CODES = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
               np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
               np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32",
               np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int64): "I64",
               np.dtype(np.uint64): "U64"}
COPY_CHUNK = 16 << 20  # bytes per read when a finished shard is copied out of its spool


@dataclasses.dataclass(frozen=True)
class SpooledTensor:
    name: str
    dtype_code: str
    shape: tuple[int, ...]
    offset: int  # in the spool
    nbytes: int


def safetensors_header(tensors: list[SpooledTensor], metadata: dict[str, str] | None) -> tuple[bytes, list]:
    """(the file's first bytes: length prefix + padded JSON header, the tensors in the order their data follows)."""
    ordered = sorted(tensors, key=lambda t: (-DTYPE_ORDER.index(t.dtype_code), t.name.encode()))
    header: dict = {"__metadata__": metadata} if metadata is not None else {}
    begin = 0
    for tensor in ordered:
        header[tensor.name] = {"dtype": tensor.dtype_code, "shape": list(tensor.shape),
                               "data_offsets": [begin, begin + tensor.nbytes]}
        begin += tensor.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def dtype_code(dtype) -> str:
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"safetensors has no dtype for {np.dtype(dtype)}") from None


class ShardedSafetensors:
    """`with ShardedSafetensors(directory, limit) as out: out.add(name, array) ...`; see the module docstring.
    `directory` must exist; on an exception the spool and unfinished parts are left for the caller's cleanup
    (`save_hf` writes into a staging directory that it deletes)."""

    def __init__(self, directory: str | Path, limit: int, metadata: dict[str, str] | None = None):
        self.directory, self.limit = Path(directory), limit
        self.metadata = {"format": "pt"} if metadata is None else metadata
        self.parts: list[tuple[Path, list[str]]] = []  # finished shards: (file, tensor names)
        self.total = 0
        self._spool = None
        self._spooled: list[SpooledTensor] = []
        self._spooled_bytes = 0
        self._written: set[str] = set()

    def __enter__(self) -> ShardedSafetensors:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finish()
        elif self._spool is not None:
            self._spool.close()

    def add(self, name: str, array: np.ndarray) -> None:
        """Append tensor `name` (written as it is: C order, its own dtype) to the current shard or a new one."""
        if name in self._written:
            raise ValueError(f"tensor {name!r} was already written")
        self._written.add(name)
        code = dtype_code(array.dtype)
        nbytes = int(array.nbytes)
        if self._spooled and self._spooled_bytes + nbytes > self.limit:
            self._finish_shard()
        if self._spool is None:
            self._spool = open(self._spool_path(), "wb")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._spool.write(data.data)
        self._spooled.append(SpooledTensor(name, code, tuple(int(n) for n in array.shape), self._spooled_bytes,
                                           nbytes))
        self._spooled_bytes += nbytes
        self.total += nbytes

    def finish(self) -> list[Path]:
        """Write the last shard, give the shards their final names (and the index when there are several)."""
        self._finish_shard()
        if len(self.parts) == 1:
            final = self.directory / "model.safetensors"
            self.parts[0][0].rename(final)
            return [final]
        files, weight_map = [], {}
        for i, (part, names) in enumerate(self.parts):
            final = self.directory / f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors"
            part.rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return files

    def _spool_path(self) -> Path:
        return self.directory / f"model-part-{len(self.parts) + 1:05d}.spool.tmp"

    def _finish_shard(self) -> None:
        """Write the current shard's final file from its spool. With nothing spooled: nothing, unless no shard
        exists yet (then one file of no tensors, as `save_file({})` writes)."""
        if not self._spooled and self.parts:
            return
        spool_path = self._spool_path()
        if self._spool is not None:
            self._spool.close()
            self._spool = None
        part = self.directory / f"model-part-{len(self.parts) + 1:05d}.safetensors.tmp"
        head, ordered = safetensors_header(self._spooled, self.metadata)
        with open(part, "wb") as out:
            out.write(head)
            if ordered:
                with open(spool_path, "rb") as spool:
                    for tensor in ordered:
                        _copy_range(spool, out, tensor.offset, tensor.nbytes)
        if spool_path.exists():
            os.remove(spool_path)
        self.parts.append((part, [t.name for t in self._spooled]))
        self._spooled, self._spooled_bytes = [], 0


def _copy_range(source, destination, offset: int, length: int) -> None:
    source.seek(offset)
    while length:
        chunk = source.read(min(COPY_CHUNK, length))
        if not chunk:
            raise OSError(f"{source.name} ended {length} bytes early")
        destination.write(chunk)
        length -= len(chunk)
