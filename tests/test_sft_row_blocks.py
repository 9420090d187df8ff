"""Which SFT data shards a process reads (`row_blocks`, mercury_jax/train/sft_data.py), in one process with the
processes faked: the test's 8 CPU devices are dealt to processes by a table, and a process's addressable devices are
its own. A batch's rows split over (data, fsdp, expert) into S blocks; a process reads the blocks its devices hold
(a block repeated over tensor or sequence chips of two processes is read by both; a process with no device of the
mesh reads none). The expected blocks are worked out by hand from the mesh's device grid (make_mesh fills the axes
data, fsdp, sequence, expert, tensor in device order, the last fastest). tests/test_multihost_train.py runs SFT on
2 real processes."""
from __future__ import annotations

import types

import jax
import pytest
from jax.sharding import NamedSharding

from mercury_jax.parallel import make_mesh
from mercury_jax.train import sft_data
from mercury_jax.train.sft_data import row_blocks

SHAPE = (16, 32)  # [batch_rows, row_length]


def as_process(monkeypatch, process_of: list[int], me: int) -> None:
    """Make `row_blocks` see the devices of process `me` as its addressable ones, device i being process_of[i]'s."""
    owner = {d.id: process_of[i] for i, d in enumerate(jax.devices())}

    def sharding(mesh, spec):
        real = NamedSharding(mesh, spec)
        return types.SimpleNamespace(
            devices_indices_map=real.devices_indices_map,
            addressable_devices_indices_map=lambda shape: {d: index for d, index in real.devices_indices_map(shape)
                                                           .items() if owner[d.id] == me})
    monkeypatch.setattr(sft_data, "NamedSharding", sharding)


def devices(order: str = "forward") -> list:
    return list(jax.devices()) if order == "forward" else list(reversed(jax.devices()))


CASES = [
    # (mesh shape, device order, device -> process, {process: (S, its blocks)})
    pytest.param({"fsdp": 8}, "forward", [0, 0, 0, 0, 1, 1, 1, 1],
                 {0: (8, {0, 1, 2, 3}), 1: (8, {4, 5, 6, 7})}, id="fsdp 8 on 2 processes"),
    pytest.param({"fsdp": 4, "tensor": 2}, "forward", [0, 0, 1, 1, 2, 2, 3, 3],
                 {0: (4, {0}), 1: (4, {1}), 2: (4, {2}), 3: (4, {3})}, id="tensor pairs within a process"),
    pytest.param({"fsdp": 4, "tensor": 2}, "forward", [0, 1, 0, 1, 0, 1, 0, 1],
                 {0: (4, {0, 1, 2, 3}), 1: (4, {0, 1, 2, 3})}, id="tensor pairs across two processes"),
    pytest.param({"fsdp": 4, "sequence": 2}, "forward", [0, 0, 0, 0, 1, 1, 1, 1],
                 {0: (4, {0, 1}), 1: (4, {2, 3})}, id="rows repeated over sequence"),
    pytest.param({"data": 2, "fsdp": 2, "expert": 2}, "reversed", [0, 0, 1, 1, 2, 2, 3, 3],
                 {0: (8, {6, 7}), 1: (8, {4, 5}), 2: (8, {2, 3}), 3: (8, {0, 1})}, id="data fsdp expert, reversed"),
]


@pytest.mark.parametrize("shape, order, process_of, expected", CASES)
def test_each_process_reads_the_blocks_its_devices_hold(monkeypatch, shape, order, process_of, expected):
    """Planted bug: `sharding.addressable_devices_indices_map(shape)` -> `sharding.devices_indices_map(shape)` in
    row_blocks (every process reads every shard)."""
    mesh = make_mesh(shape, devices(order))
    for process, blocks in expected.items():
        as_process(monkeypatch, process_of, process)
        assert row_blocks(mesh, SHAPE) == blocks, process
    assert set().union(*(mine for _, mine in expected.values())) == set(range(next(iter(expected.values()))[0]))


def test_a_process_without_a_device_of_the_mesh_reads_no_shard(monkeypatch):
    """The consecutive layout's rollout host: the actor's mesh is devices 4-7 (processes 2, 3), process 0 holds 0-1.
    Planted bug: `block = shape[0] // len(starts)` -> `shape[0] // mesh.size` in row_blocks."""
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[4:])
    process_of = [0, 0, 1, 1, 2, 2, 3, 3]
    for process, blocks in {0: (2, set()), 1: (2, set()), 2: (2, {0}), 3: (2, {1})}.items():
        as_process(monkeypatch, process_of, process)
        assert row_blocks(mesh, SHAPE) == blocks, process


def test_off_a_mesh_there_is_one_shard():
    assert row_blocks(None, SHAPE) == (1, {0})
