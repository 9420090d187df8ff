"""Shared inputs and ground truth for the gated delta rule tests of the blocked chunked path and the Pallas kernel.

`naive_gated_delta` is the recurrence written out per batch, head and token in float64; `make_inputs` draws inputs
that honour the kernels' contract (unit q and k, q scaled by K^-0.5, g <= 0, beta in (0, 1)).
"""
import numpy as np


def make_inputs(seed, batch, time, heads, key_dim, value_dim):
    """float32 inputs; g uniform in [-2, 0] with ~10% of entries at -20 (exp underflows across a chunk)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, time, heads, key_dim))
    k = rng.normal(size=(batch, time, heads, key_dim))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * key_dim ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = rng.uniform(-2.0, 0.0, size=(batch, time, heads))
    g[rng.random(g.shape) < 0.1] = -20.0
    inputs = dict(q=q, k=k, v=rng.normal(size=(batch, time, heads, value_dim)), g=g,
                  beta=rng.uniform(0.02, 0.98, size=(batch, time, heads)),
                  initial_state=rng.normal(size=(batch, heads, key_dim, value_dim)))
    return {name: x.astype(np.float32) for name, x in inputs.items()}


def segments(lengths_per_row, ids_per_row):
    """[B, T] int32 segment ids from per-row document lengths and ids."""
    rows = [np.concatenate([np.full(n, i) for n, i in zip(lengths, ids)])
            for lengths, ids in zip(lengths_per_row, ids_per_row)]
    return np.stack(rows).astype(np.int32)


def naive_gated_delta(q, k, v, g, beta, initial_state=None, segment_ids=None):
    """S = e^g S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q, in float64; the state restarts at id changes."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    batch, time, heads, key_dim = k.shape
    out = np.zeros(v.shape)
    final = np.zeros((batch, heads, key_dim, v.shape[-1]))
    for b in range(batch):
        for h in range(heads):
            state = np.zeros((key_dim, v.shape[-1])) if initial_state is None else np.array(
                initial_state[b, h], np.float64)
            for t in range(time):
                if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                    state = np.zeros_like(state)
                state = np.exp(g[b, t, h]) * state
                u = beta[b, t, h] * (v[b, t, h] - state.T @ k[b, t, h])
                state = state + np.outer(k[b, t, h], u)
                out[b, t, h] = state.T @ q[b, t, h]
            final[b, h] = state
    return out, final
