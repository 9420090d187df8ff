"""`load_hf` on damaged or ambiguous checkpoints: one named `CheckpointError` per defect, naming the file or tensor
and the fix; and the layouts that must keep loading (HF-cache symlinks, float64 weights, repeated loads)."""
from __future__ import annotations

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_model, save_checkpoint
from safetensors.numpy import load_file, save_file

from models.qwen35_moe import config as C
from models.qwen35_moe.checkpoint_errors import (
    CheckpointDtypeError,
    CheckpointError,
    CorruptShardError,
    DuplicateTensorError,
    MissingShardError,
    NonFiniteWeightError,
    ShardIndexError,
    ShardPathError,
    SymlinkLoopError,
)
from models.qwen35_moe.hf import load_hf

CFG = C.tiny(vocab_size=96, num_hidden_layers=4)
INDEX = "model.safetensors.index.json"
NORM = "model.layers.0.input_layernorm.weight"
QKV = "model.layers.2.linear_attn.in_proj_qkv.weight"  # read as three row slices (q | k | v)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_checkpoint(hf_model(CFG, seed=5), tmp_path_factory.mktemp("src") / "ckpt", experts="fused",
                           prefix="model.")


@pytest.fixture
def ckpt(source, tmp_path):
    """A fresh single-file copy of the tiny checkpoint."""
    return shutil.copytree(source, tmp_path / "ckpt")


