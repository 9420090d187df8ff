"""Throughput of the text path: rendering chats and parsing tool calls (calls per second, one CPU thread).

    python -m mercury_jax.bench.chat            # prints the table and rewrites the "chat" section of BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import time

from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.chat import (
    BUILTIN_CHAT_TEMPLATE,
    chat_ids,
    completion_ids,
    parse_assistant,
    qwen35_tokenizer,
    render,
    render_completion,
)
from mercury_jax.chat.observation import observation_ids

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool number {i}: does one thing to the records of service {i}.",
    "parameters": {"type": "object", "properties": {
        "record_id": {"type": "integer"}, "query": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "urgent": {"type": "boolean"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["record_id"]}}} for i in range(16)]


def _turn(i: int, n_calls: int) -> dict:
    return {"role": "assistant", "content": "Working on it.", "reasoning_content": "I need the records first. " * 4,
            "tool_calls": [{"name": f"tool_{(i + k) % 16}", "arguments": {
                "record_id": 1000 + k, "query": f"renewal slipped last week #{k}", "tags": ["crm", "q3"],
                "urgent": k % 2 == 0, "note": None}} for k in range(n_calls)]}


def _chat(n_turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are the operations assistant."},
                {"role": "user", "content": "Find the customer whose renewal slipped and update the ticket."}]
    for i in range(n_turns):
        messages += [_turn(i, 2), {"role": "tool", "content": f"record {i}: status open, owner ana"},
                     {"role": "tool", "content": "ok"}]
    return messages


def _rate(fn, *, min_seconds: float) -> float:
    """Calls per second of `fn()` over at least `min_seconds`."""
    fn()
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="minimum time per measurement")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()

    rows = []
    for turns in (1, 8):
        chat = _chat(turns)
        text = render(chat, TOOLS)
        rows.append([f"render, built-in ({turns} tool turns, 16 tools)", len(text),
                     _rate(lambda chat=chat: render(chat, TOOLS), min_seconds=args.seconds)])
        rows.append([f"render, jinja template ({turns} tool turns, 16 tools)", len(text),
                     _rate(lambda chat=chat: render(chat, TOOLS, chat_template=BUILTIN_CHAT_TEMPLATE),
                           min_seconds=args.seconds)])
    for n_calls in (1, 4):
        completion = render_completion(_turn(0, n_calls))
        rows.append([f"parse_assistant ({n_calls} call{'s' if n_calls > 1 else ''}, schema conversion)",
                     len(completion), _rate(lambda completion=completion: parse_assistant(completion, TOOLS),
                                            min_seconds=args.seconds)])
    malformed = render_completion(_turn(0, 4)).replace("</parameter>", "").replace("1001", "one")
    rows.append(["parse_assistant (4 calls, malformed)", len(malformed),
                 _rate(lambda: parse_assistant(malformed, TOOLS), min_seconds=args.seconds)])
    tokenizer = qwen35_tokenizer()
    trajectory = chat_ids(tokenizer, _chat(1), TOOLS) + completion_ids(tokenizer, _turn(1, 2))
    results = ["record 7: status open, owner ana, renewal 2024-05-01" * 4, "ok"]
    rows.append(["observation_ids (2 results, Qwen3.5 BPE)", sum(map(len, results)),
                 _rate(lambda: observation_ids(tokenizer, trajectory, results), min_seconds=args.seconds)])

    table = markdown_table(["operation", "text chars", "calls/s"], [[n, c, round(r)] for n, c, r in rows])
    print(table)
    if not args.no_write:
        body = ("Single-threaded Python; `render` of a whole chat (the built-in renderer and the same format "
                "through the jinja path), `parse_assistant` of one generated turn with schema conversion, and the "
                "observation ids appended after a tool turn.\n\n" + table)
        write_section("chat", "Chat text path: render and parse throughput", body, "python -m mercury_jax.bench.chat")


if __name__ == "__main__":
    main()
