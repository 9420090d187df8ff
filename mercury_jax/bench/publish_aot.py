"""Ahead-of-time compile the weight publish (actor mesh -> every rollout replica) for TPU; memory and bytes moved.

The released run's device groups over one v5p topology (`--topology`, default 4x4x8 = 128 chips): the first
`--rollout-chips` as R replicas of `--replica`, the next `--actor-chips` as the actor's mesh (fsdp over the group,
as `experiments/common.py:mesh_config`). The publish is `rollout/publish.py`'s two programs, traced from abstract
fp32 params laid out as the actor holds them: `stage` (cast to bf16, C = actor / replica-size copies in the
replica's layout, among the actor chips) and `send` (one collective-permute per round from the C copies to the R
replicas, on the union mesh). Prints per program `compiled.memory_analysis()` per chip, compile seconds, the
collectives of the compiled HLO with the bytes they deliver per chip, and an ICI estimate. Needs libtpu:

    PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.publish_aot
"""
from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import topologies

from mercury_jax.bench import jax_setup
from mercury_jax.bench.abstract import abstract_model, laid_out
from mercury_jax.bench.hlo_bytes import collective_results
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import GIB, V5P_ICI_BYTES_PER_S, program_bytes
from mercury_jax.parallel import make_mesh, param_shardings
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.publish import Publisher
from models.qwen35_moe.config import PRESETS


def share_bytes(params, mesh, dtype_bytes: int) -> int:
    """Bytes of the cast weights one chip of a replica on `mesh` holds (= receives per publish), by layout."""
    received = 0
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings(params, mesh))):
        itemsize = dtype_bytes if np.issubdtype(leaf.dtype, np.floating) else leaf.dtype.itemsize
        received += math.prod(sharding.shard_shape(leaf.shape)) * itemsize
    return received


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:4x4x8", help="the run's chips (rollout, then actor)")
    parser.add_argument("--replica", default="tensor:4", help="axis:size/axis:size, one replica's mesh")
    parser.add_argument("--rollout-chips", type=int, default=64)
    parser.add_argument("--actor-chips", type=int, default=32)
    parser.add_argument("--param-dtype", default="bfloat16")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    return parser.parse_args()


def compile_rows(stage, send) -> tuple[list[list], dict]:
    """(a table row per publish program, {program: its collectives' (count, result bytes) by kind})."""
    rows, moved = [], {}
    for name, lowered in (("stage (actor chips)", stage), ("send (actor + rollout chips)", send)):
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        total = program_bytes(memory)
        collectives = collective_results(compiled.as_text())
        moved[name] = collectives
        summary = ", ".join(f"{count} {kind} ({nbytes / GIB:.2f} GiB)" for kind, (count, nbytes)
                            in sorted(collectives.items())) or "none"
        rows.append([name, f"{memory.argument_size_in_bytes / GIB:.2f}", f"{memory.output_size_in_bytes / GIB:.2f}",
                     f"{memory.temp_size_in_bytes / GIB:.2f}", f"{total / GIB:.2f}", f"{seconds:.0f}", summary])
        print(rows[-1], flush=True)
    return rows, moved


def main():
    jax_setup.configure(platforms="cpu", tpu_topology=True)
    args = parse_args()
    replica = {k: int(v) for k, v in (item.split(":") for item in args.replica.split("/"))}
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    if args.rollout_chips + args.actor_chips > len(devices):
        raise SystemExit(f"{args.topology} has {len(devices)} chips; the groups need "
                         f"{args.rollout_chips + args.actor_chips}")
    meshes = replica_meshes(devices[:args.rollout_chips], replica)
    actor = make_mesh({"fsdp": -1}, devices=devices[args.rollout_chips:args.rollout_chips + args.actor_chips])
    params = laid_out(nnx.state(abstract_model(args.preset)), actor)  # fp32, as the actor holds them
    publisher = Publisher(meshes, args.param_dtype)
    copies, replicas = args.actor_chips // meshes[0].size, len(meshes)
    rounds = math.ceil(replicas / copies)
    dtype_bytes = np.dtype(args.param_dtype).itemsize if args.param_dtype else 4
    share = share_bytes(params, meshes[0], dtype_bytes)
    print(f"{replicas} replicas x {meshes[0].size} chips {replica}; actor fsdp={args.actor_chips}: {copies} staged "
          f"copies, {rounds} send round(s); a rollout chip's share {share / GIB:.2f} GiB", flush=True)

    rows, moved = compile_rows(*publisher.lower(params))
    headers = ["program", "arguments GiB/chip", "outputs GiB/chip", "temp GiB/chip", "total GiB/chip", "compile s",
               "collectives in the compiled HLO (results per chip)"]
    table = markdown_table(headers, rows)
    stage_in = sum(nbytes for _, nbytes in moved["stage (actor chips)"].values())
    sent = rounds * share
    ici_ms = (stage_in + sent) / V5P_ICI_BYTES_PER_S * 1e3
    estimate = (f"Bytes per publish, by layout: a rollout chip receives its share once, {share / GIB:.2f} GiB; an "
                f"actor chip receives {stage_in / GIB:.2f} GiB in `stage` (the HLO's collective results) and sends "
                f"{rounds} x {share / GIB:.2f} = {sent / GIB:.2f} GiB in `send`. At v5p's 600 GB/s of ICI per chip "
                f"(all links, an upper bound on what one chip moves) that is >= {ici_ms:.0f} "
                f"ms on an actor chip per publish.")
    print(table)
    print(estimate)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. JAX_PLATFORMS=cpu python -m mercury_jax.bench.publish_aot --preset "
                   f"{args.preset} --topology {args.topology} --replica {args.replica} --rollout-chips "
                   f"{args.rollout_chips} --actor-chips {args.actor_chips} --param-dtype {args.param_dtype} --write")
        body = (f"The weight publish of `{args.preset}` from the actor's mesh ({args.actor_chips} chips, fsdp, fp32 "
                f"master) into {replicas} rollout replicas of {meshes[0].size} chips ({replica}) on `{args.topology}`, "
                f"as `rollout/publish.py` runs it: `stage` casts to {args.param_dtype} and lays out {copies} copies "
                f"in a replica's layout among the actor chips; `send` moves copy c to replicas c, c + {copies}, ... "
                f"by {rounds} collective-permute round(s) on the union mesh of actor and rollout chips. Both "
                f"compiled ahead of time on a CPU host with libtpu; memory is `compiled.memory_analysis()` per chip "
                f"(total = arguments + outputs + temporaries - aliased; `send` donates its destination buffers). "
                f"Nothing ran on a TPU.\n\n" + table + "\n\n" + estimate)
        write_section("publish_aot", "Weight publish: actor mesh to rollout replicas, TPU ahead-of-time compile",
                      body, command)


if __name__ == "__main__":
    main()
