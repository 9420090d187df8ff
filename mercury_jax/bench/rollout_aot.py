"""Ahead-of-time compile one rollout replica's decode (and prefill) programs for TPU; memory, layout, roofline.

The released rollout group is R identical replicas (`rollout.replica`, e.g. tensor=4 -> 16 replicas of 4 chips on
64 chips), so one replica's programs on a topology of the replica's size say what every chip of the group holds.
The programs are the engine's own (`rollout/sampler.py`): `decode` (`--steps` T = 1 steps for every slot, state
donated) and `prefill` (one slot's row advanced by `--prefill-tokens` tokens), traced under the replica's mesh
with its bf16 weights and its sharded decode state (`rollout/layout.py`), from abstract shapes: nothing is
allocated, nothing runs on a TPU. Prints per program `compiled.memory_analysis()` per chip, compile seconds,
XLA's cost analysis and a v5p roofline; the decode roofline (bytes accessed / HBM bandwidth per step) gives the
group's decode tokens/s as R x slots / step time, an upper bound. Needs libtpu:

    PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.rollout_aot
"""
from __future__ import annotations

import argparse
import time

from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.bench import jax_setup
from mercury_jax.bench.abstract import abstract_engine, abstract_model, prefill_inputs
from mercury_jax.bench.hlo_bytes import bytes_per_trip, entry_transfers, optimised_module_text
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import GIB, V5P_HBM_BYTES_PER_S, cost_and_roofline, decode_read_bytes, program_bytes
from mercury_jax.parallel import make_mesh
from mercury_jax.rollout.sampler import _compiled
from mercury_jax.rollout.sizing import replica_memory
from models.qwen35_moe.config import PRESETS

