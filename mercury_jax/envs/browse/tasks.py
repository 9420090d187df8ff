"""Browsing tasks: per corpus seed, questions with gold answers and evidence pages, as plain JSON.

The corpus is rebuilt from `seed` and `corpus_config` (`task_corpus`, cached per process). The agent must end
with one line `Final answer: <answer>` (`ANSWER_LINE`); `extract_answer` reads it back. A `Final answer:` with
nothing non-blank after it is no answer line; every pattern applied to model output here runs in linear time.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict

from mercury_jax.chat.line_pattern import LinePattern
from mercury_jax.envs.browse.corpus import CorpusConfig, generate_corpus, generate_questions

BROWSE_TOOLS = ["find", "open", "search"]
# The answer is the first non-blank text after the colon (it may start on a later line) to the end of its line,
# trailing blanks dropped. Linear time: `[^\S\n]*` after `^` (not `\s*`, which let every line of a blank run rescan
# the run) and `\S(?:.*\S)?` (not `(.+?)\s*$`, which rescanned a run of blanks inside the line once per blank);
# possessive `*+` reads a blank run once where what follows cannot be a blank anyway.
ANSWER_LINE = LinePattern(r"[^\S\n]*+final answer\s*+:\s*+(\S(?:.*\S)?)", keywords=("final answer",))
SYSTEM_PROMPT = ("Answer the question using the search, open and find tools over the encyclopedia. Base the answer "
                 "only on page text you have seen. When you know it, stop and reply with one line: "
                 "Final answer: <answer>")
SHORT_SYSTEM_PROMPT = "Use the tools. End with: Final answer: <answer>"


def generate_browse_tasks(seed: int, count: int, config: CorpusConfig = CorpusConfig(), *,
                          short_prompts: bool = False) -> list[dict]:
    corpus = task_corpus(seed, json.dumps(asdict(config)))
    return [{"task_id": f"browse-{seed:06d}-{i:02d}", "world": "browse", "seed": seed,
             "system_prompt": SHORT_SYSTEM_PROMPT if short_prompts else SYSTEM_PROMPT,
             "user_prompt": q["question"], "tool_names": list(BROWSE_TOOLS), "answer": q["answer"],
             "answer_fact": q["answer_fact"], "evidence": q["evidence"], "hops": q["hops"], "chain": q["chain"],
             "corpus_config": asdict(config)}
            for i, q in enumerate(generate_questions(corpus, count, config))]


@functools.lru_cache(maxsize=64)
def task_corpus(seed: int, config_json: str) -> dict:
    data = json.loads(config_json)
    config = CorpusConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    return generate_corpus(seed, config)


def corpus_of(task: dict) -> dict:
    return task_corpus(task["seed"], json.dumps(task["corpus_config"]))


def extract_answer(text: str) -> str | None:
    """The answer on the last `Final answer:` line of the reply (reasoning excluded), or None."""
    reply = text.split("</think>", 1)[1] if "</think>" in text else text
    found = ANSWER_LINE.findall(reply)
    return found[-1] if found else None


def normalize_answer(text: str) -> str:
    text = re.sub(r"[^\w\s]", " ", (text or "").lower())
    return " ".join(w for w in text.split() if w not in ("the", "a", "an"))
