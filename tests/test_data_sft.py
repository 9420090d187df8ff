"""The SFT data path (mercury_jax/data): records checked and rendered by the chat path with the loss on assistant
tokens only, bad records named (or skipped and counted), rows packed by grain per data shard, shards disjoint with
the corpus as their union, and a stream restored from its saved state going on with exactly the rows it would have.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mercury_jax.chat import qwen35_tokenizer
from mercury_jax.data.chat_records import BadRecord, parse_record, record_tokens
from mercury_jax.data.corpus import ArrayRecordCorpus, InMemoryCorpus, chat_corpus, corpus_files
from mercury_jax.data.row_stream import RowStream
from mercury_jax.data.sft_rows import RowSpec, shard_rows
from mercury_jax.data.synthetic import TOOLS, write_corpus
from mercury_jax.data.task_order import TaskOrder

CHAT = {"messages": [
    {"role": "system", "content": "SYSTEMTEXT you help."},
    {"role": "user", "content": "USERTEXT find the invoice"},
    {"role": "assistant", "content": "ANSWERONE looking", "tool_calls": [
        {"type": "function", "function": {"name": "search_records", "arguments": json.dumps({"query": "CALLARG"})}}]},
    {"role": "tool", "name": "search_records", "content": "TOOLRESULT invoice 42"},
    {"role": "assistant", "content": "ANSWERTWO it is invoice 42"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def tokenizer():
    return qwen35_tokenizer()


def spans(tokenizer, tokens, mask, value) -> list[str]:
    """The decoded text of each maximal run of tokens whose mask is `value`."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append(tokenizer.decode(list(tokens[start:i])))
            start = None
    return out


def test_only_assistant_text_and_tool_calls_carry_the_loss(tokenizer):
    tokens, mask = record_tokens(tokenizer, parse_record(json.dumps(CHAT), 0, "t"), 0, "t", row_length=4096)
    learned, not_learned = spans(tokenizer, tokens, mask, 1), spans(tokenizer, tokens, mask, 0)
    assert len(learned) == 2  # the two assistant completions
    assert "ANSWERONE" in learned[0] and "CALLARG" in learned[0] and "search_records" in learned[0]
    assert "ANSWERTWO" in learned[1] and learned[1].endswith("<|im_end|>")
    for text in ("SYSTEMTEXT", "USERTEXT", "TOOLRESULT"):
        assert all(text not in span for span in learned), text
        assert any(text in span for span in not_learned), text
    assert tokens.dtype == np.int32 and mask.dtype == np.float32 and len(tokens) == len(mask)


def test_packed_rows_keep_each_records_tokens_and_mask(tokenizer, tmp_path):
    """Every segment of every packed row is exactly its record's rendering (tokens and loss mask), padding has
    segment 0 and no loss."""
    write_corpus(tmp_path / "c.jsonl", 12, words=60)
    corpus = chat_corpus(str(tmp_path / "c.jsonl"))
    spec = RowSpec(row_length=1024, rows_per_shard=2, shards=1, seed=0, packing_bins=2, pad_id=tokenizer.pad_id)
    batch = next(iter(shard_rows(corpus, tokenizer, spec, 0)))
    for row in range(2):
        segments = batch["segment_ids"][row]
        assert batch["loss_mask"][row][segments == 0].sum() == 0
        assert (batch["tokens"][row][segments == 0] == tokenizer.pad_id).all()
        for segment, record in enumerate(batch["records"][row], start=1):
            index, raw, where = corpus[record]
            tokens, mask = record_tokens(tokenizer, parse_record(raw, index, where), index, where, row_length=1024)
            np.testing.assert_array_equal(batch["tokens"][row][segments == segment], tokens)
            np.testing.assert_array_equal(batch["loss_mask"][row][segments == segment], mask)


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not JSON"),
    ('{"text": "hello"}', "'messages' is missing"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "needs a user message"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": '
     '{"name": "f", "arguments": "{oops"}}]}]}', "not JSON"),
])
def test_a_bad_record_is_named_with_its_index_file_and_line(tokenizer, tmp_path, line, problem):
    path = tmp_path / "c.jsonl"
    good = json.dumps(CHAT)
    path.write_text(f"{good}\n\n{good}\n{line}\n")  # the blank line is no record: the bad one is record 2, line 4
    corpus = chat_corpus(str(path))
    spec = RowSpec(row_length=4096, rows_per_shard=1, shards=1, seed=0, packing_bins=1)
    with pytest.raises(BadRecord, match=rf"SFT record 2 \({path}:4\): .*{problem}.*sft.skip_bad_records=True"):
        iterator = iter(shard_rows(corpus, tokenizer, spec, 0))
        for _ in range(3):
            next(iterator)


