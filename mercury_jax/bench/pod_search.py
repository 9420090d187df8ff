"""Search a run's rollout layout: replica shape, slots per replica and the rollout / learner device split, so the
rollout delivers a batch in about the learner's step time, within HBM and the async staleness bound.

    PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod_search --config experiments/sao.py \
        --preset qwen3.5-35b-a3b [--write]

For every replica shape and slot count the engine's own decode chunk is compiled for v5p (as `bench.pod` does:
the chunk and a 1-step compile, its HBM bytes counted in the optimised HLO by trip counts), giving the decode step
time (counted bytes over the HBM bandwidth) and the program's memory. The rest is arithmetic on the same rooflines
`bench.pod` uses, all lower bounds on time:
- prefill: the model FLOPs of one `prefill_tokens` call over the replica's chips at peak (FLOP-bound);
- learner: each program's model FLOPs over its chips at peak (`bench.pod`'s counts; SAO: values + max(K critic
  steps, actor step), the critic and actor on their own chips; GRPO: reference + optimiser steps);
- a batch of E episodes of G generated tokens on S = replicas x slots slots: ceil(E G / S) decode steps plus the
  prefills spread over the replicas, and never less than one episode (its G tokens are decoded one after another);
- step: async SAO max(rollout, learner); sync GRPO rollout + learner.
Collectives (`links.py`, the function `bench.pod` prices with): the decode chunk's own, counted in its optimised HLO
and priced on the replica's place in the torus; the learner's a lower bound, as no learner is compiled here: what
any FSDP learner must move over its group (`links.fsdp_step_seconds`: the parameters all-gathered once a run, the
gradient reduce-scattered once a training step; the micro-batches' re-gathers, expert all-to-alls and the prefill's
collectives left out). Each layout's step is given with the rooflines alone and with the collectives under both
overlap models (`step_time.program_seconds`), and layouts are ranked by the step with collectives (async ones
hidden).
An episode lasts D = G decode steps + its prefills. In async mode a trajectory's staleness is the number of
learner steps it spans, ceil(D / step); above `sao.max_staleness` the learner must wait, so the step is at least
D / max_staleness, and the table shows that bounded step and the staleness it runs at.
Learner groups other than the config's are marked "not compiled": their memory is not checked here; the chosen
layout is then checked whole by `bench.pod`.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time

import jax.numpy as jnp
from flax import nnx

from mercury_jax.bench import jax_setup
from mercury_jax.bench.abstract import abstract_engine
from mercury_jax.bench.flops import active_parameters, forward_flops_per_token
from mercury_jax.bench.hlo_bytes import bytes_per_trip, counted_collective_traffic
from mercury_jax.bench.links import (
    NO_COLLECTIVES,
    CollectiveTime,
    Fabric,
    fsdp_step_seconds,
    group_placement,
    price_traffic,
    program_coords,
    topology_fabric,
)
from mercury_jax.bench.pod import topology_devices
from mercury_jax.bench.pod_programs import learner_programs, longest_prefill, pipeline_meshes
from mercury_jax.bench.report import markdown_table, replace_subsection
from mercury_jax.bench.rooflines import (
    GIB,
    V5P_HBM_BYTES_PER_S,
    V5P_PEAK_FLOPS,
    decode_read_bytes,
    per_chip_bytes,
    program_bytes,
)
from mercury_jax.bench.run_config import load_config, model_config
from mercury_jax.bench.step_time import (
    OVERLAPS,
    episodes_per_step,
    learner_rows,
    learner_seconds,
    max_staleness,
    model_flop_utilisation,
    pipeline_name,
    program_seconds,
    rollout_seconds,
    step_seconds,
)
from mercury_jax.config.registry import pipeline as registered_pipeline
from mercury_jax.config.roles import GROUP_ORDER
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.sampler import _compiled
from models.qwen35_moe import Qwen35MoeForCausalLM

REPLICAS = ({"tensor": 4}, {"tensor": 2})  # within one v5p host (4 chips): no replica spans hosts
SLOTS = (4, 8, 16, 32)


FORWARD_ONLY = ("values + GAE", "reference log-probs")  # learner programs that update no weights


@dataclasses.dataclass
class Decode:
    """One decode step of a replica: its roofline seconds, its collectives' seconds (async and not) on the links,
    the chunk program's and the engine's GiB a chip."""
    step_s: float
    program_gib: float
    engine_gib: float
    collective_async_s: float = 0.0
    collective_sync_s: float = 0.0


@dataclasses.dataclass
class LearnerProgram:
    """A learner program of the search: its model FLOPs per step over `runs` runs a step, on `role`'s chips; a
    `training` step reduces a gradient."""
    name: str
    role: str
    flops: float
    runs: float = 1.0
    training: bool = True


@dataclasses.dataclass
class Costs:
    """What every layout is priced from: the decode chunks, the learner programs, the links and the topology's
    device coordinates (device order; None where unknown), and the FSDP sizes (parameters, compute and gradient
    bytes a parameter)."""
    decode: dict
    learner: list
    fabric: Fabric
    coords: list
    fsdp: tuple[int, int, int] = (0, 2, 4)


def decode_costs(config, cfg, devices, steps: int, fabric: Fabric) -> dict:
    """{(replica shape, slots): Decode} from compiled decode chunks of one replica, their collectives priced on
    `fabric` per step (the chunk's over its steps)."""
    r = config.rollout
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    found = {}
    for shape, slots in itertools.product(REPLICAS, SLOTS):
        mesh = replica_meshes(devices[:math.prod(shape.values())], shape)[0]
        graphdef, params, state, _, _, _ = abstract_engine(model, slots, r.max_total_tokens,
                                                           r.get("param_dtype", "") or None, mesh=mesh)
        _, decode, _, _ = _compiled(graphdef, r.max_total_tokens, mesh)
        started = time.time()
        compiled = decode.lower(params, state, steps).compile()
        priced = decode_collectives(counted_collective_traffic(started), compiled, mesh.size, fabric)
        one_trip = lambda d=decode, p=params, s=state: d.lower(p, s, 1).compile()  # noqa: E731
        per_step = bytes_per_trip(started, one_trip, steps)
        if per_step is None:
            per_step = decode_read_bytes(params, state, cfg, slots)
        program = program_bytes(compiled.memory_analysis())
        found[(tuple(shape.items()), slots)] = Decode(per_step / V5P_HBM_BYTES_PER_S, program / GIB,
                                                      (per_chip_bytes(params) + per_chip_bytes(state)) / GIB,
                                                      priced.async_s / steps, priced.sync_s / steps)
        print(f"  decode {shape} x {slots} slots: {per_step / GIB:.2f} GiB a step, "
              f"{found[(tuple(shape.items()), slots)].step_s * 1e3:.2f} ms, program {program / GIB:.1f} GiB",
              flush=True)
    return found


def decode_collectives(traffic, compiled, chips: int, fabric: Fabric) -> CollectiveTime:
    """A decode chunk's collectives (`hlo_bytes.collective_traffic`, None: not dumped) priced on `fabric`; none
    where nothing was dumped or their groups are spelt in a way `hlo_bytes` does not read (said on stdout)."""
    if traffic is None:
        return NO_COLLECTIVES
    try:
        return price_traffic(traffic, program_coords(compiled, chips), fabric)
    except ValueError as error:
        print(f"  decode collectives not priced ({error})", flush=True)
        return NO_COLLECTIVES


def learner_flops(config, cfg, devices) -> list[LearnerProgram]:
    """The learner's programs with their model FLOPs per step, from `bench.pod`'s counts (nothing compiled)."""
    programs = learner_programs(config, cfg, pipeline_meshes(config, devices)).programs
    return [LearnerProgram(p.name, p.role, p.model_flops * p.per_step, p.per_step, p.name not in FORWARD_ONLY)
            for p in programs]


def fsdp_sizes(cfg) -> tuple[int, int, int]:
    """(parameters, compute-dtype bytes a parameter, gradient bytes a parameter: the master weights' dtype) of the
    model an FSDP learner gathers and reduces."""
    return (active_parameters(cfg)[1], jnp.dtype(cfg.dtype).itemsize, jnp.dtype(cfg.param_dtype).itemsize)


def splits(config, total: int) -> list[dict]:
    """Device splits of `total` chips whose learner groups divide the batch rows: SAO's rollout / actor / critic,
    another RL pipeline's rollout / actor."""
    rows = learner_rows(config)
    if pipeline_name(config) == "sao":
        return [dict(rollout=total - a - c, actor=a, critic=c) for a in (16, 32, 64) for c in (16, 32, 64)
                if total - a - c >= 16 and rows % a == 0 and rows % c == 0]
    return [dict(rollout=total - a, actor=a) for a in (16, 32, 64, 96) if total - a >= 16 and rows % a == 0]


def evaluate(config, cfg, costs: Costs, split: dict, shape: dict, slots: int, generated: int) -> dict | None:
    """One layout's step estimate (None when its replicas do not tile the rollout group): its figures with the
    rollout's and learner's rooflines alone, and under `with_collectives` the same figures for each overlap model."""
    per_replica = math.prod(shape.values())
    if split["rollout"] % per_replica:
        return None
    replicas = split["rollout"] // per_replica
    cost = costs.decode[(tuple(shape.items()), slots)]
    times = {overlap: layout_times(config, cfg, costs, split, (per_replica, replicas, slots, cost), generated,
                                   overlap) for overlap in OVERLAPS}
    resident = cost.engine_gib if config.rollout.get("mode", "sync") == "async" else 0.0  # the evaluation engine
    return dict(times[None], split=split, shape=shape, slots=slots, replicas=replicas,
                decode_gib=cost.program_gib + resident,
                with_collectives={overlap: times[overlap] for overlap in OVERLAPS if overlap})


def layout_times(config, cfg, costs: Costs, split: dict, layout: tuple, generated: int, overlap: str | None) -> dict:
    """A layout's rollout, learner, episode and step seconds, staleness, learner idle and MFU bound, with each
    program's seconds under `overlap` (`step_time.program_seconds`; None: the rooflines alone). `layout`: (chips a
    replica, replicas, slots a replica, its Decode)."""
    r = config.rollout
    per_replica, replicas, slots, cost = layout
    episodes = episodes_per_step(config)
    per_token = forward_flops_per_token(cfg, r.max_total_tokens)
    prefill_tokens = longest_prefill(r)
    prefilled = max(r.max_total_tokens - generated, 0)
    prefill_s = per_token * prefill_tokens / (per_replica * V5P_PEAK_FLOPS)
    decode_s = program_seconds(cost.step_s, cost.collective_async_s, cost.collective_sync_s, overlap)
    rollout_s, episode_s = rollout_seconds(episodes, generated, prefilled, replicas, slots, decode_s,
                                           prefill_tokens, prefill_s)
    learner_s = learner_seconds(pipeline_name(config), learner_program_seconds(costs, split, overlap))
    async_mode = r.get("mode", "sync") == "async"
    free_step = step_seconds(async_mode, rollout_s, learner_s, episode_s, 0)  # no staleness bound
    step = step_seconds(async_mode, rollout_s, learner_s, episode_s, max_staleness(config))
    flops = per_token * episodes * (generated + prefilled) + sum(p.flops for p in costs.learner)
    return dict(decode_ms=decode_s * 1e3, rollout_s=rollout_s, learner_s=learner_s, episode_s=episode_s,
                free_step=free_step, step=step, staleness=math.ceil(episode_s / step) if async_mode else 0,
                free_staleness=math.ceil(episode_s / free_step) if async_mode else 0,
                idle=1 - learner_s / step, mfu=model_flop_utilisation(flops, sum(split.values()), V5P_PEAK_FLOPS, step))


def learner_program_seconds(costs: Costs, split: dict, overlap: str | None) -> dict[str, float]:
    """Each learner program's seconds a step on its group's chips in `split`: its model FLOPs at peak, run by run,
    with (`overlap` not None) the FSDP lower bound of its collectives on the group's place in the torus."""
    params, compute_bytes, grad_bytes = costs.fsdp
    seconds = {}
    for p in costs.learner:
        group = "critic" if p.role == "critic" else "actor"
        compute_s = p.flops / p.runs / (split[group] * V5P_PEAK_FLOPS)
        moved_s = 0.0
        if overlap is not None:
            placement = group_placement(group_coords(costs.coords, split, group), costs.fabric)
            moved_s = fsdp_step_seconds(params, compute_bytes, grad_bytes, placement, p.training)
        seconds[p.name] = program_seconds(compute_s, moved_s, 0.0, overlap) * p.runs
    return seconds


def group_coords(coords: list, split: dict, group: str) -> list:
    """The coordinates of device group `group`'s chips in `split` (consecutive slices of the devices in
    `GROUP_ORDER`, as `train/placement.py` lays them out); None for each where the coordinates are unknown."""
    start = sum(split[g] for g in GROUP_ORDER[:GROUP_ORDER.index(group)] if g in split)
    found = list(coords[start:start + split[group]])
    return found if len(found) == split[group] else [None] * split[group]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/sao.py")
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--topology", default="")
    parser.add_argument("--headroom", type=float, default=0.8)
    parser.add_argument("--generated-tokens", type=int, default=0)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=-1,
                        help="SAO's sao.max_staleness for this search (default: the config's); not written")
    parser.add_argument("--write", action="store_true")
    return parser.parse_args(argv)


