"""Evidence sufficiency of a browsing trajectory (docs/ENVIRONMENTS.md section 3).

Sufficient at a state = every evidence page of the task has been opened (an `open` observation with its
`[page pNNN]` header), or the answer span has been shown in page text (an `open` or `find` observation; search
results show titles only and do not count). The answer span is the sentence stating the final fact
(`answer_fact`, e.g. "Quiove lies in Varholia."), not the bare answer name: entity names recur on unrelated
pages, and seeing one there does not tell the agent it is the answer. `answer_shown` (the bare answer occurs in
observed page text) is what the stop-verifier uses to decide whether an answer is grounded.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from mercury_jax.envs.browse.tasks import normalize_answer
from mercury_jax.envs.browse.tools import PAGE_HEADER


def tool_texts(messages: Sequence[Mapping]) -> list[str]:
    return [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]


def opened_pages(messages: Sequence[Mapping]) -> set[str]:
    """Page ids whose `open` observation appears in `messages` (not `find`, which only searches the open page)."""
    out = set()
    for text in tool_texts(messages):
        match = PAGE_HEADER.match(text)
        if match and "\nL" in text and "<https://" in text.split("\n", 1)[0]:
            out.add(match.group(1))
    return out


def observed_page_text(messages: Sequence[Mapping]) -> str:
    """All page text shown so far (open and find observations), normalized for answer matching."""
    return " \n ".join(normalize_answer(t) for t in tool_texts(messages) if PAGE_HEADER.match(t))


def answer_shown(answer: str, messages: Sequence[Mapping]) -> bool:
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {observed_page_text(messages)} "


def evidence_sufficient(task: Mapping, messages: Sequence[Mapping]) -> bool:
    """Whether the evidence seen in `messages` suffices to answer `task`."""
    return set(task["evidence"]) <= opened_pages(messages) or answer_shown(task["answer_fact"], messages)
