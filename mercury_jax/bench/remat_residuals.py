"""Saved residuals per token per block under each remat policy: what the backward pass of the decoder stack keeps
from its forward, read from the traced program (`jax.ad_checkpoint` saved residuals), no compile and no arrays.

    python -m mercury_jax.bench.remat_residuals [--preset qwen3.5-35b-a3b] [--tokens 4096] [--attention blockwise]

Per block = the residual bytes of a stack of 2 blocks minus those of 1 block (what the embedding, the final norm
and the loss keep cancels), divided by the tokens of the batch. A block is one repeat of the layer pattern (3 GDN
+ 1 attention for Qwen3.5). Residuals are counted at their own dtype (bf16 activations under the bf16 compute
dtype, fp32 where the model computes in fp32); parameters (the stacked weights the backward pass reads anyway) are
not residuals and are left out.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # the list behind jax.ad_checkpoint.print_saved_residuals

from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.config import PRESETS, REMAT_POLICIES, Qwen35MoeConfig


def stack_of(cfg: Qwen35MoeConfig, n_blocks: int) -> Qwen35MoeConfig:
    """`cfg` with `n_blocks` repeats of its layer pattern and no tail."""
    pattern = cfg.block_layout()[0]
    return dataclasses.replace(cfg, num_hidden_layers=n_blocks * len(pattern), layer_types=pattern * n_blocks)


def residual_bytes(cfg: Qwen35MoeConfig, batch: int, tokens: int) -> int:
    """Bytes the backward pass of sum(backbone(ids)) w.r.t. the parameters keeps, parameters excluded."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))

    def loss(params, ids_BxT):
        hidden_BxTxH, _, _ = nnx.merge(graphdef, params).model(ids_BxT)
        return jnp.sum(hidden_BxTxH.astype(jnp.float32))

    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    residuals = saved_residuals(loss, params, ids)
    return int(sum(np.prod(aval.shape) * aval.dtype.itemsize for aval, source in residuals
                   if "from the argument" not in source))


def bytes_per_token_per_block(cfg: Qwen35MoeConfig, *, batch: int = 1, tokens: int = 4096) -> float:
    return (residual_bytes(stack_of(cfg, 2), batch, tokens) - residual_bytes(stack_of(cfg, 1), batch, tokens)) / (
        batch * tokens)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--attention", default="blockwise", help="attention_impl (splash traces only on TPU)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype")
    args = parser.parse_args(argv)
    print("| remat_policy | saved residuals per token per block (KiB) |\n|---|---|")
    for policy in REMAT_POLICIES:
        cfg = PRESETS[args.preset](remat_policy=policy, attention_impl=args.attention, dtype=args.dtype)
        value = bytes_per_token_per_block(cfg, tokens=args.tokens)
        print(f"| {policy} | {value / 1024:.2f} |", flush=True)
    print(f"\n{args.preset}, hidden {cfg.hidden_size}, one row of {args.tokens} tokens, attention {args.attention}, "
          f"compute {args.dtype}; block = {len(cfg.block_layout()[0])} layers {cfg.block_layout()[0]}")


if __name__ == "__main__":
    main()
