"""The type and range of every numeric and boolean field of an experiment config, as one table.

`validate.py` checks a config against `FIELDS` before any work starts, so `sao.batch_prompts=0` or
`rollout.top_p=0` is refused in one line naming the field, the value and the valid range, instead of failing
minutes later somewhere else (or hanging, as `rollout.num_slots=0` did). A pattern's `*` matches any part of a
dotted path (`mesh.*.fsdp`); the first matching row applies. Ints are meant where ints are written (a bool is not
an int here); float fields accept ints; floats must be finite. `model.overrides` holds model-config fields: the
model config's own table checks them (models/qwen35_moe/config.py `FIELD_RANGES`).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import NamedTuple

import ml_collections

from mercury_jax.rl.aggregation import LOSS_AGG_MODES
from models.qwen35_moe.config import FieldRange

COUNT = FieldRange(int, 1)             # a count of at least one
COUNT0 = FieldRange(int, 0)            # a count that may be zero
SEED = FieldRange(int, 0)
FLAG = FieldRange(bool)
UNIT = FieldRange(float, 0, 1)         # a probability, a discount, a strength
POSITIVE = FieldRange(float, 0, low_open=True)
NONNEGATIVE = FieldRange(float, 0)


class Field(NamedTuple):
    pattern: str
    rule: FieldRange
    note: str = ""
    also: tuple = ()   # values allowed outside the range (a mesh axis of -1)


OPTIMIZER = (  # every `*optimizer` section (train/optim.py)
    Field("*optimizer.lr", POSITIVE, "the learning rate"),
    Field("*optimizer.warmup_steps", COUNT0, "0: no warm-up"),
    Field("*optimizer.b1", FieldRange(float, 0, 1, high_open=True), "Adam's first-moment decay"),
    Field("*optimizer.b2", FieldRange(float, 0, 1, high_open=True), "Adam's second-moment decay"),
    Field("*optimizer.eps", POSITIVE, "Adam's denominator floor"),
    Field("*optimizer.weight_decay", NONNEGATIVE),
    Field("*optimizer.grad_clip", NONNEGATIVE, "global-norm clip; 0: off"),
)

FIELDS: tuple[Field, ...] = (
    Field("seed", SEED),
    Field("world.train_seed", SEED), Field("world.eval_seed", SEED),
    Field("world.num_train_tasks", COUNT), Field("world.num_eval_tasks", COUNT),
    Field("world.tasks_per_world", COUNT),
    Field("tokenizer.vocab_size", COUNT0, "sentencepiece only; 0 for qwen35"),
    Field("train.max_skipped", COUNT0, "non-finite steps 'skip' may skip in a run"),
    Field("model.moe_ep_round_factor", POSITIVE, "rows an expert-parallel dispatch round receives, in units of the "
          "balanced load"),
    Field("*checkpoint.every", COUNT0, "0: only at the last step and on preemption"),
    Field("*checkpoint.keep", COUNT, "checkpoints kept"),
    Field("*checkpoint.async_save", FLAG),
    Field("devices.*", COUNT0, "devices of the group; all 0: every role shares the default device"),
    Field("mesh.*.*", COUNT, "the axis size; -1 takes the rest of the role's devices", also=(-1,)),
    Field("rollout.replica.*", COUNT, "one rollout replica's axis size"),
    # SFT (also the warm start of SAO and GRPO)
    Field("sft.enabled", FLAG),
    Field("sft.steps", COUNT0),
    Field("sft.batch_rows", COUNT),
    Field("sft.row_length", FieldRange(int, 2), "tokens a packed row holds; a next-token loss needs two"),
    Field("sft.micro_batches", COUNT),
    Field("sft.data_workers", COUNT0),
    Field("sft.packing_bins", COUNT),
    Field("sft.skip_bad_records", FLAG),
    Field("sft.log_every", COUNT),
    *OPTIMIZER,
    # SAO
    Field("sao.steps", COUNT0),
    Field("sao.batch_prompts", COUNT, "prompts a step, one rollout each"),
    Field("sao.critic_only_steps", COUNT0),
    Field("sao.critic_epochs", COUNT, "critic passes over each batch"),
    Field("sao.alpha", POSITIVE, "lambda = 1 - 1 / (alpha L)"),
    Field("sao.gamma", UNIT, "the discount"),
    Field("sao.lam_critic", UNIT, "the critic targets' GAE lambda"),
    Field("sao.eps_low", FieldRange(float, 0, 1, low_open=True, high_open=True), "the trust region's lower side"),
    Field("sao.eps_high", POSITIVE, "the trust region's upper side"),
    Field("sao.value_clip", NONNEGATIVE, "0: off"),
    Field("sao.max_staleness", COUNT0, "policy versions an async trajectory may lag"),
    Field("sao.actor_micro_batches", COUNT), Field("sao.critic_micro_batches", COUNT),
    Field("sao.pack_rows", FLAG), Field("sao.whiten_advantages", FLAG),
    Field("sao.eval_every", COUNT0, "0: evaluate only before the first and after the last step"),
    Field("sao.log_window", COUNT, "steps in the logged window means"),
    # rollout
    Field("rollout.num_slots", COUNT, "sequences decoded at once"),
    Field("rollout.temperature", NONNEGATIVE, "0: greedy"),
    Field("rollout.top_p", FieldRange(float, 0, 1, low_open=True), "1: no nucleus filter"),
    Field("rollout.max_tool_turns", COUNT0),
    Field("rollout.max_total_tokens", COUNT),
    Field("rollout.max_turn_tokens", COUNT),
    # the behaviour multiplier (envs/behaviour.py)
    Field("behaviour.*_strength", UNIT, "0 turns that factor off, 1 is the full penalty"),
    Field("behaviour.repetition_threshold", FieldRange(float, 0, 1, high_open=True)),
    Field("behaviour.ngram", COUNT), Field("behaviour.min_ngrams", COUNT), Field("behaviour.runaway_chars", COUNT),
    # pivot GRPO
    Field("grpo.steps", COUNT0),
    Field("grpo.batch_states", COUNT),
    Field("grpo.group_size", FieldRange(int, 2), "continuations per state; 1 makes every advantage 0"),
    Field("grpo.eps", FieldRange(float, 0, 1, low_open=True, high_open=True), "the clip's lower side"),
    Field("grpo.eps_high", POSITIVE, "the clip's upper side"),
    Field("grpo.kl_coef", NONNEGATIVE, "0 turns the KL off"),
    Field("grpo.ppo_epochs", COUNT), Field("grpo.minibatches", COUNT), Field("grpo.micro_batches", COUNT),
    Field("grpo.pack_rows", FLAG), Field("grpo.std_normalize", FLAG), Field("grpo.filter_zero_variance", FLAG),
    Field("grpo.pivot_tasks", COUNT), Field("grpo.pivot_task_seed", SEED),
    Field("grpo.log_window", COUNT, "steps in the logged window means"),
    Field("grpo.stop_rules.*", FieldRange(float), "the stop-verifier's reward for that outcome"),
    Field("oracle.over_search_prob", UNIT),
    Field("oracle.over_search_max", COUNT, "extra searches of an over-searching oracle: 1..over_search_max"),
)

# String fields with a fixed set of values, refused here rather than when the stage that reads them starts.
CHOICES = {"rollout.mode": ("sync", "async"), "tokenizer.kind": ("qwen35", "sentencepiece"),
           "sao.loss_agg": LOSS_AGG_MODES}
UNCHECKED = ("model.overrides.*",)  # checked by the model config's own table


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted path, value) of every leaf of `config`, in order."""
    found = []
    for name, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            found += leaves(value, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", value))
    return found


def rule_for(path: str) -> Field | None:
    """The first row of `FIELDS` whose pattern matches `path`."""
    return next((field for field in FIELDS if fnmatchcase(path, field.pattern)), None)


def field_problem(config: ml_collections.ConfigDict) -> str | None:
    """The first leaf of `config` outside its row of `FIELDS` (or `CHOICES`), as a message naming the field, the
    value and the valid range; None when every field fits."""
    for path, value in leaves(config):
        if path in CHOICES and value not in CHOICES[path]:
            return f"{path} is {value!r}; use one of {list(CHOICES[path])}"
        field = rule_for(path)
        if field is None or any(fnmatchcase(path, pattern) for pattern in UNCHECKED):
            continue
        if field.rule.admits(value) or (value in field.also and type(value) is type(field.also[0])):
            continue
        expected = "True or False" if field.rule.kind is bool else field.rule.describe()
        if field.also:
            expected += " (or " + ", ".join(map(str, field.also)) + ")"
        return f"{path} is {value!r}; expected {expected}" + (f": {field.note}" if field.note else "")
    return None
