"""Async SAO across hosts (train/async_batches.py): 2 and 3 processes on this machine, the released `consecutive`
layout and the `per_process` one, each run preempted on one process, resumed, killed and resumed again; the
accounting of every episode across the whole run. The launch helpers are tests/test_multihost_train.py's."""
from __future__ import annotations

import os
import re
import signal

import pytest

from tests.test_multihost_train import _committed, _kill, _launch, _records, _wait

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

# name: (processes, devices a process, overrides, preempted first); the released layout on 2 and 3 hosts (rollout,
# actor, critic a host each on 3), and every group on every host. One layout shows the preemption (suite time).
ASYNC_LAYOUTS = {
    "consecutive-2": (2, 4, ("--config.device_layout=consecutive",), True),
    "per_process-2": (2, 4, (), False),
    "consecutive-3": (3, 4, ("--config.device_layout=consecutive", "--config.devices.actor=4",
                             "--config.devices.critic=4"), False),
}
ASYNC_STEPS = 7  # a preemption lands at step 2-4, the next checkpoint (every 2) before the end


# The suite runs the released layout on 2 hosts; the other two (about 6-7 min each on 2 cores) when asked:
# MERCURY_MULTIHOST_ALL=1 python -m pytest tests/test_multihost_async.py
EVERY_LAYOUT = os.environ.get("MERCURY_MULTIHOST_ALL") == "1"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.skipif(
    name != "consecutive-2" and not EVERY_LAYOUT, reason="suite time: MERCURY_MULTIHOST_ALL=1 runs this layout too"))
    for name in ASYNC_LAYOUTS])
def test_async_sao_preempted_killed_and_resumed_settles_every_episode_once(tmp_path, layout, children):
    """Async SAO across hosts: (the released layout on 2 hosts) a SIGTERM to one process (every process saves the same
    step, exit 143) and a resume; a SIGKILL of every process once a later checkpoint is committed; a resume to the
    end. Across the whole run every trained episode id is unique, every episode handed out is trained on or counted
    as dropped (or still unsettled at the end), every trained trajectory's policy lag is within `max_staleness`, and
    the version rises by one a step once the critic-only steps are over."""
    processes, devices, overrides, preempt = ASYNC_LAYOUTS[layout]
    # no SFT warm start: the accounting needs none, and its stage would cost every phase a compile and a restore
    overrides = (*overrides, "--config.rollout.mode=async", f"--config.sao.steps={ASYNC_STEPS}",
                 "--config.checkpoint.every=2", "--config.sft.enabled=false")
    logs = tmp_path / "logs"
    logs.mkdir()
    run = tmp_path / layout
    launch = lambda: _launch(children, "sao", run, logs, processes, devices=devices,  # noqa: E731
                             overrides=overrides)
    metrics = run / "sao" / "sao_metrics.jsonl"

    preempted = 0
    if preempt:
        procs = launch()
        assert not _wait(procs, logs, until=lambda: metrics.exists() and len(_records(metrics)) >= 2)
        procs[-1].send_signal(signal.SIGTERM)  # one process only
        assert _wait(procs, logs, expect=143)
        saved = {re.search(r"\[sao\] SIGTERM received: checkpoint of step (\d+)", (logs / f"{layout}-p{r}.log")
                           .read_text()).group(1) for r in range(processes)}
        assert len(saved) == 1, saved
        preempted = int(saved.pop())

    procs = launch()
    later = preempted + 2 - preempted % 2
    assert later < ASYNC_STEPS
    assert not _wait(procs, logs, until=_committed(run / "sao" / "checkpoints", later))
    _kill(procs)
    assert _wait(launch(), logs)

    log0 = (logs / f"{layout}-p0.log").read_text()
    assert f"resumed from step {later}" in log0
    assert not preempt or f"resumed from step {preempted}" in log0
    batches, records = _records(run / "sao" / "batches.jsonl"), _records(metrics)
    assert [b["step"] for b in batches] == [r["step"] for r in records] == list(range(1, ASYNC_STEPS + 1))
    trained = [e for b in batches for e in b["episode_ids"]]
    assert len(trained) == len(set(trained)) and min(trained) >= 0
    max_staleness = 1  # the tiny config's sao.max_staleness
    assert all(0 <= lag <= max_staleness for b in batches for lag in b["policy_lag"])
    critic_only = 1
    assert [r["policy_version"] for r in records] == [max(0, s - critic_only) for s in range(1, ASYNC_STEPS + 1)]
    dropped = sum(b["dropped_stale"] + b["env_failures"] for b in batches)
    last = records[-1]
    assert len(trained) + dropped + last["episodes_unsettled"] == last["episodes_handed_out"]
