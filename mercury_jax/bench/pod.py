"""The pod proof: every program a run executes, compiled ahead of time for its real topology, against HBM.

    PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod --config experiments/sao.py [--topology v5p:4x4x8]
    python -m mercury_jax.bench.pod --config experiments/sao.py:tiny --topology cpu --no-write   # the CI run

The config's device groups are laid over the topology's chips by the trainers' own placement
(`train/placement.py:role_meshes`, the roles of the pipeline `config.pipeline` names; `rollout/layout.py:
replica_meshes`), and every jitted program of a step is lowered from abstract shapes in the layout the trainer gives
its inputs, by the functions the trainers call (`pod_programs.py`): rollout `decode` and `prefill` of one replica
(`rollout/sampler.py`), the weight publish (`rollout/publish.py`'s `stage` and `send`), SAO `values` (critic forward
+ GAE), `critic` and `actor` steps with Adam and micro-batching (`train/sao_learner.py`), pivot-GRPO `reference`
log-probs and `grpo` step (`train/grpo_learner.py`), the group baseline's actor step, the SFT step. Nothing is
allocated and nothing runs on a TPU. Learner batches take their worst case: every row `rollout.max_total_tokens`.

Per program: `compiled.memory_analysis()` per chip (arguments + outputs + temporaries - aliased), plus what stays
resident on the same chips while it runs (the other engine's weights and state, the optimiser state a forward
does not take, the GRPO reference beside the actor), against `--headroom` (default 80%) of the chip's HBM;
compile seconds; XLA's cost analysis (FLOPs, bytes accessed) beside the model FLOPs counted by hand (`flops.py`:
6 N T for a training step, 2 N T for a forward, N the active parameters, plus causal attention) and the HBM bytes a
decode step must read (the weights a step touches: all but the routed experts, the expected share of distinct
routed experts, the decode state). XLA's cost analysis counts a while loop's body once (checked on a `lax.scan`:
one iteration's FLOPs), and every learner step and decode chunk is a loop (layers, micro-batches, decode steps),
so its figures are shown but the roofline time is the largest of the lower bounds: max(XLA FLOPs, model FLOPs) /
peak and max(XLA bytes, decode bytes) / HBM bandwidth. The decode chunk's bytes are also counted in its optimised
HLO with every loop by its trip count (`hlo_bytes.py`: the chunk minus a 1-step compile, per step, times the
steps), what the compiled program moves rather than what it must; the roofline takes the larger. The step
estimate and the model FLOP utilisation follow from those rooflines and the counts of each program per step
(`step_time.py`; printed with the derivation). Each program's collectives (counted in the same optimised HLO:
bytes by kind, group, and whether XLA issues them asynchronously) are priced on the topology's links
(`links.py`: ring, bisection and link-load models on the groups' places in the torus; CPU devices have no places,
so there each group is priced as one v5p axis without wraparound), and the step estimate is given three ways:
rooflines only (collectives free, as before), + collectives with none hidden, + collectives with the async ones
hidden behind compute (`step_time.program_seconds`). Exit status 1 names every program over the threshold or
refused by the compiler.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
from jax.experimental import topologies

from mercury_jax.bench import jax_setup
from mercury_jax.bench.flops import forward_flops_per_token, gdn_rule_flops_per_token
from mercury_jax.bench.hlo_bytes import bytes_per_trip, counted_collective_traffic
from mercury_jax.bench.links import (
    NO_COLLECTIVES,
    CollectiveTime,
    Fabric,
    price_traffic,
    program_coords,
    topology_fabric,
)
from mercury_jax.bench.pod_programs import Program, learner_seq, pipeline_meshes, step_programs
from mercury_jax.bench.report import markdown_table, replace_subsection
from mercury_jax.bench.rooflines import (
    GIB,
    HBM_GIB,
    V5P_HBM_BYTES_PER_S,
    V5P_PEAK_FLOPS,
    program_bytes,
    roofline,
    xla_cost,
)
from mercury_jax.bench.run_config import apply_overrides, load_config, model_config
from mercury_jax.bench.step_time import (
    ASSEMBLY_ROUNDS_S,
    DCN_BYTES_PER_S,
    OVERLAP_TEXT,
    OVERLAPS,
    TRAJECTORY_BYTES_PER_TOKEN,
    assembly_seconds,
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
from mercury_jax.config.model import model_runtime
from models.qwen35_moe.config import PRESETS

# the smallest v5p slice of at least N chips (Cloud TPU's v5p topologies)
V5P_TOPOLOGIES = {8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8",
                  1024: "8x8x16", 2048: "8x16x16"}
# the policy update of each pipeline, by program name (the per-token roofline); GRPO's runs once per minibatch
TRAINING_PROGRAMS = ("sft step", "actor step", "grpo step")
LEARNER_TEXT = {"sao": "values + max(K x critic step, actor step) (critic and actor chips work at once)",
                "grpo": "reference + optimiser steps", "group_baseline": "the actor step"}


@dataclasses.dataclass
class Result:
    program: Program
    arguments: float = math.nan     # bytes per chip
    temp: float = math.nan
    total: float = math.nan
    compile_s: float = math.nan
    flops: float = math.nan         # XLA's, per chip
    bytes_accessed: float = math.nan
    counted_bytes: float = math.nan  # per chip per run, counted in the optimised HLO by trip counts (hlo_bytes.py)
    collectives: dict | None = None  # {kind: bytes a chip receives per run}, the same count (hlo_bytes.py)
    collective_time: CollectiveTime | None = None  # their seconds per run on the topology's links (links.py)
    error: str = ""

    @property
    def peak(self) -> float:
        return self.total + self.program.resident_bytes

    @property
    def bounds(self) -> dict:
        """Lower bounds on the program's time on one chip, by what bounds it."""
        p = self.program
        return {"XLA FLOPs": self.flops / V5P_PEAK_FLOPS, "XLA bytes": self.bytes_accessed / V5P_HBM_BYTES_PER_S,
                "model FLOPs": p.model_flops / p.group_chips / V5P_PEAK_FLOPS,
                "weights + state bytes": p.model_bytes / V5P_HBM_BYTES_PER_S,
                "counted bytes": self.counted_bytes / V5P_HBM_BYTES_PER_S}

    @property
    def roofline_s(self) -> float:
        return roofline(self.bounds)[0]

    @property
    def bound(self) -> str:
        return roofline(self.bounds)[1]

    def seconds(self, overlap: str | None = None) -> float:
        """Seconds a run: the roofline (`overlap` None), or with the collectives under an overlap model
        (`step_time.program_seconds`)."""
        c = self.collective_time or NO_COLLECTIVES
        return program_seconds(self.roofline_s, c.async_s, c.sync_s, overlap)


