"""Behaviour multiplier (docs/ENVIRONMENTS.md section 2): scales a positive reward down, never up.

    reward = effects_fraction * multiplier,
    multiplier = repetition * post_answer_runaway * degenerate_truncation * turn_budget * collateral_damage
                 * malformed_calls

Each factor lies in [0, 1], is reported separately in `parts`, and has its own strength in `BehaviourConfig`:
- **repetition**: `rate = 1 - unique/total` over the word n-grams (`ngram`, default 4) of all assistant text
  with tool-call blocks removed (their XML repeats by design); texts with fewer than `min_ngrams` n-grams have
  rate 0. `factor = 1 - repetition_strength * clip((rate - threshold) / (1 - threshold), 0, 1)`.
- **post_answer_runaway**: after the turn that states the final answer (`answered_turn`, else the first turn
  that `states_answer`), every further assistant turn is one unit, and so are tool calls that start after the
  answer line inside that turn (calls before it are the turn's work, not runaway); trailing text after the
  answer line counts `chars / runaway_chars` units beyond a free `runaway_chars`.
  `factor = max(0, 1 - runaway_strength * min(1, units))`. The answer line is searched (`ANSWER_PATTERN`) in the
  reply (after `</think>`) outside `<tool_call>` blocks: a call's arguments ("Task done." in a message body)
  state nothing. Every pattern here runs in linear time in the turn's length: a turn of thousands of blank
  lines is scored in milliseconds (blanks after `^` that may span newlines: quadratic, seconds).
- **degenerate_truncation**: `finish_reason` is a budget stop ("length", "max_tokens", "truncated"):
  `factor = 1 - truncation_strength`, or `1 - truncation_in_think_strength` when the last turn never closed
  `<think>` (such a turn has no action at all).
- **turn_budget**: `finish_reason` is "turn_budget" (the tool-turn budget ran out before a final answer):
  `factor = 1 - turn_budget_strength`. Beyond docs/ENVIRONMENTS.md's list: without it, calls after the task is done
  are free under a state-only grade, and the tiny SAO demo learned to call tools until the budget cut it off.
- **collateral_damage**: the grade's `forbidden_violations` (records the task said to leave alone that changed):
  `factor = max(0, 1 - collateral_strength * violations)`; the default strength 1 voids the reward of an episode
  that did collateral damage. Beyond docs/ENVIRONMENTS.md's list, which counts forbidden effects only in
  `all_effects_pass`: with `effects_fraction` alone, the tiny SAO policy learned to hedge a "which deal?" task by
  updating both candidate deals, and was paid in full for it.
- **malformed_calls**: the trajectory's format errors (malformed or unknown tool calls, ids outside the
  vocabulary, turns cut off without a stop token): `factor = max(0, 1 - malformed_strength * errors)`. Off by
  default (docs/ENVIRONMENTS.md counts format errors in the metrics only); `experiments/sao.py:tiny` turns it on: a
  malformed call followed by a correct one was paid like a clean episode, and after ~50 SAO steps the tiny
  policy's format errors per episode doubled.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from mercury_jax.chat.line_pattern import LinePattern

# `[^\S\n]*` (blanks within the line), not `\s*`: the same lines match, but `^\s*` let every line start of a run
# of blank lines rescan the whole run (quadratic; 8,000 newlines took ~3 s). Possessive `*+`: a blank run that
# does not end in the colon is read once, not read and then given back character by character.
ANSWER_PATTERN = LinePattern(r"[^\S\n]*+(final answer\s*+:|<answer>|(the )?task (is )?(complete|done)\b)",
                             keywords=("final answer", "<answer>", "task"))
# A tool-call block, closed or running to the end (the semantics; `tool_call_spans` finds the same at str.find
# speed: the lazy `.*?` steps the regex engine through an unclosed block one character at a time).
TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.S)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
WORD = re.compile(r"\w+")
TRUNCATION_REASONS = ("length", "max_tokens", "truncated")


@dataclass(frozen=True)
class BehaviourConfig:
    ngram: int = 4
    min_ngrams: int = 8
    repetition_threshold: float = 0.3
    repetition_strength: float = 1.0
    runaway_strength: float = 0.5
    runaway_chars: int = 200
    truncation_strength: float = 0.5
    truncation_in_think_strength: float = 1.0
    turn_budget_strength: float = 0.5
    collateral_strength: float = 1.0
    malformed_strength: float = 0.0


def behaviour_multiplier(assistant_texts: Sequence[str], *, finish_reason: str, answered_turn: int | None = None,
                         forbidden_violations: int = 0, format_errors: int = 0,
                         config: BehaviourConfig = BehaviourConfig()) -> tuple[float, dict]:
    """(multiplier, parts) for one trajectory's generated assistant texts (raw, as sampled, one per turn), the
    number of forbidden effects its final state violates and the number of its format errors."""
    rate = repetition_rate(assistant_texts, config.ngram, config.min_ngrams)
    excess = (rate - config.repetition_threshold) / max(1e-9, 1 - config.repetition_threshold)
    repetition = 1 - config.repetition_strength * min(1.0, max(0.0, excess))

    span = None
    if answered_turn is None:
        for turn, text in enumerate(assistant_texts):
            span = answer_span(_visible(text))
            if span is not None:
                answered_turn = turn
                break
    turns_after, trailing_chars, calls_after = 0, 0, 0
    if answered_turn is not None and answered_turn < len(assistant_texts):
        turns_after = len(assistant_texts) - 1 - answered_turn
        visible = _visible(assistant_texts[answered_turn])
        span = span or answer_span(visible)
        if span is not None:
            marker_end, line_end = span
            calls_after = sum(start >= marker_end for start, _ in tool_call_spans(visible))
            trailing_chars = len(_without_calls(visible[line_end:]).strip())
    units = turns_after + calls_after + max(0, trailing_chars - config.runaway_chars) / config.runaway_chars
    runaway = max(0.0, 1 - config.runaway_strength * min(1.0, units))

    truncated = finish_reason in TRUNCATION_REASONS
    in_think = truncated and bool(assistant_texts) and "</think>" not in assistant_texts[-1]
    strength = config.truncation_in_think_strength if in_think else config.truncation_strength
    truncation = 1 - strength if truncated else 1.0

    turn_budget = 1 - config.turn_budget_strength if finish_reason == "turn_budget" else 1.0
    if forbidden_violations < 0 or format_errors < 0:
        raise ValueError(f"forbidden_violations ({forbidden_violations}) and format_errors ({format_errors}) must "
                         f"be counts")
    collateral = max(0.0, 1 - config.collateral_strength * forbidden_violations)
    malformed = max(0.0, 1 - config.malformed_strength * format_errors)

    parts = {"repetition": repetition, "repetition_rate": rate, "post_answer_runaway": runaway,
             "runaway_turns": turns_after, "runaway_calls": calls_after, "runaway_chars": trailing_chars,
             "degenerate_truncation": truncation, "truncated": truncated, "truncated_in_think": in_think,
             "turn_budget": turn_budget, "collateral_damage": collateral,
             "forbidden_violations": forbidden_violations, "malformed_calls": malformed, "format_errors": format_errors}
    return repetition * runaway * truncation * turn_budget * collateral * malformed, parts


def states_answer(text: str) -> bool:
    """Whether the reply of a raw turn (after `</think>`) has an answer line outside its `<tool_call>` blocks."""
    return answer_span(_visible(text)) is not None


def answer_span(reply: str) -> tuple[int, int] | None:
    """(end of the answer marker, end of its line) for the first `ANSWER_PATTERN` line of `reply` outside
    tool-call blocks, or None. Blocks are masked with a non-blank character of their length, so positions stay
    as written and a block's own lines (its arguments) can neither hold the answer nor end the answer line."""
    masked = _without_calls(reply, mask=True)
    marker = ANSWER_PATTERN.search(masked)
    if marker is None:
        return None
    line_end = masked.find("\n", marker.end())
    return marker.end(), line_end if line_end >= 0 else len(reply)


