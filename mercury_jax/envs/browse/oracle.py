"""Scripted browsing oracle: for each hop, `search` the entity it starts from, `open` its page (by the id the
search returned, or by url when the search missed it), optionally `find` the relation's sentence (not on the last
hop: the evidence is already sufficient there); then answer `Final answer: X`.

Over-search habit (`OracleConfig.over_search_prob`): with that probability (seeded per task) the oracle, once the
evidence is already sufficient, runs 1..`over_search_max` more searches (for the answer entity, then the question's
start entity) before answering: the behaviour pivot GRPO must remove.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from mercury_jax.envs.browse.corpus import RELATIONS
from mercury_jax.envs.browse.tasks import corpus_of
from mercury_jax.envs.browse.tools import BrowseIndex, browse_tools
from mercury_jax.envs.enterprise.toolkit import call_sync

FIND_WORD = {"founded": "founded", "born_in": "born", "hq": "headquartered", "ceo": "chief executive",
             "mayor": "mayor", "country": "lies in"}


@dataclass(frozen=True)
class OracleConfig:
    over_search_prob: float = 0.0
    over_search_max: int = 2
    use_find: bool = True
    num_lines: int = 20
    topn: int = 5


def oracle_trajectory(task: dict, config: OracleConfig = OracleConfig(), index: BrowseIndex | None = None
                      ) -> list[dict]:
    """Chat messages (system, user, assistant tool calls, tool results, final answer) solving `task`."""
    index = index or BrowseIndex(corpus_of(task))
    tools = browse_tools(index)
    rng = random.Random(f"browse-oracle-{task['task_id']}")
    messages = [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["user_prompt"]}]

    def call(name: str, **args) -> str:
        text, is_error = call_sync(tools[name], args)
        if is_error:
            raise RuntimeError(f"oracle call {name}({args}) failed on {task['task_id']}: {text}")
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": args}]})
        messages.append({"role": "tool", "name": name, "content": text})
        return text

    chain = task["chain"]
    for hop in range(task["hops"]):
        entity, relation = chain[2 * hop], chain[2 * hop + 1]
        results = call("search", query=entity, **_non_default("topn", config.topn, 5))
        found = re.search(rf"\] {re.escape(entity)} \(id: (p\d+)\)", results)
        page = found.group(1) if found else "https://wiki.local/" + entity.replace(" ", "_")
        call("open", id=page, **_non_default("num_lines", config.num_lines, 20))
        if config.use_find and hop < task["hops"] - 1:  # on the last page it would come after sufficiency
            call("find", pattern=FIND_WORD[relation])
    if rng.random() < config.over_search_prob:
        for query in [task["answer"], chain[0]][: rng.randint(1, config.over_search_max)]:
            call("search", query=query, **_non_default("topn", config.topn, 5))
    messages.append({"role": "assistant", "content": f"Final answer: {task['answer']}"})
    return messages


def _non_default(name: str, value: int, default: int) -> dict:
    """Pass an argument only when it differs from the tool's default (shorter trajectories)."""
    return {} if value == default else {name: value}


assert set(FIND_WORD) == set(RELATIONS)
