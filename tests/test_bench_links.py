"""The link table and the collective cost models (`bench/links.py`) by hand, and the collective traffic they price as
`bench/hlo_bytes.py` reads it from optimised HLO text (groups in their three spellings, loops by their trip counts,
async pairs counted once with the groups of their start)."""
from __future__ import annotations

import itertools
import types

import pytest

from mercury_jax.bench import hlo_bytes, links
from mercury_jax.bench.hlo_bytes import Traffic
from mercury_jax.bench.rooflines import V5P_ICI_BYTES_PER_S

GB = 1e9


def torus(x: int, y: int, z: int) -> list[tuple]:
    """The coordinates of a v5p slice's chips in device-id order (x fastest, as libtpu numbers them)."""
    return [(i, j, k) for k, j, i in itertools.product(range(z), range(y), range(x))]


def test_the_table_matches_the_published_per_chip_figures():
    v5p, v5e, v6e = (links.INTERCONNECTS[g] for g in ("v5p", "v5e", "v6e"))
    # one way, all links: v5p 1,200 GB/s both ways (600 one way, rooflines' figure), v5e 400, v6e 800
    assert v5p.chip_bytes_per_s == V5P_ICI_BYTES_PER_S == 600 * GB
    assert v5e.chip_bytes_per_s == 200 * GB and v6e.chip_bytes_per_s == 400 * GB
    for name in ("h100-sxm", "h200-sxm", "h200-nvl"):  # 900 GB/s both ways
        assert links.INTERCONNECTS[name].chip_bytes_per_s == 450 * GB
    assert links.INTERCONNECTS["h100-nvl"].chip_bytes_per_s == 300 * GB  # the 600 GB/s bridge


