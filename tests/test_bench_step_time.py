"""The pod step's formulas (`bench/step_time.py`) by hand: a batch's rollout and one episode's, the learner of each
pipeline, the async step within the staleness bound, the batch's assembly across hosts, MFU; and the batch each
registered pipeline trains on, read from `config.pipeline` (the group baseline is not SFT); a program's seconds with
its collectives under each overlap model."""
from __future__ import annotations

import pytest

from mercury_jax.bench import step_time
from mercury_jax.bench.run_config import load_config


@pytest.mark.parametrize("name, rows", [("sao", 128), ("grpo", 16 * 8), ("group_baseline", 16 * 8), ("sft", 64)])
def test_each_pipeline_trains_on_its_own_batch(name, rows):
    config = load_config(f"experiments/{name}.py")
    assert step_time.pipeline_name(config) == name
    assert step_time.learner_rows(config) == rows
    assert step_time.max_staleness(config) == (1 if name == "sao" else 0)


def test_an_unregistered_pipeline_is_named():
    config = load_config("experiments/sao.py")
    config.pipeline = "ppo"
    with pytest.raises(ValueError, match="'ppo'"):
        step_time.learner_rows(config)


def test_rollout_seconds_by_hand():
    # 128 episodes x 8,192 decode steps on 16 x 8 slots at 3 ms, 2 prefills an episode of 70 ms over 16 replicas
    batch, episode = step_time.rollout_seconds(128, 8192, 16384, 16, 8, 3e-3, 8192, 0.07)
    assert batch == pytest.approx(8192 * 3e-3 + 16 * 0.07) and episode == pytest.approx(8192 * 3e-3 + 2 * 0.07)
    # more slots than episodes: never less than one episode
    assert step_time.rollout_seconds(4, 100, 0, 2, 8, 1.0, 8192, 0.0) == (100.0, 100.0)


def test_async_step_within_the_staleness_bound():
    assert step_time.async_step_seconds(20.0, 12.0, 30.0, 1) == 30.0  # an episode longer than the step: the floor
    assert step_time.async_step_seconds(20.0, 12.0, 30.0, 2) == 20.0
    assert step_time.async_step_seconds(20.0, 25.0, 10.0, 0) == 25.0  # no bound: the slower side


def test_learner_seconds_of_each_pipeline():
    sao = {"values + GAE": 1.0, "critic step": 4.0, "actor step": 3.0}
    assert step_time.learner_seconds("sao", sao) == 1.0 + 4.0  # critic and actor on their own chips at once
    assert step_time.learner_seconds("grpo", {"reference log-probs": 1.0, "grpo step": 6.0}) == 7.0
    assert step_time.learner_seconds("group_baseline", {"actor step": 2.5}) == 2.5


def test_step_seconds_sync_and_async():
    assert step_time.step_seconds(False, 10.0, 4.0, 30.0, 1, publish_s=0.5) == 14.5
    # async: max(rollout, assembly + learner), at least an episode over the bound, then the publish
    assert step_time.step_seconds(True, 10.0, 4.0, 30.0, 2, publish_s=0.5, assembly_s=7.0) == 15.0 + 0.5
    assert step_time.step_seconds(True, 10.0, 4.0, 8.0, 2, publish_s=0.5, assembly_s=7.0) == 11.0 + 0.5


def test_assembly_and_mfu_by_hand():
    # 128 trajectories of 24,576 tokens x 13 bytes over 12.5 GB/s, plus two 1 ms rounds
    assert step_time.assembly_seconds(128, 24576) == pytest.approx(128 * 24576 * 13 / 12.5e9 + 2e-3)
    assert step_time.model_flop_utilisation(459e12 * 64, 128, 459e12, 2.0) == 0.25


def test_program_seconds_under_each_overlap_model():
    # roofline 10 ms; collectives: 6 ms issued async, 3 ms not
    assert step_time.program_seconds(0.010, 0.006, 0.003, None) == 0.010  # the roofline alone
    assert step_time.program_seconds(0.010, 0.006, 0.003, "none") == pytest.approx(0.019)  # all in turn
    assert step_time.program_seconds(0.010, 0.006, 0.003, "async") == pytest.approx(0.013)  # async under compute
    assert step_time.program_seconds(0.010, 0.015, 0.003, "async") == pytest.approx(0.018)  # longer than compute
    with pytest.raises(ValueError, match="'full'"):
        step_time.program_seconds(0.010, 0.0, 0.0, "full")