def _edit(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _shard(path) -> dict[str, str]:
    """Split model.safetensors into two shards with an index; returns the weight map."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in files.items() for n in part}
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _flat(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


# ------------------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("stored, code", [(np.int32, "I32"), (np.bool_, "BOOL")])
def test_an_integer_or_bool_weight_is_refused_not_cast(ckpt, stored, code):
    _edit(ckpt, lambda t: t.__setitem__(NORM, np.ones(64, stored)))
    with pytest.raises(CheckpointDtypeError, match=rf"tensor {NORM} in \S+model\.safetensors is stored as {code}, "
                                                   r"not a float dtype .*dequantized first"):
        load_hf(ckpt)


def test_a_float64_weight_still_loads(ckpt, source):
    _edit(ckpt, lambda t: t.__setitem__(NORM, t[NORM].astype(np.float64)))
    assert _flat(load_hf(ckpt)).keys() == _flat(load_hf(source)).keys()


# ---------------------------------------------------------------------------------------------- duplicates
def _second_file_copy(path):
    save_file({NORM: np.zeros(64, np.float32)}, str(path / "stray.safetensors"))


def _index_lists_twice(path):
    weight_map = _shard(path)
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[NORM])
    text = json.dumps({"metadata": {}, "weight_map": weight_map})
    # JSON allows a repeated key; json.loads would silently keep the last one
    (path / INDEX).write_text(text[:-2] + f', "{NORM}": "{other}"' + "}}")


def _shard_holds_a_second_copy(path):
    weight_map = _shard(path)
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[NORM])
    tensors = load_file(str(path / other))
    save_file({**tensors, NORM: np.zeros(64, np.float32)}, str(path / other), metadata={"format": "pt"})


@pytest.mark.parametrize("make, pattern", [
    (_second_file_copy, rf"tensor {NORM} is stored in both \S+model\.safetensors and \S+stray\.safetensors"),
    (_index_lists_twice, rf"lists tensor {NORM} twice, in model-0000\d-of-00002\.safetensors and in model-0000\d"),
    (_shard_holds_a_second_copy, rf"tensor {NORM} is stored in \S+model-0000\d-of-00002\.safetensors and in \S+"
                                 rf"model-0000\d-of-00002\.safetensors \(where {INDEX} points\)"),
], ids=["two_files", "index_twice", "shard_and_index"])
def test_a_tensor_in_two_files_is_ambiguous_not_last_wins(ckpt, make, pattern):
    make(ckpt)
    with pytest.raises(DuplicateTensorError, match=pattern + ".*which copy to load is unknown"):
        load_hf(ckpt)


def test_index_and_shards_that_disagree(ckpt):
    weight_map = _shard(ckpt)
    held_by, other = weight_map[NORM], next(f for f in sorted(set(weight_map.values())) if f != weight_map[NORM])
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {**weight_map, NORM: other}}))
    with pytest.raises(ShardIndexError, match=rf"maps tensor {NORM} to {other}, but it is stored in {held_by}; "
                                              r"regenerate the index"):
        load_hf(ckpt)
    del weight_map[NORM]
    (ckpt / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ShardIndexError, match=rf"holds tensor {NORM}, which \S+ does not list; regenerate"):
        load_hf(ckpt)
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {**weight_map, NORM: held_by, "model.ghost": held_by}}))
    with pytest.raises(ShardIndexError, match=rf"maps \['model\.ghost'\] to \S+{held_by}, which does not hold them"):
        load_hf(ckpt)
    (ckpt / INDEX).write_text("{not json")
    with pytest.raises(ShardIndexError, match=rf"{INDEX} is not valid JSON"):
        load_hf(ckpt)


# ------------------------------------------------------------------------------------------- shard paths
@pytest.mark.parametrize("where", ["parent", "middle", "absolute"])
def test_an_index_path_outside_the_directory_is_refused(ckpt, tmp_path, where):
    """`../x`, `sub/../../x` (a `..` after a real subdirectory: a check of the first component alone lets it
    through) and an absolute path all name a readable shard outside the checkpoint."""
    weight_map = _shard(ckpt)
    first = weight_map[NORM]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt / first, outside / first)  # a readable shard there: refused for its path, not for missing
    (ckpt / "sub").mkdir()  # so that sub/../../outside/<shard> resolves to that readable shard
    escaped = {"parent": f"../outside/{first}", "middle": f"sub/../../outside/{first}",
               "absolute": str(outside / first)}[where]
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {n: escaped if f == first else f
                                                          for n, f in weight_map.items()}}))
    pattern = rf"maps tensor \S+ to '{re.escape(escaped)}', a path outside .*fix the index"
    with pytest.raises(ShardPathError, match=pattern):
        load_hf(ckpt)


def test_hf_cache_style_shard_links_into_a_blob_store_still_load(ckpt, source, tmp_path):
    """The hub cache keeps `snapshots/<rev>/<file>` as symlinks to `blobs/<hash>`: outside the directory, allowed."""
    _shard(ckpt)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(ckpt.glob("*.safetensors")):
        shutil.move(shard, blobs / shard.name)
        shard.symlink_to(os.path.relpath(blobs / shard.name, ckpt))
    loaded, reference = _flat(load_hf(ckpt)), _flat(load_hf(source))
    assert all(np.array_equal(loaded[k], reference[k]) for k in reference)


# ------------------------------------------------------------------------------------------- corrupt files
def _truncate_shard(path):
    _shard(path)
    data = (path / "model-00002-of-00002.safetensors").read_bytes()
    (path / "model-00002-of-00002.safetensors").write_bytes(data[: len(data) // 2])
    return "model-00002-of-00002.safetensors", r"truncated or damaged: re-download or re-export"


def _garbage_single_file(path):
    (path / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    return "model.safetensors", r"truncated or damaged: re-download or re-export"


def _broken_config(path):
    (path / "config.json").write_text('{"model_type": "qwen3_5_moe_text",')
    return "config.json", r"is not valid JSON .*re-download it or re-export"


@pytest.mark.parametrize("damage", [_truncate_shard, _garbage_single_file, _broken_config])
def test_a_corrupt_file_is_named(ckpt, damage):
    name, fix = damage(ckpt)
    with pytest.raises(CorruptShardError, match=rf"{re.escape(str(ckpt / name))}\b.*{fix}"):
        load_hf(ckpt)


# ------------------------------------------------------------------------------------------------ symlinks
def test_a_symlink_loop_is_reported_as_a_loop_not_as_missing(ckpt, tmp_path):
    _shard(ckpt)
    shard = ckpt / "model-00001-of-00002.safetensors"
    shard.unlink()
    (ckpt / "loop.safetensors").symlink_to(shard.name)
    shard.symlink_to("loop.safetensors")
    at = re.escape(str(shard))
    with pytest.raises(SymlinkLoopError, match=rf"{at} \(a shard listed in {INDEX}\) is a symlink loop "
                                               rf"\({at} -> \S+loop\.safetensors -> {at} -> .*point the link"):
        load_hf(ckpt)
    looping_dir = tmp_path / "looping"
    looping_dir.symlink_to(looping_dir)
    with pytest.raises(SymlinkLoopError, match=r"looping/config\.json \(the model config\) is a symlink loop"):
        load_hf(looping_dir)


def test_a_dangling_shard_link_names_its_target(ckpt):
    _shard(ckpt)
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to("../blobs/abc123")
    pattern = rf"{re.escape(str(shard))} .* is a symlink to \.\./blobs/abc123, which does not exist; re-download"
    with pytest.raises(MissingShardError, match=pattern):
        load_hf(ckpt)


# ---------------------------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("name, where, bad, counts, ours", [
    # in the v rows of the fused q|k|v weight: only the third of its slice reads sees it
    (QKV, (100, 0), np.nan, "1 NaN and 0 inf", "model/blocks/layers/2/mixer/v_proj"),
    ("lm_head.weight", (slice(5, 7), slice(None)), np.inf, "0 NaN and 128 inf", "lm_head"),
])
def test_a_nonfinite_weight_names_the_tensor(ckpt, name, where, bad, counts, ours):
    _edit(ckpt, lambda t: t[name].__setitem__(where, bad))
    with pytest.raises(NonFiniteWeightError, match=rf"tensor {name} in \S+model\.safetensors holds {counts} values "
                                                   r"\(of \d+\).*allow_nonfinite=True"):
        load_hf(ckpt)
    assert not np.isfinite(_flat(load_hf(ckpt, allow_nonfinite=True))[ours]).all()


def test_a_cast_that_overflows_is_named(ckpt):
    _edit(ckpt, lambda t: t[NORM].__setitem__(3, 1e6))  # finite in fp32, inf in float16 (max 65504)
    with pytest.raises(NonFiniteWeightError, match=rf"our model\.blocks\.layers\.0\.input_norm\.weight overflows "
                                                   rf"float16 when cast \(its checkpoint tensors \['{NORM}'\] are "
                                                   r"finite\); load with dtype=jnp\.float32"):
        load_hf(ckpt, dtype=jnp.float16)
    assert load_hf(ckpt, dtype=jnp.float32) is not None


# ------------------------------------------------------------------------------------------ repeated loads
def test_models_loaded_one_after_another_keep_their_own_weights(ckpt, source):
    """`load_hf` reuses one traced abstract model per config; each load must still get fresh variables."""
    _edit(ckpt, lambda t: t.__setitem__(NORM, t[NORM] + 1.0))
    first, second = load_hf(source), load_hf(ckpt)
    key = "model/blocks/layers/0/input_norm/weight"
    np.testing.assert_array_equal(_flat(second)[key][0], _flat(first)[key][0] + 1.0)
    assert isinstance(CheckpointDtypeError("x"), CheckpointError) and isinstance(CheckpointError("x"), ValueError)
