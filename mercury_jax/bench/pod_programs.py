"""Every jitted program one step of a run executes, as `bench.pod` compiles it: lowered from abstract shapes in the
layout the trainer gives its inputs, by the functions the trainers call, with the hand counts of its work.

The roles (and so the meshes) come from the pipeline that `config.pipeline` names (`config/registry.py`); each
pipeline's learner programs from `LEARNERS`: SAO `values` (critic forward + GAE), `critic` and `actor` steps
(`train/sao_learner.py`); pivot-GRPO `reference` log-probs and `grpo` step (`train/grpo_learner.py`); the group
baseline's actor step (SAO's, on B x K rows); the SFT step. An RL pipeline adds the rollout engine's `decode` and
`prefill` of one replica (`rollout/sampler.py`) and the weight publish (`rollout/publish.py`). Learner batches take
their worst case: every row `rollout.max_total_tokens` (SFT: `sft.row_length`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mercury_jax.bench.abstract import (
    abstract_engine,
    abstract_opt_state,
    abstract_state,
    batch_spec,
    laid_out,
    prefill_inputs,
    shardings,
)
from mercury_jax.bench.flops import forward_flops_per_token
from mercury_jax.bench.rooflines import decode_read_bytes, per_chip_bytes
from mercury_jax.bench.step_time import pipeline_name
from mercury_jax.config.registry import pipeline as registered_pipeline
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.publish import Publisher
from mercury_jax.rollout.replicas import slots_per_replica
from mercury_jax.rollout.sampler import _compiled, bucket_length, prefill_chunk
from mercury_jax.train.grpo_learner import make_grpo_step, make_reference_logprobs, reference_micro_batches
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.placement import batch_sharding, role_meshes
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step
from mercury_jax.train.sft_learner import make_sft_step
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable

POLICY_KEYS = dict(tokens=jnp.int32, action_mask=jnp.float32, rollout_logprobs=jnp.float32,
                   advantages=jnp.float32)  # a policy-gradient batch's arrays (train/batching.py, group_batch.py)


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
class Learner:
    """A pipeline's learner programs and what the rest of the step needs of them: the actor's abstract params and
    Adam bytes per chip (the publish reads them) and each role's arrays per chip that stay resident."""
    programs: list[Program]
    actor_params: object
    actor_opt_bytes: int
    persistent: dict


def pipeline_meshes(config, devices) -> dict:
    """A mesh per role of the config's pipeline (its registered roles) over `devices`, as the trainer places them."""
    return role_meshes(config, registered_pipeline(config.pipeline).roles, devices=devices)


def learner_seq(config) -> int:
    """Tokens per learner row in the worst case: SFT's `sft.row_length`, an RL run's `rollout.max_total_tokens`."""
    return config.sft.row_length if pipeline_name(config) == "sft" else config.rollout.max_total_tokens


def learner_programs(config, cfg, meshes: dict) -> Learner:
    """The learner programs of the config's pipeline (`LEARNERS`), every row `learner_seq(config)` tokens."""
    name = pipeline_name(config)
    if name not in LEARNERS:
        raise ValueError(f"bench.pod has no learner programs for pipeline {name!r}; add them to "
                         f"pod_programs.LEARNERS")
    return LEARNERS[name](config, cfg, meshes, learner_seq(config))


def step_programs(config, cfg, meshes: dict) -> tuple[list[Program], dict | None]:
    """(every program of a step, the rollout's facts or None for SFT): the rollout engine's decode and prefill, the
    weight publish and the learner, each with what its chips also hold while it runs."""
    learner = learner_programs(config, cfg, meshes)
    if "rollout" not in meshes:
        add_shared_residency(learner.programs, meshes, learner.persistent)
        return learner.programs, None
    rollout, facts = rollout_programs(config, cfg, meshes, async_mode=config.rollout.get("mode", "sync") == "async")
    learner.persistent["rollout"] = facts["persistent"]
    programs = (rollout + publish_programs(meshes, facts, learner.actor_params, learner.actor_opt_bytes)
                + learner.programs)
    add_shared_residency(programs, meshes, learner.persistent)
    return programs, facts


def longest_prefill(r) -> int:
    """Tokens of the longest prefill call of rollout section `r`: the bucket of a whole history before the last
    turn, or the chunk a longer one is fed in (`sampler.prefill_chunk`)."""
    return min(bucket_length(r.max_total_tokens - r.max_turn_tokens, r.max_total_tokens),
               prefill_chunk(r.max_total_tokens))


