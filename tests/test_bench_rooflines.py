"""The benches' rooflines and byte counts (`bench/rooflines.py`) on made-up costs, memory figures and sharded
shapes, computed by hand."""
from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.bench import rooflines
from mercury_jax.parallel import make_mesh


def test_the_largest_known_bound_wins():
    assert rooflines.roofline({"FLOPs": 2.0, "HBM": 3.0, "counted": math.nan}) == (3.0, "HBM")
    assert rooflines.roofline({"FLOPs": 2.0, "HBM": 2.0}) == (2.0, "FLOPs")  # a tie: the first named
    with pytest.raises(ValueError):
        rooflines.roofline({"counted": math.nan})


class Compiled:
    """A stand-in for a compiled program: XLA's cost analysis (a list of one dict, as some backends return it)."""

    def __init__(self, cost):
        self.cost = cost

    def cost_analysis(self):
        return self.cost


def test_xla_cost_and_its_v5p_roofline():
    compiled = Compiled([{"flops": 459e12, "bytes accessed": 2 * 2765e9}])
    assert rooflines.xla_cost(compiled) == (459e12, 2 * 2765e9)
    # 1 s of v5p's bf16 peak against 2 s of its HBM bandwidth
    assert rooflines.cost_and_roofline(compiled) == (459e12, 2 * 2765e9, 2.0, "HBM")
    assert rooflines.cost_and_roofline(Compiled({"flops": 3 * 459e12}))[2:] == (3.0, "FLOPs")
    flops, nbytes = rooflines.xla_cost(Compiled(None))
    assert math.isnan(flops) and math.isnan(nbytes)


def test_program_bytes_less_the_aliased_outputs():
    memory = types.SimpleNamespace(argument_size_in_bytes=100, output_size_in_bytes=40, temp_size_in_bytes=7,
                                   alias_size_in_bytes=30)
    assert rooflines.program_bytes(memory) == 100 + 40 + 7 - 30


def test_per_chip_bytes_counts_one_shard():
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    split = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    whole = jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    assert rooflines.per_chip_bytes([split, whole]) == 2 * 6 * 4 + 3 * 2


def test_decode_read_bytes_by_hand():
    """Dense weights whole, the embedding table not at all, the routed experts' expected share: 2 slots of top-2
    over 8 experts hit 1 - (6/8)^2 = 7/16 of them; the decode state whole."""
    cfg = types.SimpleNamespace(num_experts=8, num_experts_per_tok=2)
    params = {"embed": jax.ShapeDtypeStruct((512, 64), jnp.float32),
              "layer": {"q_proj": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
                        "expert_up": jax.ShapeDtypeStruct((8, 64, 32), jnp.bfloat16)}}
    state = {"k": jax.ShapeDtypeStruct((2, 100), jnp.float32)}
    expected = 64 * 64 * 2 + 7 / 16 * (8 * 64 * 32 * 2) + 2 * 100 * 4
    assert rooflines.decode_read_bytes(params, state, cfg, slots=2) == pytest.approx(expected)
