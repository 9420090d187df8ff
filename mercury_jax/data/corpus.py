"""SFT corpora as grain random-access sources (docs/DATA.md): files or globs, local or `gs://`, JSONL (one JSON
object a line) or ArrayRecord (one JSON object a record); or the in-memory chats of a `:tiny` run.

    corpus = chat_corpus("gs://bucket/sft/*.jsonl")    # or "a.jsonl,b.jsonl", a directory, "*.array_record"
    index, raw, where = corpus[i]                       # global index, the record's bytes, "file:line"

Record i is the i-th of the files in sorted order. A JSONL file is indexed by byte offset once (an int64 a record;
blank lines are not records) and each read seeks to its line, so a source pickles cheaply into grain workers.
A corpus that cannot be read as it is (no file, no record, a damaged ArrayRecord file, a `gs://` path without
gcsfs) raises a `CorpusError` naming the file and the fix.
"""
from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from etils import epath

from mercury_jax.data.uris import check_remote

JSONL_SUFFIXES = (".jsonl", ".json")
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")


class CorpusError(ValueError):
    """An SFT corpus that cannot be read as it is; the message names the file and the fix."""


class CorpusNotFound(CorpusError, FileNotFoundError):
    """`sft.data` names no file."""


def corpus_files(spec: str, what: str = "sft.data") -> list[str]:
    """The files of `spec`: comma-separated files, globs or directories (every JSONL / ArrayRecord file inside).
    `what` names `spec` in the errors (the config field, or a tool's flag)."""
    files: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        check_remote(part, what)
        if any(ch in part for ch in "*?["):
            root, pattern = _split_glob(part)
            matched = sorted(str(p) for p in epath.Path(root).glob(pattern))
        elif epath.Path(part).is_dir():
            matched = sorted(str(p) for p in epath.Path(part).iterdir()
                             if p.name.endswith(JSONL_SUFFIXES + ARRAY_RECORD_SUFFIXES))
        else:
            matched = [part] if epath.Path(part).exists() else []
        if not matched:
            raise CorpusNotFound(f"{what} {part!r} names no file; give JSONL or ArrayRecord files, a glob or a "
                                 f"directory holding them (docs/DATA.md)")
        files += matched
    return files


def _split_glob(pattern: str) -> tuple[str, str]:
    """(directory, relative glob) of a glob whose wildcards are all past its last fixed directory."""
    head, sep, _ = pattern.partition("*") if "*" in pattern else (pattern, "", "")
    cut = head.rfind("/")
    return (pattern[:cut] or "/", pattern[cut + 1:]) if cut >= 0 else (".", pattern)


class JsonlCorpus:
    """Random access to the records of JSONL files (module docstring)."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        self.offsets: list[np.ndarray] = []   # per file, the byte offset of each record
        self.lines: list[np.ndarray] = []     # per file, the 1-based line number of each record
        for name in self.files:
            offsets, lines, offset = [], [], 0
            with epath.Path(name).open("rb") as file:
                for number, line in enumerate(file, start=1):
                    if line.strip():
                        offsets.append(offset)
                        lines.append(number)
                    offset += len(line)
            self.offsets.append(np.asarray(offsets, np.int64))
            self.lines.append(np.asarray(lines, np.int64))
        self.starts = np.cumsum([0] + [len(o) for o in self.offsets]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> tuple[int, bytes, str]:
        k = bisect.bisect_right(self.starts, index) - 1
        local = index - self.starts[k]
        with epath.Path(self.files[k]).open("rb") as file:
            file.seek(int(self.offsets[k][local]))
            return index, file.readline(), f"{self.files[k]}:{int(self.lines[k][local])}"


class ArrayRecordCorpus:
    """Random access to the records of ArrayRecord files (grain's `ArrayRecordDataSource`), each a JSON object."""

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        counts = [len(_array_record_source(name)) for name in self.files]  # each file checked on its own first
        self.source = grain.sources.ArrayRecordDataSource(self.files)
        self.starts = np.cumsum([0] + counts).tolist()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[int, bytes, str]:
        k = bisect.bisect_right(self.starts, index) - 1
        where = f"{self.files[k]} record {index - self.starts[k]}"
        try:
            return index, self.source[index], where
        except Exception as error:  # noqa: BLE001 - array_record reports a damaged chunk as a bare RuntimeError
            raise CorpusError(f"{where} cannot be read ({_reason(error)}): the ArrayRecord file is damaged; rewrite "
                              f"it (python -m mercury_jax.data.to_array_record) or leave it out of sft.data") from None


def _array_record_source(name: str):
    """grain's source over one ArrayRecord file; CorpusError naming the file when its index cannot be read (a
    truncated file, not an ArrayRecord file)."""
    try:
        return grain.sources.ArrayRecordDataSource([name])
    except Exception as error:  # noqa: BLE001 - array_record raises bare RuntimeErrors, some without a message
        raise CorpusError(f"{name} is not a readable ArrayRecord file ({_reason(error)}): it is truncated or "
                          f"damaged; rewrite it (python -m mercury_jax.data.to_array_record) or leave it out of "
                          f"sft.data") from None


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__} without a message"


class InMemoryCorpus:
    """A list of record dicts (the oracle chats of a `:tiny` run) in the same (index, record, where) form."""

    def __init__(self, records: Sequence[Any], name: str = "in-memory chat"):
        self.records, self.name = list(records), name

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[int, Any, str]:
        return index, self.records[index], f"{self.name} {index}"


def chat_corpus(spec: str):
    """The corpus `spec` names (`corpus_files`), JSONL or ArrayRecord by the files' suffixes (one kind a corpus)."""
    files = corpus_files(spec)
    kinds = {"jsonl" if f.endswith(JSONL_SUFFIXES) else "array_record" if f.endswith(ARRAY_RECORD_SUFFIXES)
             else os.path.splitext(f)[1] or f for f in files}
    if kinds == {"jsonl"}:
        corpus = JsonlCorpus(files)
    elif kinds == {"array_record"}:
        corpus = ArrayRecordCorpus(files)
    else:
        raise CorpusError(f"sft.data {spec!r} holds {sorted(kinds)}; a corpus is JSONL files (.jsonl) or "
                          f"ArrayRecord files (.array_record), one kind (docs/DATA.md)")
    if len(corpus) == 0:
        raise CorpusError(f"sft.data {spec!r} holds no record ({', '.join(files)}: "
                          f"{'empty' if len(files) == 1 else 'all empty'}); give a corpus with at least one chat "
                          f"record (docs/DATA.md \"Record format\")")
    return corpus
