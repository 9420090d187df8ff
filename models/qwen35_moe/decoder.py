"""Decoder layers and the scanned stack.

Per layer:  h = x + Mixer(norm_in(x));  x' = h + MoE(norm_post(h)),  Mixer = GatedDeltaNet or Attention.
The stack is `pattern * n_blocks + tail` (see `Qwen35MoeConfig.block_layout`): one `DecoderBlock` holds one
repeat of the pattern (3 GDN + 1 attention for Qwen3.5) with every parameter stacked over a leading `layers`
axis of size n_blocks, applied with `lax.scan` (one compiled block, any depth) under the configured remat
policy; the tail layers, if any, run one by one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mercury_jax.parallel import BATCH_LENGTH_EMBED, constrain
from models.qwen35_moe.attention import Attention
from models.qwen35_moe.config import FULL_ATTENTION, Qwen35MoeConfig
from models.qwen35_moe.gated_deltanet import GatedDeltaNet
from models.qwen35_moe.moe import SparseMoe
from models.qwen35_moe.moe_picked import reads_picked_experts
from models.qwen35_moe.norms import RMSNorm
from models.qwen35_moe.params import LAYERS

# Named residuals (`checkpoint_name`) a policy may keep: each layer's input, and the MoE's input (the mixer's output
# added to the residual stream). "full" keeps nothing inside a block: the backward pass recomputes the whole block
# from the scan carry (one [B, T, H] per block); the named policies keep 4 or 8 [B, T, H] per block of 4 layers
# and recompute one layer (or one half-layer) at a time.
LAYER_INPUT, MOE_INPUT = "layer_input", "moe_input"
_REMAT_POLICIES = {
    "full": None,
    "save_layer_inputs": jax.checkpoint_policies.save_only_these_names(LAYER_INPUT),
    "save_layer_and_moe_inputs": jax.checkpoint_policies.save_only_these_names(LAYER_INPUT, MOE_INPUT),
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, layer_type: str, *, rngs: nnx.Rngs):
        self.layer_type = layer_type
        pdt = config.weight_dtype
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.post_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if layer_type == FULL_ATTENTION:
            self.mixer = Attention(config, rngs=rngs)
        else:
            self.mixer = GatedDeltaNet(config, rngs=rngs)
        self.moe = SparseMoe(config, rngs=rngs)

    def __call__(self, x_BxTxH, *, positions_BxT, segment_ids_BxT, cache, cache_start_B, valid_BxT,
                 stacked_experts=None, row_split=None):
        x_BxTxH = checkpoint_name(constrain(x_BxTxH, BATCH_LENGTH_EMBED), LAYER_INPUT)
        normed = self.input_norm(x_BxTxH)
        if self.layer_type == FULL_ATTENTION:
            mixed, new_cache = self.mixer(normed, positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT,
                                          cache=cache, cache_start_B=cache_start_B, valid_BxT=valid_BxT,
                                          row_split=row_split)
        else:
            mixed, new_cache = self.mixer(normed, segment_ids_BxT=segment_ids_BxT, cache=cache, valid_BxT=valid_BxT,
                                          row_split=row_split)
        h_BxTxH = checkpoint_name(constrain(x_BxTxH + mixed, BATCH_LENGTH_EMBED), MOE_INPUT)
        moe_out, aux = self.moe(self.post_norm(h_BxTxH), stacked_experts=stacked_experts)
        return constrain(h_BxTxH + moe_out, BATCH_LENGTH_EMBED), new_cache, aux


class DecoderBlock(nnx.Module):
    """One repeat of the layer pattern; as a scanned stack its parameters carry a leading `layers` axis."""

    def __init__(self, config: Qwen35MoeConfig, pattern: tuple[str, ...], *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, t, rngs=rngs) for t in pattern])

    def __call__(self, x_BxTxH, *, caches, stacked_experts=None, **kwargs):
        new_caches, auxes = [], []
        for i, layer in enumerate(self.layers):
            x_BxTxH, new_cache, aux = layer(x_BxTxH, cache=None if caches is None else caches[i],
                                            stacked_experts=None if stacked_experts is None else stacked_experts[i],
                                            **kwargs)
            new_caches.append(new_cache)
            auxes.append(aux)
        return x_BxTxH, new_caches, _sum_aux(auxes)


def create_block_stack(config: Qwen35MoeConfig, pattern: tuple[str, ...], n_blocks: int,
                       rngs: nnx.Rngs) -> DecoderBlock:
    """A DecoderBlock whose parameters are n_blocks independent initialisations stacked on axis 0, whose logical
    name (metadata `logical_axes`) is `LAYERS`."""
    keys = jax.random.split(rngs.params(), n_blocks)

    def init_one(key):
        return nnx.split(DecoderBlock(config, pattern, rngs=nnx.Rngs(params=key)))[1]

    graphdef = nnx.split(nnx.eval_shape(lambda: DecoderBlock(config, pattern, rngs=nnx.Rngs(params=0))))[0]
    blocks = nnx.merge(graphdef, jax.vmap(init_one)(keys))
    for _, variable in nnx.iter_graph(blocks):  # the stacked axis is named, so a layout never guesses it
        if isinstance(variable, nnx.Variable) and "logical_axes" in variable.get_metadata():
            variable.set_metadata(logical_axes=(LAYERS, *variable.get_metadata()["logical_axes"]))
    return blocks


def apply_block_stack(blocks: DecoderBlock, x_BxTxH, *, caches, remat_policy: str, **kwargs):
    """Scan the stacked block over its leading axis; caches (if any) are stacked the same way."""
    graphdef, state = nnx.split(blocks)
    B, T = x_BxTxH.shape[:2]
    gather_from_stacks = caches is not None and reads_picked_experts(B * T, blocks.layers[0].moe.config)
    # a decode step picks a few experts: gather them from the whole [L, E, ...] stacks by (layer, expert), so the
    # scan never copies a layer's slice of every expert out of the stack (XLA cannot fuse that slice into a gather)
    stacks = [(layer["moe"]["expert_gate"][...], layer["moe"]["expert_up"][...], layer["moe"]["expert_down"][...])
              for layer in state["layers"].values()] if gather_from_stacks else None

    # attention K/V ride whole ([L, B, S, K, D]) in the carry, each layer's read and written in place at its index:
    # scanned as xs / ys, every step would copy each layer's K/V out of the stack and back
    in_carry = [caches is not None and "k" in c for c in (caches or [])]
    carried = [c if keep else None for c, keep in zip(caches or [], in_carry)]
    scanned_caches = None if caches is None else [None if keep else c for c, keep in zip(caches, in_carry)]

    def body(carry, scanned):
        x, kv = carry
        block_state, block_caches, index = scanned
        if block_caches is not None:
            block_caches = [dict(c, layer=index) if keep else b for c, b, keep in zip(kv, block_caches, in_carry)]
        block = nnx.merge(graphdef, block_state)
        stacked = None if stacks is None else [(*stack, index) for stack in stacks]
        x, new_caches, aux = block(x, caches=block_caches, stacked_experts=stacked, **kwargs)
        if new_caches and block_caches is not None:
            kv = [c if keep else None for c, keep in zip(new_caches, in_carry)]
            new_caches = [None if keep else c for c, keep in zip(new_caches, in_carry)]
        return (x, kv), (new_caches, aux)

    if remat_policy != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[remat_policy], prevent_cse=False)
    n_blocks = jax.tree.leaves(state)[0].shape[0]
    (x_BxTxH, carried), (new_caches, aux) = jax.lax.scan(body, (x_BxTxH, carried),
                                                         (state, scanned_caches, jnp.arange(n_blocks)))
    if caches is not None:
        new_caches = [k if keep else c for k, c, keep in zip(carried, new_caches, in_carry)]
    return x_BxTxH, new_caches, jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)


def _sum_aux(auxes: list[dict]) -> dict:
    return jax.tree.map(lambda *xs: sum(xs), *auxes)
