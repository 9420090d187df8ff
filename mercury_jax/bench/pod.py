"""The pod proof: every program a run executes, compiled ahead of time for its real topology, against HBM.

    PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod --config experiments/sao.py [--topology v5p:4x4x8]
    python -m mercury_jax.bench.pod --config experiments/sao.py:tiny --topology cpu --no-write   # the CI run

The config's device groups are laid over the topology's chips by the trainers' own placement
(`train/placement.py:role_meshes`, `rollout/layout.py:replica_meshes`), and every jitted program of a step is
lowered from abstract shapes in the layout the trainer gives its inputs, by the functions the trainers call:
rollout `decode` and `prefill` of one replica (`rollout/sampler.py`), the weight publish (`rollout/publish.py`'s
`stage` and `send`), SAO `values` (critic forward + GAE), `critic` and `actor` steps with Adam and micro-batching
(`train/sao_learner.py`), pivot-GRPO `reference` log-probs and `grpo` step (`train/grpo_learner.py`). Nothing is
allocated and nothing runs on a TPU. Learner batches take their worst case: every row `rollout.max_total_tokens`.

Per program: `compiled.memory_analysis()` per chip (arguments + outputs + temporaries - aliased), plus what stays
resident on the same chips while it runs (the other engine's weights and state, the optimiser state a forward
does not take, the GRPO reference beside the actor), against `--headroom` (default 80%) of the chip's HBM;
compile seconds; XLA's cost analysis (FLOPs, bytes accessed) beside the model FLOPs counted by hand (6 N T
for a training step, 2 N T for a forward, N the active parameters, plus causal attention) and the HBM bytes a
decode step must read (the weights a step touches: all but the routed experts, the expected share of distinct
routed experts, the decode state). XLA's cost analysis counts a while loop's body once (checked on a `lax.scan`:
one iteration's FLOPs), and every learner step and decode chunk is a loop (layers, micro-batches, decode steps),
so its figures are shown but the roofline time is the largest of the lower bounds: max(XLA FLOPs, model FLOPs) /
peak and max(XLA bytes, decode bytes) / HBM bandwidth. The decode chunk's bytes are also counted in its optimised
HLO with every loop by its trip count (`hlo_bytes.py`: the chunk minus a 1-step compile, per step, times the
steps), what the compiled program moves rather than what it must; the roofline takes the larger. The step
estimate and the model FLOP utilisation follow from those rooflines and the counts of each program per step
(printed with the derivation). Exit status 1 names every program over the threshold or refused by the compiler.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host topology; silences libtpu's probe

from mercury_jax.bench.hlo_bytes import bytes_per_trip, counted_collectives, dump_optimised_hlo  # noqa: E402, I001

if __name__ == "__main__":  # before jax starts: the optimised HLO of every program (decode bytes, collectives)
    dump_optimised_hlo(".*")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

from mercury_jax.bench.aot_tpu import (  # noqa: E402
    abstract_opt_state,
    abstract_state,
    apply_overrides,
    batch_spec,
    load_config,
    shardings,
)
from mercury_jax.bench.report import V5P_HBM_BYTES_PER_S, V5P_PEAK_FLOPS, markdown_table, replace_subsection  # noqa: E402
from mercury_jax.bench.rollout_aot import abstract_engine, decode_read_bytes, laid_out, per_chip_bytes, prefill_inputs  # noqa: E402
from mercury_jax.config.model import model_runtime, preset_config  # noqa: E402
from mercury_jax.rollout.layout import replica_meshes  # noqa: E402
from mercury_jax.rollout.publish import Publisher  # noqa: E402
from mercury_jax.rollout.replicas import slots_per_replica  # noqa: E402
from mercury_jax.rollout.sampler import _compiled, bucket_length, prefill_chunk  # noqa: E402
from mercury_jax.train.grpo_learner import make_grpo_step, make_reference_logprobs, reference_micro_batches  # noqa: E402
from mercury_jax.train.optim import make_optimizer  # noqa: E402
from mercury_jax.train.placement import batch_sharding, role_meshes  # noqa: E402
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step  # noqa: E402
from mercury_jax.train.sft_learner import make_sft_step  # noqa: E402
from mercury_kernels.gated_delta.pallas import chunk_macs  # noqa: E402
from models.qwen35_moe import Qwen35MoeForCausalLM  # noqa: E402
from models.qwen35_moe.config import PRESETS  # noqa: E402
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable  # noqa: E402

GIB = 2.0 ** 30
# Async across hosts (train/async_batches.py): a batch's trajectories reach every process by a host all-gather, in
# rounds. Per token a trajectory carries its id (int32), log-prob (fp32), action mask and policy version (int32):
# ~13 bytes, pickled. Assumed: 12.5 GB/s (100 Gb/s) of data-centre network a host, and two rounds of ~1 ms a batch.
TRAJECTORY_BYTES_PER_TOKEN = 13
DCN_BYTES_PER_S = 12.5e9
ASSEMBLY_ROUNDS_S = 2 * 1e-3
HBM_GIB = {"v5p": 95.0}  # per chip
# the smallest v5p slice of at least N chips (Cloud TPU's v5p topologies)
V5P_TOPOLOGIES = {8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8",
                  1024: "8x8x16", 2048: "8x16x16"}


@dataclasses.dataclass
class Program:
    """One jitted program of the run: how to lower it, where it runs, what else its chips hold meanwhile."""
    name: str
    chips: str                      # the device group(s) it runs on, in words
    lower: Callable                 # () -> jax.stages.Lowered
    resident_bytes: int = 0         # per chip, held by other arrays on the same chips while it runs
    resident_note: str = ""
    per_step: float = 1.0           # how many times one step runs it
    model_flops: float = 0.0        # per run of the program, all chips together (hand count)
    model_bytes: float = 0.0        # per chip per run: HBM bytes it must at least read (hand count; 0: none made)
    group_chips: int = 1            # chips running it (the roofline is per chip; the group works in parallel)
    role: str = ""                  # whose device group it runs on (other roles sharing those devices add residency)
    counted: tuple = ()             # roles whose arrays `resident_bytes` already holds
    one_step_lower: Callable | None = None  # a loop program's 1-trip version: the difference counts the loop's bytes
    steps: int = 1                  # trips of that loop per run


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
        return max(v for v in self.bounds.values() if v == v)

    @property
    def bound(self) -> str:
        bounds = self.bounds
        return max((k for k in bounds if bounds[k] == bounds[k]), key=bounds.get)


def model_config(config, preset: str):
    """The run's model architecture as the trainer builds it (`config.model.preset_config`): its preset (the `:tiny`
    overrides included) or, for a run that loads an HF checkpoint, `preset` (the checkpoint's architecture: shapes
    need no weights)."""
    return preset_config(config.model, config.tokenizer.vocab_size, config.model.get("preset") or preset)


def active_parameters(cfg) -> tuple[int, int]:
    """(parameters used per token outside the embedding lookup, total parameters): routed experts count k / E."""
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    active = total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        size = int(np.prod(leaf.get_value().shape, dtype=np.int64))
        total += size
        names = [str(p) for p in path]
        if any("embed" in n for n in names):
            continue
        routed = any(n.startswith("expert_") for n in names) and not any("shared" in n for n in names)
        active += size * cfg.num_experts_per_tok // cfg.num_experts if routed else size
    return active, total


def attention_flops_per_token(cfg, context: int) -> float:
    """Forward FLOPs of causal attention per token at mean context `context` / 2 (QK^T and PV) over the
    full-attention layers; the GDN layers' state updates are linear in the heads and left to the matmul count."""
    full_layers = sum(1 for kind in cfg.layer_types if kind == "full_attention")
    return full_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * context / 2


