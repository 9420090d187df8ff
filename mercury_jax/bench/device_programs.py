"""The two programs the device check times, built by the code the run executes: the SAO actor step
(`train/sao_learner.py:make_actor_step`, Adam and micro-batching included) and the rollout engine's decode chunk
(`rollout/sampler.py`, the program `Sampler.decode` runs), with real arrays on the default device (no mesh), and
the work a run of each does by hand count: tokens, model FLOPs, HBM bytes it must read."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.bench.device_setup import Shapes
from mercury_jax.bench.flops import forward_flops_per_token
from mercury_jax.bench.rooflines import decode_read_bytes
from mercury_jax.rollout.layout import rollout_weights
from mercury_jax.rollout.sampler import _compiled, empty_state
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.sao_learner import make_actor_step
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.config import Qwen35MoeConfig


@dataclasses.dataclass
class Program:
    """A jitted program with its inputs bound: `lower()` lowers it, `run(compiled)` runs it once (threading the
    state it donates into the next run) and returns its outputs; one run processes `tokens` tokens with
    `model_flops` FLOPs and must read `read_bytes` HBM bytes (0: not counted) over `steps` steps."""
    name: str
    shape: str
    lower: Callable[[], jax.stages.Lowered]
    run: Callable[[jax.stages.Compiled], object]
    tokens: int
    model_flops: float
    read_bytes: float = 0.0
    steps: int = 1


def init_model(cfg: Qwen35MoeConfig, seed: int) -> Qwen35MoeForCausalLM:
    """The model with fp32 weights drawn by one jitted init on the default device (an eager init would run op by
    op)."""
    def make():
        return Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(seed))
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make()))())


def actor_batch(vocab: int, shapes: Shapes, packed: bool, seed: int) -> dict:
    """One step's rows as the trainer hands them to the actor step, every row full: random tokens, every token an
    action with a random advantage, the rollout's log-probs those of a uniform draw; a packed batch (`pack_rows`)
    adds its segment ids (one trajectory filling each row)."""
    tokens_key, advantages_key = jax.random.split(jax.random.key(seed))
    B, T = shapes.rows, shapes.seq
    batch = {"tokens": jax.random.randint(tokens_key, (B, T), 0, vocab, jnp.int32),
             "action_mask": jnp.ones((B, T), jnp.float32),
             "rollout_logprobs": jnp.full((B, T), -math.log(vocab), jnp.float32),
             "advantages": jax.random.normal(advantages_key, (B, T), jnp.float32),
             "rewards": jnp.zeros((B, T), jnp.float32)}
    if packed:
        batch["segment_ids"] = jnp.ones((B, T), jnp.int32)
    return batch


def actor_program(model: Qwen35MoeForCausalLM, sao, shapes: Shapes, seed: int) -> Program:
    """One SAO actor step (`sao` the run's section, its micro-batches set to `shapes.micro_batches`) on the model's
    fp32 weights with fresh Adam moments. The step donates the weights: `model` is spent after the first run."""
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    section = sao.copy_and_resolve_references()
    section.actor_micro_batches = shapes.micro_batches
    tx = make_optimizer(section.actor_optimizer)
    step = make_actor_step(graphdef, tx, section)
    batch = actor_batch(model.config.vocab_size, shapes, bool(section.get("pack_rows")), seed)
    live = {"params": params, "opt_state": tx.init(params)}

    def run(compiled):
        live["params"], live["opt_state"], metrics = compiled(live["params"], frozen, live["opt_state"], batch)
        return metrics
    tokens = shapes.rows * shapes.seq
    return Program("actor step", f"{shapes.rows} x {shapes.seq:,} tokens, {shapes.micro_batches} micro-batch(es)",
                   lambda: step.lower(live["params"], frozen, live["opt_state"], batch), run, tokens,
                   3 * forward_flops_per_token(model.config, shapes.seq) * tokens)


def slots_in_flight(model: Qwen35MoeForCausalLM, shapes: Shapes, position: int, seed: int) -> dict:
    """The sampler state of `shapes.slots` slots each serving a request: its cache `position` tokens in (zero
    contents), a random last token, a budget of the whole cache, no stop ids."""
    state = empty_state(model.init_cache, shapes.slots, shapes.cache_length)
    S = shapes.slots
    cache = dict(state["cache"], positions=jnp.full((S,), position, jnp.int32))
    return dict(state, cache=cache, active=jnp.ones((S,), bool), limit=jnp.full((S,), shapes.cache_length, jnp.int32),
                last_token=jax.random.randint(jax.random.key(seed), (S,), 0, model.config.vocab_size, jnp.int32))


def decode_program(model: Qwen35MoeForCausalLM, shapes: Shapes, param_dtype, seed: int) -> Program:
    """The engine's decode chunk (`shapes.steps` steps for every slot, state donated) with the weights cast to the
    rollout's `param_dtype` as an engine casts them, every slot busy halfway into its cache."""
    graphdef, state = nnx.split(model)
    params = rollout_weights(state, None, param_dtype)
    position = shapes.cache_length // 2
    live = {"state": slots_in_flight(model, shapes, position, seed)}
    _, decode, _, _ = _compiled(graphdef, shapes.cache_length, None)

    def run(compiled):
        live["state"], out = compiled(params, live["state"])
        return out
    tokens = shapes.slots * shapes.steps
    read_bytes = decode_read_bytes(params, live["state"], model.config, shapes.slots) * shapes.steps
    return Program("rollout decode", f"{shapes.slots} slots x {shapes.cache_length:,}-token caches, "
                   f"{shapes.steps} steps a chunk", lambda: decode.lower(params, live["state"], shapes.steps), run,
                   tokens, forward_flops_per_token(model.config, 2 * position) * tokens, read_bytes, shapes.steps)
