"""The checkpoint sweep of pivot GRPO: interval and test statistics against hand-computed values, the released
selection rule on synthetic metric tables, the frontier plot, the CLI's errors, and one end-to-end sweep of a
fake tiny GRPO run directory (two checkpoints of a random tiny model, three held-out browsing tasks)."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from mercury_jax.config.model import build_model
from mercury_jax.evaluation import (
    EpisodeOutcomes,
    checkpoint_record,
    discordant_counts,
    format_table,
    mcnemar_exact,
    mean_interval,
    paired_difference,
    plot_frontier,
    select_checkpoint,
    sign_test,
    wilson_interval,
)
from mercury_jax.sweep import SweepError, run_sweep, sweep_steps
from mercury_jax.sweep import main as sweep_main

ALPHA = 0.05


# ------------------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("successes, trials, lower, upper", [
    # Newcombe (1998), Stat. Med. 17:857, table I, method 3 (Wilson score without continuity correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    (29, 29, 0.8830, 1.0),
])
def test_wilson_interval_matches_published_values(successes, trials, lower, upper):
    got = wilson_interval(successes, trials, 0.95)
    np.testing.assert_allclose(got, (lower, upper), atol=5e-5)  # the table gives 4 decimals


def test_wilson_interval_by_hand_and_edge_cases():
    z = 1.959963984540054  # Phi^-1(0.975)
    p, n = 0.5, 10  # centre = 0.5; half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/(4 n^2))
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    np.testing.assert_allclose(wilson_interval(5, 10), (0.5 - half, 0.5 + half), rtol=1e-12)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(29, 29)[1] == 1.0 and wilson_interval(0, 7)[0] == 0.0  # contains p despite rounding
    with pytest.raises(ValueError, match="must lie in"):
        wilson_interval(3, 2)


def test_mean_interval_is_student_t():
    # mean 2.5, s = sqrt(5/3), t_{3, 0.975} = 3.182446305 (t table), half = t * s / 2
    lower, upper = mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2
    np.testing.assert_allclose((lower, upper), (2.5 - half, 2.5 + half), rtol=1e-9)
    assert mean_interval([3.0]) == (3.0, 3.0)
    assert mean_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_mcnemar_exact_on_a_table_computed_by_hand():
    # 10 tasks: 6 the start solved and the candidate did not (b), 1 the reverse (c), 2 both, 1 neither
    start = [1] * 6 + [0] + [1, 1] + [0]
    candidate = [0] * 6 + [1] + [1, 1] + [0]
    assert discordant_counts(start, candidate) == (6, 1)
    n = 7
    lower_tail = (math.comb(n, 0) + math.comb(n, 1)) / 2 ** n   # P(X <= 1) = 8 / 128
    assert mcnemar_exact(start, candidate, "two-sided") == pytest.approx(2 * lower_tail, abs=1e-15)  # 0.125
    assert mcnemar_exact(start, candidate, "less") == pytest.approx(lower_tail, abs=1e-15)           # 0.0625
    upper_tail = sum(math.comb(n, i) for i in range(1, n + 1)) / 2 ** n                            # P(X >= 1)
    assert mcnemar_exact(start, candidate, "greater") == pytest.approx(upper_tail, abs=1e-15)


def test_mcnemar_exact_edge_cases_and_reference():
    from scipy.stats import binomtest

    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == 1.0                # no discordant pair
    assert mcnemar_exact([1, 0], [0, 1]) == 1.0                      # two-sided p capped at 1 (b = c)
    assert mcnemar_exact([1] * 20, [0] * 20, "less") == pytest.approx(2.0 ** -20)
    rng = np.random.default_rng(0)
    for _ in range(20):
        start, candidate = rng.random(30) < 0.5, rng.random(30) < 0.4
        b, c = discordant_counts(start, candidate)
        for alternative in ("two-sided", "less", "greater"):
            reference = binomtest(c, b + c, 0.5, alternative=alternative).pvalue if b + c else 1.0
            assert mcnemar_exact(start, candidate, alternative) == pytest.approx(reference, rel=1e-12)
    with pytest.raises(ValueError, match="same tasks"):
        mcnemar_exact([1, 0], [1])


def test_sign_test_by_hand_and_against_scipy():
    from scipy.stats import binomtest

    assert sign_test(2, 1, "greater") == pytest.approx(4 / 8, abs=1e-15)   # P(X >= 2), X ~ Bin(3, 1/2)
    assert sign_test(2, 1, "less") == pytest.approx(7 / 8, abs=1e-15)      # P(X <= 2)
    assert sign_test(0, 0) == 1.0
    for wins, losses in [(9, 2), (0, 5), (13, 13), (30, 17)]:
        for alternative in ("two-sided", "less", "greater"):
            reference = binomtest(wins, wins + losses, 0.5, alternative=alternative).pvalue
            assert sign_test(wins, losses, alternative) == pytest.approx(reference, rel=1e-12)
    with pytest.raises(ValueError, match="must be counts"):
        sign_test(-1, 3)


def test_paired_difference_by_hand_and_against_scipy():
    from scipy.stats import ttest_rel

    start, candidate = [0.0, 1.0, 0.5, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]
    got = paired_difference(start, candidate)
    # d = [1, 0, 0.5, 0, -1]: mean 0.1, s^2 = (0.81 + 0.01 + 0.16 + 0.01 + 1.21) / 4 = 0.55, sem = sqrt(0.55 / 5)
    assert got["mean_difference"] == pytest.approx(0.1, abs=1e-15)
    assert got["sem"] == pytest.approx(math.sqrt(0.11), rel=1e-12)
    assert (got["start_mean"], got["candidate_mean"]) == pytest.approx((0.5, 0.6))
    assert (got["wins"], got["losses"], got["ties"]) == (2, 1, 2)
    assert got["p_sign_greater"] == pytest.approx(0.5, abs=1e-15)
    assert got["p_paired_t"] == pytest.approx(ttest_rel(candidate, start).pvalue, rel=1e-9)
    half = 2.7764451051977987 * math.sqrt(0.11)  # t_{4, 0.975}
    np.testing.assert_allclose(got["ci"], (0.1 - half, 0.1 + half), rtol=1e-9)
    same = paired_difference([0.5, 1.0], [0.5, 1.0])
    assert same["mean_difference"] == 0 and same["p_paired_t"] == 1.0 and same["ties"] == 2
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference([1.0, 0.0], [1.0])


# ------------------------------------------------------------------------------------------------ selection rule
def row(step, accuracy, over_search, p_accuracy, p_over_search):
    return {"step": step, "accuracy": accuracy, "over_search_rate": over_search, "p_accuracy": p_accuracy,
            "p_over_search": p_over_search}


START = row(0, 0.60, 0.50, 1.0, 1.0)


def test_selection_picks_the_latest_qualifying_step_not_the_latest_step():
    table = [START, row(10, 0.61, 0.30, 0.80, 0.010), row(20, 0.59, 0.20, 0.70, 0.001),
             row(30, 0.58, 0.10, 0.40, 0.0001), row(40, 0.45, 0.02, 0.003, 1e-6)]  # 40: accuracy collapsed
    selection = select_checkpoint(table, ALPHA)
    assert selection.step == 30
    assert selection.qualifying == (10, 20, 30)
    assert selection.verdicts[30].startswith("qualifies; SELECTED")
    assert selection.verdicts[10] == selection.verdicts[20] == "qualifies"
    assert "accuracy significantly lower" in selection.verdicts[40]
    assert "step 30 is the latest of the qualifying steps [10, 20, 30]" in selection.reason
    assert select_checkpoint(list(reversed(table)), ALPHA).step == 30  # table order does not matter


def test_selection_rejects_a_significant_accuracy_drop():
    selection = select_checkpoint([START, row(10, 0.50, 0.10, 0.02, 1e-4)], ALPHA)
    assert selection.step == 0
    assert selection.verdicts[10] == "accuracy significantly lower than the start (p 0.02 < 0.05)"


def test_selection_rejects_over_search_that_is_not_significantly_lower():
    table = [START, row(10, 0.60, 0.40, 0.90, 0.20), row(20, 0.60, 0.55, 0.90, 0.90)]
    selection = select_checkpoint(table, ALPHA)
    assert selection.step == 0 and selection.qualifying == ()
    assert selection.verdicts[10] == "over-search not significantly lower (p 0.2 >= 0.05)"
    assert selection.verdicts[20] == "over-search not significantly lower (p 0.9 >= 0.05)"


def test_selection_with_no_qualifying_step_keeps_the_start_and_says_why():
    table = [START, row(10, 0.40, 0.45, 0.001, 0.30)]  # both conditions fail
    selection = select_checkpoint(table, ALPHA)
    assert selection.step == 0
    assert "no checkpoint after the start" in selection.reason and "step 0" in selection.reason
    assert selection.verdicts[0] == "starting policy (reference); SELECTED (no checkpoint qualifies)"
    assert "accuracy significantly lower" in selection.verdicts[10]
    assert "over-search not significantly lower" in selection.verdicts[10]
    only_start = select_checkpoint([START], ALPHA)
    assert only_start.step == 0 and "only the starting policy" in only_start.reason


@pytest.mark.parametrize("candidate, qualifies, verdict_part", [
    (row(10, 0.75, 0.10, 0.001, 1e-4), False, "accuracy significantly higher"),  # "indistinguishable", literally
    (row(10, 0.60, 0.60, 0.90, 0.01), False, "rate not below the start"),         # a table contradicting itself
    (row(10, 0.60, 0.10, ALPHA, 1e-4), True, "qualifies"),                        # p = alpha: not significant
    (row(10, 0.60, 0.10, 0.90, ALPHA), False, "p 0.05 >= 0.05"),                  # p = alpha: not significant
])
def test_selection_rule_edges(candidate, qualifies, verdict_part):
    selection = select_checkpoint([START, candidate], ALPHA)
    assert (selection.step == 10) == qualifies
    assert verdict_part in selection.verdicts[10]


def test_selection_needs_the_start_and_complete_records():
    with pytest.raises(ValueError, match="no step 0"):
        select_checkpoint([row(10, 0.6, 0.1, 0.9, 0.01)], ALPHA)
    with pytest.raises(ValueError, match="lacks"):
        select_checkpoint([{"step": 0, "accuracy": 0.5}], ALPHA)
    with pytest.raises(ValueError, match="repeat a step"):
        select_checkpoint([START, START], ALPHA)


def outcomes(correct, over_searched, tool_calls=None):
    n = len(correct)
    return EpisodeOutcomes(task_ids=[f"t{i}" for i in range(n)], correct=[bool(x) for x in correct],
                           over_searched=[bool(x) for x in over_searched],
                           tool_calls=list(tool_calls) if tool_calls is not None else [2] * n)


def test_records_from_paired_outcomes_feed_the_rule():
    # 40 tasks. Start: 24 correct, over-searches on tasks 0..19. Step 10: two correct tasks lost and two gained
    # (accuracy p = 1), over-search kept only on tasks 0..3 (16 discordant pairs all one way: p = 2^-16).
    start_correct = [1] * 24 + [0] * 16
    later_correct = [0, 0] + [1] * 22 + [1, 1] + [0] * 14
    start = outcomes(start_correct, [1] * 20 + [0] * 20, [4] * 20 + [2] * 20)
    later = outcomes(later_correct, [1] * 4 + [0] * 36, [4] * 4 + [2] * 36)
    # step 20: lost 10 correct tasks, none gained (two-sided p = 2 * 2^-10)
    worse = outcomes([0] * 10 + [1] * 14 + [0] * 16, [0] * 40, [1] * 40)
    records = [checkpoint_record(s, o, start) for s, o in ((0, start), (10, later), (20, worse))]
    assert records[1]["accuracy"] == 0.6 and records[1]["p_accuracy"] == 1.0
    assert records[1]["over_search_rate"] == 0.1 and records[1]["p_over_search"] == pytest.approx(2.0 ** -16)
    assert records[2]["p_accuracy"] == pytest.approx(2 * 2.0 ** -10)
    assert records[0]["tool_calls"] == 3.0 and records[0]["tool_calls_ci"][0] < 3.0 < records[0]["tool_calls_ci"][1]
    np.testing.assert_allclose(records[1]["over_search_ci"], wilson_interval(4, 40))
    selection = select_checkpoint(records, ALPHA)
    assert selection.step == 10 and selection.qualifying == (10,)
    table = format_table(records, selection.verdicts)
    assert table.splitlines()[0].split()[:2] == ["step", "accuracy"]
    assert "0.600 [" in table and "SELECTED" in table
    with pytest.raises(ValueError, match="other tasks"):
        checkpoint_record(10, outcomes([1], [0]), start)


def test_frontier_plot_is_written(tmp_path):
    records = [{**row(step, acc, over, 1.0, 1.0), "accuracy_ci": [acc - 0.1, acc + 0.1],
                "over_search_ci": [max(0.0, over - 0.1), over + 0.1]}
               for step, acc, over in ((0, 0.6, 0.5), (10, 0.6, 0.3), (20, 0.4, 0.1))]
    path = plot_frontier(records, 10, tmp_path / "plots" / "frontier.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# ------------------------------------------------------------------------------------------------ CLI errors
def tiny_grpo_config(num_eval_tasks: int = 3):
    """What the GRPO experiment's `:tiny` config holds for the sweep: a browse world and a rollout section."""
    import ml_collections

    from experiments import common

    c = common.base_config("grpo", world="browse")
    common.tiny_common(c)
    c.world.num_train_tasks, c.world.num_eval_tasks = 8, num_eval_tasks
    c.rollout = ml_collections.ConfigDict(dict(max_tool_turns=1, max_total_tokens=512, max_turn_tokens=24,
                                               temperature=1.0, top_p=1.0, num_slots=3))
    return c


