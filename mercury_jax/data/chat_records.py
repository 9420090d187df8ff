"""One SFT record: a chat with tool calls, as HF datasets store them (docs/DATA.md "Record format"), checked and
turned into (tokens, loss mask) by the project's chat path (`rollout/messages.trajectory_from_messages`: the ids
a rollout of the same chat would hold; loss mask 1 exactly on the assistant completions, tool calls included).

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str | [parts] | null,
                   "reasoning_content": str?, "tool_calls": [{"function": {"name", "arguments"}}]?}, ...],
     "tools": [{"type": "function", "function": {"name", "description", "parameters"}}]?}

A record that cannot be trained on raises `BadRecord`, naming its index in the corpus, its file and what is wrong.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from mercury_jax.rollout.messages import trajectory_from_messages

ROLES = ("system", "user", "assistant", "tool")


class BadRecord(ValueError):
    """A corpus record that cannot be trained on: its global index, where it lives and why."""

    def __init__(self, index: int, where: str, problem: str):
        self.index, self.where, self.problem = index, where, problem
        super().__init__(f"SFT record {index} ({where}): {problem}. Fix or remove the record, or set "
                         f"sft.skip_bad_records=True to skip such records (they are counted in the SFT metrics as "
                         f"bad_records)")

    def __reduce__(self):  # raised in a grain worker process, it crosses to the trainer whole
        return BadRecord, (self.index, self.where, self.problem)


def parse_record(raw: bytes | str | Mapping, index: int, where: str) -> dict:
    """The record as a dict with a checked `messages` list and `tools` list; `BadRecord` otherwise."""
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRecord(index, where, f"not JSON ({error})") from None
    if not isinstance(raw, Mapping):
        raise BadRecord(index, where, f"a {type(raw).__name__}, not a JSON object with 'messages'")
    messages, tools = raw.get("messages"), raw.get("tools") or []
    if not isinstance(messages, list) or not messages:
        raise BadRecord(index, where, "'messages' is missing or not a non-empty list")
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise BadRecord(index, where, "'tools' is not a list of tool schemas (objects)")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, Mapping) else type(message).__name__
            raise BadRecord(index, where, f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise BadRecord(index, where, f"message {i}: 'tool_calls' must be a list on an assistant message")
    return {"messages": messages, "tools": tools}


def record_tokens(tokenizer, record: dict, index: int, where: str, *, row_length: int,
                  enable_thinking: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n], loss_mask float32 [n]) of a parsed record: 1 on assistant tokens (content, reasoning,
    tool calls, the closing `<|im_end|>`), 0 on system, user and tool-result tokens. `BadRecord` when the chat path
    rejects it, when nothing in it is an assistant token, or when it is longer than a row."""
    try:
        trajectory = trajectory_from_messages(tokenizer, record["messages"], record["tools"] or None,
                                              enable_thinking=enable_thinking)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise BadRecord(index, where, f"the chat cannot be rendered ({type(error).__name__}: {error})") from None
    tokens = np.asarray(trajectory.tokens, np.int32)
    mask = np.asarray(trajectory.action_mask, np.float32)
    if not mask.any():
        raise BadRecord(index, where, "it has no assistant turn after its prompt, so no token to learn")
    if len(tokens) > row_length:
        raise BadRecord(index, where, f"it renders to {len(tokens)} tokens, more than sft.row_length "
                                      f"{row_length}; raise the row length or split the chat")
    return tokens, mask


def record_sequence(tokenizer, raw: Any, index: int, where: str, *, row_length: int, skip_bad: bool,
                    enable_thinking: bool = True) -> dict[str, Any]:
    """What the packer takes for one record: tokens, loss_mask, and the meta features `record` (its index) and
    `bad` (1 for a record skipped under `skip_bad`: no tokens, only counted)."""
    try:
        tokens, mask = record_tokens(tokenizer, parse_record(raw, index, where), index, where,
                                     row_length=row_length, enable_thinking=enable_thinking)
    except BadRecord:
        if not skip_bad:
            raise
        return {"tokens": np.zeros(0, np.int32), "loss_mask": np.zeros(0, np.float32), "record": index, "bad": 1}
    return {"tokens": tokens, "loss_mask": mask, "record": index, "bad": 0}
