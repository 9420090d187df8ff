"""Evaluation of saved checkpoints: interval and paired-test statistics, per-checkpoint records, the released
checkpoint-selection rule, and the accuracy / over-search frontier plot (driven by `mercury_jax.sweep`)."""
from mercury_jax.evaluation.frontier_plot import plot_frontier
from mercury_jax.evaluation.heldout import heldout_summary
from mercury_jax.evaluation.selection import Selection, select_checkpoint
from mercury_jax.evaluation.stats import (
                                          discordant_counts,
                                          mcnemar_exact,
                                          mean_interval,
                                          paired_difference,
                                          sign_test,
                                          wilson_interval,
)
from mercury_jax.evaluation.table import EpisodeOutcomes, checkpoint_record, format_table, outcomes_from_trajectories

__all__ = ["EpisodeOutcomes", "Selection", "checkpoint_record", "discordant_counts", "format_table",
           "heldout_summary",
           "mcnemar_exact", "mean_interval", "outcomes_from_trajectories", "paired_difference", "plot_frontier",
           "select_checkpoint", "sign_test", "wilson_interval"]
