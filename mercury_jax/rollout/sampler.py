"""Jitted prefill and decode over a fixed number of slots sharing one batched decode cache.

The device state (a dict pytree, `Sampler.init_state()`) holds the model cache for `num_slots` rows plus, per slot,
the request it serves: its last sampled token (not yet fed to the model), how many tokens it has sampled, its
token budget, request id, seed, sampling parameters and stop ids. Two compiled paths act on it:

- `prefill`: feed a (bucketed, right-padded) token run into ONE slot and sample that request's first token.
  The slot's row is taken out of the batched cache (or a fresh empty row for a new sequence), advanced by a
  1-row backbone call on the cache (what `model.extend` does, with the LM head applied to the last real position
  only), and scattered back at the slot index. Three jitted calls: take, prefill the row, commit; the middle one,
  which holds the model, does not depend on the number of slots, so it compiles once per bucket length. Compute
  is that of the row alone; the other slots' rows are not touched. A continuation ("append observation tokens,
  then generate") is the same call without the reset: the row keeps its history and only new tokens are computed.
  A run longer than `prefill_chunk(max_length)` tokens is fed in chunks of that size (each a prefill of the row
  without the reset, the sample of the last one kept): a cached forward's attention scores are [T, max_length]
  per head, which at a 131,072-token cache and T = 122,880 would be ~1 TB; chunks keep them under ~2 GiB a head.
- `decode`: `num_steps` decode steps for all slots in one `lax.scan` (T = 1 extends). Inactive slots run with
  length 0, which leaves their cache row unchanged (attention writes are dropped, GDN state and conv window
  are kept), so a finished request's cache stays valid for a continuation. A slot stops on a stop token or when
  its budget is spent; its later steps emit nothing.

Cache layout: leaves have the slot (batch) axis at 0, except those under cache["blocks"], which are stacked over
the scanned blocks first, so their slot axis is 1 (`slot_axis`).

On a mesh (`mesh=`, one rollout replica): the weights are cast to `param_dtype` and sharded over the mesh by their
logical names, the state is sharded with them (`layout.py`: slots over the row axes, heads over tensor), every
program traces under the mesh (so `constrain`, the expert-parallel MoE and the Pallas kernels see it), decode keeps
the state in its layout, and a prefill moves one slot's row (`slot_rows.py`). Results equal the single-device
sampler's up to the order of sharded sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mercury_jax.parallel import with_mesh_context
from mercury_jax.rollout.layout import rollout_weights, state_shardings
from mercury_jax.rollout.sampling import sample_tokens, token_keys
from mercury_jax.rollout.sizing import check_replica_fits
from mercury_jax.rollout.slot_rows import put_row, put_row_on_mesh, slot_axis, take_row, take_row_on_mesh

__all__ = ["Sampler", "TokenSampling", "bucket_length", "empty_state", "prefill_chunk", "put_row", "slot_axis",
           "take_row"]

MAX_STOP_IDS = 8
MIN_BUCKET = 16
PREFILL_SCORES = 2 ** 29  # T x max_length of one prefill call: a head's fp32 scores stay <= 2 GiB


@dataclasses.dataclass(frozen=True)
class TokenSampling:
    """How one request's tokens are drawn and when it stops: its key (seed, request id), temperature / top-k / top-p
    and stop token ids."""
    request_id: int
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


def bucket_length(length: int, max_length: int) -> int:
    """Power-of-two padded length for a prefill of `length` tokens (at least MIN_BUCKET, at most max_length)."""
    bucket = MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return max(length, min(bucket, max_length))


def prefill_chunk(max_length: int, scores: int = PREFILL_SCORES) -> int:
    """The most tokens one prefill call takes on a cache of `max_length` positions: the largest power of two with
    chunk x max_length <= `scores` (at PREFILL_SCORES: 16,384 at 24,576; 4,096 at 131,072), at least MIN_BUCKET, at
    most `max_length`."""
    chunk = MIN_BUCKET
    while chunk * 2 * max_length <= scores:
        chunk *= 2
    return min(chunk, max_length)


class Sampler:
    """Owns the compiled prefill/decode functions and the model weights they run with.

    `update_weights(model, version)` swaps in new weights (same structure and shapes) without recompiling; every
    call reports the `policy_version` of the weights it ran with. `prefill_scores` bounds T x max_length of one
    prefill call (`prefill_chunk`).
    """

    def __init__(self, model: nnx.Module, *, num_slots: int, max_length: int, policy_version: int = 0,
                 mesh: Mesh | None = None, param_dtype=None, hbm_gib: float | None = None,
                 weights: nnx.State | None = None, prefill_scores: int = PREFILL_SCORES):
        self.num_slots, self.max_length = num_slots, max_length
        self.prefill_chunk = prefill_chunk(max_length, prefill_scores)
        self.mesh, self.param_dtype = mesh, param_dtype
        self.graphdef, params = nnx.split(model)
        self._init_cache = model.init_cache
        self.memory = None
        if mesh is not None:  # before any weight moves or program compiles
            self.memory = check_replica_fits(params, jax.eval_shape(self._empty_state), mesh, num_slots=num_slots,
                                             max_length=max_length, param_dtype=param_dtype, hbm_gib=hbm_gib)
        # one tuple, swapped whole: a call never mixes two versions
        # `weights`: already cast and laid out on `mesh` (a collective publish: replicas.py)
        self._weights = (weights if weights is not None else rollout_weights(params, mesh, param_dtype),
                         policy_version)
        self._weights_structure = jax.tree.structure(params)
        # hashes the graphdef once
        self._prefill_row, self._decode, self._take_row, self._commit_row = _compiled(self.graphdef, max_length, mesh)

    @property
    def policy_version(self) -> int:
        return self._weights[1]

    def update_weights(self, model: nnx.Module, version: int | None = None) -> None:
        """Sample with `model`'s weights from the next call on; `version` defaults to the current one + 1."""
        self.set_weights(self.prepare_weights(model), version)

    def prepare_weights(self, model) -> nnx.State:
        """`model`'s weights (a model, or the `nnx.State` of one, of the sampler's structure) cast to the rollout
        dtype where they are and moved into the sampler's layout, device to device; on a mesh always a copy of
        their own, so the caller may donate or delete what it passed."""
        return rollout_weights(self.weights_of(model), self.mesh, self.param_dtype)  # cast where they are, then move

    def weights_of(self, model) -> nnx.State:
        """The `nnx.State` of `model` (a model or a state); ValueError unless it has the sampler's structure."""
        if isinstance(model, nnx.Module):
            graphdef, params = nnx.split(model)
            same = graphdef == self.graphdef
        else:
            params = model
            same = jax.tree.structure(params) == self._weights_structure
        if not same:
            raise ValueError("new weights need the same structure as the sampler's model (same config; a whole "
                             "nnx.state(model)); build a new Sampler/Engine for a different model")
        return params

    def set_weights(self, params: nnx.State, version: int | None = None) -> None:
        """Sample with `prepare_weights`' output from the next call on (version: default the current one + 1)."""
        self._weights = (params, self.policy_version + 1 if version is None else version)

    def drop_weights(self) -> None:
        """Let go of the weights (their device memory is freed once nothing else holds them); version -1 until the
        next `set_weights`, and sampling before that raises."""
        self._weights = (None, -1)

    @property
    def has_weights(self) -> bool:
        return self._weights[0] is not None

    def _loaded_weights(self) -> tuple:
        if not self.has_weights:
            raise RuntimeError("this sampler's weights were dropped (drop_weights); hand it new ones "
                               "(update_weights / set_weights) before sampling")
        return self._weights

    def init_state(self) -> dict:
        """The empty state, laid out on the mesh (`layout.state_shardings`) when there is one."""
        if self.mesh is None:
            return self._empty_state()
        shardings = state_shardings(jax.eval_shape(self._empty_state), self.mesh)
        return jax.jit(self._empty_state, out_shardings=shardings)()

    def _empty_state(self) -> dict:
        return empty_state(self._init_cache, self.num_slots, self.max_length)

    def prefill(self, state: dict, slot: int, tokens: list[int], sampling: TokenSampling, *, reset: bool,
                limit: int):
        """Feed `tokens` into `slot` (after its history unless `reset`) and sample the first new token of the
        request `sampling` describes, which may sample at most `limit` tokens.

        Returns (state, (token, logprob, sampling_logprob, done), policy_version): device scalars and the weights
        version that sampled the token; `state` is donated.
        """
        stop_token_ids = sampling.stop_token_ids
        if len(stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop_token_ids)} stop token ids given; the sampler holds at most {MAX_STOP_IDS}")
        stops = jnp.asarray(list(stop_token_ids) + [-1] * (MAX_STOP_IDS - len(stop_token_ids)), jnp.int32)
        request = {"reset": jnp.asarray(reset), "limit": jnp.int32(limit),
                   "request_id": jnp.int32(sampling.request_id), "seed": jnp.int32(sampling.seed),
                   "temperature": jnp.float32(sampling.temperature), "top_k": jnp.int32(sampling.top_k),
                   "top_p": jnp.float32(sampling.top_p), "stop_ids": stops}
        slot = jnp.int32(slot)
        row = self._take_row(state["cache"], slot)
        params, version = self._loaded_weights()
        tokens = list(tokens)
        chunk = self.prefill_chunk
        for start in range(0, max(len(tokens), 1), chunk):  # the first chunk resets (when asked), the rest append
            piece = tokens[start:start + chunk]
            T = bucket_length(len(piece), self.max_length)
            ids = jnp.asarray([piece + [0] * (T - len(piece))], jnp.int32)
            row, first = self._prefill_row(params, row, ids, jnp.int32(len(piece)),
                                           request if start == 0 else dict(request, reset=jnp.asarray(False)))
        return self._commit_row(state, row, slot, first, request), first, version

    def decode(self, state: dict, num_steps: int):
        """`num_steps` decode steps for every active slot. Returns (state, outputs, policy_version) with outputs
        {"token", "logprob", "sampling_logprob", "emitted"}: [num_steps, num_slots] each."""
        params, version = self._loaded_weights()
        state, outputs = self._decode(params, state, num_steps)
        return state, outputs, version


