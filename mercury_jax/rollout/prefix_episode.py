"""The environment of a one-turn episode whose prompt is a chat prefix (a pivot state: docs/ALGORITHMS.md
pipeline 2). The runner starts from the state's `prompt_ids` and, with `max_tool_turns = 0`, ends a tool-calling
turn without executing it, so this environment only offers the state's tool schemas; the reward
(`rewards.StopVerifierReward`) judges the turn, so grading returns nothing."""
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

    async def call(self, call):
        raise RuntimeError(f"a pivot state's episode executes no tool (got {call.name!r}); run it with "
                           f"Budgets(max_tool_turns=0)")

    def grade(self, final_answer: str, transcript: list[dict]) -> dict:
        return {}
