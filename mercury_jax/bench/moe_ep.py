"""Ahead-of-time compile one released-shape MoE layer (fwd + bwd) for v5p with moe_impl='ep' and report memory/chip.

Weak scaling: a fixed number of tokens per chip on 4, 8 and 16 chips; the mesh per topology is given as
TOPOLOGY=axis:size/axis:size (default: the expert axis spans all chips). One compile at a time; nothing runs on a
TPU. Needs libtpu importable (it is not a runtime dependency):

    PYTHONPATH=/path/to/libtpu JAX_PLATFORMS=cpu python -m mercury_jax.bench.moe_ep --write
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.bench import jax_setup
from mercury_jax.bench.hlo_bytes import collective_ops
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import program_bytes
from mercury_jax.parallel.mesh import make_mesh
from mercury_jax.parallel.sharding import variable_sharding
from models.qwen35_moe.config import PRESETS
from models.qwen35_moe.moe import SparseMoe

DEFAULT_RUNS = ("v5p:2x2x1=expert:4", "v5p:2x2x2=expert:8", "v5p:2x2x4=expert:16")


def compile_layer(preset: str, topology: str, mesh_shape: dict, tokens_per_chip: int, seq: int,
                  round_factor: float = 2.0):
    """(memory_analysis, compile seconds, collective op counts) of one MoE layer's value_and_grad."""
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = make_mesh(mesh_shape, devices=devices)
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", moe_impl="ep", moe_ep_round_factor=round_factor)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: SparseMoe(cfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(state)
    params = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(p, v, mesh)) for p, v in flat]
    batch = tokens_per_chip * len(devices) // seq
    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"))))

    def loss(arrays, x_BxTxH):
        moe = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(a)) for (p, v), a in zip(flat, arrays)]))
        out, aux = moe(x_BxTxH)
        return jnp.mean(out.astype(jnp.float32) ** 2) + jnp.sum(aux["expert_counts_E"] * aux["router_prob_sum_E"])

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)),
                   out_shardings=(None, ([p.sharding for p in params], x.sharding)))
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(params, x).compile()
    seconds = time.perf_counter() - start
    ops = collective_ops(compiled.as_text())
    return compiled.memory_analysis(), seconds, ops, len(devices)


def main():
    jax_setup.configure(platforms="cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS),
                        help="TOPOLOGY=axis:size/axis:size[@TOKENS_PER_CHIP], e.g. v5p:2x2x2=expert:4/fsdp:2")
    parser.add_argument("--tokens-per-chip", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--round-factor", type=float, default=2.0, help="model.moe_ep_round_factor")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    gib = 2 ** 30
    rows = []
    for run in args.runs:
        run, _, tokens_text = run.partition("@")
        tokens_per_chip = int(tokens_text) if tokens_text else args.tokens_per_chip
        seq = max(args.seq, tokens_per_chip) if tokens_text else args.seq
        topology, mesh_text = run.split("=")
        mesh_shape = {k: int(v) for k, v in (item.split(":") for item in mesh_text.split("/"))}
        memory, seconds, ops, chips = compile_layer(args.preset, topology, mesh_shape, tokens_per_chip, seq,
                                                    args.round_factor)
        total = program_bytes(memory)
        rows.append([topology, chips, mesh_text, tokens_per_chip, f"{memory.argument_size_in_bytes / gib:.2f}",
                     f"{memory.temp_size_in_bytes / gib:.2f}", f"{total / gib:.2f}",
                     ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())), f"{seconds:.0f}"])
        print(rows[-1], flush=True)
    headers = ["topology", "chips", "mesh", "tokens/chip", "arguments GiB/chip", "temp GiB/chip", "total GiB/chip",
               "collectives", "compile s"]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir> python -m mercury_jax.bench.moe_ep --preset {args.preset} "
                   f"--tokens-per-chip {args.tokens_per_chip} --seq {args.seq} --round-factor {args.round_factor} "
                   f"--runs {' '.join(args.runs)} --write")
        body = ("One released-shape MoE layer (router, top-k, 256 experts top-8 via moe_impl='ep', shared expert), "
                "forward + backward, fp32 weights and bf16 compute, compiled ahead of time for v5p on a CPU host; "
                "memory from `compiled.memory_analysis()` per chip. The dispatch runs in rounds of "
                "B = 2 x tokens/chip x k received rows (twice the balanced load; `moe_ep.round_rows`), so the "
                "buffers do not depend on the expert-axis size P; a skewed routing takes more rounds (up to "
                "P x min(k, experts/chip) / (2 k)), not more memory. A row with `@N` uses N tokens per chip "
                "(a micro-batch of the released step is 24,576 tokens a chip).\n\n" + table)
        write_section("moe_ep", "Expert-parallel MoE layer: memory per chip (v5p AOT)", body, command)


if __name__ == "__main__":
    main()
