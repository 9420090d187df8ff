"""Synthetic agent trajectories in the SFT record format (docs/DATA.md): a system prompt, a user task, assistant
turns that call tools (OpenAI-style `tool_calls`, JSON-string arguments), tool results, and a final answer. For
tests and the input-pipeline benchmark, and to try `--config.sft.data` without a corpus of one's own:

    python -m mercury_jax.data.synthetic --out /tmp/chats.jsonl --records 1000 --words 400

Exit codes: `mercury_jax/cli/ending.py` (0 done; 2 refused, e.g. an `--out` that cannot be written, with one
`error:` line; 1 a bug, with its traceback).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from mercury_jax.cli import ending

WORDS = ("account ticket invoice customer order refund shipment status review policy update record meeting "
         "calendar report budget vendor contract approval request balance payment audit schedule inventory").split()
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} in the company's systems",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for name in ("search_records", "update_record", "send_message")]


SYLLABLES = "ka ro mi tel van sor qu ing ex pre lat dun hor bel cis nov ul zeph ard mon tri pas gel fu".split()


def _word(rng: np.random.Generator) -> str:
    """A dictionary word (60%), a number (15%) or an invented word of 2-4 syllables (25%): text a BPE tokenizer
    cannot take in one merge a word, closer to real chats than a 25-word vocabulary."""
    pick = rng.random()
    if pick < 0.6:
        return str(rng.choice(WORDS))
    if pick < 0.75:
        return str(int(rng.integers(0, 100000)))
    return "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 5))))


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(_word(rng) for _ in range(max(int(words), 1)))


def synthetic_chat(rng: np.random.Generator, words: int = 200, turns: int = 3) -> dict:
    """One record of about `words` words over `turns` tool-calling turns and a final answer."""
    share = max(words // (3 * turns + 3), 1)
    messages = [{"role": "system", "content": "You are an enterprise assistant. " + _text(rng, share)},
                {"role": "user", "content": _text(rng, share)}]
    for _ in range(turns):
        tool = TOOLS[int(rng.integers(len(TOOLS)))]["function"]["name"]
        messages.append({"role": "assistant", "content": _text(rng, share), "tool_calls": [
            {"type": "function", "function": {"name": tool, "arguments": json.dumps({"query": _text(rng, 3)})}}]})
        messages.append({"role": "tool", "name": tool, "content": _text(rng, share)})
    messages.append({"role": "assistant", "content": _text(rng, share)})
    return {"messages": messages, "tools": TOOLS}


def write_corpus(path, records: int, *, words: int = 200, turns: int = 3, seed: int = 0) -> None:
    """`records` synthetic chats, one JSON object a line."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as file:
        for _ in range(records):
            file.write(json.dumps(synthetic_chat(rng, int(rng.integers(words // 2, words * 3 // 2 + 1)), turns))
                       + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--words", type=int, default=200, help="mean words a chat (uniform in 0.5x .. 1.5x)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    ending.add_debug_flag(parser)
    args = parser.parse_args(argv)
    ending.run_entry_point(lambda: write_corpus(args.out, args.records, words=args.words, turns=args.turns,
                                                seed=args.seed), (OSError,), argv)  # an unwritable --out
    print(f"wrote {args.records} chats to {args.out}")


if __name__ == "__main__":
    main()
