"""SAO and pivot-GRPO steps with injected parts (`rollouts.Seams`): a scripted engine whose every turn is a known
function of its request id, and a reward that is a known function of the sampled tokens, so the logged rewards
and the published versions can be computed here. The runs live under a `file://` URI (a run directory named the
way a remote one is), and the SAO run is killed and resumed there."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from scripted_engine import ScriptedEngine, script

from experiments.grpo import get_config as grpo_config
from experiments.sao import get_config as sao_config
from mercury_jax.train.grpo import run_grpo
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sao import run_sao

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")  # tests/conftest.py


def score(tokens: list[int]) -> float:
    return (sum(tokens) % 11) / 10.0


def injected_reward(task, trajectory, grade):
    start, end = trajectory.turn_spans[0]
    return score(trajectory.tokens[start:end - 1]), {"scored": True}  # the turn without its stop token


@pytest.mark.slow
def test_sao_steps_with_a_scripted_engine_and_an_injected_reward_resume_under_a_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URI taken for a relative path would create ./file:/...
    config = sao_config("tiny")
    config.model.overrides.num_hidden_layers = 2
    config.sft.enabled = False
    config.sao.steps, config.sao.batch_prompts, config.sao.critic_only_steps, config.sao.eval_every = 2, 4, 0, 0
    config.rollout.num_slots, config.rollout.max_tool_turns = 4, 1
    config.world.num_train_tasks, config.world.num_eval_tasks = 8, 2
    config.checkpoint.every = 1
    config.sao.pack_rows, config.sao.actor_micro_batches, config.sao.critic_micro_batches = True, 2, 2
    uri = f"file://{tmp_path}/run"
    ScriptedEngine.made = []
    _, _, first = run_sao(config, uri, Seams(make_engine=ScriptedEngine, reward=injected_reward))
    engine = ScriptedEngine.made[-1]
    assert engine.versions == [1, 2]  # one publish per policy update
    stride = config.rollout.max_tool_turns + 1  # request id of turn 0 of episode e: e * stride
    for record in first:  # step s trains on episodes 4(s-1) .. 4s-1 of the seeded task order, one turn each
        episodes = range(4 * (record["step"] - 1), 4 * record["step"])
        assert record["reward"] == pytest.approx(np.mean([score(script(e * stride)) for e in episodes]))
        assert record["staleness_max"] == 0
        assert record["rows_used"] < 4  # short episodes share packed rows
    assert record["policy_version"] == 2
    evals = [json.loads(line) for line in (tmp_path / "run" / "sao" / "evals.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["warm start", "after SAO"]
    assert not os.path.exists(tmp_path / "file:")

    config.sao.steps = 3
    _, _, resumed = run_sao(config, uri, Seams(make_engine=ScriptedEngine, reward=injected_reward))
    assert ScriptedEngine.made[-1].versions == [2, 3]  # the restored weights are republished first
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == first
    assert resumed[2]["reward"] == pytest.approx(np.mean([score(script(e * stride)) for e in range(8, 12)]))
    meta = json.loads((tmp_path / "run" / "sao" / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta == {"step": 3, "version": 3, "tasks_consumed": 12}


@pytest.mark.slow
def test_grpo_steps_with_a_scripted_engine_and_an_injected_reward(tmp_path):
    config = grpo_config("tiny")
    config.model.overrides.num_hidden_layers = 2
    config.sft.enabled = False
    config.world.num_train_tasks = 16
    config.grpo.steps, config.grpo.batch_states, config.grpo.group_size, config.grpo.pivot_tasks = 2, 2, 4, 4
    config.rollout.num_slots, config.rollout.max_turn_tokens = 8, 16
    config.grpo.pack_rows, config.grpo.micro_batches = True, 2
    ScriptedEngine.made = []
    _, history, _ = run_grpo(config, f"file://{tmp_path}/run", Seams(make_engine=ScriptedEngine,
                                                                     reward=injected_reward))
    assert ScriptedEngine.made[-1].versions == [1, 2]
    K = config.grpo.group_size
    for record in history:  # continuation k of the run's n-th state is one turn: request n * K + k
        first = (record["step"] - 1) * config.grpo.batch_states * K
        rewards = np.array([score(script(r)) for r in range(first, first + 2 * K)]).reshape(2, K)
        assert record["reward"] == pytest.approx(rewards.mean())
        assert record["num_zero_variance"] == sum(row.std() == 0 for row in rewards)
        assert record["groups_kept"] == 2  # grpo.filter_zero_variance is off: every group is kept
        assert record["states_consumed"] == 2 * record["step"]
        assert 1 <= record["rows_used"] <= 2 * K  # packed (these prompts are too long to share a row)
    samples = [json.loads(line) for line in (tmp_path / "run" / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8
    assert [s["reward"] for s in samples[:8]] == [score(script(r)) for r in range(8)]
