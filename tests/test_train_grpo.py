"""The pivot-GRPO pipeline: the learner loss against a hand computation, real GRPO steps (the frozen reference never
changes while the actor does; checkpoints from step 0; resume), the pivot dataset builder and the stop-verifier
verdicts the trainer assigns, and fail-fast config checks.

The real steps run a randomly initialised tiny model (no SFT: `sft.enabled` False, the SentencePiece tokenizer
still trained on the tiny browsing world's oracle text). Its continuations are malformed, so every stop-verifier
reward would be 0 and every advantage 0; as in test_train_sao.py, a test-side wrapper scores continuations with a
synthetic, deterministic reward of their tokens instead, so the policy term has a real gradient.
"""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import METRIC_C, rounding

from experiments.grpo import get_config
from mercury_jax.chat import render_completion
from mercury_jax.config.model import build_model
from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.envs.browse.stop_verifier import STOP_RULES
from mercury_jax.envs.episode import oracle_trajectory
from mercury_jax.envs.presets import preset_tasks
from mercury_jax.rl.advantages import group_advantages
from mercury_jax.rollout.rewards import StopVerifierReward
from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.runs.run_reader import read_checkpoint_arrays, save_run_config
from mercury_jax.runs.rundir import RunDir
from mercury_jax.train.group_batch import group_batch
from mercury_jax.train.grpo import PivotGrpo, grpo_cadence, minibatch_rows, outcome_metrics
from mercury_jax.train.grpo_learner import (
    GrpoLossSettings,
    frozen_reference,
    grpo_loss,
    make_grpo_step,
    make_reference_logprobs,
)
from mercury_jax.train.loop import run_loop
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.pivot_data import build_pivots, read_pivots, task_tool_schemas
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.state import TrainState
from mercury_jax.train.warm_start import starting_policy
from mercury_jax.train.wiring import Wiring
from models.qwen35_moe.logprobs import sequence_logprobs

STEPS, KILLED_AT = 2, 1


def tiny_grpo_config(steps: int):
    c = get_config("tiny")
    c.model.overrides.num_hidden_layers = 2  # one GDN + one attention layer: the same code paths, faster compiles
    c.sft.enabled = False
    c.world.num_train_tasks = 16          # tokenizer corpus
    c.grpo.steps, c.grpo.batch_states, c.grpo.group_size = steps, 2, 4
    c.grpo.pivot_tasks = 4
    c.rollout.num_slots, c.rollout.max_turn_tokens = 8, 16
    c.devices.rollout, c.devices.actor = 1, 2
    return c


# ------------------------------------------------------------------------------------------------ the loss
def _fixed_batch():
    """Two states (prompts of 3 and 4 tokens) x K = 3 continuations; group 1 has equal rewards."""
    prompts = [[5, 6, 7], [5, 6, 7, 8]]
    conts = [[[11, 12], [13], [14, 15, 16]], [[17, 18], [19, 20], [21]]]
    rollout = [[[-0.5, -1.0], [-2.0], [-0.1, -0.3, -0.7]], [[-1.5, -0.2], [-0.9, -0.4], [-1.1]]]
    trajectories = [one_turn(prompt, t, lp) for prompt, ts, lps in zip(prompts, conts, rollout)
                    for t, lp in zip(ts, lps)]
    rewards = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    return trajectories, rewards


def one_turn(prompt: list[int], continuation: list[int], logprobs: list[float] | None = None,
             finish_reason: str = "answered") -> Trajectory:
    """The trajectory of a pivot state's one-turn episode, as `EpisodeRunner` builds it."""
    p, n = len(prompt), len(continuation)
    return Trajectory("t", prompt + continuation, [0] * p + [1] * n, [0.0] * p + list(logprobs or [0.0] * n),
                      [-1] * p + [0] * n, p, turn_spans=[(p, p + n)], finish_reason=finish_reason)


