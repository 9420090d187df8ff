"""The layout search's arithmetic (`bench/pod_search.py`) by hand, on the released SAO config with made-up decode
costs and learner FLOPs: a batch's rollout time, the learner time of a device split, the step raised to an episode's
length by the staleness bound, and the device splits it considers (learner groups dividing the batch)."""
from __future__ import annotations

import math

import pytest

from mercury_jax.bench import pod_search
from mercury_jax.bench.aot_tpu import load_config
from mercury_jax.bench.report import V5P_PEAK_FLOPS
from models.qwen35_moe.config import PRESETS


@pytest.fixture(scope="module")
def sao():
    return load_config("experiments/sao.py")


def test_splits_keep_learner_groups_dividing_the_batch(sao):
    found = pod_search.splits(sao, 128)
    assert dict(rollout=64, actor=32, critic=32) in found
    assert all(128 % s["actor"] == 0 and 128 % s["critic"] == 0 and sum(s.values()) == 128 for s in found)
    grpo = load_config("experiments/grpo.py")
    assert {s["actor"] for s in pod_search.splits(grpo, 128)} == {16, 32, 64}


def test_a_layout_step_by_hand(sao):
    cfg = PRESETS["qwen3.5-35b-a3b"]()
    shape, slots = {"tensor": 4}, 8
    decode = {(tuple(shape.items()), slots): pod_search.Decode(step_s=3e-3, program_gib=20.0, engine_gib=17.0)}
    # one learner second per program on 32 chips: values, 2 critic steps (one entry, per_step folded in), actor
    second = 32 * V5P_PEAK_FLOPS
    learner = [("values + GAE", "critic", second), ("critic step", "critic", 2 * second),
               ("actor step", "actor", second)]
    split = dict(rollout=64, actor=32, critic=32)
    got = pod_search.evaluate(sao, cfg, decode, learner, split, shape, slots, generated=8192)
    replicas = 16
    prefill_s = got["rollout_s"] - math.ceil(128 * 8192 / (replicas * slots)) * 3e-3
    assert got["replicas"] == replicas and got["learner_s"] == pytest.approx(1 + max(2, 1))
    assert prefill_s == pytest.approx(math.ceil(128 * 1 / replicas) * prefill_s / 8)  # 8 prefill rounds of 1 each
    episode = 8192 * 3e-3 + prefill_s / 8
    assert got["episode_s"] == pytest.approx(episode)
    assert got["free_step"] == pytest.approx(max(got["rollout_s"], 3.0))
    # max_staleness 1: the step is at least one episode; the trajectories then lag one version
    assert got["step"] == pytest.approx(max(got["free_step"], episode)) and got["staleness"] == 1
    wide = pod_search.evaluate(sao, cfg, {(tuple(shape.items()), 64): pod_search.Decode(3e-3, 20.0, 17.0)}, learner,
                               split, shape, 64, generated=8192)
    assert wide["rollout_s"] == pytest.approx(wide["episode_s"])  # 1,024 slots for 128 episodes: one episode long
    assert got["idle"] == pytest.approx(1 - 3.0 / got["step"])
    assert got["decode_gib"] == pytest.approx(37.0)  # async: the evaluation engine resident beside the program
    assert pod_search.evaluate(sao, cfg, decode, learner, dict(rollout=66, actor=31, critic=31), shape, slots,
                               8192) is None  # 66 chips do not split into replicas of 4


def test_the_shared_rollout_and_async_step_arithmetic():
    """`bench.pod`'s step estimate and the search use one rollout and one async-step formula (hand-computed)."""
    from mercury_jax.bench.pod import async_step_seconds, rollout_seconds

    # 128 episodes x 8,192 decode steps on 16 x 8 slots at 3 ms, 2 prefills an episode of 70 ms over 16 replicas
    batch, episode = rollout_seconds(128, 8192, 16384, 16, 8, 3e-3, 8192, 0.07)
    assert batch == pytest.approx(8192 * 3e-3 + 16 * 0.07) and episode == pytest.approx(8192 * 3e-3 + 2 * 0.07)
    # more slots than episodes: never less than one episode
    assert rollout_seconds(4, 100, 0, 2, 8, 1.0, 8192, 0.0) == (100.0, 100.0)
    assert async_step_seconds(20.0, 12.0, 30.0, 1) == 30.0  # an episode longer than the step: staleness floor
    assert async_step_seconds(20.0, 12.0, 30.0, 2) == 20.0 and async_step_seconds(20.0, 25.0, 10.0, 0) == 25.0
