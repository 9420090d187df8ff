"""`gated_delta_rule`: one entry point for every implementation of the gated delta rule over a sequence.

Implementations are registered by name in `_IMPLEMENTATIONS`; each takes the same arguments and returns
(o_BxTxHxV, final_state_BxHxKxV) in float32. "auto" picks "pallas" on TPU and "chunked" elsewhere.
"""
from __future__ import annotations

from mercury_kernels.gated_delta.chunked import chunked_gated_delta_rule
from mercury_kernels.gated_delta.pallas import pallas_gated_delta_rule
from mercury_kernels.gated_delta.reference import recurrent_gated_delta_rule
from mercury_kernels.platform import target_platform


def _recurrent(q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    del chunk_size  # the recurrent form goes one token at a time
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state,
                                      segment_ids_BxT=segment_ids)


def _chunked(q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    return chunked_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state,
                                    segment_ids_BxT=segment_ids, chunk_size=chunk_size)


def _pallas(q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    return pallas_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state,
                                   segment_ids_BxT=segment_ids, chunk_size=chunk_size)


_IMPLEMENTATIONS = {"chunked": _chunked, "pallas": _pallas, "recurrent": _recurrent}
_CHUNKED_IMPLS = ("chunked", "pallas")
IMPLS = ("auto", *sorted(_IMPLEMENTATIONS))  # every value `impl` accepts (the config validator lists these)


def resolve_impl(impl):
    """"auto" -> "pallas" when tracing for TPU (`target_platform`), else "chunked" (the Pallas kernel only runs
    interpreted off TPU)."""
    if impl == "auto":
        return "pallas" if target_platform() == "tpu" else "chunked"
    return impl


def gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, *, initial_state_BxHxKxV=None,
                     segment_ids_BxT=None, impl="auto", chunk_size=64):
    """Gated delta rule over a sequence; returns (o_BxTxHxV, final_state_BxHxKxV), both float32.

    Per (batch, head), state S in R^{K x V}:
        S = e^{g_t} S;   u = beta_t (v_t - S^T k_t);   S = S + k_t u^T;   o_t = S^T q_t.
    q, k: [B, T, H, K], L2-normalised, q already scaled by K^-0.5, repeated to the value-head count.
    v: [B, T, H, V].  g: [B, T, H], log decay <= 0.  beta: [B, T, H] in (0, 1).
    initial_state_BxHxKxV: state before position 0 (default zeros); it reaches only the first document.
    segment_ids_BxT: packed documents (contiguous runs of one id); the state restarts from zero where the id changes.
    impl: "auto" (default: "pallas" on TPU, else "chunked"), "chunked" (pure JAX, parallel within chunks of
    `chunk_size`), "pallas" (the Pallas TPU kernels of `pallas.py`, same chunk algebra; interpret mode off TPU) or
    "recurrent" (token by token); static under jit, like `chunk_size`.
    """
    impl = resolve_impl(impl)
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"gated_delta_rule: unknown impl {impl!r}; valid impls are "
                         f"{sorted(_IMPLEMENTATIONS) + ['auto']}")
    _check_shapes(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, segment_ids_BxT)
    if impl in _CHUNKED_IMPLS and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"gated_delta_rule: chunk_size must be a positive int (static), got {chunk_size!r}")
    return _IMPLEMENTATIONS[impl](q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                                  initial_state_BxHxKxV, segment_ids_BxT, chunk_size)


def _check_shapes(q, k, v, g, beta, initial_state, segment_ids):
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"gated_delta_rule: q and k must both be [B, T, H, K] with equal shapes (repeat key heads to "
                         f"the value-head count first), got q {q.shape}, k {k.shape}")
    batch, time, heads, key_dim = k.shape
    if v.ndim != 4 or v.shape[:3] != (batch, time, heads):
        raise ValueError(f"gated_delta_rule: v must be [B, T, H, V] = [{batch}, {time}, {heads}, V], got {v.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, time, heads):
            raise ValueError(f"gated_delta_rule: {name} must be [B, T, H] = {(batch, time, heads)}, got {x.shape}")
    if initial_state is not None and initial_state.shape != (batch, heads, key_dim, v.shape[-1]):
        raise ValueError(f"gated_delta_rule: initial_state must be [B, H, K, V] = "
                         f"{(batch, heads, key_dim, v.shape[-1])}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (batch, time):
        raise ValueError(f"gated_delta_rule: segment_ids must be [B, T] = {(batch, time)}, got {segment_ids.shape}")