def sweep_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        sweep_main(["--workdir", *map(str, argv)])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_names_what_is_missing(tmp_path, capsys):
    from mercury_jax.runs.run_reader import save_run_config

    assert "does not exist; pass the directory of a pivot-GRPO run" in sweep_error(capsys, tmp_path / "nowhere")
    assert "config.json does not exist" in sweep_error(capsys, tmp_path)
    save_run_config(tiny_grpo_config(), tmp_path)
    assert "no grpo checkpoint in" in sweep_error(capsys, tmp_path)
    for step in (3, 5):  # what `checkpoint_steps` counts as a finished checkpoint
        (tmp_path / "grpo" / "checkpoints" / str(step) / "arrays").mkdir(parents=True)
    assert "has no step 0 (the starting policy" in sweep_error(capsys, tmp_path)
    (tmp_path / "grpo" / "checkpoints" / "0" / "arrays").mkdir(parents=True)
    assert sweep_steps(tmp_path) == [0, 3, 5] and sweep_steps(tmp_path, [5]) == [0, 5]
    err = sweep_error(capsys, tmp_path, "--steps", "3,7")
    assert "step(s) [7] do not exist" in err and "available steps: [0, 3, 5]" in err
    assert "holds out 3 tasks" in sweep_error(capsys, tmp_path, "--num-tasks", "4")
    assert "comma-separated" in sweep_error(capsys, tmp_path, "--steps", "three")
    with pytest.raises(SweepError, match="must lie in"):
        run_sweep(tmp_path, alpha=1.5)
    enterprise = tiny_grpo_config()
    enterprise.world.name = "enterprise"
    save_run_config(enterprise, tmp_path / "sao-run")
    assert "world is 'enterprise'" in sweep_error(capsys, tmp_path / "sao-run")


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tokenizer_run(tmp_path_factory):
    """The start of a fake pivot-GRPO run: config.json and the SentencePiece tokenizer trained on oracle text."""
    from mercury_jax.chat import render
    from mercury_jax.config.world import oracle_messages, tool_schemas, world_tasks
    from mercury_jax.runs.run_reader import save_run_config
    from mercury_jax.runs.tokenizer import build_tokenizer

    workdir = tmp_path_factory.mktemp("grpo-run")
    config = tiny_grpo_config()
    save_run_config(config, workdir)
    tasks = world_tasks(config.world, "train") + world_tasks(config.world, "eval")
    texts = [render(m, t) for m, t in zip(oracle_messages(tasks), tool_schemas(tasks))]
    build_tokenizer(config.tokenizer, workdir, texts)
    return workdir


