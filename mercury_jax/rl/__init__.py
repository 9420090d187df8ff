"""RL math shared by both pipelines: advantages (skip-observation GAE, group advantages), losses (DIS, PPO clip,
value, k1/k2/k3 KL) and loss aggregation as exact (numerator, denominator) pairs. See docs/ALGORITHMS.md."""
from mercury_jax.rl import advantages, aggregation, losses
from mercury_jax.rl.advantages import (
                                       group_advantages,
                                       length_adaptive_lambda,
                                       place_terminal_reward,
                                       skip_observation_gae,
)
from mercury_jax.rl.aggregation import LOSS_AGG_MODES, aggregate
from mercury_jax.rl.losses import dis_policy_loss, kl_k3, ppo_clip_loss, value_loss

__all__ = ["advantages", "aggregation", "losses", "skip_observation_gae", "length_adaptive_lambda",
           "group_advantages", "place_terminal_reward", "aggregate", "LOSS_AGG_MODES", "dis_policy_loss",
           "ppo_clip_loss", "value_loss", "kl_k3"]
