"""Reliability of the training loops (issue #21): non-finite steps are never applied nor checkpointed and stop the
run naming the step (or are skipped and counted), torn logs and replayed evaluations do not block or duplicate a
resume, a resume with a different shape/data config is refused, SIGTERM checkpoints before exiting, and async SAO
survives a slow rollout worker (published weights are the worker's own copy).

NaNs are injected through the real jitted steps: a NaN in a batch's loss mask (SFT), a NaN reward of one step's
trajectories (SAO) or continuations (GRPO), and, in the update-step unit test, a loss term whose value is 0 but
whose gradient is NaN.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from scripted_engine import ScriptedEngine

from experiments import common
from experiments.sft import sft_config
from experiments.sft import tiny_sft as tiny_sft_section
from mercury_jax.config.model import build_model
from mercury_jax.config.world import world_tasks
from mercury_jax.data.corpus import InMemoryCorpus
from mercury_jax.runs import preemption
from mercury_jax.runs.checkpoints import Checkpointer
from mercury_jax.runs.resume import ResumeError, check_run_config, read_jsonl, truncate_jsonl
from mercury_jax.runs.run_reader import read_checkpoint_arrays, save_run_config
from mercury_jax.runs.rundir import StageDir, as_path
from mercury_jax.train.guards import NonFiniteError, NonFiniteGuard
from mercury_jax.train.metrics import MetricsLogger
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sft import Sft
from mercury_jax.train.sft import run_sft as sft_run
from mercury_jax.train.state import TrainState, make_update_step

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("persistent_compilation_cache"),  # each program compiles once
              pytest.mark.timeout(1800)]  # several processes of tiny runs on a loaded 2-core host


# ------------------------------------------------------------------------------------------------ the update step
class Affine(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(6.0).reshape(2, 3) / 10)
        self.b = nnx.Param(jnp.ones(3))


def poisonable_loss(model, batch):
    """sum((x w + b)^2); `poison` 1: + NaN (a NaN loss; the constant adds nothing to the gradient); 2: + 0 *
    sum(sqrt(w - w)), whose value is 0 but whose gradient is 0 * inf = NaN (a finite loss with a NaN gradient);
    otherwise the sqrt sees 1 (gradient 0)."""
    w, b = model.w[...], model.b[...]
    loss = jnp.sum(jnp.square(batch["x"] @ w + b))
    loss = loss + jnp.where(batch["poison"] == 1, jnp.nan, 0.0)
    loss = loss + 0.0 * jnp.sum(jnp.sqrt(jnp.where(batch["poison"] == 2, w - w, 1.0)))
    return loss, {}


@pytest.mark.parametrize("poison", [1, 2], ids=["nan_loss", "nan_gradient_finite_loss"])
def test_nonfinite_update_changes_neither_params_nor_optimiser_state(poison):
    state = TrainState.create(Affine(), optax.adam(0.1))
    step = make_update_step(state.graphdef, state.tx, poisonable_loss)
    x = jnp.ones((4, 2))
    params, opt_state, metrics = step(state.params, state.frozen, state.opt_state, {"x": x, "poison": 0})
    before = jax.device_get((params, opt_state))  # after one good step: Adam's moments and count are non-trivial
    params, opt_state, metrics = step(params, state.frozen, opt_state, {"x": x, "poison": poison})
    metrics = jax.device_get(metrics)
    # poison 1: a NaN loss with a finite gradient (a constant); poison 2: a finite loss with a NaN gradient
    assert (np.isfinite(metrics["loss"]), np.isfinite(metrics["grad_norm"])) == (poison == 2, poison == 1)
    after = jax.device_get((params, opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):  # bitwise: the select kept the old leaves
        np.testing.assert_array_equal(a, b)
    params, _, _ = step(params, state.frozen, opt_state, {"x": x, "poison": 0})  # and a good step moves again
    assert not np.array_equal(jax.device_get(params["w"][...]), before[0]["w"][...])


def test_guard_raises_naming_the_step_or_skips_within_budget():
    bad = {"loss": float("nan"), "grad_norm": 1.0, "value_loss": float("nan")}
    with pytest.raises(NonFiniteError, match=r"\[sao\] step 7: non-finite critic update \(loss=nan, value_loss=nan\)"
                                             r".*--config.train.nonfinite=skip"):
        NonFiniteGuard("raise", name="sao").check(7, dict(bad), what="critic update")
    guard = NonFiniteGuard("skip", max_skipped=2, name="sft")
    assert guard.check(1, {"loss": 1.0, "grad_norm": 2.0}) and guard.skipped == 0
    assert not guard.check(2, dict(bad)) and not guard.check(3, {"loss": 1.0, "grad_norm": float("inf")})
    assert guard.skipped == 2
    with pytest.raises(NonFiniteError, match=r"step 4: .* 3 skipped steps, more than train.max_skipped = 2"):
        guard.check(4, dict(bad))
    history = [{"step": 1, "nonfinite_skipped": 0}, {"step": 2, "nonfinite_skipped": 2}]
    resumed = NonFiniteGuard.from_config(ml_collections.ConfigDict(dict(nonfinite="skip", max_skipped=2)), name="x",
                                         history=history)
    assert resumed.skipped == 2  # the count goes on across a resume
    with pytest.raises(ValueError, match=r"train.nonfinite is 'ignore'; use one of \('raise', 'skip'\)"):
        NonFiniteGuard("ignore")


# ------------------------------------------------------------------------------------------------ SFT
VOCAB, SFT_STEPS = 64, 5


def tiny_sft(steps: int, *, every: int = 1, keep: int = 2):
    tiny = common.base_config("sft")
    common.tiny_common(tiny)
    model_cfg = tiny.model
    model_cfg.overrides.num_hidden_layers = 2
    cfg = sft_config()
    tiny_sft_section(cfg)
    cfg.steps, cfg.batch_rows, cfg.row_length, cfg.log_every = steps, 2, 32, 1
    cfg.optimizer.warmup_steps = 0
    rng = np.random.default_rng(0)
    corpus = InMemoryCorpus([{"tokens": rng.integers(1, VOCAB, 20).tolist(), "loss_mask": [0] * 8 + [1] * 12}
                             for _ in range(8)])
    return model_cfg, cfg, corpus, common.checkpoint_config(every=every, keep=keep)


def run_sft(workdir, steps, *, poison_steps=(), train=None, every=1, keep=2):
    """run_sft on the tiny model; the batches of `poison_steps` get a NaN loss mask (inside the jitted step)."""
    model_cfg, cfg, corpus, checkpoint_cfg = tiny_sft(steps, every=every, keep=keep)

    class PoisonedSft(Sft):
        def batch(self, step, local):
            batch = super().batch(step, local)
            return {**batch, "loss_mask": batch["loss_mask"] * jnp.nan} if step in poison_steps else batch

    return sft_run(cfg, build_model(model_cfg, VOCAB, seed=0), corpus, workdir,
                   checkpoint_cfg=checkpoint_cfg, train_cfg=train, algorithm=PoisonedSft)


def _arrays(checkpoint_dir: Path, step: int, *subtree) -> dict:
    return read_checkpoint_arrays(checkpoint_dir / str(step) / "arrays", subtree)


def _steps(checkpoint_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_sft_nan_loss_stops_naming_the_step_and_keeps_the_last_finite_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError, match=r"\[sft\] step 4: non-finite update"):
        run_sft(tmp_path, SFT_STEPS, poison_steps={4})
    checkpoints = tmp_path / "checkpoints"
    assert _steps(checkpoints) == [2, 3]  # keep 2: the rotation never saw a non-finite state
    for path, value in _arrays(checkpoints, 3, "params").items():
        assert np.isfinite(value).all(), path
    assert [r["step"] for r in read_jsonl(tmp_path / "sft_metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_sft_skip_policy_leaves_the_state_and_counts_the_step(tmp_path):
    train = ml_collections.ConfigDict(dict(nonfinite="skip", max_skipped=1))
    _, history = run_sft(tmp_path, SFT_STEPS, poison_steps={3}, train=train, keep=10)
    assert [r["nonfinite_skipped"] for r in history] == [0, 0, 1, 1, 1]
    assert not np.isfinite(history[2]["loss"]) and np.isfinite(history[3]["loss"])
    checkpoints = tmp_path / "checkpoints"
    for part in ("params", "opt_state"):  # step 3 was skipped: its state is step 2's, bit for bit
        at_2, at_3, at_4 = (_arrays(checkpoints, s, part) for s in (2, 3, 4))
        assert at_2.keys() == at_3.keys()
        for path in at_2:
            np.testing.assert_array_equal(at_2[path], at_3[path], err_msg=f"{part} {path}")
    assert any(not np.array_equal(at_3[p], at_4[p]) for p in at_3)
    with pytest.raises(NonFiniteError, match=r"step 6: .* 2 skipped steps, more than train.max_skipped = 1"):
        run_sft(tmp_path, SFT_STEPS + 2, poison_steps={6}, train=train)  # resumed: the count went on from 1


# ------------------------------------------------------------------------------------------------ SAO
def tiny_sao_config(steps: int):
    """sao:tiny cut down: no warm start, 4 prompts of one short turn, 2 held-out tasks, a checkpoint every step."""
    from experiments.sao import get_config

    c = get_config("tiny")
    c.model.overrides.num_hidden_layers = 2
    c.sft.enabled = False
    c.sao.steps, c.sao.batch_prompts, c.sao.critic_only_steps, c.sao.eval_every = steps, 4, 1, 1
    c.rollout.num_slots, c.rollout.max_total_tokens = 4, 512
    c.rollout.max_turn_tokens, c.rollout.max_tool_turns = 8, 1
    c.world.num_train_tasks, c.world.num_eval_tasks = 8, 2
    c.checkpoint.every, c.checkpoint.keep = 1, 1
    return c


def synthetic_score(trajectory) -> float:
    """A deterministic score of the sampled tokens (an untrained policy earns 0 on every task: no signal)."""
    return (sum(t for t, m in zip(trajectory.tokens, trajectory.action_mask) if m) % 11) / 10.0


def run_sao(config, workdir: Path, *, nan_reward_at_step: int | None = None, kill_at_save: int | None = None,
            engine_step_delay_s: float = 0.0):
    """run_sao with injected parts: synthetic rewards (NaN for the training batch of step `nan_reward_at_step`), a
    checkpointer whose save of step `kill_at_save` is a kill (KeyboardInterrupt), engines whose every step sleeps
    `engine_step_delay_s`."""
    from mercury_jax.rollout.engine import Engine
    from mercury_jax.train.sao import run_sao as sao_run

    checkpoints = Path(workdir) / "sao" / "checkpoints"
    start = max((int(p.name) for p in checkpoints.glob("[0-9]*")), default=0) if checkpoints.exists() else 0
    train_ids = {t["task_id"] for t in world_tasks(config.world, "train")}
    train_rewards = []

    def reward(task, trajectory, grade):  # training batches hold batch_prompts train tasks, one batch a step
        if task["task_id"] not in train_ids:
            return synthetic_score(trajectory), {}
        train_rewards.append(1)
        step = start + (len(train_rewards) - 1) // config.sao.batch_prompts + 1
        return float("nan") if step == nan_reward_at_step else synthetic_score(trajectory), {}

    class KillableCheckpointer(Checkpointer):
        def save(self, step, arrays, meta):
            if step == kill_at_save:
                raise KeyboardInterrupt(f"killed before the checkpoint of step {step}")
            super().save(step, arrays, meta)

    class SlowEngine(Engine):
        def step(self):
            time.sleep(engine_step_delay_s)
            return super().step()

    save_run_config(config, workdir)
    return sao_run(config, workdir, Seams(reward=reward, make_checkpointer=KillableCheckpointer,
                                          make_engine=SlowEngine))


@pytest.mark.slow
def test_async_sao_with_a_slow_rollout_worker_completes(tmp_path):
    """The issue's reproduction: with the worker's engine slowed by 1 s a step, the learner publishes and runs its
    next (donating) actor step while the worker still holds the publish; the worker must own its copy."""
    config = tiny_sao_config(4)
    config.rollout.mode, config.sao.eval_every, config.checkpoint.every = "async", 0, 0
    _, _, history = run_sao(config, tmp_path, engine_step_delay_s=1.0)
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in history] == [0, 1, 2, 3]
    assert all(np.isfinite(r["value_loss"]) for r in history)


@pytest.mark.slow
def test_sao_nan_reward_stops_naming_the_step_and_a_replayed_evaluation_is_not_duplicated(tmp_path):
    # run 1: evaluations after steps 1 and 2, killed after the evaluation of step 2, before its checkpoint
    with pytest.raises(KeyboardInterrupt, match="step 2"):
        run_sao(tiny_sao_config(3), tmp_path, kill_at_save=2)
    evals = tmp_path / "sao" / "evals.jsonl"
    assert [r["step"] for r in read_jsonl(evals)] == [0, 1, 2]
    # run 2 resumes from step 1: replays step 2 (and its evaluation), then step 3's rewards are NaN
    with pytest.raises(NonFiniteError, match=r"\[sao\] step 3: non-finite critic update"):
        run_sao(tiny_sao_config(4), tmp_path, nan_reward_at_step=3)
    assert [r["step"] for r in read_jsonl(evals)] == [0, 1, 2]  # step 2's row once
    checkpoints = tmp_path / "sao" / "checkpoints"
    assert _steps(checkpoints) == [2]  # keep 1: the last finite state survived the rotation
    for part in ("actor", "critic"):
        for path, value in read_checkpoint_arrays(checkpoints / "2" / "arrays", (part, "params")).items():
            assert np.isfinite(value).all(), (part, path)
    assert [r["step"] for r in read_jsonl(tmp_path / "sao" / "sao_metrics.jsonl")] == [1, 2]


# ------------------------------------------------------------------------------------------------ GRPO
@pytest.mark.slow
def test_grpo_nan_reward_stops_naming_the_step_and_keeps_the_last_finite_checkpoint(tmp_path):
    from experiments.grpo import get_config
    from mercury_jax.train.grpo import run_grpo

    config = get_config("tiny")
    config.model.overrides.num_hidden_layers = 2
    config.sft.enabled = False
    config.world.num_train_tasks = 16
    config.grpo.steps, config.grpo.batch_states, config.grpo.group_size, config.grpo.pivot_tasks = 3, 2, 4, 4
    config.rollout.num_slots, config.rollout.max_turn_tokens = 8, 16
    config.checkpoint.keep = 1
    scored = []

    def reward(state, trajectory, grade):  # 2 states x 4 continuations a step; step 2's rewards are NaN
        scored.append(1)
        start, end = trajectory.turn_spans[-1]
        return float("nan") if (len(scored) - 1) // 8 + 1 == 2 else (sum(trajectory.tokens[start:end]) % 7) / 6.0, {}

    save_run_config(config, tmp_path)
    with pytest.raises(NonFiniteError, match=r"\[grpo\] step 2: non-finite actor update"):
        run_grpo(config, tmp_path, Seams(reward=reward, make_engine=ScriptedEngine))  # the learner is under test
    checkpoints = tmp_path / "grpo" / "checkpoints"
    assert _steps(checkpoints) == [1]
    for path, value in read_checkpoint_arrays(checkpoints / "1" / "arrays", ("actor", "params")).items():
        assert np.isfinite(value).all(), path
    assert [r["step"] for r in read_jsonl(tmp_path / "grpo" / "grpo_metrics.jsonl")] == [1]


# ------------------------------------------------------------------------------------------------ preemption
def _sft_child(workdir: str) -> None:
    """The SIGTERM test's child: a long tiny SFT run with the preemption handler installed, as main.py does."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets it for the parent
    preemption.install()
    run_sft(workdir, 100_000, every=100_000)


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_the_rerun_resumes_from_it(tmp_path, children):
    child = children.start([sys.executable, __file__, "sft-child", str(tmp_path / "run")], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    metrics = tmp_path / "run" / "sft_metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert child.poll() is None, child.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the child logged no 2 steps in 240 s"
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, output[-3000:]
    saved = _steps(tmp_path / "run" / "checkpoints")
    logged = [r["step"] for r in read_jsonl(metrics)]
    assert len(saved) == 1 and saved[0] == logged[-1] >= 2  # the step in progress, not the cadence (100,000)
    assert f"SIGTERM received: checkpoint of step {saved[0]} saved" in output

    k = saved[0]
    _, resumed = run_sft(tmp_path / "run", k + 1)
    _, fresh = run_sft(tmp_path / "fresh", k + 1)
    assert [r["step"] for r in resumed] == list(range(1, k + 2))
    # the resumed step k + 1 starts from the child's checkpoint of step k: the same loss as an uninterrupted run
    # (same program and data; rtol for the other process's thread scheduling of fp32 reductions)
    np.testing.assert_allclose(resumed[-1]["loss"], fresh[-1]["loss"], rtol=1e-5)


# ------------------------------------------------------------------------------------------------ logs
def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "sft_metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        logger = MetricsLogger(StageDir(as_path(tmp_path), "sft"), total_steps=5, tensorboard=False)
    assert [r["step"] for r in logger.history] == [1, 2]
    logger.truncate(2)
    logger.log(3, {"loss": 1.0})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]

    path.write_text('{"step": 1}\n{"step": 2}')  # cut just before the newline: kept, and the next append is apart
    assert [r["step"] for r in read_jsonl(path)] == [1, 2] and path.read_text().endswith("}\n")
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ResumeError, match=r"line 2 is not JSON .* not the last line"):
        read_jsonl(path)