def _hand_loss(batch, logp, ref_logp, eps, eps_high, kl_coef, loss_agg):
    """The GRPO loss row by row, token by token (module docstring of grpo_learner)."""
    pg_rows, kl_rows, clipped, tokens = [], [], 0, 0
    length = batch["tokens"].shape[1]
    for b in range(len(batch["tokens"])):
        idx = np.flatnonzero(batch["action_mask"][b])
        if not len(idx):
            continue
        pg, kl = [], []
        for t in idx:
            ratio = math.exp(logp[b, t] - batch["rollout_logprobs"][b, t])
            adv = batch["advantages"][b, t]
            unclipped, clip = -adv * ratio, -adv * min(max(ratio, 1 - eps), 1 + eps_high)
            pg.append(max(unclipped, clip))
            clipped += clip > unclipped
            d = ref_logp[b, t] - logp[b, t]
            kl.append(math.exp(d) - d - 1)
            tokens += 1
        if loss_agg == "seq-mean-token-mean":
            pg_rows.append(np.mean(pg)), kl_rows.append(np.mean(kl))
        elif loss_agg == "seq-mean-token-sum-norm":
            pg_rows.append(np.sum(pg) / length), kl_rows.append(np.sum(kl) / length)
        else:
            pg_rows += pg
            kl_rows += kl
    return np.mean(pg_rows) + kl_coef * np.mean(kl_rows), clipped / tokens


@pytest.mark.parametrize("std_normalize,filter_zero,loss_agg", [
    (True, False, "seq-mean-token-mean"), (False, True, "token-mean"), (True, True, "seq-mean-token-sum-norm")])
def test_group_advantages_and_loss_on_a_fixed_batch_match_hand_computation(std_normalize, filter_zero, loss_agg):
    trajectories, rewards = _fixed_batch()
    adv, stats = group_advantages(rewards, std_normalize=std_normalize, return_stats=True)
    # group 0: mean 1/3, population std sqrt(2)/3; group 1: all equal -> 0 and counted
    centred = np.array([2 / 3, -1 / 3, -1 / 3])
    want = centred / (math.sqrt(2) / 3 + 1e-6) if std_normalize else centred
    np.testing.assert_allclose(np.asarray(adv)[0], want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv)[1], 0.0)
    assert int(stats["num_zero_variance"]) == 1 and float(stats["zero_variance_fraction"]) == 0.5
    keep = np.asarray(stats["keep"]) if filter_zero else np.ones(2, bool)
    batch = group_batch(trajectories, np.asarray(adv), keep, 8, pad_id=0)

    # layout: row g*K + k = prompt g then continuation k; only continuation tokens of kept groups are actions
    np.testing.assert_array_equal(batch["tokens"][2], [5, 6, 7, 14, 15, 16, 0, 0])
    np.testing.assert_array_equal(batch["tokens"][3], [5, 6, 7, 8, 17, 18, 0, 0])
    np.testing.assert_array_equal(batch["action_mask"][0], [0, 0, 0, 1, 1, 0, 0, 0])
    kept = float(not filter_zero)
    np.testing.assert_array_equal(batch["action_mask"][3], [0, 0, 0, 0, kept, kept, 0, 0])
    np.testing.assert_allclose(batch["advantages"][0, 3:5], want[0], rtol=1e-6)
    np.testing.assert_allclose(batch["rollout_logprobs"][2, 3:6], [-0.1, -0.3, -0.7])
    assert not batch["advantages"][:, :3].any()

    rng = np.random.default_rng(0)
    sign = (-1.0) ** np.add.outer(np.arange(6), np.arange(8))  # ratios e^0.4 and e^-0.4: outside the band
    logp = (batch["rollout_logprobs"] + 0.4 * sign).astype(np.float32)
    ref_logp = batch["rollout_logprobs"] + rng.normal(0, 0.5, batch["tokens"].shape).astype(np.float32)
    loss, metrics = grpo_loss(logp, batch["rollout_logprobs"], ref_logp, batch["advantages"], batch["action_mask"],
                              GrpoLossSettings(eps=0.2, eps_high=0.28, kl_coef=0.01, kl_estimator="k3",
                                               loss_agg=loss_agg))
    hand, clip_fraction = _hand_loss(batch, logp, ref_logp, 0.2, 0.28, 0.01, loss_agg)
    # fp32 against float64 over a handful of tokens
    np.testing.assert_allclose(float(loss), hand, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clip_fraction, rtol=1e-6)
    assert 0 < clip_fraction < 1  # the perturbation moves some ratios out of the band


