"""The group-baseline pipeline (mercury_jax/train/group_baseline.py): its advantages against a hand computation,
its config checks, and a tiny run on the 8-device CPU mesh that is SIGKILLed after a checkpoint and resumed, whose
later steps equal an uninterrupted run's."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from group_baseline_worker import run_tiny, tiny_group_config

from experiments.group_baseline import get_config
from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.runs.rundir import checkpoint_steps
from mercury_jax.train.group_baseline import GroupBaseline

pytestmark = [pytest.mark.usefixtures("persistent_compilation_cache"),  # each program compiles once
              pytest.mark.timeout(1800)]  # several processes of tiny runs on a loaded 2-core host

WORKER = Path(__file__).with_name("group_baseline_worker.py")
# wall-clock figures, and the slot occupancy (which decode chunk a continuation joins depends on tool-call timing)
TIMING_KEYS = ("tokens_per_s", "rollout_s", "learner_s", "step_time_s", "rollout_busy_s", "slot_occupancy",
               "barrier_wait_s", "group_wait_s")


def _trajectory(reward: float, n_prompt: int, n_action: int, failed: bool = False) -> Trajectory:
    return Trajectory(task_id="t", tokens=list(range(n_prompt + n_action)),
                      action_mask=[0] * n_prompt + [1] * n_action, rollout_logprobs=[0.0] * (n_prompt + n_action),
                      policy_versions=[-1] * n_prompt + [0] * n_action, prompt_length=n_prompt, reward=reward,
                      env_failure="open: boom" if failed else None, timings={"total_s": 1.0 + reward})


class _Tokenizer:
    pad_id = 0


def test_group_advantages_cover_every_action_token_and_drop_failed_groups():
    """Two groups of 3: (1, 0, 0.5) gives A = R - 0.5 over std 0.408 on each action token (hand computed), never
    on prompt tokens; a group with an environment failure is dropped whole (empty action mask)."""
    config = get_config("tiny")
    algorithm = GroupBaseline.__new__(GroupBaseline)
    algorithm.cfg, algorithm.rcfg, algorithm.tokenizer = config.group_baseline, config.rollout, _Tokenizer()
    algorithm.cfg.group_size, algorithm.cfg.std_normalize = 3, True
    trajectories = [_trajectory(1.0, 3, 2), _trajectory(0.0, 2, 4), _trajectory(0.5, 1, 1),
                    _trajectory(1.0, 2, 2), _trajectory(0.0, 2, 2, failed=True), _trajectory(0.0, 2, 2)]
    batch, metrics = algorithm._batch(trajectories, 2)
    std = math.sqrt(((0.5 ** 2) * 2 + 0.0) / 3)
    expected = [(1.0 - 0.5) / (std + 1e-6), (0.0 - 0.5) / (std + 1e-6), 0.0]
    for row, (trajectory, advantage) in enumerate(zip(trajectories[:3], expected)):
        mask = np.array(trajectory.action_mask, np.float32)
        np.testing.assert_allclose(batch["advantages"][row, :len(mask)], advantage * mask, rtol=1e-6)
        assert not batch["advantages"][row, len(mask):].any()
    assert not batch["action_mask"][3:].any() and not batch["advantages"][3:].any()
    assert metrics["groups_kept"] == 1 and metrics["env_failure_groups"] == 1


def test_config_checks_name_the_field_and_the_fix():
    validate_config(get_config("tiny"))
    validate_config(tiny_group_config(3))  # the kill test's layout: 4 rollout and 4 actor devices
    for field, value, message in (("rollout.mode", "async", r"set rollout.mode='sync'"),
                                  ("group_baseline.group_size", 1, r"needs >= 2 episodes"),
                                  ("group_baseline.policy_loss", "a2c", r"use one of \['dis', 'ppo'\]")):
        bad = get_config("tiny")
        section, name = field.split(".")
        bad[section][name] = value
        with pytest.raises(ConfigError, match=message):
            validate_config(bad)


@pytest.mark.slow
def test_a_sigkilled_run_resumes_from_its_checkpoint_as_if_never_killed(tmp_path, children):
    """The child runs the tiny pipeline (2 tasks x 4 episodes a step, a checkpoint every step) until the parent
    sees a committed checkpoint and SIGKILLs it; the run resumed from that checkpoint logs the same later steps
    (rewards, losses, lengths, advantages: every non-timing metric) as an uninterrupted run, exactly."""
    workdir, checkpoints = tmp_path / "killed", tmp_path / "killed" / "group_baseline" / "checkpoints"
    # the repository on the script's path; the session's compilation cache too (tests/conftest.py)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = children.start([sys.executable, str(WORKER), str(workdir), "1000"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 600
    while not checkpoint_steps(checkpoints):
        assert child.poll() is None, child.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the child committed no checkpoint in 600 s"
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    last = checkpoint_steps(checkpoints)[-1]
    total = last + 2
    _, resumed = run_tiny(workdir, total)
    _, reference = run_tiny(tmp_path / "reference", total)
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == list(range(1, total + 1))
    def untimed(record):  # a timing, or its window mean in the progress line ("window/barrier_wait_s")
        return {k: v for k, v in record.items() if k.split("/")[-1] not in TIMING_KEYS}

    for ours, theirs in zip(resumed[last:], reference[last:]):
        assert untimed(ours) == untimed(theirs), ours["step"]
    assert any(r["groups_kept"] for r in reference[last:]) and "policy_loss" in reference[-1]
