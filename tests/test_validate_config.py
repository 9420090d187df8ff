"""`validate_config` refuses every out-of-range or wrong-typed numeric field of the released configs in one line
naming the field, the value and the range (the table in mercury_jax/config/ranges.py), before any work
starts; the released configs and their `:tiny` variants pass."""
from __future__ import annotations

import math
import re

import jax
import ml_collections
import pytest

from experiments import grpo, sao, sft
from mercury_jax.config.ranges import FIELDS, UNCHECKED, leaves, rule_for
from mercury_jax.config.validate import ConfigError, validate_config

EXPERIMENTS = {"sft": sft, "sao": sao, "grpo": grpo}
VARIANTS = [(name, variant) for name in EXPERIMENTS for variant in (None, "tiny")] + [("sft", "long"),
                                                                                      ("grpo", "long")]


@pytest.fixture
def pod(monkeypatch, tmp_path):
    """What the released configs expect of their machine: 128 TPU devices, an HF checkpoint at model.hf_path and
    the pivot dataset's directory (this test has 8 fake CPU devices and neither path)."""
    monkeypatch.setattr(jax, "device_count", lambda: 128)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")

    def config(name: str, variant: str | None) -> ml_collections.ConfigDict:
        c = EXPERIMENTS[name].get_config(variant)
        if c.model.hf_path:
            c.model.hf_path = str(tmp_path)
        if name == "grpo" and c.grpo.pivots_path:
            c.grpo.pivots_path = str(tmp_path / "pivots.jsonl")
        return c
    return config


def _numeric(config) -> list[tuple[str, object]]:
    return [(path, value) for path, value in leaves(config) if isinstance(value, int | float)
            and not path.startswith(tuple(p.rstrip("*") for p in UNCHECKED))]


def _with(config: ml_collections.ConfigDict, path: str, value) -> ml_collections.ConfigDict:
    """`config` with `path` set to `value`, whatever its type (a ConfigDict refuses a change of type)."""
    tree = config.to_dict()
    *parents, leaf = path.split(".")
    node = tree
    for key in parents:
        node = node[key]
    node[leaf] = value
    return ml_collections.ConfigDict(tree)


@pytest.mark.parametrize("name, variant", VARIANTS)
def test_the_released_configs_and_their_tiny_variants_validate(pod, name, variant):
    validate_config(pod(name, variant))


def test_every_numeric_field_has_a_rule_and_every_rule_a_field(pod):
    """A numeric field added to a config without a row in config/ranges.FIELDS fails here, and so does a row whose
    pattern matches nothing (a typo would leave its field unchecked)."""
    paths = {path for name, variant in VARIANTS for path, _ in _numeric(pod(name, variant))}
    assert sorted(path for path in paths if rule_for(path) is None) == []
    used = {rule_for(path).pattern for path in paths}
    assert [field.pattern for field in FIELDS if field.pattern not in used] == []


def _bad_values(field) -> list:
    """A wrong type, and the nearest values just outside the range on each bounded side."""
    rule = field.rule
    if rule.kind is bool:
        return ["yes", 1]
    bad = ["abc", True] + ([1.5] if rule.kind is int else [math.nan, math.inf])
    step = 1 if rule.kind is int else 1e-3
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - step)
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + step)
    return bad


def _cases():
    """(experiment, variant, path, bad value) for every numeric path of the released configs, each path taken from
    the first config that has it."""
    seen, cases = set(), []
    for name, variant in VARIANTS:
        for path, _ in _numeric(EXPERIMENTS[name].get_config(variant)):
            if path not in seen and rule_for(path):  # a path without a rule fails the coverage test above
                seen.add(path)
                cases += [(name, variant, path, bad) for bad in _bad_values(rule_for(path))]
    return cases


@pytest.mark.parametrize("name, variant, path, bad", _cases())
def test_each_bad_value_is_refused_naming_the_field(pod, name, variant, path, bad):
    config = _with(pod(name, variant), path, bad)
    with pytest.raises(ConfigError) as refused:
        validate_config(config)
    message = str(refused.value)
    assert message.startswith(f"{path} is {bad!r}; expected ") and "\n" not in message, message


