"""The SAO trainer end to end on the 8-device CPU mesh, its resume, its HF export, and fail-fast config checks.

One uninterrupted tiny run (3 steps: 1 critic-only, then 2 with policy updates; rollout / actor / critic on 4 / 2 /
2 devices, a checkpoint every step) serves most tests; its checkpoints are read back with
`mercury_jax.runs.run_reader.read_checkpoint_arrays`. The tiny policy after 2 SFT steps earns reward 0 on every
task, which makes every advantage, value target and gradient 0 (nothing would move, and every test below would pass
vacuously); so the runs inject (`rollouts.Seams`) a synthetic, deterministic reward of their action tokens and an
engine that records the weights the trainer publishes to it.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from experiments.sao import get_config
from mercury_jax.config.model import build_model
from mercury_jax.config.rollout import behaviour, episode_reward
from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.export import export_run
from mercury_jax.export import main as export_main
from mercury_jax.rollout.engine import Engine
from mercury_jax.runs.run_reader import RunReader, RunReadError, read_checkpoint_arrays, save_run_config
from mercury_jax.runs.rundir import RunDir
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sao import Sao, run_sao
from mercury_jax.train.wiring import Wiring

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")  # tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
TOTAL_STEPS, KILLED_AT, CRITIC_ONLY = 3, 2, 1
# wall-clock figures, and the slot occupancy: which decode chunk a continuation joins depends on when its tool call
# returns (its tokens do not: they depend on the request's seed and id)
TIMING_KEYS = ("tokens_per_s", "rollout_s", "learner_s", "step_time_s", "rollout_busy_s", "slot_occupancy",
               "barrier_wait_s")


def tiny_sao_config(steps: int):
    c = get_config("tiny")
    c.model.overrides.num_hidden_layers = 2  # one GDN + one attention layer: every code path, faster compiles
    c.sft.steps, c.sft.batch_rows, c.sft.log_every = 2, 2, 1
    c.sao.steps, c.sao.batch_prompts, c.sao.critic_only_steps, c.sao.eval_every = steps, 4, CRITIC_ONLY, 0
    c.rollout.num_slots, c.rollout.max_total_tokens = 4, 512
    c.rollout.max_turn_tokens, c.rollout.max_tool_turns = 32, 2
    c.world.num_train_tasks, c.world.num_eval_tasks = 8, 2
    c.checkpoint.every, c.checkpoint.keep = 1, 10
    c.devices.rollout, c.devices.actor, c.devices.critic = 4, 2, 2
    c.behaviour.turn_budget_strength = 0.25  # not the default: the runners must take it from the config
    return c


def synthetic_score(trajectory) -> float:
    """A deterministic score in [0, 1] of the sampled tokens (varies across trajectories, so advantages do)."""
    actions = [tok for tok, m in zip(trajectory.tokens, trajectory.action_mask) if m]
    return (sum(actions) % 11) / 10.0


def synthetic_reward(config):
    """The run's own reward parts (effects, multiplier...) with the synthetic score as the reward."""
    real = episode_reward(config)

    def reward(task, trajectory, grade):
        return synthetic_score(trajectory), real(task, trajectory, grade)[1]
    return reward