# -- the programs -------------------------------------------------------------------------------------------------

def longest_prefill(r) -> int:
    """Tokens of the longest prefill call of rollout section `r`: the bucket of a whole history before the last
    turn, or the chunk a longer one is fed in (`sampler.prefill_chunk`)."""
    return min(bucket_length(r.max_total_tokens - r.max_turn_tokens, r.max_total_tokens),
               prefill_chunk(r.max_total_tokens))


def rollout_programs(config, cfg, meshes: dict, *, async_mode: bool) -> tuple[list[Program], dict]:
    """The engine's decode and largest prefill on one replica (or the single engine on the first rollout device),
    and facts the step estimate needs."""
    r = config.rollout
    replica = dict(r.get("replica", {}) or {})
    param_dtype = r.get("param_dtype", "") or None
    rollout_devices = list(meshes["rollout"].devices.flat)
    if replica:
        replicas = replica_meshes(rollout_devices, replica)
        mesh, count = replicas[0], len(replicas)
        slots = slots_per_replica(r.num_slots, count)
    else:
        replicas, mesh, count, slots = [], None, 1, r.num_slots
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, decode_state, row_shapes, _, _ = abstract_engine(
        model, slots, r.max_total_tokens, param_dtype, mesh=mesh, device=rollout_devices[0])
    steps = int(r.get("steps_per_sync", 8))
    prefill_tokens = longest_prefill(r)
    prefill_row, decode, _, _ = _compiled(graphdef, r.max_total_tokens, mesh)
    whole = NamedSharding(mesh, PartitionSpec()) if mesh is not None else SingleDeviceSharding(rollout_devices[0])
    inputs = prefill_inputs(prefill_tokens, whole)
    engine_bytes = per_chip_bytes(params) + per_chip_bytes(decode_state)
    # async: the worker's engine samples while the evaluation engine (offloaded between evaluations) evaluates
    other = engine_bytes if async_mode else 0
    other_note = "the evaluation engine (async mode, during an evaluation)" if async_mode else ""
    where = (f"rollout: 1 of {count} replicas {replica} ({slots} slots)" if replica
             else f"rollout: one engine on 1 device ({slots} slots)")
    active, _ = active_parameters(cfg)
    per_token = 2 * active + attention_flops_per_token(cfg, r.max_total_tokens)
    chips = mesh.size if mesh is not None else 1
    step_bytes = decode_read_bytes(params, decode_state, cfg, slots)
    weights_bytes = decode_read_bytes(params, {}, cfg, prefill_tokens)  # a long prefill touches every expert
    programs = [
        Program("rollout decode", where, lambda: decode.lower(params, decode_state, steps), other, other_note,
                model_flops=per_token * slots * steps, model_bytes=step_bytes * steps, group_chips=chips,
                role="rollout", one_step_lower=lambda: decode.lower(params, decode_state, 1), steps=steps),
        Program("rollout prefill", where, lambda: prefill_row.lower(params, row_shapes, *inputs),
                per_chip_bytes(decode_state) + other, "the engine's decode state" + (f" + {other_note}" if other
                                                                                   else ""),
                model_flops=per_token * prefill_tokens, model_bytes=weights_bytes, group_chips=chips,
                role="rollout")]
    facts = dict(replicas=count, slots=slots, steps=steps, prefill_tokens=prefill_tokens, replica_meshes=replicas,
                 param_dtype=param_dtype, engine_bytes=engine_bytes, persistent=engine_bytes + other)
    return programs, facts