# -- running and reporting ----------------------------------------------------------------------------------------

def compile_program(program: Program, fabric: Fabric) -> Result:
    """The program compiled: its memory per chip, XLA's costs, the collectives it receives and their seconds on
    `fabric`, and (a loop program) the bytes its optimised HLO moves counted by trip counts; a refused compile is a
    result with its error."""
    result = Result(program)
    start, started = time.perf_counter(), time.time()
    try:
        compiled = program.lower().compile()
    except Exception as error:  # a refused compile (temporaries over HBM) is a result: reported and failed
        result.error = f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"
        result.compile_s = time.perf_counter() - start
        return result
    result.compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    if memory is not None:
        result.arguments = memory.argument_size_in_bytes
        result.temp = memory.temp_size_in_bytes
        result.total = program_bytes(memory)
    result.flops, result.bytes_accessed = xla_cost(compiled)
    traffic = counted_collective_traffic(started)
    if traffic is not None:  # None: jax started before the dump was set up (tests)
        result.collectives = {}
        for t in traffic:
            result.collectives[t.kind] = result.collectives.get(t.kind, 0) + t.bytes
        try:
            result.collective_time = price_traffic(traffic, program_coords(compiled, program.group_chips), fabric)
        except ValueError as error:  # groups spelt in a way hlo_bytes does not read: the rest of the run stands
            print(f"  {program.name}: collectives not priced ({error})", flush=True)
    if program.one_step_lower is not None and program.steps > 1:
        per_step = bytes_per_trip(started, lambda: program.one_step_lower().compile(), program.steps)
        if per_step is not None:  # None: jax started before the dump was set up (tests)
            result.counted_bytes = per_step * program.steps
    return result