def search(config, cfg, devices, hbm_bytes: float, generated: int, headroom: float, fabric: Fabric) -> list[dict]:
    """Every layout within `headroom` of HBM, fastest step with collectives (async ones hidden) first, then least
    staleness, each marked whether it is the config's own (`released`) and whether `bench.pod` compiled its learner
    groups."""
    total = sum(dict(config.devices).values())
    coords = [tuple(d.coords) if hasattr(d, "coords") else None for d in devices]
    costs = Costs(decode_costs(config, cfg, devices, int(config.rollout.get("steps_per_sync", 8)), fabric),
                  learner_flops(config, cfg, devices), fabric, coords, fsdp_sizes(cfg))
    released = dict(config.devices)
    rows = []
    for split, shape, slots in itertools.product(splits(config, total), REPLICAS, SLOTS):
        result = evaluate(config, cfg, costs, split, shape, slots, generated)
        if result is None or result["decode_gib"] > headroom * hbm_bytes / GIB:
            continue
        result["released"] = (split == released and shape == dict(config.rollout.replica)
                              and slots * result["replicas"] == config.rollout.num_slots)
        result["learner_compiled"] = all(split[k] == released.get(k) for k in split if k != "rollout")
        rows.append(result)
    rows.sort(key=lambda x: (x["with_collectives"]["async"]["step"], x["with_collectives"]["async"]["staleness"]))
    return rows