def publish_programs(meshes: dict, rollout: dict, learner_params, learner_resident: int) -> list[Program]:
    """`stage` on the actor chips and `send` on actor + rollout chips, when the trainer's publish takes the
    collective route (`Publisher.supports`); otherwise none (a shared device: a cast and a device_put)."""
    if not rollout["replica_meshes"]:
        return []
    publisher = Publisher(rollout["replica_meshes"], rollout["param_dtype"])
    if not publisher.supports(learner_params):
        return []
    lowered = {}

    def lower(which):
        if not lowered:
            lowered["stage"], lowered["send"] = publisher.lower(learner_params)
        return lowered[which]
    return [Program("publish stage", f"actor ({meshes['actor'].size} chips)", lambda: lower("stage"),
                    learner_resident, "the actor's Adam moments", role="actor"),
            Program("publish send", "actor + rollout chips", lambda: lower("send"), rollout["engine_bytes"],
                    "a rollout chip's engine (weights in use + decode state)", role="rollout")]


def sao_programs(config, cfg, meshes: dict, rows: int, seq: int) -> tuple[list[Program], object, int]:
    s = config.sao
    active, _ = active_parameters(cfg)
    tokens = rows * seq
    forward = (2 * active + attention_flops_per_token(cfg, seq)) * tokens
    programs = []
    critic_mesh, actor_mesh = meshes["critic"], meshes["actor"]
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeCritic(cfg, rngs=nnx.Rngs(0)), critic_mesh,
                                              critic_trainable)
    tx = make_optimizer(s.critic_optimizer)
    opt_state = abstract_opt_state(tx, params, critic_mesh)
    keys = dict(tokens=jnp.int32, action_mask=jnp.float32, rollout_logprobs=jnp.float32, rewards=jnp.float32)
    values_fn = make_advantage_fn(graphdef, s, mesh=critic_mesh)
    critic_batch = batch_spec(critic_mesh, rows, seq, keys, s)
    programs.append(Program("values + GAE", f"critic ({critic_mesh.size} chips)",
                            lambda: values_fn.lower(params, frozen, critic_batch), per_chip_bytes(opt_state),
                            "the critic's Adam moments", model_flops=forward, group_chips=critic_mesh.size,
                            role="critic"))
    critic_step = make_critic_step(graphdef, tx, s, state_shardings=(shardings(params), shardings(opt_state)))
    step_batch = batch_spec(critic_mesh, rows, seq, dict(keys, returns=jnp.float32, old_values=jnp.float32), s)
    programs.append(Program("critic step", f"critic ({critic_mesh.size} chips)",
                            lambda: critic_step.lower(params, frozen, opt_state, step_batch),
                            per_step=s.critic_epochs, model_flops=3 * forward, group_chips=critic_mesh.size,
                            role="critic"))
    a_graphdef, a_params, a_frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)),
                                                    actor_mesh, nnx.Param)
    a_tx = make_optimizer(s.actor_optimizer)
    a_opt = abstract_opt_state(a_tx, a_params, actor_mesh)
    actor_step = make_actor_step(a_graphdef, a_tx, s, state_shardings=(shardings(a_params), shardings(a_opt)))
    actor_batch = batch_spec(actor_mesh, rows, seq, dict(tokens=jnp.int32, action_mask=jnp.float32,
                                                         rollout_logprobs=jnp.float32, advantages=jnp.float32,
                                                         rewards=jnp.float32), s)
    programs.append(Program("actor step", f"actor ({actor_mesh.size} chips)",
                            lambda: actor_step.lower(a_params, a_frozen, a_opt, actor_batch),
                            model_flops=3 * forward, group_chips=actor_mesh.size, role="actor"))
    persistent = {"critic": per_chip_bytes((params, frozen, opt_state)),
                  "actor": per_chip_bytes((a_params, a_frozen, a_opt))}
    return programs, a_params, per_chip_bytes(a_opt), persistent


