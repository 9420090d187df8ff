"""Rubric judges: score rubric items over a finished trajectory; their verdicts join the state checks as extra
effects (docs/ENVIRONMENTS.md section 1).

A rubric item is `{"kind", "description", ...}`. `RuleJudge` (the deterministic default) knows
`mentions` (`value` occurs in the final reply, case-insensitive) and `called` (`tool` was called in the
transcript); any other kind is an error. `OpenAIJudge` asks an OpenAI-compatible chat-completions endpoint one
yes/no question per item (temperature 0) and reads the first YES/NO of the reply.

A judge that cannot give a verdict raises `JudgeError`: the request failed (connection, timeout, HTTP error), the
response is not a chat completion, or the reply holds no YES or NO. Scoring such an item False would lower the
reward for the endpoint's fault, not the policy's; scoring it True would reward it. So grading fails instead, and
the episode runner records the episode as an environment failure at "grade" (`rollout/failures.py`): counted in
`env_failures`, never trained on.
"""
from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class JudgeError(RuntimeError):
    """The judge gave no verdict on a rubric item (the request failed, or the reply was not YES/NO)."""


class RubricJudge(Protocol):
    def score(self, items: Sequence[Mapping], final_answer: str, transcript: Sequence[Mapping] | None) -> list[dict]:
        """One `{"description", "ok", ...}` per item, in order; raises `JudgeError` when it cannot judge one."""


class RuleJudge:
    """Deterministic rubric checks."""

    def score(self, items, final_answer, transcript=None) -> list[dict]:
        return [{"description": item["description"], "ok": self._check(item, final_answer, transcript or ())}
                for item in items]

    @staticmethod
    def _check(item: Mapping, final_answer: str, transcript: Sequence[Mapping]) -> bool:
        if item["kind"] == "mentions":
            return str(item["value"]).lower() in (final_answer or "").lower()
        if item["kind"] == "called":
            return any(_call_name(c) == item["tool"] for m in transcript for c in m.get("tool_calls") or ())
        raise ValueError(f"RuleJudge does not know rubric kind {item['kind']!r}; expected mentions or called "
                         "(or use OpenAIJudge for free-text rubric items)")


class OpenAIJudge:
    """An LLM judge behind an OpenAI-compatible `POST {base_url}/chat/completions` (vLLM, SGLang, OpenAI...).
    Raises `JudgeError` on the first item it cannot judge (module docstring)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 max_transcript_chars: int = 12000):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.max_transcript_chars = max_transcript_chars

    def score(self, items, final_answer, transcript=None) -> list[dict]:
        shown = _transcript_text(transcript or ())[-self.max_transcript_chars:]
        out = []
        for item in items:
            question = (f"Transcript of an assistant's work:\n{shown}\n\nFinal reply:\n{final_answer}\n\n"
                        f"Rubric item: {item['description']}\nDoes the work satisfy the rubric item? "
                        "Answer YES or NO first, then one sentence why.")
            try:
                reply = self._complete(question)
            except (OSError, ValueError, KeyError, IndexError, TypeError) as error:  # URLError, timeouts, bad JSON
                raise JudgeError(f"judge {self.model!r} at {self.url} failed on rubric item "
                                 f"{item['description']!r}: {type(error).__name__}: {error}; check that the "
                                 "endpoint is up and serves chat completions") from error
            verdict = re.search(r"\b(YES|NO)\b", reply.upper())
            if verdict is None:
                raise JudgeError(f"judge {self.model!r} at {self.url} gave no YES/NO verdict on rubric item "
                                 f"{item['description']!r}; it replied {reply[:200]!r}")
            out.append({"description": item["description"], "ok": verdict.group(1) == "YES", "judge_reply": reply})
        return out

    def _complete(self, prompt: str) -> str:
        body = json.dumps({"model": self.model, "temperature": 0, "max_tokens": 64,
                           "messages": [{"role": "system", "content": "You are a strict grader."},
                                        {"role": "user", "content": prompt}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            content = json.loads(response.read())["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise TypeError(f"the reply's message content is {type(content).__name__}, not text")
        return content


def _call_name(call: Any) -> str:
    if isinstance(call, Mapping):
        return (call.get("function") or call).get("name", "")
    return getattr(call, "name", "")


def _transcript_text(transcript: Sequence[Mapping]) -> str:
    lines = []
    for message in transcript:
        calls = "".join(f" [call {_call_name(c)}]" for c in message.get("tool_calls") or ())
        lines.append(f"{message.get('role')}: {message.get('content') or ''}{calls}")
    return "\n".join(lines)