def repetition_rate(texts: Sequence[str], n: int = 4, min_ngrams: int = 8) -> float:
    """1 - unique/total word n-grams over `texts` (tool-call blocks removed); 0 for short texts."""
    # Blank runs collapsed first (str.split, ~100x faster than the regex engine over 1 MB of spaces); words never
    # hold blanks, so the words are the same.
    words = [w.lower() for t in texts for w in WORD.findall(" ".join(_without_calls(t, " ").split()))]
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if len(grams) < min_ngrams:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def tool_call_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each `TOOL_CALL_BLOCK` match, in order: a block runs from `<tool_call>` to the end of the
    first `</tool_call>` after it, else to the end of the text (before a final newline, as the regex's `$`)."""
    spans, start = [], text.find(_OPEN)
    while start >= 0:
        close = text.find(_CLOSE, start + len(_OPEN))
        if close < 0:
            spans.append((start, len(text) - 1 if text.endswith("\n") and len(text) - 1 >= start + len(_OPEN)
                          else len(text)))
            break
        spans.append((start, close + len(_CLOSE)))
        start = text.find(_OPEN, close + len(_CLOSE))
    return spans


def _without_calls(text: str, replacement: str = "", *, mask: bool = False) -> str:
    """`text` with each tool-call block replaced (by `replacement`, or with `mask` by as many NUL characters)."""
    pieces, position = [], 0
    for start, end in tool_call_spans(text):
        pieces += [text[position:start], "\x00" * (end - start) if mask else replacement]
        position = end
    return "".join(pieces) + text[position:] if pieces else text


def _visible(text: str) -> str:
    """The reply part of a turn: text after `</think>` when present (reasoning may rehearse an answer)."""
    return text.split("</think>", 1)[1] if "</think>" in text else text