@pytest.fixture(scope="module")
def tiny_run(tokenizer_run):
    """The fake run with Orbax checkpoints 0 and 1 of a random tiny model in the trainer's layout
    {"actor": {"params", "frozen"}} (step 1 = step 0 with rescaled weights)."""
    import jax
    from flax import nnx

    from mercury_jax.runs.checkpoints import Checkpointer
    from mercury_jax.runs.run_reader import RunReader

    reader = RunReader(tokenizer_run)
    config = reader.config
    model = build_model(config.model, reader.tokenizer().vocab_size, config.seed)
    _, params, frozen = nnx.split(model, nnx.Param, ...)
    perturbed = jax.tree.map(lambda x: x * 1.5, params)
    checkpointer = Checkpointer(tokenizer_run / "grpo" / "checkpoints", save_every=1, keep=10, async_save=False)
    for step, step_params in ((0, params), (1, perturbed)):
        checkpointer.save(step, {"actor": {"params": step_params, "frozen": frozen}}, {"step": step})
    checkpointer.close()
    return tokenizer_run


@pytest.mark.slow
def test_sweep_end_to_end_on_a_tiny_run(tiny_run):
    from mercury_jax.rollout.engine import Engine

    versions = []

    class RecordingEngine(Engine):
        def update_weights(self, model, version=None):
            versions.append(version)
            super().update_weights(model, version)

    log = io.StringIO()
    summary = run_sweep(tiny_run, num_tasks=2, stream=log, make_engine=RecordingEngine)
    out = Path(tiny_run) / "sweep"
    assert versions == [1]  # one engine: built with step 0, given step 1's weights
    assert summary["steps"] == [0, 1] and [r["step"] for r in summary["records"]] == [0, 1]
    assert all(r["num_tasks"] == 2 for r in summary["records"])
    start = summary["records"][0]
    assert start["p_accuracy"] == 1.0 and start["p_over_search"] == 1.0  # the start against itself
    # a random model neither answers nor over-searches: nothing qualifies, the start is kept
    assert summary["selection"]["step"] == 0 and "no checkpoint after the start" in summary["selection"]["reason"]
    assert json.loads((out / "sweep.json").read_text())["selection"] == summary["selection"]
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    text = log.getvalue()
    assert "[sweep] step 1 (2/2): accuracy" in text and "ETA" in text
    assert "selected checkpoint: step 0" in text and "verdict" in text

    log = io.StringIO()  # a rerun with the same setup reuses the stored outcomes (no episodes)
    again = run_sweep(tiny_run, num_tasks=2, stream=log)
    assert "outcomes reused" in log.getvalue() and again["records"] == summary["records"]