def rollout_programs(config, cfg, meshes: dict, *, async_mode: bool) -> tuple[list[Program], dict]:
    """The engine's decode and largest prefill on one replica (or the single engine on the first rollout device),
    and facts the step estimate needs."""
    r = config.rollout
    facts = _rollout_layout(r, meshes["rollout"])
    mesh, slots = facts["mesh"], facts["slots"]
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, decode_state, row_shapes, _, _ = abstract_engine(
        model, slots, r.max_total_tokens, facts["param_dtype"], mesh=mesh, device=facts["device"])
    steps = int(r.get("steps_per_sync", 8))
    prefill_tokens = longest_prefill(r)
    prefill_row, decode, _, _ = _compiled(graphdef, r.max_total_tokens, mesh)
    whole = NamedSharding(mesh, PartitionSpec()) if mesh is not None else SingleDeviceSharding(facts["device"])
    inputs = prefill_inputs(prefill_tokens, whole)
    engine_bytes = per_chip_bytes(params) + per_chip_bytes(decode_state)
    # async: the worker's engine samples while the evaluation engine (offloaded between evaluations) evaluates
    other = engine_bytes if async_mode else 0
    other_note = "the evaluation engine (async mode, during an evaluation)" if async_mode else ""
    per_token = forward_flops_per_token(cfg, r.max_total_tokens)
    chips = mesh.size if mesh is not None else 1
    step_bytes = decode_read_bytes(params, decode_state, cfg, slots)
    weights_bytes = decode_read_bytes(params, {}, cfg, prefill_tokens)  # a long prefill touches every expert
    programs = [
        Program("rollout decode", facts["where"], lambda: decode.lower(params, decode_state, steps), other,
                other_note, model_flops=per_token * slots * steps, model_bytes=step_bytes * steps, group_chips=chips,
                role="rollout", one_step_lower=lambda: decode.lower(params, decode_state, 1), steps=steps),
        Program("rollout prefill", facts["where"], lambda: prefill_row.lower(params, row_shapes, *inputs),
                per_chip_bytes(decode_state) + other, "the engine's decode state" + (f" + {other_note}" if other
                                                                                   else ""),
                model_flops=per_token * prefill_tokens, model_bytes=weights_bytes, group_chips=chips,
                role="rollout")]
    facts.update(steps=steps, prefill_tokens=prefill_tokens, engine_bytes=engine_bytes,
                 persistent=engine_bytes + other)
    return programs, facts


def _rollout_layout(r, rollout_mesh) -> dict:
    """The rollout group as the engine lays it out: its replicas (`rollout.replica`; none: a single engine on the
    group's first device), the first replica's mesh, the slots of one, and the weights' dtype."""
    replica = dict(r.get("replica", {}) or {})
    devices = list(rollout_mesh.devices.flat)
    if replica:
        replicas = replica_meshes(devices, replica)
        mesh, count = replicas[0], len(replicas)
        slots = slots_per_replica(r.num_slots, count)
    else:
        replicas, mesh, count, slots = [], None, 1, r.num_slots
    where = (f"rollout: 1 of {count} replicas {replica} ({slots} slots)" if replica
             else f"rollout: one engine on 1 device ({slots} slots)")
    return dict(replicas=count, slots=slots, replica_meshes=replicas, mesh=mesh, device=devices[0], where=where,
                param_dtype=r.get("param_dtype", "") or None)


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


def _policy_state(cfg, mesh, optimizer):
    """(graphdef, params, frozen, tx, opt_state) of the policy on `mesh` with `optimizer`'s Adam state, abstract."""
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh, nnx.Param)
    tx = make_optimizer(optimizer)
    return graphdef, params, frozen, tx, abstract_opt_state(tx, params, mesh)