def empty_state(init_cache, num_slots: int, max_length: int) -> dict:
    """The sampler state of `num_slots` idle slots: the model's empty cache (`init_cache(num_slots, max_length)`)
    and every per-slot field."""
    S = num_slots
    return {
        "cache": init_cache(S, max_length),
        "last_token": jnp.zeros((S,), jnp.int32),
        "active": jnp.zeros((S,), bool),
        "num_generated": jnp.zeros((S,), jnp.int32),
        "limit": jnp.zeros((S,), jnp.int32),
        "request_id": jnp.zeros((S,), jnp.int32),
        "seed": jnp.zeros((S,), jnp.int32),
        "temperature": jnp.ones((S,), jnp.float32),
        "top_k": jnp.zeros((S,), jnp.int32),
        "top_p": jnp.ones((S,), jnp.float32),
        "stop_ids": jnp.full((S, MAX_STOP_IDS), -1, jnp.int32),
    }


def _finished(token, num_generated, limit, stop_ids):
    """Done after sampling `token` (the num_generated-th token): a stop id, or the budget is spent."""
    return jnp.any(token[..., None] == stop_ids, axis=-1) | (num_generated >= limit)


def _prefill_row(graphdef, max_length, params, row, ids_1xT, length, request):
    """Advance one slot's 1-row cache by the real `length` tokens of `ids_1xT` and sample the first new token.
    Independent of the number of slots, so one compilation per bucket serves every engine."""
    model = nnx.merge(graphdef, params)
    fresh = model.init_cache(1, max_length)
    row = jax.tree.map(lambda f, r: jnp.where(request["reset"], f, r), fresh, row)
    # backbone + LM head on the last real position only: [T, V] fp32 logits of a long prompt never exist
    # (`model.extend` would build them all; 16k tokens x 248k vocab is 16 GB)
    hidden_1xTxH, row, _ = model.model(ids_1xT, cache=row, lengths_B=length[None])
    last_hidden_1x1xH = jax.lax.dynamic_slice_in_dim(hidden_1xTxH, length - 1, 1, axis=1)
    last_logits_1xV = model.logits(last_hidden_1x1xH)[:, 0]
    one = lambda x: jnp.asarray(x)[None]
    keys = token_keys(one(request["seed"]), one(request["request_id"]), jnp.zeros((1,), jnp.int32))
    token, logprob, sampling_logprob = sample_tokens(last_logits_1xV, keys, one(request["temperature"]),
                                                     one(request["top_k"]), one(request["top_p"]))
    token, logprob, sampling_logprob = token[0], logprob[0], sampling_logprob[0]
    done = _finished(token, 1, request["limit"], request["stop_ids"])
    return row, (token, logprob, sampling_logprob, done)


