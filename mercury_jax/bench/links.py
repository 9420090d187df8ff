"""Inter-chip link bandwidths, and the seconds a collective takes on them: the collective term of a pod step.

A collective is priced by its result bytes per chip B (as the optimised HLO gives them, `hlo_bytes.py`), the n
chips of its group and where they sit on the topology. R is the group's ring bandwidth, one way: the sum over the
torus axes the group spans of b x (2 where the group covers a whole axis that wraps around: a bidirectional ring;
1 otherwise: a ring that goes out along one direction of a line and back along the other), b one link's bandwidth
one way. Each model is the bandwidth term of the textbook algorithm, so a lower bound like the rooflines:

    all-reduce          2 (n - 1) / n x B / R          ring reduce-scatter, then ring all-gather
    all-gather          (n - 1) / n x B / R            B the gathered result
    reduce-scatter      (n - 1) x B / R                its input is n B, of which (n - 1) / n crosses the ring
    all-to-all          max over spanned axes a of n_a B / (4 R_a)     the bisection: n B / 4 bytes cross the cut
                        across the longest axis, over the links that cut has (ragged: B its worst-case buffer)
    collective-permute  L x B / b                      L the most messages that share one directed link when each
                        pair is routed dimension by dimension (a ring shift: L = 1)

A group spanning several axes uses all their links at once (XLA's TPU collectives run over every link of the axes
a group spans); devices without coordinates (CPU) are priced as one axis without wraparound (stated where used).
On a switch (NVLink through NVSwitch, or an NVLink bridge) every GPU reaches every peer at its whole NVLink
bandwidth: the ring models with R = that bandwidth, all-to-all (n - 1) / n x B / R, a permute B / R. Latency (per
hop and per op) is not priced: no vendor publishes it; small collectives (a decode step's) are under-priced.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import jax

from mercury_jax.bench.hlo_bytes import Traffic, permute_pairs, replica_groups

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """One chip's links: `link_bytes_per_s` one link one way, `links` of them; a 'torus' (ICI, a link to each
    neighbour along each axis) or a 'switch' (NVLink: any peer at the whole bandwidth); a torus slice's axes wrap
    around when every axis is at least `wrap_every_axis` chips (0: never by that rule), or an axis on its own when it
    is `wrap_axis` chips long (0: never)."""
    name: str
    link_bytes_per_s: float
    links: int
    topology: str
    source: str
    wrap_every_axis: int = 0
    wrap_axis: int = 0

    @property
    def chip_bytes_per_s(self) -> float:
        """All of a chip's links one way."""
        return self.link_bytes_per_s * self.links