def sao_programs(config, cfg, meshes: dict, seq: int) -> Learner:
    """SAO's values + GAE and critic step on the critic's mesh, and its actor step on the actor's, over
    `sao.batch_prompts` rows of `seq` tokens."""
    s = config.sao
    rows = s.batch_prompts
    forward = forward_flops_per_token(cfg, seq) * (rows * seq)
    critic_mesh, actor_mesh = meshes["critic"], meshes["actor"]
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeCritic(cfg, rngs=nnx.Rngs(0)), critic_mesh,
                                              critic_trainable)
    tx = make_optimizer(s.critic_optimizer)
    opt_state = abstract_opt_state(tx, params, critic_mesh)
    keys = dict(tokens=jnp.int32, action_mask=jnp.float32, rollout_logprobs=jnp.float32, rewards=jnp.float32)
    values_fn = make_advantage_fn(graphdef, s, mesh=critic_mesh)
    critic_batch = batch_spec(critic_mesh, rows, seq, keys, s)
    critic_step = make_critic_step(graphdef, tx, s, state_shardings=(shardings(params), shardings(opt_state)))
    step_batch = batch_spec(critic_mesh, rows, seq, dict(keys, returns=jnp.float32, old_values=jnp.float32), s)
    a_graphdef, a_params, a_frozen, a_tx, a_opt = _policy_state(cfg, actor_mesh, s.actor_optimizer)
    actor_step = make_actor_step(a_graphdef, a_tx, s, state_shardings=(shardings(a_params), shardings(a_opt)))
    actor_batch = batch_spec(actor_mesh, rows, seq, dict(POLICY_KEYS, rewards=jnp.float32), s)
    programs = [
        Program("values + GAE", f"critic ({critic_mesh.size} chips)",
                lambda: values_fn.lower(params, frozen, critic_batch), per_chip_bytes(opt_state),
                "the critic's Adam moments", model_flops=forward, group_chips=critic_mesh.size, role="critic"),
        Program("critic step", f"critic ({critic_mesh.size} chips)",
                lambda: critic_step.lower(params, frozen, opt_state, step_batch), per_step=s.critic_epochs,
                model_flops=3 * forward, group_chips=critic_mesh.size, role="critic"),
        Program("actor step", f"actor ({actor_mesh.size} chips)",
                lambda: actor_step.lower(a_params, a_frozen, a_opt, actor_batch), model_flops=3 * forward,
                group_chips=actor_mesh.size, role="actor")]
    persistent = {"critic": per_chip_bytes((params, frozen, opt_state)),
                  "actor": per_chip_bytes((a_params, a_frozen, a_opt))}
    return Learner(programs, a_params, per_chip_bytes(a_opt), persistent)


def grpo_programs(config, cfg, meshes: dict, seq: int) -> Learner:
    """Pivot GRPO's reference log-probs (the frozen reference on the actor's devices) and its step (ppo_epochs x
    minibatches a step) over `grpo.batch_states x group_size` rows of `seq` tokens."""
    g = config.grpo
    rows = g.batch_states * g.group_size
    minibatch = rows // g.minibatches
    forward_token = forward_flops_per_token(cfg, seq)
    actor_mesh, ref_mesh = meshes["actor"], meshes["reference"]
    a_graphdef, a_params, a_frozen, tx, opt_state = _policy_state(cfg, actor_mesh, g.actor_optimizer)
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
    batch = batch_spec(actor_mesh, minibatch, seq, dict(POLICY_KEYS, ref_logprobs=jnp.float32), g)
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
    return Learner(programs, a_params, per_chip_bytes(opt_state), persistent)


def group_baseline_programs(config, cfg, meshes: dict, seq: int) -> Learner:
    """The group baseline's one actor update a step (SAO's actor step, no critic, no reference) over
    `group_baseline.batch_prompts x group_size` rows of `seq` tokens."""
    g = config.group_baseline
    rows = g.batch_prompts * g.group_size
    mesh = meshes["actor"]
    graphdef, params, frozen, tx, opt_state = _policy_state(cfg, mesh, g.actor_optimizer)
    step = make_actor_step(graphdef, tx, g, state_shardings=(shardings(params), shardings(opt_state)))
    batch = batch_spec(mesh, rows, seq, POLICY_KEYS, g)
    forward = forward_flops_per_token(cfg, seq) * rows * seq
    programs = [Program("actor step", f"actor ({mesh.size} chips)",
                        lambda: step.lower(params, frozen, opt_state, batch), model_flops=3 * forward,
                        group_chips=mesh.size, role="actor")]
    return Learner(programs, params, per_chip_bytes(opt_state), {"actor": per_chip_bytes((params, frozen, opt_state))})


def sft_programs(config, cfg, meshes: dict, seq: int) -> Learner:
    """The SFT step (Adam, micro-batched as configured) on the actor's mesh, `sft.batch_rows` rows of `seq`
    (= `sft.row_length`) tokens."""
    s = config.sft
    rows = s.batch_rows
    mesh = meshes["actor"]
    graphdef, params, frozen, tx, opt_state = _policy_state(cfg, mesh, s.optimizer)
    step = make_sft_step(graphdef, tx, s, state_shardings=(shardings(params), shardings(opt_state)))
    batch = batch_spec(mesh, rows, seq, dict(tokens=jnp.int32, segment_ids=jnp.int32, loss_mask=jnp.float32), s)
    forward = forward_flops_per_token(cfg, seq) * rows * seq
    programs = [Program("sft step", f"actor ({mesh.size} chips)",
                        lambda: step.lower(params, frozen, opt_state, batch), model_flops=3 * forward,
                        group_chips=mesh.size, role="actor")]
    return Learner(programs, params, per_chip_bytes(opt_state), {"actor": per_chip_bytes((params, frozen, opt_state))})


# each registered pipeline's learner programs: (config, model config, role meshes, tokens a row) -> Learner
LEARNERS = {"sao": sao_programs, "grpo": grpo_programs, "group_baseline": group_baseline_programs,
            "sft": sft_programs}


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