def test_too_long_records_are_named_and_skipping_counts_them(tokenizer):
    corpus = InMemoryCorpus([CHAT, {"tokens": [1] * 50, "loss_mask": [1] * 50}, CHAT, {"messages": []}])
    spec = RowSpec(row_length=400, rows_per_shard=1, shards=1, seed=0, packing_bins=1)
    with pytest.raises(BadRecord, match="renders to .* tokens, more than sft.row_length 40;"):
        record_tokens(tokenizer, CHAT, 0, "t", row_length=40)
    skipping = iter(shard_rows(corpus, tokenizer, RowSpec(**{**spec.__dict__, "row_length": 60, "skip_bad": True}),
                               0))
    steps = [next(skipping) for _ in range(4)]  # one epoch: the 50-token record a row; the chats and [] skipped
    assert {r for s in steps for row in s["records"] for r in row} == {1}
    assert sum(s["bad"] for s in steps) >= 3


def test_shards_are_disjoint_and_cover_the_corpus_and_every_epoch_reshuffles():
    corpus = InMemoryCorpus([{"tokens": [i + 1] * 4, "loss_mask": [1] * 4} for i in range(24)])
    spec = RowSpec(row_length=4, rows_per_shard=1, shards=3, seed=5, packing_bins=1)
    seen = {}
    for shard in range(3):
        iterator = iter(shard_rows(corpus, None, spec, shard))
        seen[shard] = [next(iterator)["records"][0][0] for _ in range(16)]  # two epochs of the shard's 8 records
    for shard, records in seen.items():
        assert sorted(records[:8]) == sorted(records[8:]) == list(range(shard, 24, 3))
        assert records[:8] != records[8:]  # a new permutation in epoch 2
    assert sorted(r for records in seen.values() for r in records[:8]) == list(range(24))


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])  # a worker starts in ~10 s
def test_a_restored_stream_goes_on_with_the_same_rows(tmp_path, workers):
    """In this process and in a grain worker process (whose state holds the worker's position)."""
    write_corpus(tmp_path / "c.jsonl", 40, words=30)
    corpus = chat_corpus(str(tmp_path / "c.jsonl"))
    tokenizer = qwen35_tokenizer()
    spec = RowSpec(row_length=2048, rows_per_shard=2, shards=2, seed=1, packing_bins=3, workers=workers)

    def make(k):
        return shard_rows(corpus, tokenizer, spec, k)

    reference = RowStream(make, [0, 1])
    steps = [reference.next() for _ in range(7)]
    resumed = RowStream(make, [0, 1])
    for _ in range(3):
        resumed.next()
    state = resumed.snapshot().get_state()
    restored = RowStream(make, [0, 1])
    restored.set_state(state)
    for step in steps[3:]:
        got = restored.next()
        for k in (0, 1):
            assert got[k]["records"] == step[k]["records"]
            np.testing.assert_array_equal(got[k]["tokens"], step[k]["tokens"])
    with pytest.raises(ValueError, match=r"holds shards \['0', '1'\], this process reads shards \[1\]"):
        RowStream(make, [1]).set_state(state)


