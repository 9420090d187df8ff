"""Browsing world: corpus and questions, deterministic BM25 tools, evidence sufficiency, the oracle (with and
without over-search), pivot extraction on oracle trajectories, and every stop-verifier rule."""
import asyncio
import hashlib
import json

import pytest

from mercury_jax.chat import render, train_sentencepiece_tokenizer
from mercury_jax.envs.browse.corpus import SHORT_NAMES, CorpusConfig, generate_corpus, generate_questions
from mercury_jax.envs.browse.oracle import OracleConfig, oracle_trajectory
from mercury_jax.envs.browse.pivots import extract_pivots, write_pivots
from mercury_jax.envs.browse.stop_verifier import STOP_RULES, verify_stop
from mercury_jax.envs.browse.sufficiency import answer_shown, evidence_sufficient, opened_pages
from mercury_jax.envs.browse.tasks import corpus_of, extract_answer, generate_browse_tasks
from mercury_jax.envs.browse.tools import BrowseIndex, browse_tools
from mercury_jax.envs.enterprise.toolkit import call_sync
from mercury_jax.envs.episode import grade_browse, make_episode
from mercury_jax.envs.presets import BROWSE, preset_tasks


@pytest.fixture(scope="module")
def tasks():
    return [t for seed in range(4) for t in generate_browse_tasks(seed, 10)]


@pytest.fixture(scope="module")
def indexes(tasks):
    return {seed: BrowseIndex(corpus_of(next(t for t in tasks if t["seed"] == seed))) for seed in range(4)}


def search_call(query):
    return (f"</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\n{query}\n</parameter>\n</function>\n"
            "</tool_call>")


def test_questions_need_their_evidence(tasks):
    assert {t["hops"] for t in tasks} == {1, 2, 3, 4}
    for task in tasks:
        pages = {p["id"]: p for p in corpus_of(task)["pages"]}
        assert len(task["evidence"]) == task["hops"] and task["answer"] not in task["user_prompt"]
        last = pages[task["evidence"][-1]]
        assert any(task["answer"] in line for line in last["lines"][1:])  # the final fact is on the last page
        for page_id, entity in zip(task["evidence"], task["chain"][::2]):
            assert pages[page_id]["title"] == entity
    assert generate_corpus(3) == generate_corpus(3) and generate_corpus(3) != generate_corpus(4)
    questions = json.dumps(generate_questions(generate_corpus(3), 5))
    assert questions == json.dumps(generate_questions(generate_corpus(3), 5))


def test_tools_are_deterministic_and_explain_errors(tasks, indexes):
    task = tasks[0]
    tools = browse_tools(indexes[0])
    first, _ = call_sync(tools["search"], {"query": task["chain"][0]})
    assert first == call_sync(browse_tools(BrowseIndex(corpus_of(task)))["search"], {"query": task["chain"][0]})[0]
    assert first.startswith(f"[0] {task['chain'][0]} (id: {task['evidence'][0]})")
    assert "no page is open" in call_sync(tools["find"], {"pattern": "x"})[0]
    assert "page ids look like p012" in call_sync(tools["open"], {"id": "p999"})[0]
    opened, _ = call_sync(tools["open"], {"id": task["evidence"][0], "loc": 1, "num_lines": 2})
    assert opened.splitlines()[1].startswith("L1: ") and len(opened.splitlines()) == 3
    assert "topn must be between 1 and 20" in call_sync(tools["search"], {"query": "x", "topn": 99})[0]
    assert call_sync(tools["search"], {"query": "the of"})[0].startswith("No results")


def test_oracle_answers_every_question(tasks, indexes):
    for task in tasks:
        messages = oracle_trajectory(task, index=indexes[task["seed"]])
        result = grade_browse(task, messages[-1]["content"], messages)
        assert result["accuracy"] == 1.0 and result["grounded"] and result["over_search_calls"] == 0, task["task_id"]
        assert evidence_sufficient(task, messages) and set(task["evidence"]) <= opened_pages(messages)


def test_over_search_habit_is_configurable(tasks, indexes):
    habit = OracleConfig(over_search_prob=1.0, over_search_max=2)
    counts = []
    for task in tasks[:10]:
        messages = oracle_trajectory(task, habit, index=indexes[task["seed"]])
        result = grade_browse(task, messages[-1]["content"], messages)
        assert result["accuracy"] == 1.0 and result["over_search_calls"] >= 1
        counts.append(result["over_search_calls"])
    assert set(counts) <= {1, 2}


def test_sufficiency_counts_opened_pages_or_answer_text_not_titles(tasks, indexes):
    task = next(t for t in tasks if t["hops"] >= 2)
    messages = oracle_trajectory(task, index=indexes[task["seed"]])
    last_open = max(k for k, m in enumerate(messages) if m.get("tool_calls")
                    and m["tool_calls"][0]["name"] == "open")
    assert not evidence_sufficient(task, messages[:last_open + 1])
    assert evidence_sufficient(task, messages[:last_open + 2])
    titles_only = [{"role": "tool", "content": f"[0] {task['answer']} (id: p001)"}]
    assert not answer_shown(task["answer"], titles_only)
    assert not evidence_sufficient(task, [{"role": "tool", "content": f"[page p001] X\nL3: near {task['answer']}."}])
    assert evidence_sufficient(task, [{"role": "tool", "content": f"[page p001] X\nL3: {task['answer_fact']}"}])