# Behaviour of "the policy at step s" in the scripted sweep: the browsing oracle searching on after the answer with
# this probability, and whether its final answer is replaced by a wrong one.
ORACLE_POLICIES = {0: (1.0, False), 1: (0.0, False), 2: (0.0, False), 3: (0.0, True)}


class OracleEngine:
    """Stands in for `Engine` (its submit / step / results / release / forget / update_weights API): turn k of
    episode e replays turn k of the oracle's solution of held-out task e, with the behaviour of the policy version
    loaded (`ORACLE_POLICIES`). Step 2 differs from step 1 on task 0 only, where it still over-searches."""
    tasks: tuple = ()    # the held-out tasks in episode order, the run's tokenizer, EpisodeRunner.request_stride:
    tokenizer = None     # set by the test
    stride = 0

    def __init__(self, model, *, num_slots, max_length, policy_version=0):
        self.num_slots, self.max_length, self.policy_version = num_slots, max_length, policy_version
        self.results, self.queue = {}, []

    def update_weights(self, model, version=None):
        self.policy_version = version

    def submit(self, request):
        self.queue.append(request)

    def release(self, request_id):
        pass

    def forget(self, request_id):
        return self.results.pop(request_id)

    def step(self):
        from mercury_jax.chat import render_completion
        from mercury_jax.envs import oracle_trajectory
        from mercury_jax.rollout.engine import Sample

        for request in self.queue:
            episode, turn = divmod(request.request_id, self.stride)
            over_search_prob, wrong = ORACLE_POLICIES[self.policy_version]
            if self.policy_version == 2 and episode == 0:
                over_search_prob = 1.0
            messages = oracle_trajectory(self.tasks[episode], over_search_prob=over_search_prob)
            turns = [render_completion(m) for m in messages if m["role"] == "assistant"]
            if wrong:
                turns[-1] = render_completion({"role": "assistant", "content": "Final answer: nobody"})
            tokens = self.tokenizer.encode(turns[turn])
            history = (self.results[request.continue_from].history if request.continue_from is not None else [])
            self.results[request.request_id] = Sample(
                request.request_id, tokens, [-0.5] * len(tokens), "stop", history=history + request.prompt + tokens,
                policy_versions=[self.policy_version] * len(tokens))
        self.queue = []
        return False


