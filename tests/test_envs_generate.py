"""Corpus CLI (deterministic bytes, resumable, summary) and the tiny presets (oracle solves them; whole rendered
trajectories stay near 512 tokens of a small SentencePiece vocabulary)."""
import asyncio
import statistics

import pytest

from mercury_jax.chat import render, train_sentencepiece_tokenizer
from mercury_jax.envs.enterprise.effects import grade_state
from mercury_jax.envs.enterprise.oracle import run_script
from mercury_jax.envs.enterprise.tasks import initial_state
from mercury_jax.envs.episode import grade_browse, make_episode, oracle_trajectory
from mercury_jax.envs.generate import TaskSource, generate, main, read_tasks
from mercury_jax.envs.presets import preset_tasks


def corpus_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.jsonl"))}


def test_generation_is_deterministic_and_resumable(tmp_path):
    first = generate("enterprise", 5, 4, tmp_path / "a", shard_worlds=2, progress=False)
    generate("enterprise", 5, 4, tmp_path / "b", shard_worlds=2, progress=False)
    assert corpus_bytes(tmp_path / "a") == corpus_bytes(tmp_path / "b") and len(corpus_bytes(tmp_path / "a")) == 3
    (tmp_path / "a" / "enterprise-00001-of-00003.jsonl").unlink()  # a crash mid-run: that shard is redone
    (tmp_path / "a" / "enterprise-00002-of-00003.stats.json").unlink()
    (tmp_path / "a" / "enterprise-00000-of-00003.jsonl.tmp").write_text("half a line")
    again = generate("enterprise", 5, 4, tmp_path / "a", shard_worlds=2, progress=False)
    assert corpus_bytes(tmp_path / "a") == corpus_bytes(tmp_path / "b")
    assert first["tasks"] == again["tasks"] == 20 and sum(first["templates"].values()) == 20
    assert sum(first["tool_counts"].values()) == 20 and 10 <= first["tool_count_min"] <= first["tool_count_max"] <= 26
    tasks = list(read_tasks(tmp_path / "a"))
    assert [t["seed"] for t in tasks] == sorted(t["seed"] for t in tasks) and len(tasks) == 20


def test_grain_reads_the_corpus(tmp_path):
    grain = pytest.importorskip("grain")
    generate("browse", 5, 3, tmp_path, shard_worlds=2, progress=False)
    everything = list(read_tasks(tmp_path))
    source = TaskSource(tmp_path)
    assert len(source) == 15 and source[7] == everything[7]
    dataset = grain.MapDataset.source(source).shuffle(seed=0)
    assert sorted(t["task_id"] for t in dataset) == sorted(t["task_id"] for t in everything)
    hosts = [TaskSource(tmp_path, shard_index=h, shard_count=2) for h in range(2)]
    assert sorted(t["task_id"] for h in hosts for t in (h[i] for i in range(len(h)))) == \
        sorted(t["task_id"] for t in everything)
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl shards"):
        TaskSource(tmp_path / "missing")


def test_cli_both_worlds(tmp_path, capsys):
    summary = main(["--world", "browse", "--worlds", "3", "--tasks-per-world", "5", "--out", str(tmp_path),
                    "--no-progress"])
    assert summary["tasks"] == 15 and "tasks per template" in capsys.readouterr().out
    assert all(t["world"] == "browse" for t in read_tasks(tmp_path))
    tiny = main(["--world", "enterprise", "--preset", "tiny", "--worlds", "2", "--tasks-per-world", "3",
                 "--out", str(tmp_path / "tiny"), "--no-progress"])
    assert tiny["tasks"] == 6


async def _tools(task):
    async with make_episode(task) as episode:
        return await episode.tools()


@pytest.fixture(scope="module")
def tiny_renders():
    renders = {"enterprise": [], "browse": []}
    for world in renders:
        for seed in range(12):
            for task in preset_tasks(world, "tiny", seed, 3):
                messages = oracle_trajectory(task)
                if world == "enterprise":
                    db = initial_state(task)
                    run_script(task, db)
                    assert grade_state(task["required_effects"], task["forbidden_effects"], initial_state(task),
                                       db)["all_effects_pass"]
                else:
                    assert grade_browse(task, messages[-1]["content"], messages)["all_effects_pass"]
                renders[world].append(render(messages, asyncio.run(_tools(task)), add_generation_prompt=False))
    return renders


def test_tiny_presets_fit_a_small_context(tiny_renders, tmp_path_factory):
    texts = tiny_renders["enterprise"] + tiny_renders["browse"]
    tokenizer = train_sentencepiece_tokenizer(texts, vocab_size=2048, cache_dir=tmp_path_factory.mktemp("spm"))
    for world, renders in tiny_renders.items():
        lengths = [len(tokenizer.encode(t)) for t in renders]
        # ~512: the renderer's fixed tool-call instructions alone take ~170 tokens; SentencePiece never merges
        # across spaces, so JSON schemas cost about a token per word.
        assert statistics.mean(lengths) <= 640 and max(lengths) <= 780, (world, statistics.mean(lengths), max(lengths))
        assert all(tokenizer.decode(tokenizer.encode(t)) == t for t in renders[:3])