@pytest.mark.parametrize("over_search", [0.0, 1.0])
def test_pivots_on_oracle_trajectories(tasks, indexes, over_search, tmp_path):
    pivots = []
    for task in tasks[:12]:
        messages = oracle_trajectory(task, OracleConfig(over_search_prob=over_search), index=indexes[task["seed"]])
        found = extract_pivots(task, messages)
        kinds = [p["kind"] for p in found]
        assert kinds == ["one_step_before", "just_sufficient"], (task["task_id"], kinds)
        before, stop = found
        assert not before["evidence_sufficient"] and before["next_action"] == "tool_call"
        assert stop["evidence_sufficient"] and stop["turn_index"] == before["turn_index"] + 1
        assert stop["next_action"] == ("tool_call" if over_search else "answer")
        assert evidence_sufficient(task, stop["prefix"]) and not evidence_sufficient(task, before["prefix"])
        pivots += found
    path = tmp_path / "pivots.jsonl"
    assert write_pivots(pivots, path) == len(pivots)
    assert [json.loads(line)["task_id"] for line in path.read_text().splitlines()] == [p["task_id"] for p in pivots]


@pytest.fixture(scope="module")
def pivot_pair(tasks, indexes):
    task = next(t for t in tasks if t["hops"] == 2)
    before, stop = extract_pivots(task, oracle_trajectory(task, index=indexes[task["seed"]]))
    return task, before["prefix"], stop["prefix"]


def test_stop_verifier_rules(pivot_pair):
    task, insufficient, sufficient = pivot_pair
    answer, start = task["answer"], task["chain"][0]
    cases = [
        # stop when sufficient
        (sufficient, f"<think>\nI have it.\n</think>\n\nFinal answer: {answer}", "correct_stop"),
        (sufficient, f"Final answer: {answer.upper()}.", "correct_stop"),                         # normalized match
        (sufficient, search_call(answer), "over_search"),
        (insufficient, f"</think>\n\nFinal answer: {answer}", "premature"),
        (insufficient, search_call(task["chain"][2]), "continue_insufficient"),
        (sufficient, "</think>\n\nFinal answer: Atlantis", "ungrounded"),
        (sufficient, f"</think>\n\nFinal answer: {start}", "wrong"),                             # seen, not gold
        (sufficient, f"</think>\n\nI believe it is {answer}.", "malformed"),                      # no answer line
        (sufficient, f"Final answer: {answer}\n" + search_call(answer)[11:], "malformed"),        # answer and call
        (sufficient, "<tool_call>\n<function=search>\n<parameter=query>\nx", "malformed"),       # cut-off call
    ]
    for prefix, continuation, outcome in cases:
        result = verify_stop(task, prefix, continuation)
        assert result["outcome"] == outcome, (continuation, result)
        assert result["reward"] == STOP_RULES[outcome]
    assert verify_stop(task, sufficient, search_call("x"), rules={"over_search": -0.5})["reward"] == -0.5
    with pytest.raises(ValueError, match="unknown stop-verifier rules"):
        verify_stop(task, sufficient, "Final answer: x", rules={"vibes": 1.0})


def test_stop_verifier_rejects_unknown_tools_when_given_schemas(pivot_pair):
    task, _, sufficient = pivot_pair
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    bad = "<tool_call>\n<function=browse_web>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"
    assert verify_stop(task, sufficient, bad, tools=tools)["outcome"] == "malformed"


@pytest.mark.parametrize("text, answer", [
    ("<think>Final answer: no</think>\nFinal answer:  Varhol ", "Varhol"),       # reasoning excluded, trimmed
    ("no answer here", None),
    ("Final answer: a\nFinal answer: b\n", "b"),                                # the last answer line
    ("  FINAL ANSWER :  New  Varhol \t\r\n", "New  Varhol"),                    # case, blanks, inner spaces kept
    ("Final answer:\n\n  Varhol  \nthanks", "Varhol"),                          # the answer may start lines later
    ("Final answer:   ", None),                                                 # blank: no answer line (was " ")
    ("Final answer: x" + " " * 100_000 + "y", "x" + " " * 100_000 + "y"),
    ("I think the final answer: Varhol", None),                                 # not at a line start
    ("\n" * 100_000 + "Final answer: Varhol", "Varhol"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_short_names_are_single_pieces_unique_and_leave_the_full_world_unchanged(tmp_path):
    names = [n for pool in SHORT_NAMES.values() for n in pool]
    assert len(set(names)) == len(names) and all(n.isalpha() and n.istitle() and len(n) <= 6 for n in names)
    corpus = generate_corpus(0)  # the full world is byte-identical to the one before short_names existed
    digest = hashlib.sha256(json.dumps([corpus, generate_questions(corpus, 10)]).encode()).hexdigest()[:16]
    assert digest == "17efd641afc89565"
    assert not BROWSE["full"].short_names and BROWSE["tiny"].short_names
    for seed in range(20):
        pages = generate_corpus(seed, BROWSE["tiny"])["pages"]
        assert all(p["title"] in SHORT_NAMES[p["kind"]] for p in pages)
        assert len({p["title"] for p in pages}) == len(pages)
    with pytest.raises(ValueError, match="short_names"):
        generate_corpus(0, CorpusConfig(cities=len(SHORT_NAMES["city"]) + 1, short_names=True))

    async def tools(task):
        async with make_episode(task) as episode:
            return await episode.tools()

    tasks = [t for seed in range(40) for t in preset_tasks("browse", "tiny", seed, 4)]
    texts = [render(oracle_trajectory(t), asyncio.run(tools(t))) for t in tasks]
    tokenizer = train_sentencepiece_tokenizer(texts, vocab_size=1024, cache_dir=tmp_path)
    for task in tasks:  # every answer is one piece where the model must write it
        assert len(tokenizer.encode(f"Final answer: {task['answer']}")) == len(tokenizer.encode("Final answer:")) + 1
    assert all(grade_browse(t, oracle_trajectory(t)[-1]["content"], oracle_trajectory(t))["all_effects_pass"]
               for t in tasks)