def _commit_row(put, state, row, slot, first, request):
    """Scatter the prefilled row back into the batched cache (`put`) and record the slot's new request."""
    token, _, _, done = first
    new_state = dict(state)
    new_state["cache"] = put(state["cache"], row, slot)
    updates = {"last_token": token, "active": ~done, "num_generated": jnp.int32(1)}
    updates.update({k: request[k] for k in ("limit", "request_id", "seed", "temperature", "top_k", "top_p",
                                            "stop_ids")})
    for name, value in updates.items():
        new_state[name] = state[name].at[slot].set(value)
    return new_state


def _decode(graphdef, mesh, params, state, num_steps):
    model = nnx.merge(graphdef, params)
    keep_layout = (lambda s: s) if mesh is None else (
        lambda s: jax.lax.with_sharding_constraint(s, state_shardings(s, mesh)))

    def step(state, _):
        active_B = state["active"]
        logits_Bx1xV, cache = model.extend(state["last_token"][:, None], state["cache"], active_B.astype(jnp.int32))
        keys_B = token_keys(state["seed"], state["request_id"], state["num_generated"])
        token_B, logprob_B, sampling_logprob_B = sample_tokens(logits_Bx1xV[:, 0], keys_B, state["temperature"],
                                                               state["top_k"], state["top_p"])
        num_generated_B = state["num_generated"] + active_B.astype(jnp.int32)
        done_B = active_B & _finished(token_B, num_generated_B, state["limit"], state["stop_ids"])
        new_state = keep_layout(dict(state, cache=cache, num_generated=num_generated_B, active=active_B & ~done_B,
                                     last_token=jnp.where(active_B, token_B, state["last_token"])))
        out = {"token": token_B, "logprob": logprob_B, "sampling_logprob": sampling_logprob_B, "emitted": active_B}
        return new_state, out

    return jax.lax.scan(step, state, None, length=num_steps)


# Shared by every Sampler with the same model structure, shapes and mesh, so engines reuse compiled code. The
# model's graphdef is bound here, once, rather than passed as a static argument: hashing it costs ~1 ms per call.
@functools.lru_cache(maxsize=16)
def _compiled(graphdef, max_length: int, mesh: Mesh | None):
    on_mesh = functools.partial(with_mesh_context, mesh=mesh)
    prefill_row = jax.jit(on_mesh(functools.partial(_prefill_row, graphdef, max_length)), donate_argnums=(1,))
    decode = jax.jit(on_mesh(functools.partial(_decode, graphdef, mesh)), static_argnums=(2,), donate_argnums=(1,))
    if mesh is None:
        take, put = take_row, put_row
    else:
        take = functools.partial(take_row_on_mesh, mesh=mesh)
        put = functools.partial(put_row_on_mesh, mesh=mesh)
    commit = jax.jit(functools.partial(_commit_row, put), donate_argnums=(0,))
    return prefill_row, decode, jax.jit(take), commit