def layout_table(shown: list[dict]) -> str:
    return markdown_table(
        ["devices (rollout / learner)", "replica", "slots a replica (all)", "decode ms a step", "rollout s",
         "learner s", "episode s", "step s (staleness)", "learner idle", "MFU bound",
         "+ collectives: step s, none hidden / async hidden (staleness)", "+ collectives: learner idle",
         "+ collectives: MFU bound", "decode GiB/chip", "learner memory"],
        [[("**released** " if x["released"] else "") + " / ".join(f"{k} {v}" for k, v in x["split"].items()),
          str(x["shape"]), f"{x['slots']} ({x['slots'] * x['replicas']})", f"{x['decode_ms']:.2f}",
          f"{x['rollout_s']:.1f}", f"{x['learner_s']:.1f}", f"{x['episode_s']:.1f}",
          f"{x['step']:.1f} ({x['staleness']})" + (f"; unbounded {x['free_step']:.1f} ({x['free_staleness']})"
                                                   if x["free_step"] < x["step"] else ""),
          f"{x['idle']:.0%}", f"{x['mfu']:.1%}", collective_step_text(x["with_collectives"]),
          f"{x['with_collectives']['async']['idle']:.0%}", f"{x['with_collectives']['async']['mfu']:.1%}",
          f"{x['decode_gib']:.1f}",
          "compiled (bench.pod)" if x["learner_compiled"] else "not compiled"] for x in shown])