def test_minibatches_partition_the_rows_the_same_way_on_a_rerun():
    assert [list(r) for r in minibatch_rows(6, 1, seed=0, step=3, epoch=0)] == [list(range(6))]
    parts = minibatch_rows(8, 4, seed=0, step=3, epoch=1)
    assert len(parts) == 4 and all(len(p) == 2 for p in parts)
    assert sorted(np.concatenate(parts)) == list(range(8))
    assert all((a == b).all() for a, b in zip(parts, minibatch_rows(8, 4, seed=0, step=3, epoch=1)))


def test_learner_step_wires_rollout_and_reference_logprobs(tiny_model):
    """The jitted step's loss equals `grpo_loss` on the model's own log-probs, with the batch's rollout and
    reference log-probs in their places; the reference log-probs come from the bf16 copy (close to the fp32
    model's, not equal)."""
    model = tiny_model
    cfg = get_config("tiny").grpo
    cfg.kl_coef = 0.5  # large, so a swapped reference/rollout would change the loss visibly
    reference_graphdef, reference_state = frozen_reference(model, jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(reference_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.bfloat16)}
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(40, 200, (4, 24)), jnp.int32)
    mask = np.zeros((4, 24), np.float32)
    mask[:, 10:20] = 1
    ref_logp = np.asarray(make_reference_logprobs(reference_graphdef)(reference_state, tokens))
    logp = np.asarray(nnx.jit(sequence_logprobs)(model, tokens))
    assert 1e-4 < np.abs(ref_logp - logp)[mask > 0].max() < 0.1  # bf16 weights: close, not equal
    batch = {"tokens": tokens, "action_mask": mask, "ref_logprobs": ref_logp,
             "rollout_logprobs": (logp + rng.normal(0, 0.2, logp.shape) * mask).astype(np.float32),
             "advantages": (np.array([1.0, -1.0, 0.5, -0.5])[:, None] * mask).astype(np.float32)}
    want, want_metrics = grpo_loss(logp, batch["rollout_logprobs"], ref_logp, batch["advantages"], mask,
                                   GrpoLossSettings(eps=cfg.eps, eps_high=cfg.eps_high, kl_coef=cfg.kl_coef,
                                                    loss_agg=cfg.loss_agg))
    state = TrainState.create(model, make_optimizer(cfg.actor_optimizer))
    step = make_grpo_step(state.graphdef, state.tx, cfg)
    _, _, metrics = step(state.params, state.frozen, state.opt_state, batch)
    # same fp32 forward inside and outside the jit; reductions may be ordered differently. The loss sums terms A r of
    # both signs (|loss| ~ mean |A| / 150), so its rounding scales with mean |A| (tests/tolerances.py)
    atol = METRIC_C * rounding(mask.size) * float(np.abs(batch["advantages"]).sum() / mask.sum())
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5, atol=atol)
    np.testing.assert_allclose(float(metrics["kl"]), float(want_metrics["kl"]), rtol=1e-4)
    assert float(metrics["kl"]) > 0 and float(metrics["grad_norm"]) > 0


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(tiny_grpo_config(1).model, 256, seed=0)


# ------------------------------------------------------------------------------------------------ real steps
def synthetic_reward(tokenizer):
    """The stop verifier's verdict with a deterministic reward in [0, 1] of the sampled tokens (varies within a
    group, so advantages do)."""
    verifier = StopVerifierReward(tokenizer)

    def reward(state, trajectory, grade):
        start, end = trajectory.turn_spans[-1]
        return (sum(trajectory.tokens[start:end]) % 7) / 6.0, verifier(state, trajectory, grade)[1]
    return reward