# Every range bound of config/ranges.py FIELDS, written out by hand from what each field means (not read from the
# table): path -> (values that must be refused, values that must be accepted). The accepted values sit on the
# bound (a closed side) or just inside it (an open side); the refused ones on it (open) or just outside (closed).
# `test_every_bound_of_the_table_has_a_hand_written_case` checks that each bounded row of the table has one.
BOUND_CASES: dict[str, tuple[tuple, tuple]] = {
    "seed": ((-1,), (0,)),
    "world.train_seed": ((-1,), (0,)),
    "world.eval_seed": ((-1,), (0,)),
    "world.num_train_tasks": ((0,), (1,)),
    "world.num_eval_tasks": ((0,), (1,)),
    "world.tasks_per_world": ((0,), (1,)),
    "tokenizer.vocab_size": ((-1,), (0,)),
    "train.max_skipped": ((-1,), (0,)),
    "model.moe_ep_round_factor": ((0.0, -1.0), (1e-3,)),
    "checkpoint.every": ((-1,), (0,)),
    "sft.checkpoint.keep": ((0,), (1,)),
    "devices.rollout": ((-1,), (0,)),
    "mesh.actor.fsdp": ((0, -2), (1, -1)),
    "rollout.replica.tensor": ((0,), (1,)),
    "sft.steps": ((-1,), (0,)),
    "sft.batch_rows": ((0,), (1,)),
    "sft.row_length": ((1, 0), (2,)),
    "sft.micro_batches": ((0,), (1,)),
    "sft.data_workers": ((-1,), (0,)),
    "sft.packing_bins": ((0,), (1,)),
    "sft.log_every": ((0,), (1,)),
    "sft.optimizer.lr": ((0.0, -1e-3), (1e-6,)),
    "sft.optimizer.warmup_steps": ((-1,), (0,)),
    "sao.actor_optimizer.b1": ((-1e-3, 1.0), (0.0, 0.999)),
    "grpo.actor_optimizer.b2": ((-1e-3, 1.0), (0.0, 0.999)),
    "sao.critic_optimizer.eps": ((0.0, -1e-8), (1e-9,)),
    "sft.optimizer.weight_decay": ((-1e-3,), (0.0,)),
    "grpo.actor_optimizer.grad_clip": ((-1e-3,), (0.0,)),
    "sao.steps": ((-1,), (0,)),
    "sao.batch_prompts": ((0,), (1,)),
    "sao.critic_only_steps": ((-1,), (0,)),
    "sao.critic_epochs": ((0,), (1,)),
    "sao.alpha": ((0.0,), (1e-3,)),
    "sao.gamma": ((-1e-3, 1.001), (0.0, 1.0)),
    "sao.lam_critic": ((-1e-3, 1.001), (0.0, 1.0)),
    "sao.eps_low": ((0.0, 1.0), (1e-3, 0.999)),
    "sao.eps_high": ((0.0,), (1e-3,)),
    "sao.value_clip": ((-1e-3,), (0.0,)),
    "sao.max_staleness": ((-1,), (0,)),
    "sao.actor_micro_batches": ((0,), (1,)),
    "sao.critic_micro_batches": ((0,), (1,)),
    "sao.eval_every": ((-1,), (0,)),
    "sao.log_window": ((0,), (1,)),
    "rollout.num_slots": ((0,), (1,)),
    "rollout.temperature": ((-1e-3,), (0.0,)),
    "rollout.top_p": ((0.0, 1.001), (1e-3, 1.0)),
    "rollout.max_tool_turns": ((-1,), (0,)),
    "rollout.max_total_tokens": ((0,), (1,)),
    "rollout.max_turn_tokens": ((0,), (1,)),
    "behaviour.runaway_strength": ((-1e-3, 1.001), (0.0, 1.0)),
    "behaviour.repetition_threshold": ((-1e-3, 1.0), (0.0, 0.999)),
    "behaviour.ngram": ((0,), (1,)),
    "behaviour.min_ngrams": ((0,), (1,)),
    "behaviour.runaway_chars": ((0,), (1,)),
    "grpo.steps": ((-1,), (0,)),
    "grpo.batch_states": ((0,), (1,)),
    "grpo.group_size": ((1, 0), (2,)),
    "grpo.eps": ((0.0, 1.0), (1e-3, 0.999)),
    "grpo.eps_high": ((0.0,), (1e-3,)),
    "grpo.kl_coef": ((-1e-3,), (0.0,)),
    "grpo.ppo_epochs": ((0,), (1,)),
    "grpo.minibatches": ((0,), (1,)),
    "grpo.micro_batches": ((0,), (1,)),
    "grpo.pivot_tasks": ((0,), (1,)),
    "grpo.pivot_task_seed": ((-1,), (0,)),
    "grpo.log_window": ((0,), (1,)),
    "oracle.over_search_prob": ((-1e-3, 1.001), (0.0, 1.0)),
    "oracle.over_search_max": ((0,), (1,)),
}
# What an accepted edge value needs of the rest of the tiny config (rules between fields, not ranges).
EDGE_COMPANIONS = {("mesh.actor.fsdp", -1): {"mesh.actor.data": 1}}


