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

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host topology; silences libtpu's probe

import argparse  # noqa: E402
import time  # noqa: E402

from mercury_jax.bench.hlo_bytes import bytes_per_trip, dump_optimised_hlo, entry_transfers, optimised_module_text  # noqa: E402, I001

# run as the bench: the optimised HLO of every compile on a mesh lands here, for the trip-counted byte count
DUMP_DIR = dump_optimised_hlo() if __name__ == "__main__" else None

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

from mercury_jax.bench.report import V5P_HBM_BYTES_PER_S, cost_and_roofline, markdown_table, write_section  # noqa: E402
from mercury_jax.parallel import make_mesh, variable_sharding  # noqa: E402
from mercury_jax.rollout.layout import rollout_dtype, row_shardings, state_shardings  # noqa: E402
from mercury_jax.rollout.sampler import MAX_STOP_IDS, _compiled, empty_state  # noqa: E402
from mercury_jax.rollout.sizing import replica_memory  # noqa: E402
from models.qwen35_moe import Qwen35MoeForCausalLM  # noqa: E402
from models.qwen35_moe.config import PRESETS  # noqa: E402

GIB = 2 ** 30


def abstract_model(preset: str) -> nnx.Module:
    """The preset's model (fp32 params) as abstract shapes: nothing allocated."""
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32")
    return nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))


def laid_out(state: nnx.State, mesh) -> nnx.State:
    """`state`'s variables as ShapeDtypeStructs laid out on `mesh` by their logical names."""
    return nnx.from_flat_state([
        (path, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(path, v, mesh))))
        for path, v in nnx.to_flat_state(state)])


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of `tree`'s sharded abstract leaves (the largest shard; a replicated leaf whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def decode_read_bytes(params, decode_state, cfg, slots: int) -> float:
    """HBM bytes per chip one decode step must read: every weight but the embedding table (a lookup) and the routed
    experts, the routed experts' expected share of distinct experts hit by `slots` tokens of top-k routing
    (E (1 - (1 - k / E)^slots) of E, uniform routing), and the whole decode state (K/V caches and GDN states)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    hit = 1 - (1 - k / E) ** slots
    dense = routed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(p, "key", p)) for p in path]
        if any("embed" in n for n in names):
            continue
        nbytes = per_chip_bytes([leaf])
        if any(n.startswith("expert_") for n in names):
            routed += nbytes
        else:
            dense += nbytes
    return dense + hit * routed + per_chip_bytes(decode_state)


def abstract_engine(model: nnx.Module, slots: int, max_length: int, param_dtype, mesh=None, device=None):
    """(graphdef, params cast to `param_dtype`, decode state, one slot's row, the cast params and the state's
    shapes unplaced), every array abstract and laid out as an engine lays it out: on a replica's `mesh`
    (`rollout/layout.py`), or whole on one `device` (an engine without a mesh)."""
    graphdef, state = nnx.split(model)
    cast = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, rollout_dtype(a.dtype, param_dtype)), state)
    shapes = jax.eval_shape(lambda: empty_state(model.init_cache, slots, max_length))
    row = jax.eval_shape(lambda: model.init_cache(1, max_length))
    if mesh is not None:
        params, state_sh, row_sh = laid_out(cast, mesh), state_shardings(shapes, mesh), row_shardings(row, mesh)
    else:
        one = SingleDeviceSharding(device)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), cast)
        state_sh, row_sh = jax.tree.map(lambda _: one, shapes), jax.tree.map(lambda _: one, row)
    placed = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
    return graphdef, params, placed(shapes, state_sh), placed(row, row_sh), cast, shapes


def prefill_inputs(tokens: int, sharding) -> tuple:
    """(ids [1, tokens], length, request) of one `Sampler.prefill` call, abstract, on `sharding` (replicated)."""
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=sharding)  # noqa: E731
    request = {"reset": scalar(bool), "limit": scalar(jnp.int32), "request_id": scalar(jnp.int32),
               "seed": scalar(jnp.int32), "temperature": scalar(jnp.float32), "top_k": scalar(jnp.int32),
               "top_p": scalar(jnp.float32),
               "stop_ids": jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=sharding)}
    return jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=sharding), scalar(jnp.int32), request


def main():
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
    args = parser.parse_args()
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
    rows, decode_step_s, decode_counts = [], None, None
    for name, lower in programs.items():
        start, started = time.perf_counter(), time.time()
        try:
            compiled = lower().compile()
        except Exception as error:  # a refused compile (e.g. over HBM) is a result, reported in the table
            message = " ".join(str(error).split())[:300]
            print(f"{name}: FAILED: {type(error).__name__}: {message}", flush=True)
            rows.append([name, f"failed: {type(error).__name__}: {message}"] + [""] * 7)
            continue
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                 - memory.alias_size_in_bytes)
        flops, nbytes, roofline_s, bound = cost_and_roofline(compiled)
        text = optimised_module_text(DUMP_DIR, started)
        outside = sum(b for _, _, b in entry_transfers(text, 16 * 2 ** 20))
        if name == "decode":  # XLA counts the decode loop's body once: count the HLO by trip counts instead
            must_read = decode_read_bytes(params, state, PRESETS[args.preset](), slots)
            counted = bytes_per_trip(started, lambda: decode.lower(params, state, 1).compile(), args.steps)
            decode_counts = (counted, must_read, outside)
            decode_step_s = max(counted, must_read) / V5P_HBM_BYTES_PER_S
        rows.append([name, f"{memory.argument_size_in_bytes / GIB:.2f}", f"{memory.temp_size_in_bytes / GIB:.2f}",
                     f"{total / GIB:.2f}", f"{seconds:.0f}", f"{flops / 1e12:.3f}", f"{nbytes / GIB:.2f}",
                     f"{roofline_s * 1e3:.1f} ({bound})", f"{outside / GIB:.2f}"])
        print(rows[-1], flush=True)
    headers = ["program", "arguments GiB/chip", "temp GiB/chip", "total GiB/chip", "compile s", "TFLOP/chip",
               "GiB accessed/chip", "roofline ms (bound)", "copies + collectives outside loops GiB"]
    table = markdown_table(headers, rows)
    estimate = ""
    if decode_step_s:
        group_tps = replicas * slots / decode_step_s
        counted, must_read, outside = decode_counts
        estimate = (f"Decode bytes per step: {counted / GIB:.2f} GiB per chip counted in the compiled program "
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
    print(table)
    print(estimate)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.rollout_aot --preset "
                   f"{args.preset} --topology {args.topology} --replica {args.replica} --group-chips "
                   f"{args.group_chips} --slots {args.slots} --max-length {args.max_length} --steps {args.steps} "
                   f"--prefill-tokens {args.prefill_tokens} --param-dtype {args.param_dtype} --write")
        body = (f"One rollout replica of `{args.preset}`: {per_replica} chips of `{args.topology}` as mesh {replica}, "
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
        write_section("rollout_aot", "Rollout replica: decode and prefill, TPU ahead-of-time compile", body, command)


if __name__ == "__main__":
    main()