def test_truncate_jsonl_drops_rows_a_resume_replays(tmp_path):
    path = tmp_path / "evals.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (0, 2, 4, 6)))
    assert [r["step"] for r in truncate_jsonl(path, 4)] == [0, 2, 4]
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 4]
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == [] and not (tmp_path / "missing.jsonl").exists()


# ------------------------------------------------------------------------------------------------ config match
def test_resume_with_a_different_shape_or_data_config_is_refused_naming_the_fields(tmp_path):
    from experiments.sao import get_config

    saved = get_config("tiny")
    save_run_config(saved, tmp_path)
    same_run = get_config("tiny")
    same_run.sao.steps, same_run.sao.actor_optimizer.lr = 200, 1e-5  # longer, another lr: still the same run
    assert check_run_config(tmp_path, same_run) == {}
    changed = get_config("tiny")
    changed.model.overrides.hidden_size, changed.seed, changed.world.num_train_tasks = 128, 3, 99
    with pytest.raises(ResumeError, match=r"model.overrides.hidden_size: 96 in the workdir's run, 128 now; seed: 0 in "
                                          r"the workdir's run, 3 now; world.num_train_tasks: .*--resume_force_config"):
        check_run_config(tmp_path, changed)
    with pytest.warns(UserWarning, match="forced"):
        assert set(check_run_config(tmp_path, changed, force=True)) == {"model.overrides.hidden_size", "seed",
                                                                        "world.num_train_tasks"}
    assert check_run_config(tmp_path / "new", changed) == {}  # a fresh workdir has nothing to match