def tiny_with(path: str, value) -> ml_collections.ConfigDict:
    """The `:tiny` config of the pipeline that reads `path` (sft, grpo or sao; else the first that has the field's
    section) with `path` set to `value`."""
    owner = "sft" if path.startswith("sft.") else "grpo" if path.startswith(("grpo.", "oracle.")) else "sao"
    name = next(name for name in (owner, "sao", "grpo", "sft") if _has_section(EXPERIMENTS[name], path))
    config = _with(EXPERIMENTS[name].get_config("tiny"), path, value)
    for other, other_value in EDGE_COMPANIONS.get((path, value), {}).items():
        config = _with(config, other, other_value)
    return config


def _has_section(experiment, path: str) -> bool:
    """Whether the `:tiny` config of `experiment` has the section that holds `path`."""
    node = experiment.get_config("tiny").to_dict()
    for key in path.split(".")[:-1]:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return isinstance(node, dict)


def _sides(field) -> list[tuple[str, float, bool]]:
    """(side, bound, open) of each bounded side of a table row."""
    rule = field.rule
    return [(side, bound, is_open) for side, bound, is_open in (("low", rule.low, rule.low_open),
                                                                  ("high", rule.high, rule.high_open))
            if bound is not None]


def test_every_bound_of_the_table_has_a_hand_written_case():
    """Each bounded side of each row of FIELDS is pinned by BOUND_CASES: on a closed side the bound is accepted and
    the nearest value past it refused (an int: 1 past; a float: within 0.01); on an open side the bound is refused
    and a value within 0.01 inside it accepted. A new bounded row without such a case fails here."""
    missing = []
    for field in FIELDS:
        cases = [BOUND_CASES[path] for path in BOUND_CASES if rule_for(path) == field]
        refused = [v for bad, _ in cases for v in bad]
        accepted = [v for _, good in cases for v in good]
        for side, bound, is_open in _sides(field):
            outward = -1 if side == "low" else 1
            near = 1 if field.rule.kind is int else 0.01
            if is_open:
                pinned = bound in refused and any(0 < (bound - v) * outward <= near for v in accepted)
            else:
                pinned = bound in accepted and any(0 < (v - bound) * outward <= near for v in refused)
            if not pinned:
                missing.append(f"{field.pattern} ({side} {bound})")
    assert missing == []
    assert all(rule_for(path) is not None for path in BOUND_CASES)


@pytest.mark.parametrize("path, bad", [(path, bad) for path, (refused, _) in BOUND_CASES.items() for bad in refused])
def test_each_hand_written_out_of_range_value_is_refused(path, bad):
    """Planted bug: `Field("grpo.group_size", FieldRange(int, 2), ...)` -> `FieldRange(int, 1)` in config/ranges.py
    (and any other bound moved outward)."""
    with pytest.raises(ConfigError) as refused:
        validate_config(tiny_with(path, bad))
    assert str(refused.value).startswith(f"{path} is {bad!r}; expected "), str(refused.value)


@pytest.mark.parametrize("path, good", [(path, good) for path, (_, accepted) in BOUND_CASES.items()
                                        for good in accepted])
def test_each_hand_written_edge_value_is_accepted(path, good):
    """Planted bug: `Field("sft.row_length", FieldRange(int, 2), ...)` -> `FieldRange(int, 3)` in config/ranges.py
    (and any other bound moved inward)."""
    validate_config(tiny_with(path, good))