def grpo_programs(config, cfg, meshes: dict, seq: int) -> tuple[list[Program], object, int]:
    g = config.grpo
    active, _ = active_parameters(cfg)
    rows = g.batch_states * g.group_size
    minibatch = rows // g.minibatches
    forward_token = 2 * active + attention_flops_per_token(cfg, seq)
    actor_mesh, ref_mesh = meshes["actor"], meshes["reference"]
    a_graphdef, a_params, a_frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)),
                                                    actor_mesh, nnx.Param)
    tx = make_optimizer(g.actor_optimizer)
    opt_state = abstract_opt_state(tx, a_params, actor_mesh)
    reference_dtype = jnp.dtype(g.reference_dtype)
    r_graphdef, r_state = nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))
    r_state = laid_out(jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, reference_dtype if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype), r_state), ref_mesh)
    reference_fn = make_reference_logprobs(r_graphdef, mesh=ref_mesh, micro_batches=reference_micro_batches(g))
    row_spec = batch_sharding(ref_mesh, (rows, seq))
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=row_spec)
    segments = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=row_spec) if g.pack_rows else None
    actor_bytes = per_chip_bytes((a_params, a_frozen, opt_state))
    step = make_grpo_step(a_graphdef, tx, g, state_shardings=(shardings(a_params), shardings(opt_state)))
    batch = batch_spec(actor_mesh, minibatch, seq, dict(tokens=jnp.int32, action_mask=jnp.float32,
                                                        rollout_logprobs=jnp.float32, advantages=jnp.float32,
                                                        ref_logprobs=jnp.float32), g)
    programs = [
        Program("reference log-probs", f"actor devices ({ref_mesh.size} chips, reference mesh)",
                lambda: reference_fn.lower(r_state, tokens, segments), actor_bytes, "the actor's params + Adam",
                model_flops=forward_token * rows * seq, group_chips=ref_mesh.size, role="reference",
                counted=("actor",)),
        Program("grpo step", f"actor ({actor_mesh.size} chips)", lambda: step.lower(a_params, a_frozen, opt_state,
                                                                                      batch),
                per_chip_bytes(r_state), f"the frozen reference ({g.reference_dtype})",
                per_step=g.ppo_epochs * g.minibatches, model_flops=3 * forward_token * minibatch * seq,
                group_chips=actor_mesh.size, role="actor", counted=("reference",))]
    # the reference shares the actor's devices and each program above counts the other: nothing to add there
    persistent = {"actor": actor_bytes, "reference": per_chip_bytes(r_state)}
    return programs, a_params, per_chip_bytes(opt_state), persistent


