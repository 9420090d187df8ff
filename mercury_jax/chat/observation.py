"""Observation tokens: what the chat format inserts after an assistant turn that called tools.

Token-in, token-out (docs/ENVIRONMENTS.md section 4): the sampled ids stay as they were; only the new text is
tokenised and appended. The observation closes the assistant turn when the sample did not (`<|im_end|>` is
the normal stop; after `<|endoftext|>`, a stop string or a cut-off, `<|im_end|>` is appended first), then
adds the user turn of `<tool_response>` blocks and the next generation prompt:

    [<|im_end|>] \\n <|im_start|> user \\n<tool_response>\\n{result}\\n</tool_response> ... <|im_end|> \\n
    <|im_start|> assistant\\n <think> \\n            (thinking off: \\n\\n </think> \\n\\n)

Each stretch of text between two special tokens is encoded as one piece, as a tokenizer does on the rendered
chat, so for results without special-token strings the ids equal the tokenisation of `render(...)`'s tail.
Tool results are untrusted: special-token strings inside them are encoded as plain text, never as control ids.
"""
from __future__ import annotations

from collections.abc import Sequence

from mercury_jax.chat.special_tokens import IM_END, IM_START, THINK, THINK_END, TOOL_RESPONSE, TOOL_RESPONSE_END
from mercury_jax.chat.tokenizer import Tokenizer


def observation_ids(tokenizer: Tokenizer, trajectory_ids: Sequence[int], tool_results: Sequence[str], *,
                    enable_thinking: bool = True) -> list[int]:
    """Ids to append to `trajectory_ids` (prompt + sampled turn) for `tool_results`, one string per call."""
    return encode_segments(tokenizer, observation_segments(tokenizer, trajectory_ids, tool_results,
                                                           enable_thinking=enable_thinking))


def observation_segments(tokenizer: Tokenizer, trajectory_ids: Sequence[int], tool_results: Sequence[str], *,
                         enable_thinking: bool = True) -> list[tuple[str, str]]:
    """The observation as ("special", token) / ("text", text) segments, in order."""
    if not tool_results:
        raise ValueError("an observation needs at least one tool result")
    segments: list[tuple[str, str]] = []
    if not trajectory_ids or trajectory_ids[-1] != tokenizer.im_end_id:
        segments.append(("special", IM_END))
    segments += [("text", "\n"), ("special", IM_START), ("text", "user")]
    for result in tool_results:
        segments += [("text", "\n"), ("special", TOOL_RESPONSE), ("text", f"\n{result.strip()}\n"),
                     ("special", TOOL_RESPONSE_END)]
    segments += [("special", IM_END), ("text", "\n"), ("special", IM_START), ("text", "assistant\n"),
                 ("special", THINK)]
    segments += [("text", "\n")] if enable_thinking else [("text", "\n\n"), ("special", THINK_END),
                                                           ("text", "\n\n")]
    return _merge_text(segments)


def encode_segments(tokenizer: Tokenizer, segments: Sequence[tuple[str, str]]) -> list[int]:
    ids: list[int] = []
    for kind, value in segments:
        ids += [tokenizer.token_id(value)] if kind == "special" else tokenizer.encode(value, allow_special=False)
    return ids


def _merge_text(segments: list[tuple[str, str]]) -> list[tuple[str, str]]:
    merged: list[tuple[str, str]] = []
    for kind, value in segments:
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        elif kind != "text" or value:
            merged.append((kind, value))
    return merged
