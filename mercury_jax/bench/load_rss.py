"""Host memory of loading a checkpoint straight into its sharding: peak RSS while `load_hf(..., mesh=)` reads a
synthetic Qwen3.5-MoE checkpoint of ~1.5B parameters (the 35B-A3B block, fewer layers and experts, the real
vocabulary), against the checkpoint's size and its largest tensor.

    python -m mercury_jax.bench.load_rss [--dir /tmp/mercury_load_rss] [--layers 2] [--experts 64]

The checkpoint is written once (bf16, by `save_hf`, in a child process). The load runs in a fresh child with 8
host-platform devices and a (fsdp 4, expert 2) mesh, while a thread samples /proc/self/status every 5 ms. On CPU
the "devices" are host memory, so the placed fp32 parameters are resident by design: the number that says whether
a load is bounded by about one tensor is the transient, peak anonymous RSS minus the anonymous RSS once the load
returned, compared with the largest tensor (fp32). File-backed pages of the safetensors reads (page cache mapped
by safetensors) are reported apart: the kernel reclaims them under pressure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def child(code: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


WRITE = """
import json, sys
import jax.numpy as jnp
from flax import nnx
from models.qwen35_moe import Qwen35MoeForCausalLM, save_hf
from models.qwen35_moe.config import Qwen35MoeConfig, default_layer_types
cfg = Qwen35MoeConfig(num_hidden_layers={layers}, num_experts={experts}, layer_types=default_layer_types({layers}, 2))
model = Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
save_hf(model, {path!r}, dtype=jnp.bfloat16)
print(json.dumps({{}}))
"""

LOAD = """
import json, re, threading, time
import numpy as np
import jax
from flax import nnx

def status():
    text = open("/proc/self/status").read()
    return {{k: int(re.search(rf"{{k}}:\\s+(\\d+)", text).group(1)) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}}

peak = {{"RssAnon": 0, "RssFile": 0, "VmRSS": 0}}
running = True
def sample():
    while running:
        now = status()
        for k in peak:
            peak[k] = max(peak[k], now[k])
        time.sleep(0.005)

from mercury_jax.parallel import make_mesh
from models.qwen35_moe import load_hf
mesh = make_mesh({{"fsdp": 4, "expert": 2}})
jax.numpy.zeros(8).block_until_ready()
before = status()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
model = load_hf({path!r}, mesh=mesh)
jax.block_until_ready(nnx.state(model))
seconds = time.perf_counter() - t0
after = status()
running = False
thread.join()
arrays = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
on_one_device = max(max(s.data.nbytes for s in a.addressable_shards) for a in arrays)
print(json.dumps({{"before": before, "after": after, "peak": peak, "seconds": seconds,
                  "param_bytes": int(sum(a.nbytes for a in arrays)),
                  "resident_bytes": int(sum(s.data.nbytes for a in arrays for s in a.addressable_shards)),
                  "largest_bytes": int(max(a.nbytes for a in arrays)),
                  "largest_shard_bytes": int(on_one_device), "params": int(sum(a.size for a in arrays))}}))
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/mercury_load_rss")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args(argv)
    path = Path(args.dir) / f"ckpt-{args.layers}l-{args.experts}e"
    if not (path / "config.json").exists():
        print(f"writing the synthetic checkpoint to {path} ...", flush=True)
        child(WRITE.format(layers=args.layers, experts=args.experts, path=str(path)))
    disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    result = child(LOAD.format(path=str(path)), {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    gib = 2.0 ** 30
    before, after, peak = result["before"], result["after"], result["peak"]
    rows = [
        ("parameters", f"{result['params'] / 1e9:.2f} B"),
        ("checkpoint on disk (bf16 safetensors)", f"{disk / gib:.2f} GiB"),
        ("loaded parameters (fp32)", f"{result['param_bytes'] / gib:.2f} GiB"),
        ("their shards on the 8 devices (replicas over the axes a tensor is not split on)",
         f"{result['resident_bytes'] / gib:.2f} GiB"),
        ("largest tensor (fp32)", f"{result['largest_bytes'] / gib:.2f} GiB"),
        ("largest shard on one device (fp32)", f"{result['largest_shard_bytes'] / gib:.2f} GiB"),
        ("anonymous RSS before -> after the load",
         f"{before['RssAnon'] / gib:.2f} -> {after['RssAnon'] / gib:.2f} GiB"),
        ("peak anonymous RSS during the load", f"{peak['RssAnon'] / gib:.2f} GiB"),
        ("transient: peak - after (anonymous)", f"{(peak['RssAnon'] - after['RssAnon']) / gib:.2f} GiB"),
        ("transient / largest tensor", f"{(peak['RssAnon'] - after['RssAnon']) / result['largest_bytes']:.2f}"),
        ("peak file-backed RSS (page cache of the reads)", f"{peak['RssFile'] / gib:.2f} GiB"),
        ("load time", f"{result['seconds']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"\nload_hf(mesh=fsdp 4 x expert 2) of {path}")
    print(f"| {'quantity'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")


if __name__ == "__main__":
    main()