def test_a_run_from_before_the_data_fields_resumes_and_a_changed_corpus_is_refused(tmp_path):
    """A config.json written before `sft.data` / `packing_bins` / `data_workers` existed matches a config holding
    their defaults; another corpus or packing changes the SFT data order, so it is refused by name."""
    from experiments.sao import get_config

    older = get_config("tiny")
    for field in ("data", "packing_bins", "data_workers", "skip_bad_records"):
        del older.sft[field]
    save_run_config(older, tmp_path)
    assert check_run_config(tmp_path, get_config("tiny")) == {}
    other_corpus = get_config("tiny")
    other_corpus.sft.data, other_corpus.sft.packing_bins = "gs://bucket/chats/*.jsonl", 4
    with pytest.raises(ResumeError, match=r"sft.data: '' in the workdir's run, 'gs://bucket/chats/\*.jsonl' now; "
                                          r"sft.packing_bins: 8 in the workdir's run, 4 now"):
        check_run_config(tmp_path, other_corpus)


def test_main_refuses_a_mismatched_resume_before_any_work(tmp_path):
    from experiments.sft import get_config

    saved = get_config("tiny")
    saved.seed = 5
    save_run_config(saved, tmp_path)
    before = (tmp_path / "config.json").read_text()
    result = subprocess.run([sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sft.py:tiny",
                             "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    assert result.returncode != 0
    assert "seed: 5 in the workdir's run, 0 now" in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "config.json").read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json"]


if __name__ == "__main__" and sys.argv[1:2] == ["sft-child"]:
    _sft_child(sys.argv[2])