INTERCONNECTS = {
    # cloud.google.com/tpu/docs/v5p: "Bidirectional inter-chip interconnect (ICI) bandwidth per chip 1200 GBps"
    # (an older revision: "Interchip Interconnect BW 4800 Gbps", i.e. 600 GB/s one way), 3D torus, so 6 links:
    # 1200 / 6 / 2 = 100 GB/s a link one way. "All 4x4x4 and larger slices (one cube) have full 3D torus":
    # smaller slices have no wraparound links.
    "v5p": Interconnect("TPU v5p ICI", 100 * GB, 6, "torus", "cloud.google.com/tpu/docs/v5p", wrap_every_axis=4),
    # cloud.google.com/tpu/docs/v5e: "Bidirectional ICI bandwidth (per chip) 400 GBps" (older: 1600 Gbps one way),
    # "Interconnect topology 2D Torus", 4 ICI ports: 400 / 4 / 2 = 50 GB/s a link one way. The page gives the pod
    # (16x16) as a torus and says nothing of smaller slices: assumed, an axis wraps only when it spans the pod's 16.
    "v5e": Interconnect("TPU v5e ICI", 50 * GB, 4, "torus", "cloud.google.com/tpu/docs/v5e", wrap_axis=16),
    # cloud.google.com/tpu/docs/v6e: "Bidirectional ICI bandwidth (per chip) 800 GBps" (3200 Gbps one way; one
    # revision of the page says 3584 Gbps), "ICI ports per chip 4", 2D torus: 800 / 4 / 2 = 100 GB/s a link one
    # way. Wraparound as v5e (assumed).
    "v6e": Interconnect("TPU v6e ICI", 100 * GB, 4, "torus", "cloud.google.com/tpu/docs/v6e", wrap_axis=16),
    # NVIDIA H100 / H200 Tensor Core GPU datasheets: SXM "NVIDIA NVLink: 900GB/s" (18 NVLink 4 links of 50 GB/s
    # both ways: 25 GB/s a link one way), the 8 GPUs of an HGX board through NVSwitch; H100 NVL and H100 PCIe "NVLink
    # bridge: 600GB/s" (to its bridged peer); H200 NVL "2- or 4-way NVIDIA NVLink bridge: 900GB/s".
    "h100-sxm": Interconnect("NVIDIA H100 SXM NVLink", 25 * GB, 18, "switch", "NVIDIA H100 datasheet"),
    "h100-nvl": Interconnect("NVIDIA H100 NVL / PCIe NVLink bridge", 25 * GB, 12, "switch", "NVIDIA H100 datasheet"),
    "h200-sxm": Interconnect("NVIDIA H200 SXM NVLink", 25 * GB, 18, "switch", "NVIDIA H200 datasheet"),
    "h200-nvl": Interconnect("NVIDIA H200 NVL NVLink bridge", 25 * GB, 18, "switch", "NVIDIA H200 datasheet"),
}
# (words that must all appear in the lower-cased `device_kind`, interconnect); first match wins (as peaks.CHIPS)
DEVICE_KINDS = ((("tpu v5 lite",), "v5e"), (("tpu v5e",), "v5e"), (("tpu v5",), "v5p"), (("tpu v6",), "v6e"),
                (("h200", "nvl"), "h200-nvl"), (("h200",), "h200-sxm"), (("h100", "pcie"), "h100-nvl"),
                (("h100", "nvl"), "h100-nvl"), (("h100",), "h100-sxm"))


def chip_interconnect(device_kind: str) -> Interconnect | None:
    """The links of a chip by JAX's `device.device_kind` (None: not in the table, e.g. CPU)."""
    kind = device_kind.lower()
    return next((INTERCONNECTS[name] for words, name in DEVICE_KINDS if all(w in kind for w in words)), None)