def verdicts(results: list[Result], hbm_bytes: float, headroom: float) -> list[str]:
    """One line per program that does not fit: refused by the compiler, or its peak over headroom x HBM."""
    limit = headroom * hbm_bytes
    problems = []
    for r in results:
        if r.error:
            problems.append(f"{r.program.name}: the compile failed ({r.error})")
        elif not r.peak <= limit:
            problems.append(f"{r.program.name}: {r.peak / GIB:.2f} GiB a chip ({r.total / GIB:.2f} for the program + "
                            f"{r.program.resident_bytes / GIB:.2f} resident) is over {headroom:.0%} of "
                            f"{hbm_bytes / GIB:.1f} GiB HBM ({limit / GIB:.2f} GiB) by "
                            f"{(r.peak - limit) / GIB:.2f} GiB")
    return problems


def seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 1 else f"{value * 1e3:.2f} ms"


def step_figures(config, results: list[Result], rollout: dict, generated: int, chips: int,
                 overlap: str | None = None) -> dict:
    """The step estimate's figures from the programs' seconds (`step_time.py`; `Result.seconds(overlap)`: the
    rooflines, or with the collectives): the rollout of a batch and of one episode, the learner, the publish, the
    async batch assembly, the step, and the model FLOPs and MFU."""
    by_name = {r.program.name: r for r in results}
    r = config.rollout
    episodes = episodes_per_step(config)
    prefilled = max(r.max_total_tokens - generated, 0)
    decode, prefill = by_name["rollout decode"], by_name["rollout prefill"]
    decode_step_s = decode.seconds(overlap) / rollout["steps"]
    rollout_s, episode_s = rollout_seconds(episodes, generated, prefilled, rollout["replicas"], rollout["slots"],
                                           decode_step_s, rollout["prefill_tokens"], prefill.seconds(overlap))
    learner = [x for x in results if not x.program.name.startswith(("rollout", "publish"))]
    learner_s = learner_seconds(pipeline_name(config),
                                {x.program.name: x.seconds(overlap) * x.program.per_step for x in learner})
    publish_s = sum(x.seconds(overlap) for x in results if x.program.name.startswith("publish"))
    async_mode = r.get("mode", "sync") == "async"
    # async: every host receives the whole batch before the learner starts; the rollout hosts take part in each
    # publish (its send reads and writes their HBM while they decode), so it costs both sides
    assembly_s = assembly_seconds(episodes, r.max_total_tokens) if async_mode else 0.0
    staleness = max_staleness(config)
    step_s = step_seconds(async_mode, rollout_s, learner_s, episode_s, staleness, publish_s, assembly_s)
    rollout_flops = decode.program.model_flops / rollout["steps"] / rollout["slots"] * episodes * generated
    rollout_flops += prefill.program.model_flops / rollout["prefill_tokens"] * episodes * prefilled
    flops = rollout_flops + sum(x.program.model_flops * x.program.per_step for x in learner)
    return dict(episodes=episodes, generated=generated, prefilled=prefilled, decode_step_s=decode_step_s,
                prefill_s=prefill.seconds(overlap), rollout_s=rollout_s, episode_s=episode_s, learner_s=learner_s,
                publish_s=publish_s, assembly_s=assembly_s, staleness=staleness, step_s=step_s, flops=flops,
                mfu=model_flop_utilisation(flops, chips, V5P_PEAK_FLOPS, step_s), async_mode=async_mode)


