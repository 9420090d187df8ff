"""One row's positions split over the mesh's 'sequence' axis (context parallelism), in zig-zag span order.

A row of T tokens is cut into 2n spans of S = T / (2n) positions (n = the 'sequence' axis size). Chip c holds two
of them, spans c and 2n - 1 - c (`RowSplit.table`): under a causal mask the early span sees few keys and the late
one many, so every chip's attention does the same work, (2n + 1) span pairs of S x S scores, instead of chip n - 1
doing 2n - 1 and chip 0 one. The model permutes its [B, T] inputs into this order at entry (`to_split_order`) and
its hidden states back at exit (`from_split_order`), so callers, losses and log-probs see rows in their natural
order; between the two, the T dim of every activation is laid out 'zig-zag' and split over 'sequence' by the
`activation_length` rule. Per-token layers (norms, projections, MoE, the residual stream) do not care about the
order; the token mixers do, and read it here:
  - attention gathers K/V (and each token's row index and segment id) over the axis and masks by row index
    (`split_attention.py`);
  - the Gated DeltaNet composes the spans' affine state maps in span order and takes its conv window from the
    previous span's last W - 1 inputs (`mercury_kernels/gated_delta/split.py`, `gated_deltanet.py`).
The permutations are point-to-point transfers (`ppermute`) of whole spans: each token moves once each way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.parallel import logical_partition_spec, partitioned_mesh

SEQUENCE_AXIS = "sequence"
SPANS_PER_CHIP = 2
ROW_DIMS = ("activation_batch", "activation_length")


class RowSplitError(ValueError):
    """A row that the 'sequence' axis cannot split (length not a multiple of 2n, spans shorter than the conv)."""


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Rows of `length` positions split over mesh axis `axis` of size `chips`, two spans a chip, zig-zag."""
    axis: str
    chips: int
    length: int

    @property
    def span(self) -> int:
        return self.length // (SPANS_PER_CHIP * self.chips)

    @property
    def table(self) -> np.ndarray:
        """[chips, 2] int: the natural span index of each chip's first and second local span."""
        c = np.arange(self.chips)
        return np.stack([c, 2 * self.chips - 1 - c], axis=1)

    @property
    def order(self) -> np.ndarray:
        """[2n]: the natural span at each position of the split order (chip-major)."""
        return self.table.reshape(-1)

    @property
    def inverse(self) -> np.ndarray:
        """[2n]: the position in the split order of each natural span."""
        return np.argsort(self.order)

    def local_spans(self) -> jax.Array:
        """Inside `shard_map`: this chip's two natural span indices, [2] int32."""
        return jnp.asarray(self.table, jnp.int32)[jax.lax.axis_index(self.axis)]

    def to_natural(self, gathered_BxTx___: jax.Array) -> jax.Array:
        """An all-gathered (tiled, chip-major) [B, T, ...] in split order -> natural order (a local gather)."""
        B = gathered_BxTx___.shape[0]
        spans = gathered_BxTx___.reshape(B, 2 * self.chips, self.span, *gathered_BxTx___.shape[2:])
        return spans[:, self.inverse].reshape(gathered_BxTx___.shape)


def row_split(length: int, *, min_span: int = 1) -> RowSplit | None:
    """The split of rows of `length` positions on the mesh being traced under, or None (no partitioned mesh, or
    its 'sequence' axis has size 1). RowSplitError when the axis cannot split such a row."""
    mesh = partitioned_mesh()
    if mesh is None or mesh.shape.get(SEQUENCE_AXIS, 1) == 1:
        return None
    n = mesh.shape[SEQUENCE_AXIS]
    if length % (SPANS_PER_CHIP * n) or length // (SPANS_PER_CHIP * n) < min_span:
        raise RowSplitError(
            f"rows of {length} positions cannot be split over the mesh's '{SEQUENCE_AXIS}' axis of size {n}: a "
            f"split row is {SPANS_PER_CHIP * n} spans of at least {min_span} positions (zig-zag, two a chip); pad "
            f"rows to a multiple of {SPANS_PER_CHIP * n} positions (at least {SPANS_PER_CHIP * n * min_span}), or "
            f"set the learner mesh's '{SEQUENCE_AXIS}' to 1")
    return RowSplit(SEQUENCE_AXIS, n, length)


def sequence_shards(length: int) -> int:
    """How many chips of the mesh being traced under split a [B, length, ...] activation by position: the
    'sequence' axis size when it divides `length` (the `activation_length` rule's layout), else 1."""
    mesh = partitioned_mesh()
    n = 1 if mesh is None else mesh.shape.get(SEQUENCE_AXIS, 1)
    return n if length % n == 0 else 1


def _row_spec(x: jax.Array, mesh):
    return logical_partition_spec(ROW_DIMS + (None,) * (x.ndim - 2), x.shape, mesh)


def _permute_spans(x_BxTx___: jax.Array, split: RowSplit, to_split: bool) -> jax.Array:
    mesh = partitioned_mesh()
    spec = _row_spec(x_BxTx___, mesh)
    if spec[1] != split.axis:
        raise RowSplitError(f"the T dim of a [B, T, ...] array is laid out {spec[1]!r}, not over "
                            f"'{split.axis}'; check the `activation_length` rule")
    table = split.table  # natural span of (chip, slot) in split order

    def local(x_bxtx___):
        b = x_bxtx___.shape[0]
        spans = x_bxtx___.reshape(b, SPANS_PER_CHIP, split.span, *x_bxtx___.shape[2:])
        out = jnp.zeros_like(spans)
        # natural order puts span g on chip g // 2, slot g % 2; split order on (chip, slot) with table[chip, slot] = g
        for src_slot in range(SPANS_PER_CHIP):
            for dst_slot in range(SPANS_PER_CHIP):
                if to_split:  # natural (chip g // 2, slot g % 2) -> split (chip c, slot s), g = table[c, s]
                    pairs = [(int(table[c, dst_slot]) // 2, c) for c in range(split.chips)
                             if table[c, dst_slot] % 2 == src_slot]
                else:         # split (chip c, slot s) -> natural (chip g // 2, slot g % 2)
                    pairs = [(c, int(table[c, src_slot]) // 2) for c in range(split.chips)
                             if table[c, src_slot] % 2 == dst_slot]
                if pairs:
                    moved = jax.lax.ppermute(spans[:, src_slot], split.axis, pairs)
                    out = out.at[:, dst_slot].add(moved)
        return out.reshape(x_bxtx___.shape)

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(x_BxTx___)


def to_split_order(x_BxTx___: jax.Array, split: RowSplit) -> jax.Array:
    """[B, T, ...] in natural order -> split order (chip c's shard: spans c and 2n - 1 - c)."""
    return _permute_spans(x_BxTx___, split, to_split=True)


def from_split_order(x_BxTx___: jax.Array, split: RowSplit) -> jax.Array:
    """The inverse of `to_split_order`."""
    return _permute_spans(x_BxTx___, split, to_split=False)


__all__ = ["RowSplit", "RowSplitError", "SEQUENCE_AXIS", "from_split_order", "row_split", "sequence_shards",
           "to_split_order"]
