"""Slot helpers of the sampler on a hand-built cache: the slot axis is 1 under cache["blocks"] (stacked over the
scanned blocks) and 0 elsewhere; taking and putting a row touches that slot only. Exact comparisons (copies)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.rollout.sampler import bucket_length, put_row, take_row


def _cache(num_slots: int, n_blocks: int = 3) -> dict:
    rng = np.random.RandomState(0)
    return {"positions": jnp.arange(num_slots, dtype=jnp.int32) + 10,
            "blocks": [{"k": jnp.asarray(rng.randn(n_blocks, num_slots, 5, 2), jnp.float32),
                        "state": jnp.asarray(rng.randn(n_blocks, num_slots, 2, 3, 3), jnp.float32)}],
            "tail": [{"conv": jnp.asarray(rng.randn(num_slots, 3, 2), jnp.float32)}]}


def test_take_row_picks_the_slot_on_the_right_axis():
    cache = _cache(4)
    row = take_row(cache, jnp.int32(2))
    assert row["positions"].tolist() == [12]
    np.testing.assert_array_equal(row["blocks"][0]["k"], cache["blocks"][0]["k"][:, 2:3])
    np.testing.assert_array_equal(row["blocks"][0]["state"], cache["blocks"][0]["state"][:, 2:3])
    np.testing.assert_array_equal(row["tail"][0]["conv"], cache["tail"][0]["conv"][2:3])


@pytest.mark.parametrize("slot", [0, 3])
def test_put_row_replaces_only_that_slot(slot):
    cache, other = _cache(4), _cache(4)
    row = take_row(jax_tree_negate(other), jnp.int32(1))
    new = put_row(cache, row, jnp.int32(slot))
    keep = np.array([s for s in range(4) if s != slot])
    assert new["positions"][slot] == -11 and new["positions"][keep].tolist() == cache["positions"][keep].tolist()
    for name in ("k", "state"):
        np.testing.assert_array_equal(new["blocks"][0][name][:, slot], row["blocks"][0][name][:, 0])
        np.testing.assert_array_equal(new["blocks"][0][name][:, keep], cache["blocks"][0][name][:, keep])
    np.testing.assert_array_equal(new["tail"][0]["conv"][slot], row["tail"][0]["conv"][0])
    np.testing.assert_array_equal(new["tail"][0]["conv"][keep], cache["tail"][0]["conv"][keep])


def jax_tree_negate(tree):
    return jax.tree.map(lambda a: -a, tree)


@pytest.mark.parametrize("length,max_length,expected", [(1, 100, 16), (16, 100, 16), (17, 100, 32), (33, 100, 64),
                                                        (65, 100, 100), (90, 100, 100), (20, 24, 24)])
def test_bucket_lengths_are_powers_of_two_capped_by_max_length(length, max_length, expected):
    assert bucket_length(length, max_length) == expected
