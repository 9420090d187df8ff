"""Ahead-of-time compile one full-attention layer, forward+backward, for a TPU chip per `attention_impl`.

One `Attention` layer of a preset (default Qwen3.5-35B-A3B: 16 query heads, 2 KV heads, head dim 256, hidden
2048), bf16 activations and fp32 parameters, on one packed row of `--seq` tokens with segment ids, compiled for
one chip of `--topology` on this CPU host with libtpu; gradients w.r.t. the layer's parameters and its input.
Prints `compiled.memory_analysis()` per chip and the compile seconds for each impl ("dense" builds the fp32
[K, G, T, T] scores; "blockwise" and "splash" should not). Nothing runs on a TPU. Needs libtpu:

    PYTHONPATH=<libtpu dir> JAX_PLATFORMS=cpu nice -n 15 python -m mercury_jax.bench.attention_aot --seq 24576
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
from models.qwen35_moe.attention import Attention
from models.qwen35_moe.config import ATTENTION_IMPLS, PRESETS


def compile_layer(preset: str, impl: str, topology: str, seq: int, with_segments: bool):
    """(compiled value_and_grad of one attention layer on one chip, compile seconds)."""
    device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    one_chip = NamedSharding(Mesh(np.array([device]), ("data",)), PartitionSpec())
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", attention_impl=impl)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Attention(cfg, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_chip), state)
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.bfloat16, sharding=one_chip)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=one_chip)

    def loss(params, x_BxTxH, segment_ids_BxT):
        layer = nnx.merge(graphdef, params)
        positions_BxT = jnp.broadcast_to(jnp.arange(seq), (1, seq))
        out_BxTxH, _ = layer(x_BxTxH, positions_BxT=positions_BxT,
                             segment_ids_BxT=segment_ids_BxT if with_segments else None)
        return jnp.sum(out_BxTxH.astype(jnp.float32) ** 2)

    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x, ids).compile()
    return compiled, time.perf_counter() - start


def main():
    jax_setup.configure(platforms="cpu", tpu_topology=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:2x2x2", help="the first chip of it is compiled for")
    parser.add_argument("--seq", type=int, default=24576)
    parser.add_argument("--impls", default=",".join(ATTENTION_IMPLS), help="comma list of attention_impl values")
    parser.add_argument("--no-segments", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]()
    gib = 2 ** 30
    rows = []
    for impl in args.impls.split(","):
        try:
            compiled, seconds = compile_layer(args.preset, impl, args.topology, args.seq, not args.no_segments)
        except Exception as error:  # a failed lowering is a result of this benchmark, reported in the table
            message = " ".join(str(error).split())[:300]
            print(f"{impl}: FAILED: {type(error).__name__}: {message}", flush=True)
            rows.append([impl, f"failed: {type(error).__name__}: {message}", "", "", ""])
            continue
        memory = compiled.memory_analysis()
        mosaic_calls = compiled.as_text().count("tpu_custom_call")
        rows.append([impl, f"{memory.temp_size_in_bytes / gib:.2f}", f"{memory.argument_size_in_bytes / gib:.2f}",
                     mosaic_calls, f"{seconds:.1f}"])
        print(f"{impl}: compiled in {seconds:.1f} s, temp {memory.temp_size_in_bytes / gib:.2f} GiB", flush=True)
    headers = ["attention_impl", "temp GiB/chip", "arguments GiB/chip", "Mosaic calls in HLO", "compile s"]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir> JAX_PLATFORMS=cpu python -m mercury_jax.bench.attention_aot --preset "
                   f"{args.preset} --topology {args.topology} --seq {args.seq} --impls {args.impls}"
                   + (" --no-segments" if args.no_segments else "") + " --write")
        body = (f"One full-attention layer of `{args.preset}` ({cfg.num_attention_heads} query heads, "
                f"{cfg.num_key_value_heads} KV heads, head dim {cfg.head_dim}, hidden {cfg.hidden_size}), "
                f"value_and_grad w.r.t. its parameters and input, bf16 activations, fp32 parameters, one row of "
                f"{args.seq} tokens (segment ids {'off' if args.no_segments else 'on'}), compiled ahead of time for "
                f"one chip of `{args.topology}` on a CPU host with libtpu. Nothing ran on a TPU.\n\n" + table)
        write_section("attention_aot", "Attention implementations: TPU ahead-of-time compile", body, command)


if __name__ == "__main__":
    main()