def sft_programs(config, cfg, meshes: dict) -> tuple[list[Program], object, int, dict]:
    """The SFT step (Adam, micro-batched as configured) on the actor's mesh, every row `sft.row_length` tokens."""
    s = config.sft
    rows, seq = s.batch_rows, s.row_length
    mesh = meshes["actor"]
    active, _ = active_parameters(cfg)
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh, nnx.Param)
    tx = make_optimizer(s.optimizer)
    opt_state = abstract_opt_state(tx, params, mesh)
    step = make_sft_step(graphdef, tx, s, state_shardings=(shardings(params), shardings(opt_state)))
    batch = batch_spec(mesh, rows, seq, dict(tokens=jnp.int32, segment_ids=jnp.int32, loss_mask=jnp.float32), s)
    forward = (2 * active + attention_flops_per_token(cfg, seq)) * rows * seq
    programs = [Program("sft step", f"actor ({mesh.size} chips)",
                        lambda: step.lower(params, frozen, opt_state, batch), model_flops=3 * forward,
                        group_chips=mesh.size, role="actor")]
    return programs, params, per_chip_bytes(opt_state), {"actor": per_chip_bytes((params, frozen, opt_state))}


def add_shared_residency(programs: list[Program], meshes: dict, persistent: dict) -> None:
    """Where roles share devices (`config.devices` all 0: one device holds everything), a program's chips also
    hold the other roles' persistent arrays (engine weights and state, learner params and Adam moments)."""
    devices = {role: {d.id for d in mesh.devices.flat} for role, mesh in meshes.items()}
    for program in programs:
        mine = devices.get(program.role, set())
        others = [role for role in persistent if role != program.role and role not in program.counted
                  and devices.get(role, set()) & mine]
        extra = sum(persistent[role] for role in others)
        if extra:
            program.resident_bytes += extra
            note = " + ".join(f"the {role}'s arrays (same devices)" for role in others)
            program.resident_note = f"{program.resident_note} + {note}" if program.resident_note else note


# -- running and reporting ----------------------------------------------------------------------------------------

def compile_program(program: Program) -> Result:
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
        result.total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                        - memory.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    result.flops = float(cost.get("flops", math.nan)) if cost else math.nan
    result.bytes_accessed = float(cost.get("bytes accessed", math.nan)) if cost else math.nan
    result.collectives = counted_collectives(started)
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


def episodes_per_step(config) -> int:
    """The episodes a step trains on: SAO's prompts, GRPO's states x their group."""
    return config.sao.batch_prompts if "sao" in config else config.grpo.batch_states * config.grpo.group_size


def rollout_seconds(episodes: int, generated: int, prefilled: int, replicas: int, slots: int, decode_step_s: float,
                    prefill_tokens: int, prefill_s: float) -> tuple[float, float]:
    """(rollout seconds for a batch, seconds for one episode): the batch's decode steps with all `replicas x slots`
    slots busy plus its prefills (ceil(prefilled / prefill_tokens) calls an episode) spread over the replicas, never
    less than one episode, whose tokens come one decode step after another."""
    prefills = math.ceil(prefilled / prefill_tokens)
    episode_s = generated * decode_step_s + prefills * prefill_s
    batch_s = (math.ceil(episodes * generated / (replicas * slots)) * decode_step_s
               + math.ceil(episodes * prefills / replicas) * prefill_s)
    return max(batch_s, episode_s), episode_s


def async_step_seconds(rollout_s: float, learner_s: float, episode_s: float, max_staleness: int) -> float:
    """An async step: the rollout and the learner overlap, and a step is never shorter than an episode over the
    staleness bound (a trajectory may lag at most that many policy versions)."""
    free = max(rollout_s, learner_s)
    return max(free, episode_s / max_staleness) if max_staleness else free


