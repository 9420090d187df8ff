"""Export with `save_hf` -> load in transformers -> same logits; and clear errors for bad checkpoints.

fp32 export: 1e-5 (same weights, fp32 compute on both sides). bf16 export: transformers on the bf16 file vs our
model on the same rounded weights agree to 1e-5; against the original fp32 model, logits move by the weight
rounding only. Documented bf16 tolerance, relative to the largest |logit|: median drift < 1% (bf16 keeps 8
mantissa bits, 2^-9 relative per weight, compounded over 4 layers; observed ~0.5%) and max drift < 15%, because
rounding can flip a near-tied top-k routing decision, which moves a token's output discretely (observed ~5%).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import hf_logits, hf_model, save_checkpoint
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models.qwen35_moe import config as C
from models.qwen35_moe.hf import CheckpointError, load_hf, save_hf

CFG = C.tiny(vocab_size=96, num_hidden_layers=4)


@nnx.jit
def _forward(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    path = save_checkpoint(hf_model(CFG, seed=3), tmp_path_factory.mktemp("src"), experts="fused", prefix="model.")
    return load_hf(path)


def _load_transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("experts", ["fused", "unfused"])
def test_fp32_export_loads_in_transformers_with_same_logits(ours, tmp_path, experts):
    path = save_hf(ours, tmp_path / "out", dtype=np.float32, experts=experts, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((path / f).exists() for f in files)
    listed = set()
    for f in files:
        with safe_open(path / f, "numpy") as handle:
            listed |= set(handle.keys())
    assert listed == set(index["weight_map"])
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in listed)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text"

    ids = np.random.RandomState(0).randint(0, 96, size=(2, 77))
    np.testing.assert_allclose(hf_logits(_load_transformers(path), ids), np.asarray(_forward(ours, ids)),
                               atol=1e-5, rtol=0)
    # and back into our model, bit for bit
    again = load_hf(path)
    for (pa, a), (pb, b) in zip(nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(again))):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))


def test_bf16_export_keeps_fp32_tensors_and_matches_within_bf16_tolerance(ours, tmp_path):
    path = save_hf(ours, tmp_path / "bf16")
    with safe_open(path / "model.safetensors", "numpy") as handle:
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    assert dtypes["model.language_model.layers.0.linear_attn.A_log"] == "F32"
    assert dtypes["model.language_model.layers.0.linear_attn.norm.weight"] == "F32"
    assert dtypes["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == "BF16"
    assert dtypes["lm_head.weight"] == "BF16"

    ids = np.random.RandomState(1).randint(0, 96, size=(2, 50))
    theirs = hf_logits(_load_transformers(path), ids)
    rounded = load_hf(path)
    np.testing.assert_allclose(theirs, np.asarray(_forward(rounded, ids)), atol=1e-5, rtol=0)
    exact = np.asarray(_forward(ours, ids))
    scale = np.abs(exact).max()
    drift = np.abs(theirs - exact)
    assert 0 < np.median(drift) / scale < 1e-2, np.median(drift) / scale
    assert drift.max() / scale < 0.15, drift.max() / scale

    rounded_all = save_hf(ours, tmp_path / "bf16_all", round_fp32_tensors=True)
    with safe_open(rounded_all / "model.safetensors", "numpy") as handle:
        assert handle.get_slice("model.language_model.layers.0.linear_attn.A_log").get_dtype() == "BF16"


# ------------------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def good_checkpoint(tmp_path):
    return save_checkpoint(hf_model(CFG, seed=4), tmp_path / "ckpt", experts="fused", prefix="model.")


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(good_checkpoint):
    _rewrite(good_checkpoint, lambda t: t.pop("model.layers.3.self_attn.q_proj.weight"))
    with pytest.raises(CheckpointError, match=r"no tensor model\.layers\.3\.self_attn\.q_proj\.weight "
                                              r"\(expected full_attention layer 3.*shape \(128, 64\)"):
        load_hf(good_checkpoint)


def test_wrong_shape_names_expected_and_found(good_checkpoint):
    def edit(t):
        t["model.layers.1.linear_attn.in_proj_z.weight"] = np.zeros((60, 64), np.float32)
    _rewrite(good_checkpoint, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.linear_attn\.in_proj_z\.weight has shape "
                                              r"\(60, 64\), expected \(64, 64\)"):
        load_hf(good_checkpoint)


def test_config_that_does_not_match_the_tensors(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    config["num_experts"] = 16
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    shape_error = r"tensor model\.layers\.0\.mlp\.\S+ has shape \(8, [0-9, ]+\), expected \(16, "
    with pytest.raises(CheckpointError, match=shape_error):
        load_hf(good_checkpoint)


def test_wrong_model_type_and_missing_rope_theta(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    (good_checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        load_hf(good_checkpoint)
    config.pop("rope_parameters", None)
    config.pop("rope_theta", None)
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no rope_theta"):
        load_hf(good_checkpoint)


def test_unexpected_tensors_are_listed(good_checkpoint):
    def edit(t):
        t["model.layers.0.mlp.mystery.weight"] = np.zeros((2,), np.float32)
    _rewrite(good_checkpoint, edit)
    with pytest.raises(CheckpointError, match=r"does not use: \['model\.layers\.0\.mlp\.mystery\.weight'\]"):
        load_hf(good_checkpoint)
    assert load_hf(good_checkpoint, strict=False) is not None


def test_missing_shard_file_and_empty_directory(good_checkpoint, tmp_path):
    (good_checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        load_hf(good_checkpoint)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(empty)