@pytest.mark.parametrize("location", ["path", "gs"])
def test_sweep_selects_by_the_rule_on_scripted_policies(tokenizer_run, tmp_path, monkeypatch, location, request):
    """Real browse episodes and grading, policies replaced by scripted oracle behaviours per step: 0 over-searches
    on all 10 tasks, 1 never, 2 on task 0 only, 3 never but answers wrongly. Steps 1 and 2 qualify (accuracy equal,
    over-search p = 2^-10, 2^-9); 3 loses accuracy (p = 2 * 2^-10); the latest qualifying step, 2, is selected.
    `gs`: the run directory is a `gs://` URI read through epath's remote-path code (config, checkpoint listing, the
    tokenizer copied to a local cache; outcomes, sweep.json and the plot written back)."""
    import shutil

    from mercury_jax import sweep
    from mercury_jax.config.world import world_tasks
    from mercury_jax.runs.run_reader import RunReader, save_run_config

    workdir = tmp_path
    if location == "gs":
        workdir = request.getfixturevalue("buckets") / "bucket" / tmp_path.name
        workdir.mkdir(parents=True)
    config = tiny_grpo_config(num_eval_tasks=10)
    config.rollout.max_tool_turns, config.rollout.max_total_tokens, config.rollout.max_turn_tokens = 4, 4096, 256
    save_run_config(config, tmp_path)
    shutil.copytree(tokenizer_run / "tokenizer", tmp_path / "tokenizer")
    for step in ORACLE_POLICIES:
        (tmp_path / "grpo" / "checkpoints" / str(step) / "arrays").mkdir(parents=True)
    monkeypatch.setattr(OracleEngine, "tasks", tuple(world_tasks(config.world, "eval")))
    monkeypatch.setattr(OracleEngine, "tokenizer", RunReader(tmp_path).tokenizer())
    monkeypatch.setattr(OracleEngine, "stride", config.rollout.max_tool_turns + 1)
    if location == "gs":
        shutil.copytree(tmp_path, workdir, dirs_exist_ok=True)
    summary = sweep.run_sweep(workdir if location == "path" else f"gs://bucket/{tmp_path.name}",
                              stream=io.StringIO(), load_policy=lambda reader, step: f"policy {step}",
                              make_engine=OracleEngine)
    if location == "gs":
        assert summary["workdir"] == f"gs://bucket/{tmp_path.name}"
        written = json.loads((workdir / "sweep" / "sweep.json").read_text())
        assert written["selection"] == summary["selection"]
        assert (workdir / "sweep" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
        assert sorted(p.name for p in (workdir / "sweep" / "outcomes").iterdir()) == [f"{s}.json" for s in range(4)]
    records = {r["step"]: r for r in summary["records"]}
    assert [records[s]["accuracy"] for s in ORACLE_POLICIES] == [1.0, 1.0, 1.0, 0.0]
    assert [records[s]["over_search_rate"] for s in ORACLE_POLICIES] == [1.0, 0.0, 0.1, 0.0]
    assert records[1]["p_over_search"] == pytest.approx(2.0 ** -10)
    assert records[2]["p_over_search"] == pytest.approx(2.0 ** -9)
    assert records[3]["p_accuracy"] == pytest.approx(2 * 2.0 ** -10)
    assert records[0]["tool_calls"] > records[1]["tool_calls"] == 2.0  # search + open, then the answer
    assert summary["selection"]["step"] == 2 and summary["selection"]["qualifying"] == [1, 2]
    assert "accuracy significantly lower" in summary["selection"]["verdicts"]["3"]
