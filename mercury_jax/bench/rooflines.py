"""Lower bounds on a program's time on one chip, and the bytes a chip holds and must read.

    roofline = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth, ...)     (each term a lower bound; the largest wins)

The chip figures are v5p's (Google Cloud's published figures, per chip); `peaks.py` has other chips by device kind.
A compiled program's own figures come from XLA: `compiled.cost_analysis()` (FLOPs, bytes accessed: a while loop's
body counted once) and `compiled.memory_analysis()` (arguments + outputs + temporaries - aliased, per chip).
"""
from __future__ import annotations

import math

import jax
import numpy as np

GIB = 2.0 ** 30
# v5p per chip: bf16 peak, HBM bandwidth, inter-chip interconnect (4,800 Gbps, all links together)
V5P_PEAK_FLOPS = 459e12
V5P_HBM_BYTES_PER_S = 2765e9
V5P_ICI_BYTES_PER_S = 600e9
HBM_GIB = {"v5p": 95, "v5e": 16, "v6e": 32, "v4": 32}  # HBM per chip by TPU generation (a topology's prefix)


def roofline(bounds: dict[str, float]) -> tuple[float, str]:
    """(the largest of `bounds`' seconds, its name): the time no faster run beats. NaN bounds (not measured) are
    left out; of equal bounds the first named wins."""
    known = [name for name, seconds in bounds.items() if seconds == seconds]
    name = max(known, key=bounds.get)
    return bounds[name], name


def xla_cost(compiled, missing: float = math.nan) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per chip from XLA's cost analysis of a compiled program (`missing` where it has
    none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost:
        return missing, missing
    return float(cost.get("flops", missing)), float(cost.get("bytes accessed", missing))


def cost_and_roofline(compiled) -> tuple[float, float, float, str]:
    """(FLOPs, bytes accessed, roofline seconds on v5p, "FLOPs" or "HBM": which bound) from XLA's cost analysis of
    a compiled program; the roofline is max(FLOPs / bf16 peak, bytes / HBM bandwidth), a lower bound."""
    flops, nbytes = xla_cost(compiled, missing=0.0)
    seconds, bound = roofline({"FLOPs": flops / V5P_PEAK_FLOPS, "HBM": nbytes / V5P_HBM_BYTES_PER_S})
    return flops, nbytes, seconds, bound


def program_bytes(memory) -> int:
    """Bytes a compiled program needs per chip while it runs (`compiled.memory_analysis()`): its arguments, outputs
    and temporaries, less the outputs that alias (donated) arguments."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes)


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of `tree`'s sharded abstract leaves (the largest shard; a replicated leaf whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def decode_read_bytes(params, decode_state, cfg, slots: int) -> float:
    """HBM bytes per chip one decode step must read: every weight but the embedding table (a lookup) and the routed
    experts, the routed experts' expected share of distinct experts hit by `slots` tokens of top-k routing
    (E (1 - (1 - k / E)^slots) of E, uniform routing), and the whole decode state (K/V caches and GDN states)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    hit = 1 - (1 - k / E) ** slots
    dense = routed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(p, "key", p)) for p in path]
        if any("embed" in n for n in names):
            continue
        nbytes = per_chip_bytes([leaf])
        if any(n.startswith("expert_") for n in names):
            routed += nbytes
        else:
            dense += nbytes
    return dense + hit * routed + per_chip_bytes(decode_state)
