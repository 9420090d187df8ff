"""Ahead-of-time compile the gated delta rule for a TPU topology on this CPU host: Pallas kernels vs pure-JAX chunked.

Lowers and compiles `pallas_gated_delta_rule` (interpret=False, so the kernel bodies go through Mosaic) and, side by
side, `chunked_gated_delta_rule` (`--impls`), forward and forward+backward for `--topology` (default v5p:2x2x2,
8 chips), with the batch sharded over the chips by `shard_map` (each chip runs the rule on its own rows). Reports
compile time, `compiled.memory_analysis()` per chip, the compiler's cost analysis and whether the compiled HLO
holds the Mosaic custom calls. Needs libtpu (not a runtime dependency):

    pip install --target LIBTPU_DIR "libtpu==0.0.52"        # the compiler of the BENCHMARKS figures (docs/USAGE.md)
    PYTHONPATH=<libtpu dir> python -m mercury_jax.bench.gated_delta_aot --batch 8 --seq 1024 --heads 32
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.bench import jax_setup
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import cost_and_roofline
from mercury_kernels.gated_delta.chunked import chunked_gated_delta_rule
from mercury_kernels.gated_delta.pallas import chunk_macs, pallas_gated_delta_rule


def compile_kernels(topology, batch, seq, heads, key_dim, value_dim, chunk, dtype, with_segments, impl="pallas"):
    """Compiled forward and value_and_grad executables and their compile seconds, batch sharded over the chips."""
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    if batch % len(devices):
        raise ValueError(f"gated_delta_aot: --batch {batch} must be a multiple of the {len(devices)} chips of "
                         f"{topology} (the batch is sharded over them)")
    mesh = Mesh(devices, ("data",))
    rows = PartitionSpec("data")
    sharded = NamedSharding(mesh, rows)

    def struct(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharded)

    args = [struct((batch, seq, heads, key_dim), dtype), struct((batch, seq, heads, key_dim), dtype),
            struct((batch, seq, heads, value_dim), dtype), struct((batch, seq, heads), jnp.float32),
            struct((batch, seq, heads), jnp.float32), struct((batch, heads, key_dim, value_dim), jnp.float32),
            struct((batch, seq), jnp.int32)]

    def local(q, k, v, g, beta, initial_state, segment_ids):
        segment_ids = segment_ids if with_segments else None
        if impl == "chunked":
            return chunked_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state,
                                            segment_ids_BxT=segment_ids, chunk_size=chunk)
        return pallas_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state,
                                       segment_ids_BxT=segment_ids, chunk_size=chunk, interpret=False)

    rule = jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 7, out_specs=(rows, rows), check_vma=False)

    def loss(q, k, v, g, beta, initial_state, segment_ids):
        out, final = rule(q, k, v, g, beta, initial_state, segment_ids)
        return jnp.sum(out) + jnp.sum(final)

    results = {}
    for name, fn in (("forward", rule), ("forward+backward", jax.value_and_grad(loss, argnums=range(6)))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        results[name] = (compiled, time.perf_counter() - start)
    return results, len(devices)


def main():
    jax_setup.configure(platforms="cpu", tpu_topology=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32, help="value heads (35B-A3B: 32)")
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-segments", action="store_true")
    parser.add_argument("--impls", default="pallas", help="comma list: pallas, chunked")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    mib = 2 ** 20
    rows, n_devices = [], 0
    for impl in args.impls.split(","):
        results, n_devices = compile_kernels(args.topology, args.batch, args.seq, args.heads, args.key_dim,
                                             args.value_dim, args.chunk, jnp.dtype(args.dtype),
                                             not args.no_segments, impl)
        for name, (compiled, seconds) in results.items():
            memory = compiled.memory_analysis()
            mosaic_calls = compiled.as_text().count("tpu_custom_call")
            flops, nbytes, roofline_s, bound = cost_and_roofline(compiled)
            chunks_per_chip = args.batch // n_devices * args.heads * -(-args.seq // args.chunk)
            analytic = 2 * (4 if "backward" in name else 1) * chunks_per_chip * chunk_macs(
                args.chunk, args.key_dim, args.value_dim)
            rows.append([impl, name, f"{args.batch}x{args.seq}", f"{args.heads}x{args.key_dim}/{args.value_dim}",
                         args.chunk, args.dtype, f"{memory.argument_size_in_bytes / mib:.1f}",
                         f"{memory.temp_size_in_bytes / mib:.1f}", f"{analytic / 1e12:.2f}", f"{flops / 1e12:.3f}",
                         f"{nbytes / mib:,.0f}", f"{roofline_s * 1e3:.2f} ({bound})", mosaic_calls,
                         f"{seconds:.1f}"])
            print(f"{impl} {name}: compiled in {seconds:.1f} s, temp {memory.temp_size_in_bytes / mib:.1f} MiB, "
                  f"{mosaic_calls} Mosaic custom call(s)", flush=True)
    headers = ["impl", "pass", "batch x seq", "heads x K/V", "chunk", "q/k/v dtype", "arguments MiB/chip",
               "temp MiB/chip", "chunk-algebra TFLOP/chip", "XLA TFLOP/chip", "XLA MiB accessed/chip",
               "XLA roofline ms (bound)", "Mosaic calls in HLO",
               "compile s"]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir> python -m mercury_jax.bench.gated_delta_aot --topology "
                   f"{args.topology} --batch {args.batch} --seq {args.seq} --heads {args.heads} --key-dim "
                   f"{args.key_dim} --value-dim {args.value_dim} --chunk {args.chunk} --dtype {args.dtype}"
                   + (" --no-segments" if args.no_segments else "") + f" --impls {args.impls} --write")
        body = (f"The gated delta rule alone (`pallas_gated_delta_rule` compiled with Mosaic, interpret=False; "
                f"`chunked_gated_delta_rule`, pure JAX) ahead of time for `{args.topology}` ({n_devices} chips) on a "
                f"CPU host with libtpu; the batch is sharded over the chips with `shard_map` "
                f"({args.batch // max(n_devices, 1)} rows per chip); segment ids "
                f"{'off' if args.no_segments else 'on'}, initial state on. \"Chunk-algebra TFLOP\" counts the "
                "products of the WY/UT chunk step both forms compute (`pallas.chunk_macs`; the backward as 3x the "
                "forward). The XLA columns are the compiler's cost analysis: the Mosaic calls by the kernel's "
                "declared `pl.CostEstimate`, while the chunked form's loop bodies are counted once per loop, not "
                "once per trip, so its XLA FLOPs and bytes are far too low and its roofline is not comparable. The "
                "roofline is max(FLOPs / bf16 peak, bytes / HBM bandwidth) on v5p, a lower bound. Nothing ran on a "
                "TPU: this proves the kernels lower and compile for the chip and what they hold, not their "
                "speed.\n\n" + table)
        write_section("gated_delta_aot", "Gated delta rule: Pallas vs chunked, TPU ahead-of-time compile", body,
                      command)


if __name__ == "__main__":
    main()