def step_estimate(config, results: list[Result], rollout: dict, generated: int, chips: int) -> str:
    """Seconds per step from the rooflines (lower bounds) and the model FLOP utilisation they imply, in words."""
    f = step_figures(config, results, rollout, generated, chips)
    pipeline, r = pipeline_name(config), config.rollout
    slots_total = rollout["replicas"] * rollout["slots"]
    decode_steps = math.ceil(f["episodes"] * generated / slots_total)
    prefill_calls = f["episodes"] * math.ceil(f["prefilled"] / rollout["prefill_tokens"])
    return (f"Step estimate ({pipeline}, {r.get('mode', 'sync')} mode), from the rooflines above, so a lower bound "
            f"on time: {f['episodes']} episodes of {generated:,} generated + {f['prefilled']:,} prefilled tokens "
            f"(assumed: `--generated-tokens`). Rollout: {decode_steps:,} decode steps x "
            f"{f['decode_step_s'] * 1e3:.2f} ms (every one of the {slots_total} slots busy) + "
            f"{prefill_calls} prefills of {rollout['prefill_tokens']:,} tokens over {rollout['replicas']} replica(s) "
            f"x {f['prefill_s'] * 1e3:.1f} ms, never less than one episode = **{seconds(f['rollout_s'])}**. Learner: "
            f"{LEARNER_TEXT.get(pipeline, 'the learner programs')} = **{seconds(f['learner_s'])}**; publish "
            f"{f['publish_s'] * 1e3:.0f} ms. "
            + (f"Batch assembly across hosts (async): {f['episodes']} x {r.max_total_tokens:,} tokens x "
               f"{TRAJECTORY_BYTES_PER_TOKEN} B to every host at {DCN_BYTES_PER_S / 1e9:.1f} GB/s + "
               f"{ASSEMBLY_ROUNDS_S * 1e3:.0f} ms of rounds = {seconds(f['assembly_s'])}. " if f["async_mode"] else "")
            + "Step: " + (f"max(rollout, assembly + learner, episode {seconds(f['episode_s'])} / max staleness "
                          f"{f['staleness']}) + publish (async: the two sides overlap; the rollout hosts join every "
                          "publish)" if f["async_mode"]
                          else "rollout + learner + publish (sync)") + f" = **{seconds(f['step_s'])}**. "
            f"Model FLOPs per step (hand count: 2 N per generated or prefilled token, 6 N per trained token, N the "
            f"active parameters, plus causal attention) {f['flops'] / 1e12:,.1f} TFLOP over "
            f"{chips} chips x {V5P_PEAK_FLOPS / 1e12:.0f} TFLOP/s x {seconds(f['step_s'])}: **MFU {f['mfu']:.1%}** "
            f"(an upper bound, as the time is a lower bound).")


def step_variants(config, results: list[Result], rollout: dict, generated: int, chips: int) -> str:
    """The step estimate three ways (`step_time.OVERLAPS`): the rooflines alone (the paragraph above), + the
    collectives with none hidden, + the collectives with the async ones hidden behind compute; with the learner's
    idle share of the step and the MFU each implies."""
    rows = []
    for overlap in OVERLAPS:
        f = step_figures(config, results, rollout, generated, chips, overlap)
        rows.append([OVERLAP_TEXT[overlap], f"{f['decode_step_s'] * 1e3:.2f}", seconds(f["rollout_s"]),
                     seconds(f["learner_s"]), seconds(f["publish_s"]), f"**{seconds(f['step_s'])}**",
                     f"{1 - f['learner_s'] / f['step_s']:.0%}", f"{f['mfu']:.1%}"])
    return ("Step with and without collectives (each program's seconds as in the collectives table; the same step "
            "formula):\n\n" + markdown_table(["programs' seconds", "decode ms a step", "rollout", "learner",
                                                "publish", "step", "learner idle", "MFU bound"], rows))