def collective_step_text(times: dict) -> str:
    """`a / b (s)`: the step with collectives, none hidden and async hidden, and the staleness of the second."""
    none, hidden = times["none"], times["async"]
    return f"{none['step']:.1f} / {hidden['step']:.1f} ({hidden['staleness']})"


def run(argv=None) -> int:
    """Search the layouts of the config's RL pipeline and print (and write) the best `--top` and the config's."""
    args = parse_args(argv)
    config = load_config(args.config)
    if "rollout" not in registered_pipeline(config.pipeline).roles:
        raise SystemExit(f"{args.config}: pipeline {config.pipeline!r} has no rollout to lay out")
    if args.max_staleness >= 0 and pipeline_name(config) == "sao":
        config.sao.max_staleness = args.max_staleness
        args.write = False  # a what-if, not the run's layout
    total = sum(dict(config.devices).values())
    devices, topology, hbm_bytes = topology_devices(args.topology, total)
    cfg = model_config(config, args.preset)
    generated = args.generated_tokens or config.rollout.max_turn_tokens
    print(f"{args.config} on {topology}: {total} chips; searching replica shapes {REPLICAS} x slots {SLOTS}",
          flush=True)
    fabric = topology_fabric(topology, devices)
    rows = search(config, cfg, devices, hbm_bytes, generated, args.headroom, fabric)
    table = layout_table(rows[:args.top] + [x for x in rows[args.top:] if x["released"]])
    print(table)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod_search --config {args.config} "
                   f"--preset {args.preset} --write")
        text = (f"{total} chips of `{topology}`, {generated:,} generated tokens an episode (assumed), "
                f"max staleness {max_staleness(config)}; collectives priced on {fabric.describe()} (decode: its "
                f"compiled chunk's; learner: the FSDP lower bound, `links.fsdp_step_seconds`); best {args.top} by "
                f"step time with collectives, async ones hidden (and the released layout):\n\n" + table)
        replace_subsection("pod_search", f"Layout search: {args.config}", text, command)
    return 0


def main() -> int:
    """JAX on this host's CPU compiling for v5p, XLA dumping the decode chunks' optimised HLO (their bytes), then
    `run`."""
    jax_setup.configure(platforms="cpu", tpu_topology=True, hlo_dump=".*traced_on_mesh.*")
    return run()


if __name__ == "__main__":
    raise SystemExit(main())
