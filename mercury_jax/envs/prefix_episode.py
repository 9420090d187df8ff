"""The environment of a one-turn episode whose prompt is a chat prefix, already rendered: a pivot state of pivot
GRPO (docs/ALGORITHMS.md pipeline 2). Its prompt is the state's `prompt_ids` (and its chat `prefix`). The runner,
with `max_tool_turns = 0`, ends a tool-calling turn without executing it, so this environment only offers the
state's tool schemas; the reward (`rollout.rewards.StopVerifierReward`) judges the turn, so grading returns
nothing."""
from __future__ import annotations

from collections.abc import Mapping


class PrefixEpisode:
    def __init__(self, state: Mapping, **options):
        del options  # timeouts and caps of real environments: nothing here runs a tool
        self.state = state

    async def __aenter__(self) -> PrefixEpisode:
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    async def tools(self) -> list[dict]:
        return list(self.state["tools"])

    def prompt(self, tokenizer, tools: list[dict], *, enable_thinking: bool = True) -> tuple[list[dict], list[int]]:
        """The state's chat prefix and its ids, as the pivot dataset rendered them (the tokenizer is not used)."""
        del tokenizer, tools, enable_thinking
        return list(self.state.get("prefix", ())), list(self.state["prompt_ids"])

    async def call(self, call):
        raise RuntimeError(f"a pivot state's episode executes no tool (got {call.name!r}); run it with "
                           f"Budgets(max_tool_turns=0)")

    def grade(self, final_answer: str, transcript: list[dict]) -> dict:
        return {}