def run(config, workdir):
    """`run_grpo`'s steps with the synthetic reward injected, through the algorithm object so the test also keeps
    host copies of the reference weights as built, before the first step."""
    save_run_config(config, workdir)
    run_dir = RunDir(workdir)
    model, tokenizer = starting_policy(config, run_dir)
    grpo = PivotGrpo(Wiring(config, model, tokenizer, run_dir.stage("grpo"), Seams(reward=synthetic_reward(tokenizer))))
    reference_at_build = jax.device_get(nnx.to_pure_dict(grpo.reference_state))
    history = run_loop(grpo, run_dir.stage("grpo"), grpo_cadence(config), train_cfg=config.get("train"),
                       rollouts=grpo.rollouts)
    return grpo.actor.model(), history, grpo.reference_state, reference_at_build


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, persistent_compilation_cache):
    workdir = tmp_path_factory.mktemp("grpo")
    actor, history, reference_state, reference_at_start = run(tiny_grpo_config(KILLED_AT), workdir)
    first_history = list(history)
    actor, history, reference_state, reference_at_resume = run(tiny_grpo_config(STEPS), workdir)
    return {"workdir": workdir, "actor": actor, "history": history, "first_history": first_history,
            "reference_state": reference_state, "reference_at_start": reference_at_start,
            "reference_at_resume": reference_at_resume}


def _checkpoint(workdir, step, *subtree):
    return read_checkpoint_arrays(workdir / "grpo" / "checkpoints" / str(step) / "arrays", subtree)


