"""The critic: the policy's backbone with a scalar value head, and the trainable/frozen split of SAO.

    V[b, t] = norm_final(x)[b, t] @ w_value + b_value        (fp32; w_value, b_value start at 0)
Initialised from the base weights (`Qwen35MoeCritic.from_policy`). Token mixing (gated attention, Gated DeltaNet,
with the q/k norms and the GDN output norm inside them) and the embedding are frozen; the MoE (router, routed
and shared experts, shared-expert gate), the decoder-level norms (input, post-mixer, final) and the value head
train. `critic_trainable` is the nnx filter that says so.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.parallel import copy_into
from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.model import Qwen35MoeForCausalLM, Qwen35MoeModel
from models.qwen35_moe.params import constant_init, make_param


class Qwen35MoeCritic(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen35MoeModel(config, rngs=rngs)
        self.value_head = make_param(rngs, constant_init(0.0), (config.hidden_size,), ("embed",), jnp.float32)
        self.value_bias = make_param(rngs, constant_init(0.0), (), (), jnp.float32)

    @classmethod
    def from_policy(cls, policy: Qwen35MoeForCausalLM, *, mesh=None) -> Qwen35MoeCritic:
        """A critic whose backbone is a copy of the policy's (value head zero). With a `mesh`, every parameter is
        copied straight into its sharding there (the policy may live on another mesh; nothing is gathered)."""
        abstract = nnx.eval_shape(lambda: cls(policy.config, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        if mesh is None:
            state["model"] = jax.tree.map(jnp.copy, nnx.state(policy.model))
        else:
            state["model"] = copy_into(nnx.state(policy.model), state["model"], mesh)
        state["value_head"].set_value(jnp.zeros((policy.config.hidden_size,), jnp.float32))
        state["value_bias"].set_value(jnp.zeros((), jnp.float32))
        return nnx.merge(graphdef, state)

    def __call__(self, input_ids_BxT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Values [B, T] fp32; entry t is the value of the state that predicts token t + 1."""
        hidden_BxTxH, _, _ = self.model(input_ids_BxT, positions_BxT=positions, segment_ids_BxT=segment_ids)
        return (jnp.einsum("bth,h->bt", hidden_BxTxH.astype(jnp.float32), self.value_head[...])
                + self.value_bias[...])


def critic_trainable(path: tuple, value) -> bool:
    """nnx filter: True for the parameters SAO trains in the critic (see the module docstring)."""
    if not isinstance(value, nnx.Param):
        return False
    keys = [str(p) for p in path]
    if "mixer" in keys or "embed" in keys:
        return False
    return True


def split_critic_params(critic: Qwen35MoeCritic):
    """(graphdef, trainable state, frozen state) of the critic by `critic_trainable`."""
    return nnx.split(critic, critic_trainable, ...)