@pytest.mark.parametrize("path, value, expected", [  # the values of issue #34 item 4, with the messages
    ("sao.batch_prompts", 0, "sao.batch_prompts is 0; expected a whole number >= 1: prompts a step, one rollout each"),
    ("sao.batch_prompts", -4, "sao.batch_prompts is -4; expected a whole number >= 1"),
    ("rollout.num_slots", 0, "rollout.num_slots is 0; expected a whole number >= 1: sequences decoded at once"),
    ("sao.alpha", 0.0, "sao.alpha is 0.0; expected a number > 0: lambda = 1 - 1 / (alpha L)"),
    ("rollout.top_p", 0.0, "rollout.top_p is 0.0; expected a number in (0, 1]: 1: no nucleus filter"),
    ("rollout.top_p", 1.5, "rollout.top_p is 1.5; expected a number in (0, 1]"),
    ("rollout.temperature", -0.5, "rollout.temperature is -0.5; expected a number >= 0: 0: greedy"),
    ("mesh.actor.fsdp", 0, "mesh.actor.fsdp is 0; expected a whole number >= 1 (or -1)"),
    ("sft.steps", 2.0, "sft.steps is 2.0; expected a whole number >= 0"),
    ("sao.pack_rows", 1, "sao.pack_rows is 1; expected True or False"),
])
def test_the_reported_values_are_refused_with_the_range(path, value, expected):
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        validate_config(_with(sao.get_config("tiny"), path, value))


@pytest.mark.parametrize("path, value", [
    ("rollout.temperature", 0.0),   # greedy (rollout/sampling.py)
    ("rollout.top_p", 1.0), ("sao.gamma", 0.0), ("sao.gamma", 1.0), ("sao.lam_critic", 0.0),
    ("sao.value_clip", 0.0), ("sao.max_staleness", 0), ("sao.eval_every", 0), ("checkpoint.every", 0),
    ("sao.actor_optimizer.grad_clip", 0.0), ("sao.critic_optimizer.lr", 1),  # an int where a float is meant
    ("mesh.actor.data", -1), ("rollout.max_tool_turns", 0), ("sao.steps", 0),
])
def test_edge_values_that_mean_something_are_accepted(path, value):
    config = _with(sao.get_config("tiny"), path, value)
    if path == "mesh.actor.data":
        config.mesh.actor.fsdp = 1
    validate_config(config)


def test_a_string_field_outside_its_choices_is_refused():
    with pytest.raises(ConfigError, match=r"^rollout.mode is 'asink'; use one of \['sync', 'async'\]"):
        validate_config(_with(sao.get_config("tiny"), "rollout.mode", "asink"))


@pytest.mark.parametrize("field, value, pattern", [
    ("hidden_size", -1, r"^model.overrides.hidden_size is -1; expected a whole number >= 1"),
    ("num_experts", "8", r"^model.overrides.num_experts is '8'; expected a whole number in \[1, 65536\]"),
    ("num_key_value_heads", 3, r"^model.preset 'tiny' with model.overrides .* is not a valid model: "
                               r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("num_experts_per_tok", 9, r"num_experts_per_tok 9 must be in 1..num_experts \(8\)"),
])
def test_the_tiny_models_overrides_are_checked_by_the_model_table(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_config(_with(sao.get_config("tiny"), f"model.overrides.{field}", value))


def test_an_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match=r"^model.preset is 'huge'; use one of \["):
        validate_config(_with(sft.get_config("tiny"), "model.preset", "huge"))


def test_an_sft_corpus_that_names_no_file_is_refused_before_any_work(tmp_path):
    c = sft.get_config("tiny")
    c.sft.data = str(tmp_path / "chats-*.jsonl")
    with pytest.raises(ConfigError, match=r"^sft.data '.*chats-\*.jsonl' names no file; give JSONL or ArrayRecord"):
        validate_config(c)
    (tmp_path / "chats-0.jsonl").write_text("{}\n")
    validate_config(c)


def test_a_sequence_axis_needs_rows_it_can_split(pod):
    """`mesh.<role>.sequence` = n cuts each row into 2n spans of >= 3 positions (models/qwen35_moe/row_split.py)."""
    config = pod("sft", "long")
    config.sft.row_length = 131_070
    with pytest.raises(ConfigError, match=r"mesh.actor.sequence = 8 splits each row into 16 spans, but "
                                          r"sft.row_length is 131070"):
        validate_config(config)
    config = pod("grpo", "long")
    config.devices.actor = 60
    for role in ("actor", "reference"):
        config.mesh[role].sequence, config.mesh[role].fsdp = 3, 20
    with pytest.raises(ConfigError, match=r"the learner's padding bucket is 2048: rows must be a multiple of 6"):
        validate_config(config)
    with pytest.raises(ValueError, match=r"use ':tiny' or nothing"):
        sao.get_config("long")