def test_corpus_files_take_globs_directories_and_lists_and_name_what_is_missing(tmp_path):
    for name in ("a.jsonl", "b.jsonl", "notes.txt"):
        (tmp_path / name).write_text(json.dumps(CHAT) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps(CHAT) + "\n")
    a, b, c = (str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "sub/c.jsonl"))
    assert corpus_files(f"{tmp_path}/*.jsonl") == [a, b]
    assert corpus_files(str(tmp_path)) == [a, b]
    assert corpus_files(f"{c},{a}") == [c, a]
    assert len(chat_corpus(f"{tmp_path}/*.jsonl,{c}")) == 3
    with pytest.raises(FileNotFoundError, match="sft.data .*missing.jsonl' names no file"):
        corpus_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"holds \['.txt', 'jsonl'\]"):
        chat_corpus(f"{a},{tmp_path}/notes.txt")


def test_array_record_files_read_like_jsonl(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    names = []
    for k in range(2):
        names.append(str(tmp_path / f"part{k}.array_record"))
        writer = ArrayRecordWriter(names[-1], "group_size:1")
        for i in range(3):
            writer.write(json.dumps({**CHAT, "id": f"{k}-{i}"}).encode())
        writer.close()
    corpus = chat_corpus(f"{tmp_path}/*.array_record")
    assert isinstance(corpus, ArrayRecordCorpus) and len(corpus) == 6
    index, raw, where = corpus[4]
    assert index == 4 and json.loads(raw)["id"] == "1-1" and where == f"{names[1]} record 1"


def test_task_order_reads_positions_lazily_and_reshuffles_each_epoch():
    reads = []

    class Source:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            reads.append(i)
            return {"task_id": f"t{i}"}

    order = TaskOrder(Source(), seed=3)
    first, second = [order.at(p)["task_id"] for p in range(6)], [order.at(p)["task_id"] for p in range(6, 12)]
    assert sorted(first) == sorted(second) == [f"t{i}" for i in range(6)] and first != second
    reads.clear()
    window = order.take(4).repeated(2)
    assert len(window) == 8 and reads == [] and order.consumed == 4
    assert window[5]["task_id"] == first[2] and reads and len(reads) == 1  # one task read, the rest not
    assert [t["task_id"] for t in window][::2] == first[:4]


def test_a_gs_corpus_is_read_through_epath(buckets):
    """`gs://` globs list and read through the same epath code as a real bucket (tests/local_buckets.py)."""
    folder = buckets / "corpus-bucket" / "sft"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("b.jsonl", "a.jsonl"):
        (folder / name).write_text(json.dumps(CHAT) + "\n" + json.dumps({**CHAT, "id": name}) + "\n")
    corpus = chat_corpus("gs://corpus-bucket/sft/*.jsonl")
    assert corpus.files == ["gs://corpus-bucket/sft/a.jsonl", "gs://corpus-bucket/sft/b.jsonl"]
    index, raw, where = corpus[3]
    assert json.loads(raw)["id"] == "b.jsonl" and where == "gs://corpus-bucket/sft/b.jsonl:2"


@pytest.mark.slow
def test_a_bad_record_met_in_a_grain_worker_reaches_the_trainer_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + '{"messages": "oops"}\n')
    spec = RowSpec(row_length=4096, rows_per_shard=1, shards=1, seed=0, packing_bins=1, workers=1)
    with pytest.raises(BadRecord, match=rf"SFT record 1 \({path}:2\): 'messages' is missing or not a non-empty list"):
        iterator = iter(shard_rows(chat_corpus(str(path)), qwen35_tokenizer(), spec, 0))
        for _ in range(3):
            next(iterator)


def test_a_jsonl_corpus_converts_to_array_record_record_for_record(tmp_path):
    from mercury_jax.data.to_array_record import convert
    write_corpus(tmp_path / "c.jsonl", 7, words=10)
    files = convert(str(tmp_path / "c.jsonl"), str(tmp_path / "ar"), records_per_file=3)
    assert [Path(f).name for f in files] == ["part-00000.array_record", "part-00001.array_record",
                                             "part-00002.array_record"]
    jsonl, converted = chat_corpus(str(tmp_path / "c.jsonl")), chat_corpus(str(tmp_path / "ar"))
    assert len(converted) == 7
    assert all(json.loads(jsonl[i][1]) == json.loads(converted[i][1]) for i in range(7))
