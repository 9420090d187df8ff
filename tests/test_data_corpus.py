"""The record index of a corpus over several files (mercury_jax/data/corpus.py): every global index reads its own
record and names its own file, above all at the file boundaries (record 0, the first and the last record of every
file), with an empty file and blank lines in between."""
from __future__ import annotations

import json

import pytest

from mercury_jax.data.corpus import ArrayRecordCorpus, JsonlCorpus, chat_corpus

# Records per file, in sorted file order; the empty file makes two file starts equal.
COUNTS = {"a": 3, "b": 0, "c": 1, "d": 2}


def expected_records() -> list[tuple[str, int]]:
    """(file stem, position in its file) of global record 0, 1, ..., written by hand from COUNTS."""
    assert sum(COUNTS.values()) == 6
    return [("a", 0), ("a", 1), ("a", 2), ("c", 0), ("d", 0), ("d", 1)]


def write_jsonl(tmp_path) -> None:
    """Each file's records as JSON lines, with a blank line before every record past the first, so a record's line
    number is 2 * position + 1."""
    for stem, count in COUNTS.items():
        lines = [json.dumps({"id": f"{stem}{i}"}) for i in range(count)]
        (tmp_path / f"{stem}.jsonl").write_text("\n\n".join(lines) + ("\n" if lines else ""))


def test_jsonl_records_at_every_file_boundary_are_their_own(tmp_path):
    """Planted bug: `bisect.bisect_right(self.starts, index)` -> `bisect.bisect_left(self.starts, index)` in
    JsonlCorpus.__getitem__ (record 0 reads the last file; a file's first record reads past the previous one)."""
    write_jsonl(tmp_path)
    corpus = chat_corpus(f"{tmp_path}/*.jsonl")
    assert isinstance(corpus, JsonlCorpus) and len(corpus) == 6
    for index in range(len(corpus)):  # record 0 and every file's first and last among them
        stem, position = expected_records()[index]
        got_index, raw, where = corpus[index]
        assert got_index == index
        assert json.loads(raw) == {"id": f"{stem}{position}"}, index
        assert where == f"{tmp_path}/{stem}.jsonl:{2 * position + 1}", index


def test_array_record_files_name_the_file_of_every_boundary_record(tmp_path):
    """Planted bug: `bisect.bisect_right(self.starts, index)` -> `bisect.bisect_left(self.starts, index)` in
    ArrayRecordCorpus.__getitem__ (the record is read right, but named in the wrong file at every file start)."""
    array_record_module = pytest.importorskip("array_record.python.array_record_module")
    for stem, count in COUNTS.items():
        if count == 0:
            continue  # an ArrayRecord file holds at least one record (the converter never writes an empty one)
        writer = array_record_module.ArrayRecordWriter(str(tmp_path / f"{stem}.array_record"), "group_size:1")
        for i in range(count):
            writer.write(json.dumps({"id": f"{stem}{i}"}).encode())
        writer.close()
    corpus = chat_corpus(f"{tmp_path}/*.array_record")
    assert isinstance(corpus, ArrayRecordCorpus) and len(corpus) == 6
    for index in range(len(corpus)):  # record 0 and every file's first and last among them
        stem, position = expected_records()[index]
        got_index, raw, where = corpus[index]
        assert got_index == index and json.loads(raw) == {"id": f"{stem}{position}"}, index
        assert where == f"{tmp_path}/{stem}.array_record record {position}", index
