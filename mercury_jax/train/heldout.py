"""Held-out evaluations of a policy during a run: the same tasks with the same sampling seeds every time, so two
evaluations (and two runs on the same world) pair task by task. The SAO and group-baseline trainers evaluate so
before their first step, every `eval_every` steps and after their last (`STAGE/evals.jsonl`); the run ends with the
paired comparison of the last against the first (`eval_summary.json`, `STAGE_heldout.png`)."""
from __future__ import annotations

import json

import numpy as np

from mercury_jax.evaluation import heldout_summary
from mercury_jax.runs.rundir import StageDir, write_text
from mercury_jax.train.episode_metrics import trajectory_metrics
from mercury_jax.train.metrics import plot_evaluations


class HeldOut:
    """Evaluates on `tasks` with the episode runner `runner` (its own seed stream) on `rollouts`' shared engine."""

    def __init__(self, rollouts, runner, tasks: list[dict], stage: StageDir, title: str):
        self.rollouts, self.runner, self.tasks, self.stage, self.title = rollouts, runner, tasks, stage, title

    def evaluate(self, label: str) -> dict:
        """One evaluation with the latest weights: the batch's reward table plus each task's reward and pass, in
        task order (environment failures are scored 0 and kept, so that evaluations pair)."""
        self.rollouts.sync_engine()
        trajectories = self.runner.run(self.tasks)
        self.rollouts.evaluated()
        rewards = np.array([t.reward for t in trajectories])
        result = {"label": label, **trajectory_metrics(trajectories),
                  "reward_sem": float(rewards.std(ddof=1) / np.sqrt(len(rewards))) if len(rewards) > 1 else 0.0,
                  "task_ids": [t.task_id for t in trajectories], "task_rewards": rewards.tolist(),
                  "task_all_effects_pass": [bool(t.reward_parts.get("all_effects_pass")) for t in trajectories],
                  "env_failures": sum(t.env_failure is not None for t in trajectories)}
        print(f"[{self.stage.name}] eval ({label}): reward {result['reward']:.3f} +- {result['reward_sem']:.3f} "
              f"(sem over {len(rewards)} held-out tasks), all-effects pass {result['all_effects_pass']:.2f}",
              flush=True)
        return result

    def finish(self, evaluations: list[dict], final_label: str) -> None:
        """After the run: the paired summary of the last evaluation against the first, and the plot."""
        summary = heldout_summary(evaluations)
        if summary is not None and evaluations[-1]["label"] == final_label:
            write_text(self.stage.eval_summary, json.dumps(summary, indent=1) + "\n")
            print(f"[{self.stage.name}] {summary['message']}", flush=True)
            plot_evaluations(evaluations, self.stage.heldout_plot,
                             title=f"{self.title} held-out evaluations ({len(self.tasks)} tasks, the same seeds "
                                   f"each time)")