def collectives_table(results: list[Result], fabric: Fabric) -> str:
    """Per program its collective bytes by kind, their seconds on `fabric` (`links.py`) by kind and how much XLA
    issues asynchronously, and the program's seconds a run with and without them (`Result.seconds`)."""
    rows = []
    for r in results:
        if r.error or r.collective_time is None:
            rows.append([r.program.name, f"{r.program.per_step:g}", "refused" if r.error else "not counted", "", "",
                         "", "", ""])
            continue
        c = r.collective_time
        by_kind = " + ".join(f"{kind} {c.seconds[kind] * 1e3:.2f}" for kind in sorted(c.seconds, key=c.seconds.get,
                                                                                       reverse=True)
                             if c.seconds[kind] >= 5e-6) or "0"
        rows.append([r.program.name, f"{r.program.per_step:g}", collectives_text(r.collectives) or "none", by_kind,
                     f"{c.async_s / c.total_s:.0%}" if c.total_s else "", f"{r.roofline_s * 1e3:.2f}",
                     f"{r.seconds('none') * 1e3:.2f}", f"{r.seconds('async') * 1e3:.2f}"])
    return (f"Collectives per program, priced on {fabric.describe()} (`links.py`; latency not priced):\n\n"
            + markdown_table(["program", "runs a step", "collectives GiB/chip a run", "collective ms a run (by kind)",
                              "issued async", "roofline ms", "+ collectives ms (none hidden)",
                              "+ collectives ms (async hidden)"], rows))


def table(results: list[Result], hbm_bytes: float, headroom: float) -> str:
    """The programs' table (memory, compile seconds, XLA's and the hand counts, roofline, collectives) and what
    each one's resident bytes are."""
    rows = [_table_row(r, hbm_bytes, headroom) for r in results]
    headers = ["program", "chips", "arguments GiB/chip", "temp GiB/chip", "program GiB/chip", "resident GiB/chip",
               "peak GiB/chip (of HBM)", "compile s", "XLA TFLOP/chip", "model TFLOP/chip", "XLA / model FLOPs",
               "XLA GiB accessed/chip", "must-read GiB/chip", "counted GiB/chip", "roofline ms (bound)",
               "collectives GiB/chip (received per run)"]
    notes = [f"- {r.program.name}: resident = {r.program.resident_note}" for r in results if r.program.resident_note]
    return markdown_table(headers, rows) + ("\n\n" + "\n".join(notes) if notes else "")


def _table_row(r: Result, hbm_bytes: float, headroom: float) -> list:
    p = r.program
    if r.error:
        return [p.name, p.chips, "refused", "", "", "", "", f"{r.compile_s:.0f}", "", "", "", "", "", "",
                r.error[:80], ""]
    fits = "fits" if r.peak <= headroom * hbm_bytes else "**over**"
    ratio = r.flops * p.group_chips / p.model_flops if p.model_flops and r.flops == r.flops else math.nan
    return [p.name, p.chips, f"{r.arguments / GIB:.2f}", f"{r.temp / GIB:.2f}", f"{r.total / GIB:.2f}",
            f"{p.resident_bytes / GIB:.2f}", f"{r.peak / GIB:.2f} ({r.peak / hbm_bytes:.0%}, {fits})",
            f"{r.compile_s:.0f}", f"{r.flops / 1e12:.3f}", f"{p.model_flops / p.group_chips / 1e12:.3f}",
            f"{ratio:.2f}", f"{r.bytes_accessed / GIB:.2f}", f"{p.model_bytes / GIB:.2f}" if p.model_bytes
            else "", f"{r.counted_bytes / GIB:.2f}" if r.counted_bytes == r.counted_bytes else "",
            f"{r.roofline_s * 1e3:.2f} ({r.bound})", collectives_text(r.collectives)]


def per_token_text(results: list[Result], rows: int, seq: int) -> str:
    """The policy update's roofline per trained token (the update program over its rows x seq tokens, the time a
    chip group spends on one token of its batch) and the collectives it receives per step."""
    lines = []
    for r in results:
        if r.program.name not in TRAINING_PROGRAMS or r.error:
            continue
        grpo = r.program.name == "grpo step"
        tokens = rows * seq / r.program.per_step if grpo else rows * seq
        received = sum((r.collectives or {}).values())
        lines.append(f"{r.program.name}: roofline {r.roofline_s:.2f} s for {tokens:,.0f} tokens ({rows} rows x "
                     f"{seq:,}{' / ' + str(r.program.per_step) + ' minibatches' if grpo else ''}) = "
                     f"**{r.roofline_s / tokens * 1e6:.2f} us a token** on {r.program.group_chips} chips "
                     f"({r.roofline_s / tokens * 1e6 * r.program.group_chips:.1f} chip-us a token); collectives "
                     f"received {received / GIB:.1f} GiB a chip a run")
    return "\n".join(f"- {line}" for line in lines)