def step_estimate(config, results: list[Result], rollout: dict, generated: int, chips: int) -> str:
    """Seconds per step from the rooflines (lower bounds) and the model FLOP utilisation they imply, in words."""
    by_name = {r.program.name: r for r in results}
    pipeline = "sao" if "sao" in config else "grpo"
    r = config.rollout
    episodes = episodes_per_step(config)
    prefilled = max(r.max_total_tokens - generated, 0)
    decode, prefill = by_name.get("rollout decode"), by_name.get("rollout prefill")
    slots_total = rollout["replicas"] * rollout["slots"]
    decode_steps = math.ceil(episodes * generated / slots_total)
    prefill_calls = episodes * math.ceil(prefilled / rollout["prefill_tokens"])
    rollout_s, episode_s = rollout_seconds(episodes, generated, prefilled, rollout["replicas"], rollout["slots"],
                                           decode.roofline_s / rollout["steps"], rollout["prefill_tokens"],
                                           prefill.roofline_s)
    learner = [x for x in results if not x.program.name.startswith(("rollout", "publish"))]
    learner_s = sum(x.roofline_s * x.program.per_step for x in learner)
    if pipeline == "sao":  # the critic's K steps and the actor step run on their own chips at the same time
        values, critic, actor = by_name["values + GAE"], by_name["critic step"], by_name["actor step"]
        learner_s = values.roofline_s + max(critic.roofline_s * critic.program.per_step, actor.roofline_s)
    publish_s = sum(x.roofline_s for x in results if x.program.name.startswith("publish"))
    mode = r.get("mode", "sync")
    async_mode = mode == "async"
    # async: every host receives the whole batch before the learner starts; the rollout hosts take part in each
    # publish (its send reads and writes their HBM while they decode), so it costs both sides
    assembly_s = (episodes * r.max_total_tokens * TRAJECTORY_BYTES_PER_TOKEN / DCN_BYTES_PER_S + ASSEMBLY_ROUNDS_S
                  if async_mode else 0.0)
    staleness = config.sao.max_staleness if pipeline == "sao" else 0
    step_s = (async_step_seconds(rollout_s, assembly_s + learner_s, episode_s, staleness) + publish_s if async_mode
              else rollout_s + learner_s + publish_s)
    rollout_flops = decode.program.model_flops / rollout["steps"] / rollout["slots"] * episodes * generated
    rollout_flops += prefill.program.model_flops / rollout["prefill_tokens"] * episodes * prefilled
    learner_flops = sum(x.program.model_flops * x.program.per_step for x in learner)
    mfu = (rollout_flops + learner_flops) / (chips * V5P_PEAK_FLOPS * step_s)
    return (f"Step estimate ({pipeline}, {mode} mode), from the rooflines above, so a lower bound on time: "
            f"{episodes} episodes of {generated:,} generated + {prefilled:,} prefilled tokens (assumed: "
            f"`--generated-tokens`). Rollout: {decode_steps:,} decode steps x "
            f"{decode.roofline_s / rollout['steps'] * 1e3:.2f} ms (every one of the {slots_total} slots busy) + "
            f"{prefill_calls} prefills of {rollout['prefill_tokens']:,} tokens over {rollout['replicas']} replica(s) "
            f"x {prefill.roofline_s * 1e3:.1f} ms, never less than one episode = **{seconds(rollout_s)}**. Learner: "
            + ("values + max(K x critic step, actor step) (critic and actor chips work at once)" if pipeline == "sao"
               else "reference + optimiser steps") + f" = **{seconds(learner_s)}**; publish {publish_s * 1e3:.0f} ms. "
            + (f"Batch assembly across hosts (async): {episodes} x {r.max_total_tokens:,} tokens x "
               f"{TRAJECTORY_BYTES_PER_TOKEN} B to every host at {DCN_BYTES_PER_S / 1e9:.1f} GB/s + "
               f"{ASSEMBLY_ROUNDS_S * 1e3:.0f} ms of rounds = {seconds(assembly_s)}. " if async_mode else "")
            + "Step: " + (f"max(rollout, assembly + learner, episode {seconds(episode_s)} / max staleness "
                          f"{staleness}) + publish (async: the two sides overlap; the rollout hosts join every "
                          "publish)" if async_mode
                          else "rollout + learner + publish (sync)") + f" = **{seconds(step_s)}**. "
            f"Model FLOPs per step (hand count: 2 N per generated or prefilled token, 6 N per trained token, N the "
            f"active parameters, plus causal attention) {(rollout_flops + learner_flops) / 1e12:,.1f} TFLOP over "
            f"{chips} chips x {V5P_PEAK_FLOPS / 1e12:.0f} TFLOP/s x {seconds(step_s)}: **MFU {mfu:.1%}** (an upper "
            f"bound, as the time is a lower bound).")


