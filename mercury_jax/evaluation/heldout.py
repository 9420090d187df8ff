"""The paired comparison of two held-out evaluations of one run (SAO's `evals.jsonl` rows: the same tasks and
sampling seeds at every evaluation, so per-task difficulty cancels)."""
from __future__ import annotations

from mercury_jax.evaluation.stats import discordant_counts, paired_difference, sign_test


def heldout_summary(evals: list[dict]) -> dict | None:
    """The last evaluation against the first, task by task: the paired reward difference (t interval, paired t and
    sign tests), the all-effects pass rates with the exact McNemar test, and a one-line `message`. None when there
    are fewer than two evaluations or they are not over the same tasks."""
    if len(evals) < 2 or "task_all_effects_pass" not in evals[0] or evals[0]["task_ids"] != evals[-1]["task_ids"]:
        return None
    first, last = evals[0], evals[-1]
    paired = paired_difference(first["task_rewards"], last["task_rewards"])
    passed_before, passed_after = first["task_all_effects_pass"], last["task_all_effects_pass"]
    lost, gained = discordant_counts(passed_before, passed_after)
    passes = {"start": sum(passed_before) / len(passed_before), "end": sum(passed_after) / len(passed_after),
              "gained": gained, "lost": lost, "p_mcnemar_greater": sign_test(gained, lost, "greater")}
    low, high = paired["ci"]
    message = (f"held-out reward {paired['start_mean']:.3f} ({first['label']}) -> {paired['candidate_mean']:.3f} "
               f"({last['label']}): paired difference {paired['mean_difference']:+.3f} +- {paired['sem']:.3f} (sem), "
               f"{paired['confidence']:.0%} CI [{low:+.3f}, {high:+.3f}], paired t p = {paired['p_paired_t']:.2g}; "
               f"{paired['wins']} tasks better, {paired['losses']} worse, {paired['ties']} equal (sign test p = "
               f"{paired['p_sign_greater']:.2g}) over {paired['num_tasks']} tasks; all-effects pass "
               f"{passes['start']:.3f} -> {passes['end']:.3f} ({gained} tasks gained, {lost} lost, McNemar p = "
               f"{passes['p_mcnemar_greater']:.2g})")
    return {"start": {k: first[k] for k in ("step", "label", "reward", "reward_sem")},
            "end": {k: last[k] for k in ("step", "label", "reward", "reward_sem")}, "paired": paired,
            "all_effects_pass": passes, "message": message}
