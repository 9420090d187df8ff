"""The layout search's arithmetic (`bench/pod_search.py`) by hand, on the released SAO config with made-up decode
costs and learner FLOPs: a batch's rollout time, the learner time of a device split, the step raised to an episode's
length by the staleness bound, and the device splits it considers (learner groups dividing the batch); then the
same layout with collectives: the decode chunk's priced ones and the learner's FSDP lower bound on each group's
place in a v5p 4x4x8 torus."""
from __future__ import annotations

import math

import pytest

from mercury_jax.bench import links, pod_search
from mercury_jax.bench.pod_search import Costs, Decode, LearnerProgram
from mercury_jax.bench.rooflines import V5P_PEAK_FLOPS
from mercury_jax.bench.run_config import load_config
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
    group = load_config("experiments/group_baseline.py")  # 16 prompts x 8 episodes, no critic
    assert {s["actor"] for s in pod_search.splits(group, 128)} == {16, 32, 64}


def test_a_layout_step_by_hand(sao):
    cfg = PRESETS["qwen3.5-35b-a3b"]()
    shape, slots = {"tensor": 4}, 8
    decode = {(tuple(shape.items()), slots): Decode(step_s=3e-3, program_gib=20.0, engine_gib=17.0)}
    # one learner second per program on 32 chips: values, 2 critic steps (one entry, per_step folded in), actor
    second = 32 * V5P_PEAK_FLOPS
    learner = [LearnerProgram("values + GAE", "critic", second, training=False),
               LearnerProgram("critic step", "critic", 2 * second), LearnerProgram("actor step", "actor", second)]
    split = dict(rollout=64, actor=32, critic=32)
    costs = Costs(decode, learner, links.slice_fabric("v5p"), [])
    got = pod_search.evaluate(sao, cfg, costs, split, shape, slots, generated=8192)
    replicas = 16
    prefill_s = got["rollout_s"] - math.ceil(128 * 8192 / (replicas * slots)) * 3e-3
    assert got["replicas"] == replicas and got["learner_s"] == pytest.approx(1 + max(2, 1))
    assert prefill_s == pytest.approx(math.ceil(128 * 1 / replicas) * prefill_s / 8)  # 8 prefill rounds of 1 each
    episode = 8192 * 3e-3 + prefill_s / 8
    assert got["episode_s"] == pytest.approx(episode)
    assert got["free_step"] == pytest.approx(max(got["rollout_s"], 3.0))
    # max_staleness 1: the step is at least one episode; the trajectories then lag one version
    assert got["step"] == pytest.approx(max(got["free_step"], episode)) and got["staleness"] == 1
    wide_costs = Costs({(tuple(shape.items()), 64): Decode(3e-3, 20.0, 17.0)}, learner, costs.fabric, [])
    wide = pod_search.evaluate(sao, cfg, wide_costs, split, shape, 64, generated=8192)
    assert wide["rollout_s"] == pytest.approx(wide["episode_s"])  # 1,024 slots for 128 episodes: one episode long
    assert got["idle"] == pytest.approx(1 - 3.0 / got["step"])
    assert got["decode_gib"] == pytest.approx(37.0)  # async: the evaluation engine resident beside the program
    assert pod_search.evaluate(sao, cfg, costs, dict(rollout=66, actor=31, critic=31), shape, slots,
                               8192) is None  # 66 chips do not split into replicas of 4
    # no collectives anywhere (no decode collectives, no parameters to gather): every model gives the rooflines' step
    assert all(got["with_collectives"][o]["step"] == pytest.approx(got["step"]) for o in ("none", "async"))


def test_a_layout_step_with_collectives_by_hand(sao):
    cfg = PRESETS["qwen3.5-35b-a3b"]()
    shape, slots = {"tensor": 4}, 8
    # decode: 3 ms roofline, 1 ms of async and 0.5 ms of sync collectives a step
    decode = {(tuple(shape.items()), slots): Decode(3e-3, 20.0, 17.0, collective_async_s=1e-3, collective_sync_s=5e-4)}
    second = 32 * V5P_PEAK_FLOPS
    learner = [LearnerProgram("values + GAE", "critic", second, training=False),
               LearnerProgram("critic step", "critic", 2 * second, runs=2),
               LearnerProgram("actor step", "actor", second)]
    coords = [(i, j, k) for k in range(8) for j in range(4) for i in range(4)]  # v5p 4x4x8, x fastest
    params = 10 ** 10  # 10 B parameters, bf16 gathered, fp32 gradients
    costs = Costs(decode, learner, links.slice_fabric("v5p", coords), coords, (params, 2, 4))
    split = dict(rollout=64, actor=32, critic=32)
    got = pod_search.evaluate(sao, cfg, costs, split, shape, slots, generated=8192)
    # actor chips 64..95 and critic chips 96..127: each a 4 x 4 x 2 box of z's 8, so x and y wrap, z does not
    ring = 2 * 200e9 + 100e9
    gather = 31 / 32 * params * 2 / ring
    scatter = 31 * (params * 4 / 32) / ring
    none, hidden = got["with_collectives"]["none"], got["with_collectives"]["async"]
    assert none["learner_s"] == pytest.approx(1 + gather + max(2 * (1 + gather + scatter), 1 + gather + scatter))
    assert hidden["learner_s"] == pytest.approx(max(1, gather) + 2 * max(1, gather + scatter))
    assert none["decode_ms"] == pytest.approx(4.5) and hidden["decode_ms"] == pytest.approx(3.5)
    assert none["step"] > hidden["step"] > got["step"]
    assert hidden["mfu"] < got["mfu"]