HEADERS = ["program", "arguments GiB/chip", "temp GiB/chip", "total GiB/chip", "compile s", "TFLOP/chip",
           "GiB accessed/chip", "roofline ms (bound)", "copies + collectives outside loops GiB"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:2x2x1", help="one replica's chips")
    parser.add_argument("--replica", default="tensor:4", help="axis:size/axis:size, one replica's mesh")
    parser.add_argument("--group-chips", type=int, default=64, help="chips of the rollout group (R = group / replica)")
    parser.add_argument("--slots", type=int, default=128, help="slots of the whole group (num_slots)")
    parser.add_argument("--max-length", type=int, default=24576)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per program (steps_per_sync)")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="0: skip the prefill program")
    parser.add_argument("--param-dtype", default="bfloat16")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    return parser.parse_args()


def compile_row(name: str, lower, dump_dir: str) -> tuple[list, float | None, float]:
    """(the program's table row, the bytes it copies or moves outside its loops or None when it was refused, the
    time its compile started)."""
    start, started = time.perf_counter(), time.time()
    try:
        compiled = lower().compile()
    except Exception as error:  # a refused compile (e.g. over HBM) is a result, reported in the table
        message = " ".join(str(error).split())[:300]
        print(f"{name}: FAILED: {type(error).__name__}: {message}", flush=True)
        return [name, f"failed: {type(error).__name__}: {message}"] + [""] * 7, None, started
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    flops, nbytes, roofline_s, bound = cost_and_roofline(compiled)
    outside = sum(b for _, _, b in entry_transfers(optimised_module_text(dump_dir, started), 16 * 2 ** 20))
    row = [name, f"{memory.argument_size_in_bytes / GIB:.2f}", f"{memory.temp_size_in_bytes / GIB:.2f}",
           f"{program_bytes(memory) / GIB:.2f}", f"{seconds:.0f}", f"{flops / 1e12:.3f}", f"{nbytes / GIB:.2f}",
           f"{roofline_s * 1e3:.1f} ({bound})", f"{outside / GIB:.2f}"]
    print(row, flush=True)
    return row, outside, started


def decode_text(args, counts: tuple, slots: int, replicas: int) -> str:
    """The decode roofline a step and the group's tokens/s, derived in words from the bytes counted in the compiled
    chunk, the bytes a step must read and what the program moves outside its loops (`counts`)."""
    counted, must_read, outside = counts
    decode_step_s = max(counted, must_read) / V5P_HBM_BYTES_PER_S
    group_tps = replicas * slots / decode_step_s
    return (
        f"Decode bytes per step: {counted / GIB:.2f} GiB per chip counted in the compiled program "
        f"(`bench/hlo_bytes.py`: the optimised HLO with every loop by its trip count, the {args.steps}-"
        f"step compile minus a 1-step compile, over {args.steps - 1}), against {must_read / GIB:.2f} GiB "
        f"a step must read (the weights but the embedding table and the routed experts, the expected "
        f"share of distinct experts {slots} tokens hit, the decode state): {counted / must_read:.2f}x. "
        f"Outside its loops the decode program copies or moves {outside / GIB:.2f} GiB per call "
        f"(arrays of 16 MiB or more). "
        f"Decode roofline: {decode_step_s * 1e3:.2f} ms per step (the larger of the two over the HBM "
        f"bandwidth), so "
        f"{slots / decode_step_s:,.0f} tokens/s per replica and {group_tps:,.0f} tokens/s for the group "
        f"of {args.group_chips} chips with every slot busy: an upper bound (no overlap losses, no "
        f"prefills, no host sync between chunks).")


def main():
    dump_dir = jax_setup.configure(platforms="cpu", tpu_topology=True, hlo_dump=".*traced_on_mesh.*")
    args = parse_args()
    replica = {k: int(v) for k, v in (item.split(":") for item in args.replica.split("/"))}
    per_replica = 1
    for size in replica.values():
        per_replica *= size
    replicas = args.group_chips // per_replica
    slots = args.slots // replicas
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = make_mesh(replica, devices=devices)
    graphdef, params, state, row_shapes, cast, shapes = abstract_engine(
        abstract_model(args.preset), slots, args.max_length, args.param_dtype, mesh=mesh)
    sizing = replica_memory(cast, shapes, mesh)
    print(f"{replicas} replicas x {per_replica} chips {replica}, {slots} slots each; weights "
          f"{sizing['weights_gib']:.2f} GiB + decode state {sizing['state_gib']:.2f} GiB per chip", flush=True)
    prefill_row, decode, _, _ = _compiled(graphdef, args.max_length, mesh)
    programs = {"decode": lambda: decode.lower(params, state, args.steps)}
    if args.prefill_tokens:
        inputs = prefill_inputs(args.prefill_tokens, NamedSharding(mesh, PartitionSpec()))
        programs["prefill"] = lambda: prefill_row.lower(params, row_shapes, *inputs)
    rows, estimate = [], ""
    for name, lower in programs.items():
        row, outside, started = compile_row(name, lower, dump_dir)
        rows.append(row)
        if name == "decode" and outside is not None:  # XLA counts the loop's body once: count by trip counts
            must_read = decode_read_bytes(params, state, PRESETS[args.preset](), slots)
            counted = bytes_per_trip(started, lambda: decode.lower(params, state, 1).compile(), args.steps)
            estimate = decode_text(args, (counted, must_read, outside), slots, replicas)
    table = markdown_table(HEADERS, rows)
    print(table)
    print(estimate)
    if args.write:
        write_section("rollout_aot", "Rollout replica: decode and prefill, TPU ahead-of-time compile",
                      section_text(args, replica, per_replica, replicas, slots, sizing, table, estimate),
                      command_line(args))


def command_line(args) -> str:
    return (f"PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.rollout_aot --preset "
            f"{args.preset} --topology {args.topology} --replica {args.replica} --group-chips "
            f"{args.group_chips} --slots {args.slots} --max-length {args.max_length} --steps {args.steps} "
            f"--prefill-tokens {args.prefill_tokens} --param-dtype {args.param_dtype} --write")


def section_text(args, replica: dict, per_replica: int, replicas: int, slots: int, sizing: dict, table: str,
                 estimate: str) -> str:
    """The BENCHMARKS.md section: the replica, its layout and memory by shapes, the table and the estimate."""
    return (f"One rollout replica of `{args.preset}`: {per_replica} chips of `{args.topology}` as mesh {replica}, "
            f"{replicas} such replicas on the {args.group_chips}-chip rollout group, {slots} slots x "
            f"{args.max_length} tokens each ({args.slots} in all), {args.param_dtype} weights. Layout "
            f"(`rollout/layout.py`): weights by their logical names, decode state with slots over "
            f"(data, fsdp, expert) and heads over tensor where the sizes divide. By shapes and layouts "
            f"(`rollout/sizing.py`) a chip holds {sizing['weights_gib']:.2f} GiB of weights and "
            f"{sizing['state_gib']:.2f} GiB of decode state. The engine's own programs (`rollout/sampler.py`), "
            f"compiled ahead of time on a CPU host with libtpu: `decode` ({args.steps} steps for every slot, "
            f"state donated) and `prefill` (one slot's row advanced by {args.prefill_tokens} tokens). Memory is "
            f"`compiled.memory_analysis()` per chip (total = arguments + outputs + temporaries - aliased). "
            f"Nothing ran on a TPU.\n\n" + table + "\n\n" + estimate)


if __name__ == "__main__":
    main()