def _flat(pure: dict) -> dict:
    """{path of names: array}, named as `read_checkpoint_arrays` names them."""
    return {tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


@pytest.mark.slow  # the module's real GRPO run and its resume (grpo_run): ~70 s of CPU
def test_reference_never_changes_while_the_actor_does(grpo_run):
    workdir = grpo_run["workdir"]
    start = _checkpoint(workdir, 0, "actor", "params")
    last = _checkpoint(workdir, STEPS, "actor", "params")
    assert set(start) == set(last) and start
    moved = [p for p in start if not np.array_equal(start[p], last[p])]
    assert len(moved) > len(start) // 2, f"only {len(moved)} of {len(start)} actor parameters moved"

    # the reference held at the end is bitwise the bf16 copy of step 0's actor, as built before the first step
    at_end = _flat(jax.device_get(nnx.to_pure_dict(grpo_run["reference_state"])))
    at_start = _flat(grpo_run["reference_at_start"])
    assert at_end.keys() == at_start.keys()
    for path in at_start:
        np.testing.assert_array_equal(at_end[path], at_start[path], err_msg=str(path))
    for path, value in start.items():
        assert at_end[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(at_end[path], value.astype(jnp.bfloat16), err_msg=str(path))

    # and it lives where the actor lives, laid out like it
    actor_params = nnx.state(grpo_run["actor"], nnx.Param)
    reference_params = nnx.split(nnx.merge(nnx.graphdef(grpo_run["actor"]), grpo_run["reference_state"]),
                                 nnx.Param, ...)[1]
    actor_leaves, reference_leaves = jax.tree.leaves(actor_params), jax.tree.leaves(reference_params)
    assert len(actor_leaves) == len(reference_leaves)
    assert len({d for leaf in actor_leaves for d in leaf.devices()}) == 2
    for actor_leaf, reference_leaf in zip(actor_leaves, reference_leaves):
        assert reference_leaf.sharding.is_equivalent_to(actor_leaf.sharding, actor_leaf.ndim)


@pytest.mark.slow
def test_steps_log_finite_metrics_publish_weights_and_checkpoint_every_step(grpo_run):
    workdir, history = grpo_run["workdir"], grpo_run["history"]
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    for record in history:
        for key in ("reward", "kl", "clip_fraction", "grad_norm", "policy_loss", "zero_variance_fraction"):
            assert math.isfinite(record[key]), (record["step"], key)
        assert record["grad_norm"] > 0 and record["kl"] >= 0
        # the engine samples with the weights the learner holds (published after every update): log-probs agree
        # to float rounding (fp32 both sides)
        assert record["logp_train_rollout_gap"] < 1e-4, record["logp_train_rollout_gap"]
        assert abs(sum(record[f"outcome_{name}"] for name in STOP_RULES) - 1) < 1e-6
    assert [r["policy_version"] for r in history] == list(range(1, STEPS + 1))
    assert [r["states_consumed"] for r in history] == [2 * s for s in range(1, STEPS + 1)]
    steps = sorted(int(p.name) for p in (workdir / "grpo" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == list(range(STEPS + 1))  # step 0 = the starting policy
    for step in steps:
        meta = json.loads((workdir / "grpo" / "checkpoints" / str(step) / "meta" / "metadata").read_text())
        assert meta == {"step": step, "version": step, "states_consumed": 2 * step}
        assert _checkpoint(workdir, step, "actor", "frozen") is not None


@pytest.mark.slow
def test_resumed_run_continues_from_the_checkpoint(grpo_run):
    first, history = grpo_run["first_history"], grpo_run["history"]
    assert [r["step"] for r in first] == list(range(1, KILLED_AT + 1))
    assert history[:KILLED_AT] == first  # the resumed run keeps the earlier records and appends
    # the resumed reference is rebuilt from the same starting policy: bitwise the same
    for path, value in _flat(grpo_run["reference_at_start"]).items():
        np.testing.assert_array_equal(_flat(grpo_run["reference_at_resume"])[path], value)


# ------------------------------------------------------------------------------------------------ pivot data
@pytest.fixture(scope="module")
def browse_tasks():
    return preset_tasks("browse", "tiny", seed=3, count=4)


def test_pivot_builder_writes_labelled_states_with_provenance(browse_tasks, tmp_path):
    path = tmp_path / "pivots.jsonl"
    counts = build_pivots(browse_tasks, path, source="oracle", oracle_options={"over_search_prob": 1.0})
    records = read_pivots(path)
    assert counts == {"tasks": 4, "pivots": 8, "sufficient": 4, "tasks_with_pivots": 4}
    assert [r["kind"] for r in records] == ["one_step_before", "just_sufficient"] * 4
    for before, stop in zip(records[::2], records[1::2]):
        task = before["task"]
        assert stop["task"] == task and task["task_id"] in {t["task_id"] for t in browse_tasks}
        assert not before["evidence_sufficient"] and stop["evidence_sufficient"]
        assert stop["next_action"] == "tool_call"   # over_search_prob 1: the oracle searched on
        assert before["provenance"] == {"source": "oracle", "policy_version": None, "task_seed": 3,
                                        "message_index": len(before["prefix"]),
                                        "oracle_options": {"over_search_prob": 1.0}}
        assert before["prefix"] == oracle_trajectory(task, over_search_prob=1.0)[:len(before["prefix"])]

    # a policy's trajectories (here: the oracle's turns as a rollout would hold them) give the same states
    def run_episodes(tasks):
        trajectories = []
        for task in tasks:
            chat = oracle_trajectory(task, over_search_prob=1.0)
            turns = [m for m in chat if m["role"] == "assistant"]
            results, turn = [], -1
            for message in chat[2:]:
                if message["role"] == "assistant":
                    turn += 1
                else:
                    results.append({"turn": turn, "name": message["name"], "text": message["content"]})
            trajectories.append(Trajectory(task["task_id"], [0], [0], [0.0], [-1], 1,
                                           assistant_texts=[render_completion(m) for m in turns],
                                           tool_results=results))
        return trajectories

    policy_path = tmp_path / "policy.jsonl"
    build_pivots(browse_tasks, policy_path, source="policy", run_episodes=run_episodes, policy_version="sft step 80")
    from_policy = read_pivots(policy_path)
    assert [(r["kind"], r["evidence_sufficient"], r["provenance"]["message_index"]) for r in from_policy] == [
        (r["kind"], r["evidence_sufficient"], r["provenance"]["message_index"]) for r in records]
    assert {(r["provenance"]["source"], r["provenance"]["policy_version"]) for r in from_policy} == {
        ("policy", "sft step 80")}
    for ours, oracle in zip(from_policy, records):  # the rebuilt chats hold the same calls and results
        calls = [m.get("tool_calls") for m in ours["prefix"]]
        assert calls == [m.get("tool_calls") for m in oracle["prefix"]]
        assert [m["content"] for m in ours["prefix"] if m["role"] == "tool"] == [
            m["content"] for m in oracle["prefix"] if m["role"] == "tool"]
    with pytest.raises(FileNotFoundError, match="grpo.pivots_path"):
        read_pivots(tmp_path / "missing.jsonl")


class CharTokenizer:
    """decode(ids) = the characters with those code points (enough for scoring)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def _turn(text: str, finish_reason: str = "answered") -> Trajectory:
    return one_turn([ord("x")], [ord(c) for c in text], finish_reason=finish_reason)


def test_verifier_outcomes_of_known_continuations(browse_tasks, tmp_path):
    build_pivots(browse_tasks[:1], tmp_path / "p.jsonl", source="oracle", oracle_options={"over_search_prob": 1.0})
    before, stop = read_pivots(tmp_path / "p.jsonl")
    tools = task_tool_schemas([before["task"]])[0]
    states = [{"task": r["task"], "prefix": r["prefix"], "tools": tools, "record": r} for r in (before, stop)]
    answer, entity = stop["task"]["answer"], stop["task"]["chain"][0]
    search = f"\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\n{answer}\n</parameter>\n</function>\n" \
             f"</tool_call><|im_end|>"
    cases = [  # (state, continuation, finish reason, outcome)
        (1, f"\n</think>\n\nFinal answer: {answer}<|im_end|>", "answered", "correct_stop"),
        (1, search, "turn_budget", "over_search"),
        (0, f"\n</think>\n\nFinal answer: {answer}<|im_end|>", "answered", "premature"),
        (0, search, "turn_budget", "continue_insufficient"),
        (1, f"\n</think>\n\nFinal answer: {entity}<|im_end|>", "answered", "wrong"),
        (1, "\n</think>\n\nI think I know it.<|im_end|>", "answered", "malformed"),
        (1, f"\n</think>\n\nFinal answer: {answer}", "degenerate", "malformed"),  # cut off by max_turn_tokens
        (1, "\n</think>\n\n<tool_call>\n<function=browse>\n</function>\n</tool_call><|im_end|>", "turn_budget",
         "malformed"),
    ]
    scored = []
    for index, text, finish, outcome in cases:
        reward, verdict = StopVerifierReward(CharTokenizer())(states[index], _turn(text, finish), {})
        assert verdict["outcome"] == outcome, (text, verdict)
        assert reward == verdict["reward"] == STOP_RULES[outcome]
        assert verdict["cut_off"] == (finish == "degenerate")
        scored.append(dataclasses.replace(_turn(text, finish), reward=reward, reward_parts=verdict))
    metrics = outcome_metrics([states[i] for i, *_ in cases[:4]], scored[:4])
    assert metrics["over_search_rate"] == 0.5 and metrics["stop_rate_sufficient"] == 0.5
    assert metrics["premature_rate"] == 0.5 and metrics["reward"] == 0.5


# ------------------------------------------------------------------------------------------------ fail fast
def test_group_size_one_fails_with_the_fix():
    config = tiny_grpo_config(1)
    config.grpo.group_size = 1
    with pytest.raises(ConfigError, match=r"grpo.group_size is 1; expected a whole number >= 2: .*every advantage 0"):
        validate_config(config)


@pytest.mark.parametrize("field,value,message", [
    ("devices.actor", 3, r"a minibatch of 8 rows .* not divisible by the 3 row shards of the actor mesh"),
    ("grpo.kl_coef", -0.1, r"grpo.kl_coef is -0.1; expected a number >= 0"),
    ("grpo.loss_agg", "sum", r"grpo.loss_agg 'sum' is not one of"),
    ("world.name", "enterprise", r"world.name is 'enterprise'; .* world.name='browse'"),
])
def test_bad_grpo_configs_fail_with_the_fix(field, value, message):
    config = tiny_grpo_config(1)
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
    validate_config(tiny_grpo_config(1))  # the unmodified config passes
