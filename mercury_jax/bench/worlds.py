"""Time the generation of both full task corpora from scratch and check their oracles; writes the `worlds`
section of BENCHMARKS.md.

    python -m mercury_jax.bench.worlds --out DIR [--worlds 3865 --tasks-per-world 10]
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.envs.generate import generate, verify_oracle


def benchmark(out: str | Path, worlds: int = 3865, tasks_per_world: int = 10) -> str:
    """Generate both full corpora from scratch (fresh subdirectories of `out`), time them, and write the
    `worlds` section of BENCHMARKS.md. Returns the markdown table."""
    rows = []
    for world in ("enterprise", "browse"):
        target = Path(out) / f"bench-{world}"
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        summary = generate(world, worlds, tasks_per_world, target, progress=False)
        seconds = time.perf_counter() - start
        rows.append([world, worlds, summary["tasks"], round(seconds, 1), round(summary["tasks"] / seconds),
                     round(summary["bytes"] / 1e6, 1), summary["shards"],
                     f"{summary['tool_count_min']}-{summary['tool_count_max']} (mean {summary['tool_count_mean']})",
                     len(summary["templates"])])
    table = markdown_table(["world", "worlds", "tasks", "seconds", "tasks/s", "MB (JSONL)", "shards",
                            "tools per task", "templates / hop counts"], rows)
    checks = [verify_oracle(Path(out) / "bench-enterprise"), verify_oracle(Path(out) / "bench-browse", limit=1000)]
    table += "\n\n" + markdown_table(["oracle check", "all_effects_pass", "tasks checked", "seconds"],
                                     [[w, p, n, round(t, 1)] for w, p, n, t in checks])
    body = (table + "\n\nSingle process, deterministic (`json.dumps(sort_keys=True)` lines), written as 100-world "
            "shards with per-shard statistics; enterprise tasks carry their effects and oracle script, browse tasks "
            "rebuild their corpus from the seed.")
    write_section("worlds", "World and task corpus generation", body,
                  f"python -m mercury_jax.bench.worlds --out {out}")
    return table


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--worlds", type=int, default=3865)
    parser.add_argument("--tasks-per-world", type=int, default=10)
    args = parser.parse_args(argv)
    table = benchmark(args.out, args.worlds, args.tasks_per_world)
    print(table)
    return table


if __name__ == "__main__":
    main()