def gdn_split_text(cfg, meshes: dict, seq: int) -> str:
    """What splitting rows over 'sequence' adds to the Gated DeltaNet (docs/MODEL.md §8): the span map's first pass
    of the rule at width V + K, counted by the Pallas kernel's own multiply-adds (`flops.gdn_rule_flops_per_token`),
    per token and as a share of the model's forward FLOPs a token; blank when no learner mesh splits rows."""
    split = {role: mesh.shape.get("sequence", 1) for role, mesh in meshes.items() if mesh.shape.get("sequence", 1) > 1}
    if not split:
        return ""
    C, K, V = cfg.gdn_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gdn_layers = sum(1 for kind in cfg.layer_types if kind != "full_attention")
    rule = gdn_rule_flops_per_token(cfg, V)
    extra = gdn_rule_flops_per_token(cfg, V + K)
    forward = forward_flops_per_token(cfg, seq)
    return (f"- rows split over `sequence` ({', '.join(f'{r} {n}' for r, n in split.items())}): the GDN rule costs "
            f"{rule / 1e6:.1f} MFLOP a token forward ({gdn_layers} layers x {cfg.linear_num_value_heads} heads, chunk "
            f"{C}); the span maps' first pass at width V + K = {V + K} adds **{extra / 1e6:.1f} MFLOP a token "
            f"({extra / forward:.2%} of the model's {forward / 1e9:.2f} GFLOP forward a token)**, forward and "
            f"backward alike; the composition of the maps is {2 * max(split.values())} K x K products a row and head")


def collectives_text(collectives: dict | None) -> str:
    """`all-gather 1.23 + ...` (GiB a chip receives per run, loops by their trip counts), or blank."""
    if not collectives:
        return ""
    return " + ".join(f"{kind} {n / GIB:.2f}" for kind, n in sorted(collectives.items(), key=lambda kv: -kv[1])
                      if n >= GIB / 1000) or "< 0.001"


def meshes_text(meshes: dict) -> str:
    """Each role's mesh axes of size > 1, e.g. `actor fsdp 16 x sequence 4`."""
    return ", ".join(f"{role} " + (" x ".join(f"{a} {n}" for a, n in mesh.shape.items() if n > 1) or "1 chip")
                     for role, mesh in meshes.items())


def topology_devices(topology: str, needed: int) -> tuple[list, str, float]:
    """(devices, topology name, memory bytes per chip) for `topology` ("cpu": this host's devices, which share its
    RAM with no per-device limit, so the whole RAM is the budget; "" or "v5p": the smallest v5p slice that holds
    `needed` chips)."""
    if topology == "cpu":
        return jax.devices(), "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not topology or topology == "v5p":
        size = min(n for n in V5P_TOPOLOGIES if n >= needed)
        topology = f"v5p:{V5P_TOPOLOGIES[size]}"
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    return list(devices), topology, HBM_GIB[topology.split(":")[0]] * GIB


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/sao.py")
    parser.add_argument("--topology", default="", help="v5p:AxBxC, or 'cpu' (this host's devices); default: the "
                        "smallest v5p slice holding the config's device groups")
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS),
                        help="the architecture of a run that loads an HF checkpoint (model.hf_path)")
    parser.add_argument("--headroom", type=float, default=0.8, help="fraction of HBM a program may use")
    parser.add_argument("--generated-tokens", type=int, default=0,
                        help="generated tokens per episode for the step estimate (default rollout.max_turn_tokens)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set devices.rollout=128 (repeatable)")
    parser.add_argument("--only", default="", help="comma-separated program names to compile (default: all)")
    parser.add_argument("--label", default="", help="this run's heading in BENCHMARKS.md (default from the config)")
    parser.add_argument("--no-write", action="store_true", help="do not write the BENCHMARKS.md section")
    return parser.parse_args(argv)


