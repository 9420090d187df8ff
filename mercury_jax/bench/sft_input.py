"""The SFT input pipeline's throughput against what a released SFT step consumes (BENCHMARKS.md "SFT input").

    python -m mercury_jax.bench.sft_input [--workers 0,1,2] [--rows 12] [--row-length 131072]

Synthetic agent chats (`data/synthetic.py`: tool calls, tool results, ~20k tokens each) in a JSONL file go through
the SFT pipeline exactly as a run reads them (`data/sft_rows.shard_rows`: the Qwen3.5 tokenizer and chat path,
first-fit packing into 131,072-token rows, grain worker processes), one data shard as one host reads it. For each
worker count: the seconds to the first row (worker start-up included) and the tokens per second of the rows after
it (non-padding tokens, the ones the learner trains on).

The demand side is the benches' hand count (`bench/flops.py`: 6 N FLOPs per trained token, N the active
parameters, plus causal attention at the row's mean context) for Qwen3.5-35B-A3B, at 100% of the v5p peak: the
most tokens a second a host's 4 chips could ever consume, so the input pipeline's margin is a lower bound.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from mercury_jax.bench.flops import training_flops_per_token
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import V5P_PEAK_FLOPS
from mercury_jax.chat import qwen35_tokenizer
from mercury_jax.data.corpus import chat_corpus
from mercury_jax.data.sft_rows import RowSpec, shard_rows
from mercury_jax.data.synthetic import write_corpus
from models.qwen35_moe.config import PRESETS

CHIPS_PER_HOST = 4  # v5p


def learner_tokens_per_s(preset: str, row_length: int) -> tuple[float, float]:
    """(trained FLOPs per token, tokens a second a host's chips consume at 100% of peak)."""
    per_token = training_flops_per_token(PRESETS[preset](), row_length)
    return per_token, CHIPS_PER_HOST * V5P_PEAK_FLOPS / per_token


def measure(corpus, tokenizer, spec: RowSpec, rows: int) -> dict:
    iterator = iter(shard_rows(corpus, tokenizer, spec, 0))
    t0 = time.perf_counter()
    next(iterator)
    first = time.perf_counter() - t0
    tokens = 0
    t1 = time.perf_counter()
    for _ in range(rows):
        batch = next(iterator)
        tokens += int(np.sum(batch["segment_ids"] > 0))
    seconds = time.perf_counter() - t1
    return {"first_s": first, "tokens": tokens, "seconds": seconds, "fill": tokens / (rows * spec.row_length)}


def run(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--rows", type=int, default=24, help="rows timed after the first, per worker count")
    parser.add_argument("--row-length", type=int, default=131072)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--words", type=int, default=8000, help="mean words a chat (~2.5 tokens a word)")
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    tokenizer = qwen35_tokenizer()
    per_token, demand = learner_tokens_per_s(args.preset, args.row_length)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chats.jsonl")
        write_corpus(path, args.records, words=args.words, turns=12)
        corpus = chat_corpus(path)
        for workers in (int(w) for w in args.workers.split(",")):
            spec = RowSpec(row_length=args.row_length, rows_per_shard=1, shards=1, seed=0, packing_bins=4,
                           workers=workers, pad_id=tokenizer.pad_id)
            m = measure(corpus, tokenizer, spec, args.rows)
            rate = m["tokens"] / m["seconds"]
            rows.append([workers, f"{m['first_s']:.1f}", args.rows, f"{m['tokens']:,}", f"{m['fill']:.1%}",
                         f"{m['seconds']:.1f}", f"{rate:,.0f}", f"{rate / demand:.1f}x"])
            print(rows[-1], flush=True)
    table = markdown_table(["grain workers", "first row s", "rows timed", "tokens", "row fill", "seconds",
                            "tokens/s delivered", "vs learner at 100% peak"], rows)
    body = (f"One data shard (what one host reads) of {args.records} synthetic agent chats (~{args.words:,} words, "
            f"12 tool-calling turns each) rendered by the Qwen3.5 tokenizer and chat path and packed into "
            f"{args.row_length:,}-token rows. Demand: {args.preset} trains at {per_token / 1e9:.1f} GFLOP a token "
            f"(6 N + causal attention at a mean context of {args.row_length // 2:,}, bench/flops.py's count), so a "
            f"v5p host's {CHIPS_PER_HOST} chips at 100% of the {V5P_PEAK_FLOPS / 1e12:.0f} TFLOP/s peak consume at "
            f"most **{demand:,.0f} tokens/s**; any real MFU consumes less.\n\n{table}")
    print(body)
    if not args.no_write:
        write_section("sft_input", "SFT input pipeline: tokens per second against the learner's demand", body,
                      "python -m mercury_jax.bench.sft_input")


if __name__ == "__main__":
    run()