@pytest.mark.parametrize("kind, name", [("TPU v5", "v5p"), ("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"),
                                        ("NVIDIA H200", "h200-sxm"), ("NVIDIA H200 NVL", "h200-nvl"),
                                        ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-nvl")])
def test_chips_find_their_links_by_device_kind(kind, name):
    assert links.chip_interconnect(kind) is links.INTERCONNECTS[name]


def test_cpu_has_no_links():
    assert links.chip_interconnect("cpu") is None
    assert links.describe_chip_links("cpu") == "links unknown ('cpu' not in links.DEVICE_KINDS)"
    assert links.describe_chip_links("NVIDIA H200").startswith("NVIDIA H200 SXM NVLink 450 GB/s one way")


def test_wraparound_by_slice_shape():
    assert links.slice_fabric("v5p", torus(4, 4, 8)).wraps == (True, True, True)  # one cube or more: a 3D torus
    assert links.slice_fabric("v5p", torus(2, 4, 4)).wraps == (False, False, False)
    assert links.slice_fabric("v5e", [(i, j) for j in range(16) for i in range(8)]).wraps == (False, True)
    assert links.slice_fabric("v5p").shape == ()  # no coordinates: placement unknown
    with pytest.raises(ValueError, match="'v4'"):
        links.slice_fabric("v4")


def test_a_topology_by_name_and_its_devices():
    assert links.topology_fabric("cpu", []).shape == ()  # CPU: v5p's links, no places
    chips = [types.SimpleNamespace(coords=c) for c in torus(4, 4, 8)]
    fabric = links.topology_fabric("v5p:4x4x8", chips)
    assert fabric.interconnect is links.INTERCONNECTS["v5p"] and fabric.shape == (4, 4, 8) and all(fabric.wraps)


def test_a_group_is_priced_on_the_axes_it_spans():
    fabric = links.slice_fabric("v5p", torus(4, 4, 8))
    coords = torus(4, 4, 8)
    line = links.group_placement(coords[:4], fabric)  # the whole x axis, which wraps: a bidirectional ring
    assert line.chips == 4 and line.axes == ((4, 200 * GB),)
    plane = links.group_placement(coords[:16], fabric)  # x and y whole
    assert plane.ring_bytes_per_s == 400 * GB
    pair = links.group_placement([coords[0], coords[16]], fabric)  # 2 of z's 8: a line, no wraparound
    assert pair.axes == ((2, 100 * GB),)
    unknown = links.group_placement([None] * 8, links.slice_fabric("v5p"))
    assert unknown.axes == ((8, 100 * GB),)


def test_ring_models_by_hand():
    ring = links.Placement(4, ((4, 200 * GB),))
    # all-reduce 2 (n-1)/n B / R, all-gather (n-1)/n B / R, reduce-scatter (n-1) B / R (B its 1/n result)
    assert links.collective_seconds("all-reduce", 1e9, ring) == pytest.approx(2 * 3 / 4 * 1e9 / 200e9)
    assert links.collective_seconds("all-gather", 1e9, ring) == pytest.approx(3 / 4 * 1e9 / 200e9)
    assert links.collective_seconds("reduce-scatter", 0.25e9, ring) == pytest.approx(3 / 4 * 1e9 / 200e9)
    assert links.collective_seconds("all-reduce", 1e9, links.Placement(1, ())) == 0.0


def test_all_to_all_by_the_bisection():
    # 8 chips on a wrapping axis: n B / 4 cross the cut, over 2 links each way: 8 x 1 GB / (4 x 200 GB/s)
    assert links.collective_seconds("all-to-all", 1e9, links.Placement(8, ((8, 200 * GB),))) == pytest.approx(0.01)
    # 4 x 8 box: the cut across the longer axis (8, no wraparound) limits
    box = links.Placement(32, ((4, 200 * GB), (8, 100 * GB)))
    assert links.collective_seconds("ragged-all-to-all", 1e9, box) == pytest.approx(8e9 / 400e9)


def test_switch_models_by_hand():
    fabric = links.Fabric(links.INTERCONNECTS["h100-sxm"])
    group = links.group_placement([None] * 8, fabric)
    assert group.switch and group.ring_bytes_per_s == 450 * GB
    assert links.collective_seconds("all-reduce", 9e9, group) == pytest.approx(2 * 7 / 8 * 9e9 / 450e9)
    assert links.collective_seconds("all-to-all", 8e9, group) == pytest.approx(7e9 / 450e9)
    assert links.permute_seconds(4.5e9, [(None, None)], fabric) == pytest.approx(0.01)


def test_permutes_by_the_busiest_link():
    fabric = links.slice_fabric("v5p", torus(4, 4, 4))
    line = [(i, 0, 0) for i in range(4)]
    shift = [(line[i], line[(i + 1) % 4]) for i in range(4)]  # a ring shift over the wraparound: 1 a link
    assert links.link_load(shift, fabric) == 1
    assert links.permute_seconds(1e9, shift, fabric) == pytest.approx(1e9 / 100e9)
    by_two = [(line[i], line[(i + 2) % 4]) for i in range(4)]  # 2 hops each, every link carries 2
    assert links.link_load(by_two, fabric) == 2
    small = links.slice_fabric("v5p", torus(2, 2, 2))  # no wraparound; opposite ways use their own links
    assert links.link_load([((0, 0, 0), (1, 1, 1)), ((1, 0, 0), (0, 1, 1))], small) == 1
    assert links.permute_seconds(1e9, [(None, None)], links.slice_fabric("v5p")) == pytest.approx(0.01)
    assert links.permute_seconds(1e9, [((0, 0, 0), (0, 0, 0))], fabric) == 0.0


def test_price_traffic_splits_async_from_sync():
    fabric = links.slice_fabric("v5p", torus(4, 4, 4))
    coords = torus(4, 4, 4)
    traffic = [Traffic("all-reduce", "[16,4]<=[64]", False, 3, int(3e9)),           # 16 x-lines of 4
               Traffic("all-gather", "{{0,16},{1,17}}", True, 1, int(1e9)),         # pairs along z, no wrap
               Traffic("collective-permute", "{{0,1},{1,2},{2,3},{3,0}}", True, 2, int(2e9))]
    priced = links.price_traffic(traffic, coords, fabric)
    all_reduce = 2 * 3 / 4 * 3e9 / 200e9
    all_gather = 1 / 2 * 1e9 / 100e9
    permute = 2e9 / 100e9
    assert priced.seconds == pytest.approx({"all-reduce": all_reduce, "all-gather": all_gather,
                                            "collective-permute": permute})
    assert priced.sync_s == pytest.approx(all_reduce) and priced.async_s == pytest.approx(all_gather + permute)
    assert priced.total_s == pytest.approx(all_reduce + all_gather + permute)


def test_fsdp_lower_bound_by_hand():
    group = links.Placement(32, ((4, 200 * GB), (4, 200 * GB), (2, 100 * GB)))  # a 4 x 4 x 2 box of v5p
    gather = 31 / 32 * 1e9 * 2 / 500e9
    scatter = 31 * (1e9 * 4 / 32) / 500e9
    assert links.fsdp_step_seconds(10 ** 9, 2, 4, group, training=False) == pytest.approx(gather)
    assert links.fsdp_step_seconds(10 ** 9, 2, 4, group, training=True) == pytest.approx(gather + scatter)


@pytest.mark.parametrize("text, groups", [
    ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("", [[0, 1, 2, 3]]),
    ("[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("mesh['a'=2,'b'=2] {'b'}", [[0, 1], [2, 3]]),
    ("mesh['a'=2,'b'=2] {'a'}", [[0, 2], [1, 3]]),
    ("mesh['a'=2,'b'=4] {'b':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", [[3, 2], [1, 0]]),
])
def test_replica_groups_in_each_spelling(text, groups):
    devices = max(max(g) for g in groups) + 1
    assert hlo_bytes.replica_groups(text, devices) == groups


def test_an_unknown_spelling_is_named():
    with pytest.raises(ValueError, match="not in a spelling"):
        hlo_bytes.replica_groups("[3,3]<=[8]", 8)


MODULE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %ar = f32[8] all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ags = (f32[8], f32[32]) all-gather-start(%ar), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[32] all-gather-done(%ags)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]) tuple(%next, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %three), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[8]) tuple(%zero, %a)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %cp = f32[8] collective-permute(%a), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""


def test_collective_traffic_by_hand():
    found = {(t.kind, t.is_async): t for t in hlo_bytes.collective_traffic(MODULE)}
    assert set(found) == {("all-reduce", False), ("all-gather", True), ("collective-permute", False)}
    all_reduce, all_gather = found[("all-reduce", False)], found[("all-gather", True)]
    permute = found[("collective-permute", False)]
    assert (all_reduce.ops, all_reduce.bytes, all_reduce.groups) == (3, 3 * 32, "[2,4]<=[8]")  # 3 trips
    assert (all_gather.ops, all_gather.bytes) == (3, 3 * 128)  # at its -done, the start's groups
    assert all_gather.groups == "{{0,1,2,3},{4,5,6,7}}"
    assert (permute.ops, permute.bytes, hlo_bytes.permute_pairs(permute.groups)) == (1, 32, [(0, 1), (1, 0)])
    by_kind = hlo_bytes.collective_bytes(MODULE)  # the same walk, the same bytes
    assert by_kind == {"all-reduce": 96, "all-gather": 384, "collective-permute": 32}