def table(results: list[Result], hbm_bytes: float, headroom: float) -> str:
    rows = []
    for r in results:
        p = r.program
        if r.error:
            rows.append([p.name, p.chips, "refused", "", "", "", "", f"{r.compile_s:.0f}", "", "", "", "", "", "",
                         r.error[:80], ""])
            continue
        fits = "fits" if r.peak <= headroom * hbm_bytes else "**over**"
        ratio = r.flops * p.group_chips / p.model_flops if p.model_flops and r.flops == r.flops else math.nan
        rows.append([p.name, p.chips, f"{r.arguments / GIB:.2f}", f"{r.temp / GIB:.2f}", f"{r.total / GIB:.2f}",
                     f"{p.resident_bytes / GIB:.2f}", f"{r.peak / GIB:.2f} ({r.peak / hbm_bytes:.0%}, {fits})",
                     f"{r.compile_s:.0f}", f"{r.flops / 1e12:.3f}", f"{p.model_flops / p.group_chips / 1e12:.3f}",
                     f"{ratio:.2f}", f"{r.bytes_accessed / GIB:.2f}", f"{p.model_bytes / GIB:.2f}" if p.model_bytes
                     else "", f"{r.counted_bytes / GIB:.2f}" if r.counted_bytes == r.counted_bytes else "",
                     f"{r.roofline_s * 1e3:.2f} ({r.bound})", collectives_text(r.collectives)])
    headers = ["program", "chips", "arguments GiB/chip", "temp GiB/chip", "program GiB/chip", "resident GiB/chip",
               "peak GiB/chip (of HBM)", "compile s", "XLA TFLOP/chip", "model TFLOP/chip", "XLA / model FLOPs",
               "XLA GiB accessed/chip", "must-read GiB/chip", "counted GiB/chip", "roofline ms (bound)",
               "collectives GiB/chip (received per run)"]
    notes = [f"- {r.program.name}: resident = {r.program.resident_note}" for r in results if r.program.resident_note]
    return markdown_table(headers, rows) + ("\n\n" + "\n".join(notes) if notes else "")


TRAINING_PROGRAMS = {"sft step": "sft", "actor step": "sao", "grpo step": "grpo"}


def per_token_text(results: list[Result], rows: int, seq: int) -> str:
    """The policy update's roofline per trained token (the update program over its rows x seq tokens, the time a
    chip group spends on one token of its batch) and the collectives it receives per step."""
    lines = []
    for r in results:
        pipeline = TRAINING_PROGRAMS.get(r.program.name)
        if pipeline is None or r.error:
            continue
        tokens = rows * seq / r.program.per_step if pipeline == "grpo" else rows * seq
        received = sum((r.collectives or {}).values())
        lines.append(f"{r.program.name}: roofline {r.roofline_s:.2f} s for {tokens:,.0f} tokens ({rows} rows x "
                     f"{seq:,}{' / ' + str(r.program.per_step) + ' minibatches' if pipeline == 'grpo' else ''}) = "
                     f"**{r.roofline_s / tokens * 1e6:.2f} us a token** on {r.program.group_chips} chips "
                     f"({r.roofline_s / tokens * 1e6 * r.program.group_chips:.1f} chip-us a token); collectives "
                     f"received {received / GIB:.1f} GiB a chip a run")
    return "\n".join(f"- {line}" for line in lines)


def gdn_split_text(cfg, meshes: dict, seq: int) -> str:
    """What splitting rows over 'sequence' adds to the Gated DeltaNet (docs/MODEL.md §8): the span map's first pass
    of the rule at width V + K, counted by the Pallas kernel's own multiply-adds (`chunk_macs`), per token and as a
    share of the model's forward FLOPs a token; blank when no learner mesh splits rows."""
    split = {role: mesh.shape.get("sequence", 1) for role, mesh in meshes.items() if mesh.shape.get("sequence", 1) > 1}
    if not split:
        return ""
    C, K, V = cfg.gdn_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gdn_layers = sum(1 for kind in cfg.layer_types if kind != "full_attention")
    per_token = 2 * gdn_layers * cfg.linear_num_value_heads / C  # FLOPs per multiply-add, chunk MACs per token
    rule = per_token * chunk_macs(C, K, V)
    extra = per_token * chunk_macs(C, K, V + K)
    active, _ = active_parameters(cfg)
    forward = 2 * active + attention_flops_per_token(cfg, seq)
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