class RecordingEngine(Engine):
    """An Engine that keeps (version, host copy of the weights, devices) of every `update_weights`."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.published = []
        RecordingEngine.last = self

    def update_weights(self, model, version=None):
        state = nnx.state(model)
        devices = {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}
        self.published.append((version, jax.device_get(nnx.to_pure_dict(state)), devices))
        super().update_weights(model, version)


def run(config, workdir: Path):
    save_run_config(config, workdir)
    actor, critic, history = run_sao(config, workdir, Seams(reward=synthetic_reward(config),
                                                            make_engine=RecordingEngine))
    return actor, critic, history, RecordingEngine.last.published


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sao_full")
    actor, critic, history, published = run(tiny_sao_config(TOTAL_STEPS), workdir)
    return dict(workdir=workdir, actor=actor, critic=critic, history=history, published=published)


def _sao_arrays(workdir: Path, step: int, *subtree: str) -> dict:
    return read_checkpoint_arrays(workdir / "sao" / "checkpoints" / str(step) / "arrays", subtree)


def _sft_params(workdir: Path) -> dict:
    return read_checkpoint_arrays(workdir / "sft" / "checkpoints" / "2" / "arrays", ("params",))


def _pure(model) -> dict:
    flat = nnx.to_flat_state(nnx.state(model))
    return {tuple(str(k) for k in path): np.asarray(jax.device_get(v[...])) for path, v in flat}


# ------------------------------------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_sao_steps_on_device_groups_finite_losses_and_publishes_weights(full_run):
    history, published = full_run["history"], full_run["published"]
    assert [r["step"] for r in history] == list(range(1, TOTAL_STEPS + 1))
    for record in history:
        for key in ("value_loss", "critic_grad_norm", "explained_variance", "reward"):
            assert math.isfinite(record[key]), (record["step"], key)
        assert record["staleness_max"] == 0  # sync rollouts: every batch sampled by the latest weights
        # the rollout engine's use within the step (sync: it samples while the learner waits, then idles)
        assert 0 < record["rollout_busy_s"] <= record["rollout_s"] <= record["step_time_s"]
        assert 0 < record["slot_occupancy"] <= 1
        assert record["response_length_min"] <= record["response_length"] <= record["response_length_max"]
    assert history[0]["value_loss"] > 0 and history[0]["critic_grad_norm"] > 0  # synthetic reward: real signal
    # step 1 scores with the critic's zero value head: V = 0, so the residual G - V is G itself (explained variance
    # 1 - Var(G) / Var(G) = 0) and the mean value is 0
    assert history[0]["value_mean"] == 0.0
    assert history[0]["explained_variance"] == pytest.approx(0.0, abs=1e-6)  # two fp32 reductions of one array
    assert 0 < history[0]["lambda_mean"] < 1
    actor_records = history[CRITIC_ONLY:]
    for record in actor_records:
        for key in ("policy_loss", "grad_norm", "dis_masked_fraction", "logp_train_rollout_gap"):
            assert math.isfinite(record[key]), (record["step"], key)
        assert record["grad_norm"] > 0
        # the sampler's log-probs are the actor's own (fp32 both sides; sampler decode vs chunked training
        # forward differ by ~1e-7): a rollout engine with stale weights would be off by the last update
        assert record["logp_train_rollout_gap"] < 1e-4
        # hence every ratio is 1 (to 1e-4), inside the DIS band: nothing is masked, and the token-mean DIS loss
        # -mean(r A) is -mean(A), the logged advantage mean (|A| <= 1 here: rewards in [0, 1], values near 0)
        assert record["dis_masked_fraction"] == 0.0
        assert record["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
        assert record["policy_loss"] == pytest.approx(-record["advantage_mean"], abs=1e-4)
    assert "policy_loss" not in history[0]
    assert [r["policy_version"] for r in history] == [max(0, s - CRITIC_ONLY) for s in range(1, TOTAL_STEPS + 1)]

    # every policy update is published to the (one) rollout device, with the next version, and the last one holds
    # exactly the actor's final weights
    assert [v for v, _, _ in published] == list(range(1, TOTAL_STEPS - CRITIC_ONLY + 1))
    rollout_devices = set().union(*(devices for _, _, devices in published))
    assert len(rollout_devices) == 1
    final = {tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(v) for p, v in
             jax.tree_util.tree_flatten_with_path(published[-1][1])[0]}
    actor = _pure(full_run["actor"])
    assert set(final) == set(actor)
    for path, value in final.items():
        np.testing.assert_array_equal(value, actor[path], err_msg=str(path))
    # the actor and the critic live on their own device groups
    actor_devices = {d for leaf in jax.tree.leaves(nnx.state(full_run["actor"])) for d in leaf.devices()}
    critic_devices = {d for leaf in jax.tree.leaves(nnx.state(full_run["critic"])) for d in leaf.devices()}
    assert len(actor_devices) == 2 and len(critic_devices) == 2
    assert not (actor_devices & critic_devices) and not (rollout_devices & (actor_devices | critic_devices))


@pytest.mark.slow
def test_critic_only_phase_leaves_the_actor_bitwise_unchanged(full_run):
    workdir = full_run["workdir"]
    sft = _sft_params(workdir)
    for step in range(1, CRITIC_ONLY + 1):
        actor = _sao_arrays(workdir, step, "actor", "params")
        assert set(actor) == set(sft)
        for path in sft:
            np.testing.assert_array_equal(actor[path], sft[path], err_msg=f"step {step} {path}")
    after = _sao_arrays(workdir, CRITIC_ONLY + 1, "actor", "params")
    assert any(not np.array_equal(after[p], sft[p]) for p in sft), "the first policy update changed nothing"


@pytest.mark.slow
def test_critic_token_mixing_and_embedding_frozen_rest_trains(full_run):
    workdir = full_run["workdir"]
    sft = _sft_params(workdir)
    frozen = _sao_arrays(workdir, TOTAL_STEPS, "critic", "frozen")
    trainable = _sao_arrays(workdir, TOTAL_STEPS, "critic", "params")
    is_token_mixing = {p: "mixer" in p or "embed" in p for p in sft}
    assert {p for p in sft if p[0] == "model" and is_token_mixing[p]} == set(frozen)
    assert not any("mixer" in p or "embed" in p for p in trainable)
    for path, value in frozen.items():  # the critic was copied from the SFT policy and these never move
        np.testing.assert_array_equal(value, sft[path], err_msg=str(path))
    backbone = [p for p in trainable if p[0] == "model"]
    assert backbone and {("value_head",), ("value_bias",)} <= set(trainable)
    unchanged = [p for p in backbone if np.array_equal(trainable[p], sft[p])]
    assert not unchanged, f"trainable critic parameters that never moved: {unchanged}"
    assert np.any(trainable[("value_head",)] != 0)  # zero-initialised head has learned


@pytest.mark.slow
def test_runners_take_the_behaviour_section_of_the_config(full_run, tmp_path):
    from mercury_jax.envs.behaviour import BehaviourConfig

    config = tiny_sao_config(1)
    expected = BehaviourConfig(**{**get_config("tiny").behaviour.to_dict(), "turn_budget_strength": 0.25})
    assert expected != BehaviourConfig(turn_budget_strength=0.25)  # :tiny also turns the malformed-calls factor on
    assert behaviour(config) == expected
    # without an injected reward the trainer's train and held-out runners pay with the config's behaviour
    tokenizer = RunReader(full_run["workdir"]).tokenizer()
    sao = Sao(Wiring(config, build_model(config.model, tokenizer.vocab_size, 0), tokenizer,
                     RunDir(tmp_path).stage("sao")))
    assert sao.rollouts.runner.reward.behaviour == expected and sao.heldout.runner.reward.behaviour == expected
    del config.behaviour  # a run config written before the section existed
    assert behaviour(config) == BehaviourConfig()


@pytest.mark.slow
def test_held_out_evaluations_are_compared_task_by_task(full_run):
    import json

    from mercury_jax.evaluation import mcnemar_exact, paired_difference

    sao_dir = full_run["workdir"] / "sao"
    evals = [json.loads(line) for line in (sao_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, TOTAL_STEPS]
    assert evals[0]["task_ids"] == evals[-1]["task_ids"] and len(evals[0]["task_ids"]) == 2
    for e in evals:
        assert np.mean(e["task_rewards"]) == pytest.approx(e["reward"])
    summary = json.loads((sao_dir / "eval_summary.json").read_text())
    assert summary["paired"] == paired_difference(evals[0]["task_rewards"], evals[-1]["task_rewards"])
    passes = summary["all_effects_pass"]
    assert passes["start"] == evals[0]["all_effects_pass"] and passes["end"] == evals[-1]["all_effects_pass"]
    assert passes["p_mcnemar_greater"] == mcnemar_exact(evals[0]["task_all_effects_pass"],
                                                        evals[-1]["task_all_effects_pass"], "greater")
    assert (summary["start"]["step"], summary["end"]["step"]) == (0, TOTAL_STEPS)
    assert (sao_dir / "sao_heldout.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.slow
def test_killed_run_resumes_with_identical_metrics(full_run, tmp_path):
    workdir = tmp_path / "resumed"
    _, _, first, _ = run(tiny_sao_config(KILLED_AT), workdir)
    assert [r["step"] for r in first] == list(range(1, KILLED_AT + 1))
    _, _, resumed, _ = run(tiny_sao_config(TOTAL_STEPS), workdir)
    assert [r["step"] for r in resumed] == list(range(1, TOTAL_STEPS + 1))
    for ours, reference in zip(resumed[KILLED_AT:], full_run["history"][KILLED_AT:]):
        keys = set(reference) - set(TIMING_KEYS)
        assert set(ours) - set(TIMING_KEYS) == keys
        assert {k: ours[k] for k in keys} == {k: reference[k] for k in keys}, ours["step"]


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.slow
def test_fp32_export_of_a_trained_run_matches_in_transformers(full_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    export_main(["--workdir", str(full_run["workdir"]), "--out", str(out), "--dtype", "float32"])
    assert {"config.json", "model.safetensors", "chat_template.jinja", "sentencepiece.model"} <= {
        p.name for p in out.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    actor = full_run["actor"]
    ids = np.random.RandomState(0).randint(0, actor.config.vocab_size, size=(2, 40))
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.float().numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(actor, ids))
    # same fp32 weights, fp32 compute on both sides: agreement to float rounding
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_export_names_available_steps_and_stages(full_run, tmp_path):
    with pytest.raises(RunReadError, match=r"step 99 does not exist .* available steps: \[1, 2, 3\]"):
        export_run(full_run["workdir"], tmp_path / "x", step=99)
    sft = export_run(full_run["workdir"], tmp_path / "sft", stage="sft", dtype="float32")
    assert (sft / "model.safetensors").exists()
    bare = tmp_path / "bare"
    with pytest.raises(RunReadError, match="config.json does not exist"):
        export_run(bare, tmp_path / "y")
    save_run_config(tiny_sao_config(1), bare)
    with pytest.raises(RunReadError, match="no sao checkpoint in"):
        export_run(bare, tmp_path / "y")


@pytest.mark.slow
def test_checkpoint_arrays_read_from_a_relative_path(full_run, monkeypatch, tmp_path):
    workdir = full_run["workdir"]
    expected = _sao_arrays(workdir, 1, "actor", "params")
    monkeypatch.chdir(workdir.parent)  # `python -m mercury_jax.sweep --workdir runs/x` passes relative paths
    got = read_checkpoint_arrays(Path(workdir.name) / "sao" / "checkpoints" / "1" / "arrays", ("actor", "params"))
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in expected)
    with pytest.raises(RunReadError, match="holds no readable Orbax checkpoint item"):
        read_checkpoint_arrays(tmp_path, ("actor",))


def test_run_config_round_trips_through_the_workdir(tmp_path):
    config = tiny_sao_config(7)
    path = save_run_config(config, tmp_path)
    assert path == tmp_path / "config.json"
    assert RunReader(tmp_path).config.to_dict() == config.to_dict()


# ------------------------------------------------------------------------------------------------ fail fast
def _main_with_typo(tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sao.py:tiny", "--config.sao.typo=1",
         "--workdir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_unknown_config_field_fails_in_flag_parsing_before_any_work(tmp_path):
    result = _main_with_typo(tmp_path)
    assert result.returncode != 0
    assert "typo" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started


def test_unknown_config_field_message_names_the_dotted_field(tmp_path):
    last_line = _main_with_typo(tmp_path).stderr.strip().splitlines()[-1]
    assert "sao.typo" in last_line, last_line


def test_missing_checkpoint_path_fails_with_the_fix():
    config = tiny_sao_config(1)
    config.model.hf_path = "/nonexistent/Qwen3.5-35B-A3B"
    with pytest.raises(ConfigError, match=r"model.hf_path .*/nonexistent/Qwen3.5-35B-A3B.* does not exist"):
        validate_config(config)


def test_batch_not_divisible_by_actor_devices_fails_with_the_fix():
    config = tiny_sao_config(1)
    config.devices.rollout, config.devices.actor, config.devices.critic = 1, 3, 2
    config.sft.batch_rows = 6  # the warm start (on the actor's mesh) splits over 3 and 2 devices
    with pytest.raises(ConfigError, match=r"batch_prompts 4 is not divisible by the 3 row shards of the actor mesh "
                                          r".*; change sao.batch_prompts or mesh.actor / devices.actor"):
        validate_config(config)
    config.devices.actor = 2
    validate_config(config)  # and the divisible layout passes


def test_behaviour_strength_out_of_range_fails_with_the_fix():
    config = tiny_sao_config(1)
    config.behaviour.collateral_strength = 1.5
    with pytest.raises(ConfigError, match=r"behaviour.collateral_strength is 1.5; expected a number in \[0, 1\]"):
        validate_config(config)
