"""Expert-parallel routed experts under `shard_map`: token-local sort, all-to-all dispatch, grouped matmuls.

Computes exactly `moe.routed_experts` (out[n] = sum_k w[n, k] * Expert_{e[n, k]}(x[n]), dropless), distributed:

  1. tokens are split over the mesh axes ('data', 'fsdp', 'expert', 'sequence'; a token count that does not divide
     is padded with tokens that pick no expert); each device routes its own tokens (`ep_moe`: router, softmax,
     top-k) and sorts its n*K (token, expert) pairs by expert, which is also by owner device (expert e lives on
     expert-rank e // E_local);
  2. the pair counts are exchanged (all_to_all of an [P, E_local] int matrix, P = expert-axis size) and the token
     rows are sent to the owners (dispatch, below);
  3. each device re-sorts what it received by local expert and runs its E_local experts with `ragged_dot`;
  4. results travel back by the transposed dispatch, are unsorted and combined with the routing weights.
Expert weights are sharded [E over 'expert', H, I over 'tensor'] (a 'tensor' split of I is summed with one psum of
the [n, H] result); no device ever holds another device's experts, and no collective carries the global tokens.

Dispatch ("ragged" or "padded", same offsets, same buffers):
  * "ragged": `jax.lax.ragged_all_to_all` moves exactly the rows sent (TPU/GPU). XLA:CPU has no ragged-all-to-all
    (jax 0.10: "HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so
  * "padded": the same transfers by a dense `all_to_all` of [P, slot, H] (each transfer zero-padded to the most
    rows one can carry) and a scatter at the receiver's offsets, `ragged_all_to_all`'s semantics exactly. Used on
    CPU meshes (tests); "auto" picks it when the mesh's devices are CPUs.
Dropless, in rounds: a token picks K distinct experts, so a device can receive up to n * min(K, E_local) rows from
each of the P sources (every source routing every token to it), P times the balanced load n * K when E_local >= K.
Instead of a buffer of that worst case, a round receives B = ceil(round_factor * n * K) rows (`ROUND_FACTOR` 2,
twice the balanced load; capped at the worst case): round r takes positions [r B, (r + 1) B) of each receiver's
incoming stream, and the step runs as many rounds as the fullest receiver needs (one when no receiver gets more
than B rows; at most ceil(worst / B)). No pair is ever dropped, and memory per device is one round's buffers, flat
in the expert-axis size; a badly skewed routing costs extra rounds, not memory.

Backward: JAX transposes `ragged_all_to_all` / `all_to_all` (the dispatch reversed), sorts and gathers, so the
gradients w.r.t. x, the routing weights and the local experts need no gather of other devices' experts.

Mesh: the caller's mesh context (`with jax.set_mesh(mesh):`, the mesh the parameters were sharded over by
`mercury_jax.parallel.shard_params`), or an explicit `mesh=` argument. A single device is a 1x1x1x1 mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mercury_jax.parallel.mesh import MESH_AXES
from mercury_kernels.platform import target_platform
from models.qwen35_moe.routing import route

TOKEN_AXES = ("data", "fsdp", "expert", "sequence")  # [B T] flattened: rows outer, positions inner
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
DISPATCHES = ("auto", "ragged", "padded")
ROUND_FACTOR = 2.0  # a dispatch round receives ROUND_FACTOR * n * K rows: twice the balanced load


class ExpertParallelError(ValueError):
    """moe_impl='ep' cannot run with the given mesh or shapes; the message says why and how to fix it."""


def ep_moe(x_NxH: jax.Array, router_HxE: jax.Array, gate_ExHxI: jax.Array, up_ExHxI: jax.Array,
           down_ExIxH: jax.Array, *, top_k: int, mesh=None, dispatch: str = "auto",
           round_factor: float = ROUND_FACTOR) -> tuple[jax.Array, dict]:
    """Routing (`routing.route`) and the routed experts, token-local on each device, experts over 'expert'.

    Returns (routed [N, H], aux) with aux = {expert_counts_E, router_prob_sum_E} summed over all N tokens (each
    device returns its partial [E] sums; the [devices, E] stack is summed outside the shard_map, a collective of
    size devices x E, never tokens)."""
    E = gate_ExHxI.shape[0]
    ctx = _Context.build(mesh, E, gate_ExHxI.shape[2], dispatch, round_factor)
    N = x_NxH.shape[0]
    x_NxH, valid_N = ctx.pad(x_NxH), ctx.pad(jnp.ones((N,), jnp.float32))

    def local(x_nxH, valid_n, router_HxE, gate, up, down):
        probs_nxE, weight_nxK, expert_nxK = route(x_nxH, router_HxE, top_k)
        expert_nxK = jnp.where(valid_n[:, None] > 0, expert_nxK, E)  # padded tokens pick no expert
        out_nxH = _local_ep(x_nxH, expert_nxK, weight_nxK, gate, up, down, num_experts=E, ctx=ctx)
        counts_E = jnp.zeros((E,), jnp.float32).at[expert_nxK.reshape(-1)].add(1.0, mode="drop")
        prob_sum_E = jnp.sum(probs_nxE * valid_n[:, None], axis=0)
        return out_nxH, counts_E[None], prob_sum_E[None]

    tok, stat = ctx.token_spec, P(ctx.token_axes or None, None)
    out_NxH, counts_DxE, prob_sum_DxE = jax.shard_map(
        local, mesh=ctx.mesh,
        in_specs=(tok, P(ctx.token_axes or None), P(), *ctx.expert_specs),
        out_specs=(tok, stat, stat), check_vma=False,
    )(x_NxH, valid_N, router_HxE, gate_ExHxI, up_ExHxI, down_ExIxH)
    aux = {"expert_counts_E": jnp.sum(counts_DxE, axis=0), "router_prob_sum_E": jnp.sum(prob_sum_DxE, axis=0)}
    return out_NxH[:N], aux


def ep_routed_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_ExHxI: jax.Array,
                      up_ExHxI: jax.Array, down_ExIxH: jax.Array, *, mesh=None, dispatch: str = "auto",
                      round_factor: float = ROUND_FACTOR) -> jax.Array:
    """`moe.routed_experts` (routing given) with experts sharded over the 'expert' mesh axis."""
    E = gate_ExHxI.shape[0]
    ctx = _Context.build(mesh, E, gate_ExHxI.shape[2], dispatch, round_factor)
    N = x_NxH.shape[0]
    # padded tokens pick the out-of-range expert E, which sorts last and is never sent
    x_NxH, expert_NxK, weight_NxK = ctx.pad(x_NxH), ctx.pad(expert_NxK, E), ctx.pad(weight_NxK)
    local = functools.partial(_local_ep, num_experts=E, ctx=ctx)
    tok = ctx.token_spec
    out_NxH = jax.shard_map(local, mesh=ctx.mesh, in_specs=(tok, tok, tok, *ctx.expert_specs), out_specs=tok,
                            check_vma=False)(x_NxH, expert_NxK, weight_NxK, gate_ExHxI, up_ExHxI, down_ExIxH)
    return out_NxH[:N]


@dataclasses.dataclass(frozen=True)
class _Context:
    """The mesh and what it implies: token axes, expert / tensor axes in use, the dispatch."""
    mesh: object
    token_axes: tuple[str, ...]
    n_token_shards: int
    ep: str | None
    ep_size: int
    tp: str | None
    dispatch: str
    round_factor: float = ROUND_FACTOR

    @staticmethod
    def build(mesh, num_experts: int, intermediate: int, dispatch: str, round_factor: float = ROUND_FACTOR
              ) -> _Context:
        mesh = _resolve_mesh(mesh)
        if not round_factor > 0:
            raise ExpertParallelError(f"round_factor must be > 0 (rows a dispatch round receives, in units of the "
                                      f"balanced load n * K), got {round_factor!r}")
        ep_size = mesh.shape.get(EXPERT_AXIS, 1)
        if num_experts % ep_size:
            raise ExpertParallelError(f"num_experts {num_experts} is not divisible by the mesh's '{EXPERT_AXIS}' "
                                      f"axis of size {ep_size}; choose an expert-axis size that divides it")
        token_axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)
        tp_size = mesh.shape.get(TENSOR_AXIS, 1)
        return _Context(mesh=mesh, token_axes=token_axes, n_token_shards=math.prod(mesh.shape[a] for a in token_axes),
                        ep=EXPERT_AXIS if ep_size > 1 else None, ep_size=ep_size,
                        tp=TENSOR_AXIS if tp_size > 1 and intermediate % tp_size == 0 else None,
                        dispatch=_resolve_dispatch(dispatch, mesh), round_factor=float(round_factor))

    @property
    def token_spec(self) -> P:
        return P(self.token_axes or None, None)

    @property
    def expert_specs(self) -> tuple[P, P, P]:
        return P(self.ep, None, self.tp), P(self.ep, None, self.tp), P(self.ep, self.tp, None)

    def pad(self, a: jax.Array, value=0) -> jax.Array:
        """Pad the token (first) dim to a multiple of the token shards."""
        pad = (-a.shape[0]) % self.n_token_shards
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=value) if pad else a


def receive_capacity(tokens_per_device: int, top_k: int, experts_per_device: int) -> int:
    """Rows one device can receive from one source device, worst case: n * min(K, E_local) (dropless bound)."""
    return tokens_per_device * min(top_k, experts_per_device)


def _local_ep(x_nxH, expert_nxK, weight_nxK, gate_ExHxI, up_ExHxI, down_ExIxH, *, num_experts, ctx):
    """One device's routed sum for its n tokens; expert ids >= num_experts mean 'no expert' (padding)."""
    ep, ep_size, tp = ctx.ep, ctx.ep_size, ctx.tp
    n, K = expert_nxK.shape
    M, H = n * K, x_nxH.shape[1]
    E_local = gate_ExHxI.shape[0]
    flat_expert_M = expert_nxK.reshape(M)
    order_M = jnp.argsort(flat_expert_M, stable=True)
    x_sorted_MxH = x_nxH[order_M // K]
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[flat_expert_M].add(1, mode="drop")

    if ep is None:
        y_sorted_MxH = _grouped_swiglu(x_sorted_MxH, counts_E, gate_ExHxI, up_ExHxI, down_ExIxH)
    else:
        y_sorted_MxH = _exchange_and_compute(x_sorted_MxH, counts_E.reshape(ep_size, E_local), gate_ExHxI, up_ExHxI,
                                             down_ExIxH, n=n, K=K, ctx=ctx)
    y_MxH = jnp.zeros((M, H), y_sorted_MxH.dtype).at[order_M].set(y_sorted_MxH)
    out_nxH = jnp.einsum("nkh,nk->nh", y_MxH.reshape(n, K, H), weight_nxK)
    return jax.lax.psum(out_nxH, tp) if tp else out_nxH


def round_rows(tokens_per_device: int, top_k: int, experts_per_device: int, ep_size: int,
               round_factor: float = ROUND_FACTOR) -> tuple[int, int]:
    """(rows a dispatch round receives B, most rounds a step can need): B = ceil(round_factor * n * K), capped at
    the worst case P * n * min(K, E_local); rounds = ceil(worst / B)."""
    worst = ep_size * receive_capacity(tokens_per_device, top_k, experts_per_device)
    rows = max(1, min(worst, math.ceil(round_factor * tokens_per_device * top_k)))
    return rows, -(-worst // rows)


def _exchange_and_compute(x_sorted_MxH, send_counts_PxL, gate_LxHxI, up_LxHxI, down_LxIxH, *, n, K, ctx):
    """Send sorted rows to their expert-ranks, run the local experts, return the results in the sorted order.

    A receiver's incoming rows form one stream: source 0's rows, then source 1's, ..., each grouped by local expert.
    Round r moves stream positions [r B, (r + 1) B) of every receiver at once (each sender sends the part of its
    block that falls in the window), runs the experts on them and sends the results back. The round count is the
    fullest receiver's stream over B, the same on every device (it comes from the all-gathered [P, P] counts);
    rounds past it are skipped by `lax.cond`, and a round's body is rematerialised in the backward pass, so memory
    stays one round's buffers whatever the routing.
    """
    ep, ep_size, M, H = ctx.ep, ctx.ep_size, *x_sorted_MxH.shape
    E_local = gate_LxHxI.shape[0]
    B, max_rounds = round_rows(n, K, E_local, ep_size, ctx.round_factor)
    me = jax.lax.axis_index(ep)
    send_P = jnp.sum(send_counts_PxL, axis=1)
    sizes_PxP = jax.lax.all_gather(send_P, ep)  # [source, destination]
    recv_counts_PxL = jax.lax.all_to_all(send_counts_PxL, ep, 0, 0, tiled=True)  # [source, local expert] to me
    stream_start_PxP = _exclusive_cumsum(sizes_PxP, axis=0)  # where source s's block starts in d's stream
    send_offsets_P = _exclusive_cumsum(send_P)  # where my rows for d start in x_sorted
    back_offsets_P = _exclusive_cumsum(sizes_PxP, axis=1)[:, me]  # where s's rows for me start in s's x_sorted
    rounds = -(-jnp.max(jnp.sum(sizes_PxP, axis=0)) // B)
    exchange = (jax.lax.ragged_all_to_all if ctx.dispatch == "ragged"
                else functools.partial(_padded_ragged_all_to_all, slot_rows=min(M, B)))

    def one_round(r):
        lo, hi = r * B, r * B + B
        out_start_P, in_start_P = stream_start_PxP[me], stream_start_PxP[:, me]
        out_lo_P = jnp.clip(out_start_P, lo, hi)  # my block for d, clipped to d's window
        sent_P = jnp.clip(out_start_P + send_P, lo, hi) - out_lo_P
        in_lo_P = jnp.clip(in_start_P, lo, hi)  # s's block for me, clipped to my window
        received_P = jnp.clip(in_start_P + sizes_PxP[:, me], lo, hi) - in_lo_P
        recv_BxH = exchange(x_sorted_MxH, jnp.zeros((B, H), x_sorted_MxH.dtype),
                            _where_sent(sent_P, send_offsets_P + out_lo_P - out_start_P), sent_P,
                            _where_sent(sent_P, out_lo_P - lo), received_P, axis_name=ep)
        # the window's rows: per source, grouped by local expert; re-sort them by local expert
        group_start_PxL = in_start_P[:, None] + _exclusive_cumsum(recv_counts_PxL, axis=1)
        group_lo_PxL = jnp.clip(group_start_PxL, lo, hi)
        group_len_PxL = jnp.clip(group_start_PxL + recv_counts_PxL, lo, hi) - group_lo_PxL
        starts_S, lengths_S = (group_lo_PxL - lo).reshape(-1), group_len_PxL.reshape(-1)
        row_B = jnp.arange(B, dtype=jnp.int32)
        segment_B = jnp.searchsorted(starts_S, row_B, side="right") - 1
        valid_B = row_B < starts_S[segment_B] + lengths_S[segment_B]
        local_order_B = jnp.argsort(jnp.where(valid_B, segment_B % E_local, E_local), stable=True)
        y_B = _grouped_swiglu(recv_BxH[local_order_B], jnp.sum(group_len_PxL, axis=0), gate_LxHxI, up_LxHxI,
                              down_LxIxH)
        y_BxH = jnp.zeros_like(y_B).at[local_order_B].set(y_B)
        return exchange(y_BxH, jnp.zeros((M, H), y_BxH.dtype), _where_sent(received_P, in_lo_P - lo), received_P,
                        _where_sent(received_P, back_offsets_P + in_lo_P - in_start_P), sent_P, axis_name=ep)

    if max_rounds == 1:
        return one_round(0)

    def round_step(y_MxH, r):
        skip = lambda r: jnp.zeros((M, H), x_sorted_MxH.dtype)  # noqa: E731
        return y_MxH + jax.lax.cond(r < rounds, one_round, skip, r), None

    y_MxH, _ = jax.lax.scan(jax.checkpoint(round_step), jnp.zeros((M, H), x_sorted_MxH.dtype),
                            jnp.arange(max_rounds, dtype=jnp.int32))
    return y_MxH


def _where_sent(sizes_P, offsets_P):
    """Offsets of empty transfers set to 0, so no offset points past its buffer."""
    return jnp.where(sizes_P > 0, offsets_P, 0)


def _padded_ragged_all_to_all(operand, output, input_offsets_P, send_sizes_P, output_offsets_P, recv_sizes_P, *,
                              axis_name, slot_rows):
    """`jax.lax.ragged_all_to_all` by its documented semantics from a dense `all_to_all` (XLA:CPU lacks the op):
    rows operand[input_offsets[j] : + send_sizes[j]] go to device j and land at output[output_offsets[j] : ...]
    there; recv_sizes[s] rows arrive from device s. Every transfer is padded to `slot_rows` (>= any send size)."""
    rows = operand.shape[0]
    slot_S = jnp.arange(slot_rows, dtype=jnp.int32)
    sending_PxS = slot_S[None, :] < send_sizes_P[:, None]
    index_PxS = jnp.clip(input_offsets_P[:, None] + slot_S[None, :], 0, rows - 1)
    send_PxSxH = jnp.where(sending_PxS[..., None], operand[index_PxS], 0)
    recv_PxSxH = jax.lax.all_to_all(send_PxSxH, axis_name, 0, 0, tiled=False)
    offsets_from_P = jax.lax.all_to_all(output_offsets_P, axis_name, 0, 0, tiled=True)  # where source s writes in me
    valid_PxS = slot_S[None, :] < recv_sizes_P[:, None]
    target_PxS = jnp.where(valid_PxS, offsets_from_P[:, None] + slot_S[None, :], output.shape[0])
    return output.at[target_PxS.reshape(-1)].set(recv_PxSxH.reshape(-1, *operand.shape[1:]), mode="drop")


def _grouped_swiglu(x_RxH, group_sizes_L, gate_LxHxI, up_LxHxI, down_LxIxH):
    """(silu(x @ G_e) * (x @ U_e)) @ D_e for rows grouped by expert; rows past sum(group_sizes) give zeros."""
    group_sizes_L = group_sizes_L.astype(jnp.int32)
    gate_RxI = jax.lax.ragged_dot(x_RxH, gate_LxHxI, group_sizes_L)
    up_RxI = jax.lax.ragged_dot(x_RxH, up_LxHxI, group_sizes_L)
    return jax.lax.ragged_dot(jax.nn.silu(gate_RxI) * up_RxI, down_LxIxH, group_sizes_L)


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _resolve_mesh(mesh):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ExpertParallelError(
            "moe_impl='ep' needs a device mesh but none is set; run the model under `with jax.set_mesh(mesh):` "
            "(e.g. mercury_jax.parallel.make_mesh({'expert': 4, 'fsdp': 2})), or pass mesh= explicitly")
    unknown = set(mesh.axis_names) - set(MESH_AXES)
    if unknown:
        raise ExpertParallelError(f"mesh axes {sorted(unknown)} are not project axes {MESH_AXES}; build the mesh "
                                  "with mercury_jax.parallel.make_mesh")
    return mesh


def _resolve_dispatch(dispatch, mesh):
    if dispatch not in DISPATCHES:
        raise ExpertParallelError(f"dispatch {dispatch!r} is not one of {DISPATCHES}")
    if dispatch != "auto":
        return dispatch
    return "padded" if target_platform(mesh) == "cpu" else "ragged"
