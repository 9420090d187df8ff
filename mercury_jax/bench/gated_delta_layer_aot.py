"""Ahead-of-time compile the model's Gated DeltaNet layer, forward+backward, for TPU per `gdn_impl`, side by side.

One `GatedDeltaNet` layer of a preset (default Qwen3.5-35B-A3B: 16 key / 32 value heads, K = V = 128, hidden 2048)
with its projections, causal conv, gated norm and output projection; bf16 activations, fp32 parameters; packed rows
with segment ids; `--rows-per-chip` rows of `--seq` tokens on every chip of `--topology`, rows sharded over the
chips ('data') under the mesh context the trainers use, so the Pallas kernel runs through the layer's per-shard
`shard_map` (`parallel.per_shard`). value_and_grad w.r.t. the parameters and the input. Prints, per `gdn_impl`,
`compiled.memory_analysis()` per chip, compile seconds, the compiler's cost analysis (FLOPs, bytes accessed; the
Mosaic calls carry the kernel's own `pl.CostEstimate`) and a roofline time on v5p (max of FLOPs / peak and bytes /
HBM bandwidth). Nothing runs on a TPU. Needs libtpu:

    PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.gated_delta_layer_aot
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.bench import jax_setup
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import V5P_HBM_BYTES_PER_S, V5P_PEAK_FLOPS, cost_and_roofline
from mercury_jax.parallel import with_mesh_context
from models.qwen35_moe.config import PRESETS
from models.qwen35_moe.gated_deltanet import GatedDeltaNet


def compile_layer(preset: str, impl: str, topology: str, rows_per_chip: int, seq: int):
    """(compiled value_and_grad of one GDN layer, rows over the topology's chips, compile seconds, chip count)."""
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.array(devices), ("data",))
    replicated, by_row = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", gdn_impl=impl)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GatedDeltaNet(cfg, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
    rows = rows_per_chip * len(devices)
    x = jax.ShapeDtypeStruct((rows, seq, cfg.hidden_size), jnp.bfloat16, sharding=by_row)
    ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=by_row)

    def loss(params, x_BxTxH, segment_ids_BxT):
        out_BxTxH, _ = nnx.merge(graphdef, params)(x_BxTxH, segment_ids_BxT=segment_ids_BxT)
        return jnp.sum(out_BxTxH.astype(jnp.float32) ** 2)

    step = jax.jit(with_mesh_context(jax.value_and_grad(loss, argnums=(0, 1)), mesh))
    start = time.perf_counter()
    compiled = step.lower(params, x, ids).compile()
    return compiled, time.perf_counter() - start, len(devices)


def main():
    jax_setup.configure(platforms="cpu", tpu_topology=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--rows-per-chip", type=int, default=4)
    parser.add_argument("--seq", type=int, default=24576)
    parser.add_argument("--impls", default="chunked,pallas", help="comma list of gdn_impl values")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]()
    gib = 2 ** 30
    rows, chips = [], 0
    for impl in args.impls.split(","):
        try:
            compiled, seconds, chips = compile_layer(args.preset, impl, args.topology, args.rows_per_chip, args.seq)
        except Exception as error:  # a failed lowering is a result of this benchmark, reported in the table
            message = " ".join(str(error).split())[:300]
            print(f"{impl}: FAILED: {type(error).__name__}: {message}", flush=True)
            rows.append([impl, f"failed: {type(error).__name__}: {message}"] + [""] * 7)
            continue
        memory = compiled.memory_analysis()
        flops, nbytes, roofline_s, bound = cost_and_roofline(compiled)
        mosaic_calls = compiled.as_text().count("tpu_custom_call")
        rows.append([impl, f"{memory.temp_size_in_bytes / gib:.2f}", f"{memory.argument_size_in_bytes / gib:.2f}",
                     f"{seconds:.1f}", f"{flops / 1e12:.2f}", f"{nbytes / gib:.1f}",
                     f"{roofline_s * 1e3:.1f} ({bound})",
                     mosaic_calls])
        print(f"{impl}: compiled in {seconds:.1f} s, temp {memory.temp_size_in_bytes / gib:.2f} GiB, "
              f"{flops / 1e12:.2f} TFLOP, {nbytes / gib:.1f} GiB accessed", flush=True)
    headers = ["gdn_impl", "temp GiB/chip", "arguments GiB/chip", "compile s", "TFLOP/chip", "GiB accessed/chip",
               "roofline ms (bound)", "Mosaic calls"]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.gated_delta_layer_aot "
                   f"--preset {args.preset} --topology {args.topology} --rows-per-chip {args.rows_per_chip} --seq "
                   f"{args.seq} --impls {args.impls} --write")
        body = (f"One Gated DeltaNet layer of `{args.preset}` ({cfg.linear_num_key_heads} key / "
                f"{cfg.linear_num_value_heads} value heads, K = {cfg.linear_key_head_dim}, V = "
                f"{cfg.linear_value_head_dim}, hidden {cfg.hidden_size}, chunk {cfg.gdn_chunk_size}) with its "
                f"projections, conv and gated norm, value_and_grad w.r.t. its parameters and input, bf16 activations, "
                f"fp32 parameters, {args.rows_per_chip} packed rows x {args.seq} tokens per chip on the {chips} chips "
                f"of `{args.topology}` (rows over the chips under the trainers' mesh context; the Pallas kernel "
                f"runs per shard), compiled ahead of time on a CPU host with libtpu. Cost analysis is XLA's for the "
                f"whole program, the Mosaic calls counted by the kernel's declared `pl.CostEstimate`; the roofline "
                f"uses v5p's bf16 peak ({V5P_PEAK_FLOPS / 1e12:.0f} TFLOP/s) and HBM bandwidth "
                f"({V5P_HBM_BYTES_PER_S / 1e9:,.0f} GB/s), so it is a lower bound (the kernel's matmuls are f32 at "
                f"HIGHEST precision, several MXU passes each). Nothing ran on a TPU.\n\n" + table)
        write_section("gated_delta_layer_aot", "Gated DeltaNet layer: chunked vs Pallas, TPU ahead-of-time compile",
                      body, command)


if __name__ == "__main__":
    main()