def describe_chip_links(device_kind: str) -> str:
    """A chip's links in words, for a measured chip's header: what its pod step's collectives are priced with."""
    ic = chip_interconnect(device_kind)
    if ic is None:
        return f"links unknown ('{device_kind}' not in links.DEVICE_KINDS)"
    return f"{ic.name} {ic.chip_bytes_per_s / GB:,.0f} GB/s one way ({ic.links} links; {ic.source})"


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The links of a slice: its interconnect, the chips along each torus axis and which axes wrap around; `shape`
    () where the devices carry no coordinates (CPU)."""
    interconnect: Interconnect
    shape: tuple[int, ...] = ()
    wraps: tuple[bool, ...] = ()

    def describe(self) -> str:
        ic = self.interconnect
        where = (f"{'x'.join(map(str, self.shape))} torus, wraparound on "
                 + (", ".join(f"axis {a}" for a, w in enumerate(self.wraps) if w) or "no axis")
                 if self.shape else "placement unknown: each group priced as one axis without wraparound")
        return (f"{ic.name}: {ic.link_bytes_per_s / GB:.0f} GB/s a link one way x {ic.links} links "
                f"({ic.source}); {where}")


def slice_fabric(generation: str, coords: list | None = None) -> Fabric:
    """The fabric of a slice of TPU `generation` ("v5p", "v5e", "v6e") whose chips sit at `coords` (None or any
    None among them: unknown placement)."""
    if generation not in INTERCONNECTS:
        raise ValueError(f"no link figures for {generation!r}; links.INTERCONNECTS has {sorted(INTERCONNECTS)}")
    ic = INTERCONNECTS[generation]
    if not coords or any(c is None for c in coords):
        return Fabric(ic)
    shape = tuple(max(c[a] for c in coords) + 1 for a in range(len(coords[0])))
    every = bool(ic.wrap_every_axis) and min(shape) >= ic.wrap_every_axis
    return Fabric(ic, shape, tuple(every or (bool(ic.wrap_axis) and n == ic.wrap_axis) for n in shape))


def topology_fabric(topology: str, devices: list) -> Fabric:
    """The links of `topology` (`topology_devices`'s name) over its `devices`' coordinates; "cpu": v5p's links with
    no placement (the figures the rooflines use are v5p's too)."""
    if topology == "cpu":
        return slice_fabric("v5p")
    return slice_fabric(topology.split(":")[0], [tuple(d.coords) if hasattr(d, "coords") else None for d in devices])


def program_coords(compiled, chips: int) -> list:
    """The coordinates of a compiled program's devices in the order its collectives' device ids count them (the
    device assignment its shardings share: a mesh's devices, flattened); None for a device without coordinates
    (CPU), or `chips` Nones when no input names a mesh."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        devices = getattr(getattr(sharding, "mesh", None), "devices", None)
        if devices is not None and getattr(devices, "size", 0):
            return [tuple(d.coords) if hasattr(d, "coords") else None for d in devices.flat]
    return [None] * chips


@dataclasses.dataclass(frozen=True)
class Placement:
    """A collective group on the fabric: its `chips`, and per torus axis it spans (chips along it, ring bandwidth
    one way); `switch` when its chips reach one another through a switch."""
    chips: int
    axes: tuple[tuple[int, float], ...]
    switch: bool = False

    @property
    def ring_bytes_per_s(self) -> float:
        return sum(bandwidth for _, bandwidth in self.axes)


def group_placement(group_coords: list, fabric: Fabric) -> Placement:
    """Where a group of chips (their coordinates, None where unknown) sits: the axes along which they differ, each
    with b x 2 when the group covers the whole axis and it wraps around, else b."""
    n, ic = len(group_coords), fabric.interconnect
    if n <= 1:
        return Placement(n, ())
    if ic.topology == "switch":
        return Placement(n, ((n, ic.chip_bytes_per_s),), switch=True)
    if not fabric.shape or any(c is None for c in group_coords):
        return Placement(n, ((n, ic.link_bytes_per_s),))
    axes = []
    for a, length in enumerate(fabric.shape):
        along = len({c[a] for c in group_coords})
        if along > 1:
            whole_ring = fabric.wraps[a] and along == length
            axes.append((along, ic.link_bytes_per_s * (2 if whole_ring else 1)))
    return Placement(n, tuple(axes))


def collective_seconds(kind: str, result_bytes: float, placement: Placement) -> float:
    """Seconds of a collective (`kind` as HLO names it, not a permute) whose result is `result_bytes` per chip on a
    group at `placement` (the models in the module docstring)."""
    n, ring = placement.chips, placement.ring_bytes_per_s
    if n <= 1 or not result_bytes:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes / ring
    if kind == "all-gather":
        return (n - 1) / n * result_bytes / ring
    if kind == "reduce-scatter":
        return (n - 1) * result_bytes / ring
    if kind in ("all-to-all", "ragged-all-to-all"):
        if placement.switch:
            return (n - 1) / n * result_bytes / ring
        return max(along * result_bytes / (4 * bandwidth) for along, bandwidth in placement.axes)
    raise ValueError(f"no cost model for collective {kind!r}; collective-permute goes through permute_seconds")


def permute_seconds(result_bytes: float, pairs: list[tuple], fabric: Fabric) -> float:
    """Seconds of a collective-permute moving `result_bytes` a chip between the (source, target) coordinates of
    `pairs`: on a torus the busiest directed link's messages x bytes / b (each pair routed axis by axis, the shorter
    way round where the axis wraps; unknown coordinates: 1 message a link); on a switch bytes / the GPU's bandwidth."""
    ic = fabric.interconnect
    moving = [(s, t) for s, t in pairs if s is None or t is None or s != t]  # unknown places: apart
    if not moving or not result_bytes:
        return 0.0
    if ic.topology == "switch":
        return result_bytes / ic.chip_bytes_per_s
    if not fabric.shape or any(s is None or t is None for s, t in moving):
        return result_bytes / ic.link_bytes_per_s
    return link_load(moving, fabric) * result_bytes / ic.link_bytes_per_s


def link_load(pairs: list[tuple], fabric: Fabric) -> int:
    """The most messages any directed link carries when each (source, target) coordinate pair is routed dimension
    by dimension (the shorter way round an axis that wraps)."""
    load: Counter = Counter()
    for source, target in pairs:
        at = list(source)
        for a, length in enumerate(fabric.shape):
            step, hops = _direction(at[a], target[a], length, fabric.wraps[a])
            for _ in range(hops):
                load[(tuple(at), a, step)] += 1
                at[a] = (at[a] + step) % length
    return max(load.values(), default=0)


def _direction(source: int, target: int, length: int, wraps: bool) -> tuple[int, int]:
    """(+1 or -1, hops) from `source` to `target` along an axis of `length` chips."""
    forward = (target - source) % length if wraps else target - source
    if wraps and forward > length - forward:
        return -1, length - forward
    return (1, forward) if forward >= 0 else (-1, -forward)


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """A program's collective seconds per run: by kind, and split into those XLA issues asynchronously (which can
    hide behind compute) and the rest."""
    seconds: dict
    async_s: float
    sync_s: float

    @property
    def total_s(self) -> float:
        return self.async_s + self.sync_s


NO_COLLECTIVES = CollectiveTime({}, 0.0, 0.0)


def price_traffic(traffic: list[Traffic], coords: list, fabric: Fabric) -> CollectiveTime:
    """The seconds of a program's collectives (`hlo_bytes.collective_traffic`) whose device ids index `coords` (the
    coordinates of the program's devices in its device assignment's order; None entries where unknown): each op
    priced on its slowest group."""
    seconds: dict[str, float] = {}
    split = {True: 0.0, False: 0.0}
    placements: dict[str, list[Placement]] = {}
    for t in traffic:
        if t.kind == "collective-permute":
            pairs = [(_at(coords, s), _at(coords, d)) for s, d in permute_pairs(t.groups)]
            spent = permute_seconds(t.bytes, pairs, fabric)
        else:
            if t.groups not in placements:
                placements[t.groups] = [group_placement([_at(coords, i) for i in g], fabric)
                                        for g in replica_groups(t.groups, len(coords))]
            spent = max((collective_seconds(t.kind, t.bytes, p) for p in placements[t.groups]), default=0.0)
        seconds[t.kind] = seconds.get(t.kind, 0.0) + spent
        split[t.is_async] += spent
    return CollectiveTime(seconds, split[True], split[False])


def _at(coords: list, device: int):
    """The coordinates of device id `device` (None when the assignment is shorter: an unknown placement)."""
    return coords[device] if device < len(coords) else None


def fsdp_step_seconds(param_count: int, compute_bytes: int, grad_bytes: int, group: Placement,
                      training: bool) -> float:
    """The least any FSDP learner program moves, in seconds: the parameters all-gathered once in the compute dtype
    (`compute_bytes` a parameter) and, for a training step, the gradient reduce-scattered once (`grad_bytes` a
    parameter); per micro-batch re-gathers and expert-parallel all-to-alls left out, so a lower bound."""
    gather = collective_seconds("all-gather", param_count * compute_bytes, group)
    scatter = collective_seconds("reduce-scatter", math.ceil(param_count * grad_bytes / max(group.chips, 1)), group)
    return gather + (scatter if training else 0.0)