def compile_all(programs: list[Program], fabric: Fabric) -> list[Result]:
    """Each program compiled in turn (its collectives priced on `fabric`), a line printed as each one finishes."""
    results = []
    for program in programs:
        results.append(compile_program(program, fabric))
        r = results[-1]
        print(f"  {program.name:22s} {program.chips}: " + (f"FAILED {r.error}" if r.error else
              f"{r.total / GIB:.2f} GiB program + {program.resident_bytes / GIB:.2f} resident, compile "
              f"{r.compile_s:.0f} s, roofline {r.roofline_s * 1e3:.2f} ms"), flush=True)
    return results


def run(argv=None) -> int:
    """Compile every program of the config's step (or `--only` some) and print (and write) the proof; 1 when a
    program does not fit or is refused."""
    args = parse_args(argv)
    config = load_config(args.config)
    apply_overrides(config, args.set)
    pipeline = pipeline_name(config)
    groups = dict(config.devices)
    chips = sum(groups.values()) or 1
    devices, topology, hbm_bytes = topology_devices(args.topology, chips)
    cfg = model_config(config, args.preset)
    meshes = pipeline_meshes(config, devices)
    seq = learner_seq(config)
    programs, facts = step_programs(config, cfg, meshes)
    every_program = {p.name for p in programs}
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        programs = [p for p in programs if p.name in wanted]
    model_name = config.model.get("preset") or args.preset
    print(f"{args.config} ({pipeline}, {model_name}) on {topology}: {len(devices)} devices, groups {groups}; HBM "
          f"{hbm_bytes / GIB:.1f} GiB a chip, threshold {args.headroom:.0%}", flush=True)
    fabric = topology_fabric(topology, devices)
    results = compile_all(programs, fabric)
    body = table(results, hbm_bytes, args.headroom) + "\n\n" + collectives_table(results, fabric)
    problems = verdicts(results, hbm_bytes, args.headroom)
    complete = every_program == {r.program.name for r in results if not r.error}  # the estimate needs them all
    estimate = ""
    if complete and facts is not None:
        generated = args.generated_tokens or config.rollout.max_turn_tokens
        estimate = (step_estimate(config, results, facts, generated, chips) + "\n\n"
                    + step_variants(config, results, facts, generated, chips))
    rows = learner_rows(config)
    per_token = "\n".join(t for t in (per_token_text(results, rows, seq), gdn_split_text(cfg, meshes, seq)) if t)
    verdict = ("**Every program fits** within " + f"{args.headroom:.0%} of HBM." if not problems
               else "**Does not fit**:\n" + "\n".join(f"- {p}" for p in problems))
    print("\n\n".join(part for part in (body, per_token, estimate, verdict) if part))
    if not args.no_write:
        rollout_text = ("" if facts is None else f"rollout {config.rollout.get('mode', 'sync')}, {facts['replicas']} "
                        f"replica(s) x {facts['slots']} slots; ")
        text = (f"Groups {groups} over `{topology}`; meshes {meshes_text(meshes)}; {rollout_text}learner batches "
                f"{rows} rows x {seq:,} tokens (worst case); model runtime {model_runtime(config.model)}.\n\n" + body
                + "".join(f"\n\n{part}" for part in (per_token, estimate) if part) + "\n\n" + verdict)
        replace_subsection("pod", args.label or f"{args.config} ({model_name}, {topology})", text,
                           command_line(args, config))
    return 1 if problems else 0


def command_line(args, config) -> str:
    """The command that reproduces this run, for BENCHMARKS.md."""
    return ("PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod --config " + args.config
            + (f" --topology {args.topology}" if args.topology else "") + "".join(f" --set {s}" for s in args.set)
            + (f" --preset {args.preset}" if not config.model.get("preset") else ""))


def main() -> int:
    """JAX on this host's CPU (the TPU topology is compiled for, not run on), XLA dumping every program's optimised
    HLO (decode bytes, collectives), then `run`."""
    jax_setup.configure(platforms="cpu", tpu_topology=True, hlo_dump=".*")
    return run()


if __name__ == "__main__":
    sys.exit(main())
