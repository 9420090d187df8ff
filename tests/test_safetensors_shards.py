"""The streaming shard writer against `safetensors.numpy.save_file`: the same files, byte for byte, for every dtype
the library knows, mixed in one shard, for scalars and empty tensors, for one shard and for several (with the index
HF expects)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.qwen35_moe.safetensors_shards import DTYPE_CODES, ShardedSafetensors

DTYPES = list(DTYPE_CODES)


def tensors(count: int, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """`count` tensors of every dtype in turn, varied shapes (a scalar and an empty one among them), names that
    sort differently from their order here."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        shape = [(), (0,), (3,), (2, 5), (4, 1, 3)][i % 5]
        values = np.asarray(rng.standard_normal(shape) * 50)
        array = np.asarray(values > 0) if dtype == np.dtype(np.bool_) else values.astype(dtype)
        out.append((f"layer.{(7 * i) % count}.w{i % 3}", array))
    return out


def reference(directory, items, limit) -> None:
    """What save_hf wrote before it streamed: shards filled in order (a tensor starts a new shard when the current
    one is non-empty and would pass `limit`), each written by save_file."""
    shards, current, size = [], {}, 0
    for name, array in items:
        if current and size + array.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for _, a in items)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("count,limit", [(0, 100), (1, 100), (40, 10**9), (40, 60), (40, 1)],
                         ids=["empty", "one", "one_shard", "several", "one_per_tensor"])
def test_files_equal_save_file(tmp_path, count, limit):
    items = tensors(count)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    with ShardedSafetensors(tmp_path / "ours", limit) as out:
        for name, array in items:
            out.add(name, array)
    reference(tmp_path / "theirs", items, limit)
    ours, theirs = files(tmp_path / "ours"), files(tmp_path / "theirs")
    assert list(ours) == list(theirs)
    assert ours == theirs
    if count:
        loaded = {}
        for name in ours:
            if name.endswith(".safetensors"):
                loaded.update(load_file(str(tmp_path / "ours" / name)))
        for name, array in items:
            np.testing.assert_array_equal(loaded[name], array)


def test_a_non_contiguous_view_is_written_in_c_order(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    with ShardedSafetensors(tmp_path, 10**6) as out:
        out.add("t", base.T)
        out.add("b", base[:, ::2].astype(ml_dtypes.bfloat16))
    loaded = load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(loaded["t"], base.T)
    np.testing.assert_array_equal(loaded["b"], base[:, ::2].astype(ml_dtypes.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no spool left


def test_refuses_a_repeated_name_and_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="already written"), ShardedSafetensors(tmp_path, 100) as out:
        out.add("a", np.zeros(2, np.float32))
        out.add("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="no dtype for complex64"), ShardedSafetensors(tmp_path, 100) as out:
        out.add("c", np.zeros(2, np.complex64))
