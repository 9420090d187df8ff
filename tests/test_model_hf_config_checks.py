"""A hostile or broken `config.json` is refused by `load_hf` / `Qwen35MoeConfig.from_hf` with a `BadConfigValue`
naming the field, the value and what is expected, before any shape or name list is derived from it (no raw
TypeError / ZeroDivisionError, no billion-name list)."""
from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from flax import nnx

from models.qwen35_moe import config as C
from models.qwen35_moe.checkpoint_errors import BadConfigValue, CheckpointError
from models.qwen35_moe.hf import load_hf, save_hf
from models.qwen35_moe.model import Qwen35MoeForCausalLM

CFG = C.tiny(vocab_size=96, num_hidden_layers=4)  # 8 experts


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny checkpoint with unfused experts (`mlp.experts.E.*`: the layout whose name list grows with E)."""
    model = Qwen35MoeForCausalLM(CFG, rngs=nnx.Rngs(0))
    return save_hf(model, tmp_path_factory.mktemp("src") / "ckpt", experts="unfused", dtype="float32")


@pytest.fixture
def ckpt(source, tmp_path):
    return shutil.copytree(source, tmp_path / "ckpt")


def _set(path, **fields):
    """Set (or with None, drop) fields of the checkpoint's text config."""
    config = json.loads((path / "config.json").read_text())
    for name, value in fields.items():
        if value is None:
            config["text_config"].pop(name, None)
        else:
            config["text_config"][name] = value
    (path / "config.json").write_text(json.dumps(config))


# The findings of issue #34 item 5 first, then the rules between fields.
@pytest.mark.parametrize("fields, pattern", [
    (dict(hidden_size=-1), r"hidden_size is -1; expected a whole number >= 1"),
    (dict(head_dim=-4), r"head_dim is -4; expected a whole number >= 1"),
    (dict(vocab_size="abc"), r"vocab_size is 'abc'; expected a whole number >= 1"),
    (dict(num_key_value_heads=0), r"num_key_value_heads is 0; expected a whole number >= 1"),
    (dict(num_key_value_heads=3), r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok 9 must be in 1..num_experts \(8\)"),
    (dict(num_hidden_layers="4"), r"num_hidden_layers is '4'; expected a whole number in \[1, 4096\]"),
    (dict(layer_types=["linear_attention"] * 3), r"layer_types has 3 entries but num_hidden_layers is 4"),
    (dict(layer_types=None, full_attention_interval=0), r"full_attention_interval is 0; expected a whole number"),
    (dict(tie_word_embeddings="yes"), r"tie_word_embeddings is 'yes'; expected true or false"),
    (dict(eos_token_id=[1, -2]), r"eos_token_id is \[1, -2\]; expected a token id"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), r"rope_theta is 'abc'; expected a number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 2}),
     r"partial_rotary_factor is 2; expected a number in \(0, 1\]"),
])
def test_a_bad_config_value_is_named_before_anything_is_built(ckpt, fields, pattern):
    _set(ckpt, **fields)
    with pytest.raises(BadConfigValue, match=re.escape(str(ckpt / "config.json")) + ": .*" + pattern):
        load_hf(ckpt)


@pytest.mark.parametrize("num_experts, pattern", [
    (10**9, r"num_experts is 1000000000; expected a whole number in \[1, 65536\]"),  # the sanity bound
    (60_000, r"num_experts is 60000, but layer 0 of the checkpoint stores 8 unfused experts"),  # the index's count
    (9, r"num_experts is 9, but layer 0 of the checkpoint stores 8 unfused experts"),
])
def test_a_hostile_expert_count_fails_fast(ckpt, num_experts, pattern):
    """Before the check, 10**9 experts on an unfused checkpoint built 10.9 GB of tensor names in 40 s. Within the
    sanity bound the count is checked against the experts the shard index lists. 1 s is a loose bound for a check
    that reads only config.json and the index (it takes milliseconds)."""
    _set(ckpt, num_experts=num_experts)
    start = time.perf_counter()
    with pytest.raises(BadConfigValue, match=pattern):
        load_hf(ckpt)
    assert time.perf_counter() - start < 1.0


def test_bad_config_value_is_a_checkpoint_error_and_the_good_config_loads(ckpt):
    assert issubclass(BadConfigValue, CheckpointError) and issubclass(BadConfigValue, ValueError)
    assert load_hf(ckpt).config.num_experts == CFG.num_experts  # the fixture itself is sound


def _bad_values(rule: C.FieldRange) -> list:
    """A wrong type, and the nearest values just outside the range on each bounded side."""
    if rule.kind is bool:
        return [1, "true"]
    bad = ["abc", True] + ([1.5] if rule.kind is int else [float("nan"), float("inf")])
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - (1 if rule.kind is int else 1e-3))
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + 1)
    return bad


ROPE_FIELDS = ("rope_theta", "partial_rotary_factor", "mrope_interleaved")  # under rope_parameters in config.json
RUNTIME_FIELDS = ("scan_layers", "gdn_chunk_size", "moe_ep_round_factor")  # ours, never in config.json


@pytest.mark.parametrize("name, value", [(name, value) for name, rule in C.FIELD_RANGES.items()
                                         if name not in RUNTIME_FIELDS for value in _bad_values(rule)])
def test_every_hf_field_is_type_and_range_checked(name, value):
    text = CFG.to_hf_text()
    if name in ROPE_FIELDS:
        text["rope_parameters"][name] = value
    else:
        text[name] = value
        if name == "full_attention_interval":  # read only when layer_types is absent
            text.pop("layer_types")
    with pytest.raises(BadConfigValue, match=rf"^{name} is .*; expected"):
        C.Qwen35MoeConfig.from_hf(text)


@pytest.mark.parametrize("name, value", [(name, value) for name in RUNTIME_FIELDS
                                         for value in _bad_values(C.FIELD_RANGES[name])])
def test_every_runtime_field_is_type_and_range_checked(name, value):
    with pytest.raises(ValueError, match=rf"invalid Qwen35MoeConfig: {name} is .*; expected"):
        C.tiny(**{name: value})


def test_the_field_table_covers_every_numeric_field():
    """A numeric or boolean config field added without a range in FIELD_RANGES fails here (token ids, which may be
    null, mrope_section and layer_types have rules of their own; HF's full_attention_interval is read, not kept)."""
    fields = {f.name for f in C.Qwen35MoeConfig.__dataclass_fields__.values()
              if isinstance(f.default, int | float) and not f.name.endswith("token_id")}
    assert fields | {"full_attention_interval"} == set(C.FIELD_RANGES)


def test_released_presets_pass_the_table():
    for preset in ("qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"):
        assert C.Qwen35MoeConfig.from_hf(C.PRESETS[preset]().to_hf()) == C.PRESETS[preset]()