def run(argv=None) -> int:
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
    args = parser.parse_args(argv)
    config = load_config(args.config)
    apply_overrides(config, args.set)
    pipeline = "sao" if "sao" in config else "grpo" if "grpo" in config else "sft"
    groups = dict(config.devices)
    needed = sum(groups.values()) or 1
    devices, topology, hbm_bytes = topology_devices(args.topology, needed)
    cfg = model_config(config, args.preset)
    roles = {"sao": ("rollout", "actor", "critic"), "grpo": ("rollout", "actor", "reference"),
             "sft": ("actor",)}[pipeline]
    meshes = role_meshes(config, roles, devices=devices)
    chips = needed
    if pipeline == "sft":
        seq = config.sft.row_length
        programs, _, _, persistent = sft_programs(config, cfg, meshes)
        facts = None
    else:
        seq = config.rollout.max_total_tokens
        rollout, facts = rollout_programs(config, cfg, meshes,
                                          async_mode=config.rollout.get("mode", "sync") == "async")
        if pipeline == "sao":
            learner, actor_params, actor_opt_bytes, persistent = sao_programs(config, cfg, meshes,
                                                                              config.sao.batch_prompts, seq)
        else:
            learner, actor_params, actor_opt_bytes, persistent = grpo_programs(config, cfg, meshes, seq)
        persistent["rollout"] = facts["persistent"]
        programs = rollout + publish_programs(meshes, facts, actor_params, actor_opt_bytes) + learner
    add_shared_residency(programs, meshes, persistent)
    every_program = {p.name for p in programs}
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        programs = [p for p in programs if p.name in wanted]
    model_name = config.model.get("preset") or args.preset
    print(f"{args.config} ({pipeline}, {model_name}) on {topology}: {len(devices)} devices, groups {groups}; HBM "
          f"{hbm_bytes / GIB:.1f} GiB a chip, threshold {args.headroom:.0%}", flush=True)
    results = []
    for program in programs:
        results.append(compile_program(program))
        r = results[-1]
        print(f"  {program.name:22s} {program.chips}: " + (f"FAILED {r.error}" if r.error else
              f"{r.total / GIB:.2f} GiB program + {program.resident_bytes / GIB:.2f} resident, compile "
              f"{r.compile_s:.0f} s, roofline {r.roofline_s * 1e3:.2f} ms"), flush=True)
    body = table(results, hbm_bytes, args.headroom)
    problems = verdicts(results, hbm_bytes, args.headroom)
    estimate = ""
    names = {r.program.name for r in results if not r.error}
    complete = every_program == names  # the estimate needs every program's roofline
    if complete and facts is not None:
        generated = args.generated_tokens or config.rollout.max_turn_tokens
        estimate = step_estimate(config, results, facts, generated, chips)
    rows = {"sao": lambda: config.sao.batch_prompts, "sft": lambda: config.sft.batch_rows,
            "grpo": lambda: config.grpo.batch_states * config.grpo.group_size}[pipeline]()
    per_token = "\n".join(t for t in (per_token_text(results, rows, seq), gdn_split_text(cfg, meshes, seq)) if t)
    print(body)
    print(per_token)
    print(estimate)
    verdict = ("**Every program fits** within " + f"{args.headroom:.0%} of HBM." if not problems
               else "**Does not fit**:\n" + "\n".join(f"- {p}" for p in problems))
    print(verdict)
    if not args.no_write:
        label = args.label or f"{args.config} ({model_name}, {topology})"
        command = ("PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.pod --config " + args.config +
                   (f" --topology {args.topology}" if args.topology else "") + "".join(f" --set {s}" for s in args.set)
                   + (f" --preset {args.preset}" if not config.model.get("preset") else ""))
        rollout_text = ("" if facts is None else f"rollout {config.rollout.get('mode', 'sync')}, {facts['replicas']} "
                        f"replica(s) x {facts['slots']} slots; ")
        text = (f"Groups {groups} over `{topology}`; meshes {meshes_text(meshes)}; {rollout_text}learner batches "
                f"{rows} rows x {seq:,} tokens (worst case); model runtime {model_runtime(config.model)}.\n\n" + body
                + ("\n\n" + per_token if per_token else "")
                + ("\n\n" + estimate if estimate else "") + "\n\n" + verdict)
        replace_subsection("pod", label, text, command)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(run())
