"""The episode runner and `trajectory_from_messages`.

Scripted engine (`ScriptedEngine`: replays given completions token by token, with the engine's request/continuation
semantics) for deterministic episodes: oracle replay solves its task; budgets, stop tokens, malformed calls,
unknown tools, tool errors and timeouts give the right finish reason and format errors. A real tiny model (random
weights, its LM head restricted by top-k to a few chat tokens so turns stop and "call tools") for robustness and
batch independence of multi-turn episodes.
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from flax import nnx
from loop_heartbeat import frozen_heap, heartbeat

from mercury_jax.chat import render, render_completion, train_sentencepiece_tokenizer
from mercury_jax.envs import BehaviourConfig, make_episode, oracle_trajectory, presets
from mercury_jax.envs.episode import Episode
from mercury_jax.rollout import Engine
from mercury_jax.rollout.engine import Sample
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.messages import trajectory_from_messages
from mercury_jax.rollout.rewards import EffectsReward
from mercury_jax.rollout.settings import Budgets, EnvLimits, EpisodeSettings, SamplingParams
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

ENTERPRISE = presets.preset_tasks("enterprise", "tiny", 0, 4)
BROWSE = presets.preset_tasks("browse", "tiny", 0, 2)
TASKS = ENTERPRISE + BROWSE


def tools_of(task):
    """The task's tool schemas, as an episode offers them."""
    async def get():
        async with make_episode(task) as ep:
            return await ep.tools()
    return asyncio.run(get())


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    texts = []
    for task in presets.preset_tasks("enterprise", "tiny", 1, 12) + presets.preset_tasks("browse", "tiny", 1, 6):
        texts.append(render(oracle_trajectory(task), tools_of(task), add_generation_prompt=False))
    return train_sentencepiece_tokenizer(texts, vocab_size=1024, cache_dir=tmp_path_factory.mktemp("spm"))


def prompt_messages(task):
    return [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["user_prompt"]}]


class ScriptedEngine:
    """The Engine's submit / step / results / release API; request r's tokens come from `script(r, request)`
    (cut at the first stop id or at the budget), log-prob -0.5, version `policy_version`. Keeps `history` like the
    engine, so a continuation's history is checkable."""

    def __init__(self, script, *, num_slots=4, max_length=4096):
        self.script, self.num_slots, self.max_length = script, num_slots, max_length
        self.results: dict[int, Sample] = {}
        self.queue, self.released, self.submitted = [], [], []
        self.policy_version = 0

    def submit(self, request):
        if request.continue_from is not None and request.continue_from not in self.results:
            raise ValueError("continuation of an unknown request")
        self.queue.append(request)
        self.submitted.append(request)

    def release(self, request_id):
        self.released.append(request_id)

    def forget(self, request_id):
        self.release(request_id)
        return self.results.pop(request_id)

    def step(self):
        for request in self.queue:
            history = (self.results[request.continue_from].history if request.continue_from is not None
                       else []) + list(request.prompt)
            limit = min(request.max_new_tokens, self.max_length - len(history))
            tokens = []
            for token in self.script(request.request_id, request):
                tokens.append(token)
                if token in request.stop_token_ids or len(tokens) >= limit:
                    break
            reason = "stop" if tokens and tokens[-1] in request.stop_token_ids else "length"
            self.results[request.request_id] = Sample(request.request_id, tokens, [-0.5] * len(tokens), reason,
                                                      history=history + tokens,
                                                      policy_versions=[self.policy_version] * len(tokens))
        self.queue = []
        return False


def oracle_script(tokenizer, tasks, stride, overrides=None, thinking=True):
    """Episode e (request e * stride + k) replays turn k of tasks[e]'s oracle; `overrides[(e, k)]` replaces a
    turn's text."""
    overrides = overrides or {}

    def script(request_id, request):
        episode, turn = divmod(request_id, stride)
        text = overrides.get((episode, turn))
        if text is None:
            turns = [render_completion(m, enable_thinking=thinking) for m in oracle_trajectory(tasks[episode])
                     if m["role"] == "assistant"]
            text = turns[turn] if turn < len(turns) else "Done.<|im_end|>"
        return text if isinstance(text, list) else tokenizer.encode(text)
    return script


def run_scripted(tokenizer, tasks, *, budgets=Budgets(), overrides=None, factory=None, thinking=True, **options):
    settings = EpisodeSettings(budgets=budgets, enable_thinking=thinking,
                               limits=EnvLimits(call_timeout_s=options.pop("call_timeout_s", 30.0)),
                               reward=EffectsReward(options.pop("behaviour", BehaviourConfig())))
    if factory is not None:
        settings = dataclasses.replace(settings, environment=factory)
    engine = ScriptedEngine(None, **options)
    runner = EpisodeRunner(engine, tokenizer, settings)
    engine.script = oracle_script(tokenizer, tasks, runner.request_stride, overrides, thinking)
    return runner.run(tasks), engine


# -- trajectory_from_messages --

@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("task", TASKS[:2] + BROWSE[:1], ids=lambda t: t["task_id"])
def test_trajectory_from_messages_decodes_to_render_and_masks_completions(tokenizer, task, thinking):
    messages, tools = oracle_trajectory(task), tools_of(task)
    traj = trajectory_from_messages(tokenizer, messages, tools, task_id=task["task_id"], enable_thinking=thinking)
    # render closes the last assistant turn with "<|im_end|>\n"; the trajectory ends at the sampled <|im_end|>
    assert tokenizer.decode(traj.tokens) + "\n" == render(messages, tools, add_generation_prompt=False,
                                                          enable_thinking=thinking)
    completions = [render_completion(m, enable_thinking=thinking) for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(traj.tokens[a:b]) for a, b in traj.turn_spans] == completions
    action_ids = [t for t, m in zip(traj.tokens, traj.action_mask) if m]
    assert action_ids == [t for c in completions for t in tokenizer.encode(c)]
    assert traj.prompt_length == len(tokenizer.encode(render(prompt_messages(task), tools, enable_thinking=thinking)))
    assert set(traj.policy_versions) == {-1} and set(traj.rollout_logprobs) == {0.0}
    assert traj.finish_reason == "answered" and traj.tokens[-1] == tokenizer.im_end_id


# -- scripted episodes --

def test_oracle_replay_solves_every_task_with_the_rollout_token_layout(tokenizer):
    trajectories, engine = run_scripted(tokenizer, TASKS, num_slots=3)  # 6 episodes on 3 slots: slots refill
    for task, traj in zip(TASKS, trajectories):
        assert traj.finish_reason == "answered" and not traj.format_errors, traj.format_errors
        assert traj.reward == 1.0 and traj.reward_parts["all_effects_pass"], traj.reward_parts
        assert traj.reward_parts["effects_fraction"] == 1.0 and traj.reward_parts["multiplier"] == 1.0
        # same ids as the messages path (SFT data and rollouts agree token for token)
        reference = trajectory_from_messages(tokenizer, oracle_trajectory(task), tools_of(task))
        assert traj.tokens == reference.tokens and traj.action_mask == reference.action_mask
        assert traj.turn_spans == reference.turn_spans
        assert not any(r["is_error"] for r in traj.tool_results)
        assert [r["text"] for r in traj.tool_results] == [r["text"] for r in reference.tool_results]
        sampled = [v for v, m in zip(traj.policy_versions, traj.action_mask) if m]
        assert set(sampled) == {0} and all(v == -1 for v, m in zip(traj.policy_versions, traj.action_mask) if not m)
        assert all(lp == -0.5 for lp, m in zip(traj.rollout_logprobs, traj.action_mask) if m)
    # every turn after the first continued its predecessor; every episode released its last request
    stride = Budgets().max_tool_turns + 1
    for request in engine.submitted:
        turn = request.request_id % stride
        assert request.continue_from == (None if turn == 0 else request.request_id - 1) and request.keep_cache
    assert set(engine.released) >= {r.request_id for r in engine.submitted}  # each forgotten once consumed
    assert engine.results == {}  # the runner forgets finished requests (a long-running worker must not grow)


def test_oracle_replay_with_thinking_off(tokenizer):
    tasks = ENTERPRISE[:1] + BROWSE[:1]
    trajectories, _ = run_scripted(tokenizer, tasks, thinking=False)
    for task, traj in zip(tasks, trajectories):
        reference = trajectory_from_messages(tokenizer, oracle_trajectory(task), tools_of(task), enable_thinking=False)
        assert traj.reward == 1.0 and traj.tokens == reference.tokens and traj.action_mask == reference.action_mask


def test_turn_budget_stops_before_executing_more_tools(tokenizer):
    task = ENTERPRISE[0]  # oracle: two tool turns then an answer
    (traj,), _ = run_scripted(tokenizer, [task], budgets=Budgets(max_tool_turns=1))
    assert traj.finish_reason == "turn_budget"
    assert len(traj.turn_spans) == 2 and len(traj.tool_results) == 1  # the second call was not executed
    assert traj.reward_parts["effects_fraction"] < 1.0 and traj.tokens[-1] == tokenizer.im_end_id
    assert traj.action_mask[-1] == 1  # the trajectory ends on the sampled turn


def test_collateral_damage_voids_the_reward_of_a_solved_task(tokenizer):
    task = next(t for t in ENTERPRISE if t["template"] == "tiny_deal_stage")
    required = task["required_effects"][0]
    other = task["forbidden_effects"][0]["id"]  # a deal the task says to leave alone
    hedge = render_completion({"role": "assistant", "content": "", "tool_calls": [
        {"name": "update_deal", "arguments": {"deal_id": other, "stage": required["value"]}}]})
    (clean, hedged), _ = run_scripted(tokenizer, [task, task], overrides={(1, 2): hedge})
    assert clean.reward == 1.0 and clean.reward_parts["collateral_damage"] == 1.0
    # the second episode also moved the other deal: every required effect holds, one forbidden effect fired
    assert hedged.reward_parts["effects_fraction"] == 1.0 and not hedged.reward_parts["all_effects_pass"]
    assert hedged.reward_parts["forbidden_violations"] == 1 and hedged.reward_parts["collateral_damage"] == 0.0
    assert hedged.reward == 0.0


def test_token_budget_mid_turn_and_observation_overflow(tokenizer):
    task = ENTERPRISE[0]
    reference = trajectory_from_messages(tokenizer, oracle_trajectory(task), tools_of(task))
    (first_end, second_start) = reference.turn_spans[0][1], reference.turn_spans[1][0]
    # budget ends inside the first turn
    (cut,), _ = run_scripted(tokenizer, [task], budgets=Budgets(max_total_tokens=first_end - 3))
    assert cut.finish_reason == "token_budget" and cut.truncated and len(cut.tokens) == first_end - 3
    assert cut.reward_parts["truncated"] and cut.reward == 0.0
    # the first turn fits, its observation (plus one token to sample) does not: not appended
    (over,), _ = run_scripted(tokenizer, [task], budgets=Budgets(max_total_tokens=second_start))
    assert over.finish_reason == "token_budget" and over.tokens == reference.tokens[:first_end]
    assert len(over.tool_results) == 1  # the call ran; its result did not fit
    (fits,), _ = run_scripted(tokenizer, [task], budgets=Budgets(max_total_tokens=len(reference.tokens)))
    assert fits.finish_reason == "answered" and fits.tokens == reference.tokens


def test_degenerate_turn_cut_inside_think(tokenizer):
    rambling = "I wonder " * 40 + "<|im_end|>"
    (traj,), _ = run_scripted(tokenizer, [ENTERPRISE[0]], budgets=Budgets(max_turn_tokens=20),
                              overrides={(0, 0): rambling})
    assert traj.finish_reason == "degenerate" and len(traj.tokens) == traj.prompt_length + 20
    assert traj.reward_parts["truncated_in_think"] and traj.reward_parts["multiplier"] == 0.0
    assert any("without a stop token" in e for e in traj.format_errors)


def test_malformed_and_unknown_calls_are_observations_and_the_episode_goes_on(tokenizer):
    bad = ("\n</think>\n\n<tool_call>\n<function=search_tickets>\n<parameter=no_such_arg>\nx\n</parameter>\n"
           "</function>\n</tool_call>\n<tool_call>\n<function=drop_database>\n</function>\n</tool_call><|im_end|>")
    cut_off = "\n</think>\n\n<tool_call>\n<function=search_tickets>\n<parameter=status>\nopen<|im_end|>"
    overrides = {(0, 0): bad, (0, 1): cut_off}
    (traj,), _ = run_scripted(tokenizer, [ENTERPRISE[0]], overrides=overrides)
    # turns: bad, cut_off, then the oracle's turns 2.. ("Done." past its end): the episode never crashed
    assert traj.finish_reason == "answered"
    assert [r["executed"] for r in traj.tool_results[:3]] == [False, False, False]
    assert "no_such_arg" in traj.tool_results[0]["text"] and "drop_database" in traj.tool_results[1]["text"]
    assert all(r["is_error"] for r in traj.tool_results[:3])
    assert sum("turn 0" in e for e in traj.format_errors) == 2 and any("turn 1" in e for e in traj.format_errors)
    assert [c["ok"] for c in traj.tool_calls[:3]] == [False, False, False]
    # the reward counts them only when the malformed-calls factor is on (off by default)
    errors = len(traj.format_errors)
    assert traj.reward_parts["format_errors"] == errors and traj.reward_parts["malformed_calls"] == 1.0
    # the first turn malformed (2 errors), then the oracle's write and answer: the task is solved
    (strict,), _ = run_scripted(tokenizer, [ENTERPRISE[0]], overrides={(0, 0): bad},
                                behaviour=BehaviourConfig(malformed_strength=0.25))
    assert strict.reward_parts["effects_fraction"] == 1.0 and len(strict.format_errors) == 2
    assert strict.reward_parts["malformed_calls"] == 0.5 and strict.reward == 0.5


def test_endoftext_ends_a_turn_and_im_end_is_inserted_unsampled(tokenizer):
    task = ENTERPRISE[0]
    first = render_completion(oracle_trajectory(task)[2]).replace("<|im_end|>", "<|endoftext|>")
    (traj,), _ = run_scripted(tokenizer, [task], overrides={(0, 0): first})
    assert traj.finish_reason == "answered" and traj.reward == 1.0
    end = traj.turn_spans[0][1]
    assert traj.tokens[end - 1] == tokenizer.eos_id and traj.action_mask[end - 1] == 1
    assert traj.tokens[end] == tokenizer.im_end_id and traj.action_mask[end] == 0


def test_ids_outside_the_vocabulary_are_a_format_error_not_a_crash(tokenizer):
    outside = tokenizer.vocab_size + 3  # the model's embedding may be padded past the tokenizer's vocabulary
    ids = tokenizer.encode("\n</think>\n\nDone") + [outside] + [tokenizer.im_end_id]
    (traj,), _ = run_scripted(tokenizer, [ENTERPRISE[0]], overrides={(0, 0): ids})
    assert traj.finish_reason == "answered" and traj.assistant_texts == ["\n</think>\n\nDone<|im_end|>"]
    assert traj.tokens[traj.prompt_length:] == ids and any(str(outside) in e for e in traj.format_errors)


def test_a_broken_task_fails_run_loudly(tokenizer):
    tasks = [ENTERPRISE[0], {**ENTERPRISE[1], "world": "atlantis"}, ENTERPRISE[2]]
    with pytest.raises(ValueError, match="atlantis"):  # a bug in the task source is not an observation
        run_scripted(tokenizer, tasks)


class FaultyEpisode(Episode):
    """Tools that fail: a ToolError, a crash, a hang; grading gives 1 if the agent answered."""

    def _tools(self):
        from mcp.server.mcpserver.exceptions import ToolError

        async def refuse(x: str) -> str:
            """Always refuses."""
            raise ToolError(f"refused {x}")

        async def crash(x: str) -> str:
            """Always crashes."""
            raise RuntimeError("boom")

        async def hang(x: str) -> str:
            """Never answers in time."""
            await asyncio.sleep(30)
            return x

        return {"refuse": refuse, "crash": crash, "hang": hang}

    def grade(self, final_answer_text, transcript=None):
        return {"effects_fraction": float(bool(final_answer_text)), "all_effects_pass": bool(final_answer_text)}


def test_tool_errors_crashes_and_timeouts_become_observations(tokenizer):
    def call(name):
        return f"<tool_call>\n<function={name}>\n<parameter=x>\nq\n</parameter>\n</function>\n</tool_call>"
    think = "\n</think>\n\n"
    overrides = {(0, 0): think + call("refuse") + "\n" + call("crash") + "<|im_end|>",
                 (0, 1): think + call("hang") + "<|im_end|>",
                 (0, 2): "\n</think>\n\nGave up.<|im_end|>"}
    task = {**ENTERPRISE[0], "task_id": "faulty"}
    (traj,), _ = run_scripted(tokenizer, [task], overrides=overrides, call_timeout_s=0.3,
                              factory=lambda t, **o: FaultyEpisode(t, **o))
    assert traj.finish_reason == "answered" and traj.reward == 1.0 and not traj.format_errors
    texts = [r["text"] for r in traj.tool_results]
    assert "refused q" in texts[0] and "crash" in texts[1] and "within 0.3 s" in texts[2]
    assert all(r["is_error"] and r["executed"] for r in traj.tool_results)


# -- the real tiny model --

CHAT_TOKENS = ("<tool_call>", "<|im_end|>")


def chatty_model(tokenizer):
    """Random tiny model whose LM head only has weight on a few chat tokens and text pieces, scaled up: with
    top_k=4 every sampled token is one of them, so turns stop (<|im_end|>) and open tool calls (<tool_call>)."""
    # one GDN + one attention layer: every mechanism, half the compile and decode time of the 4-layer preset
    two_layers = C.tiny(vocab_size=tokenizer.vocab_size, num_hidden_layers=2, full_attention_interval=2)
    model = Qwen35MoeForCausalLM(two_layers, rngs=nnx.Rngs(0))
    keep = [tokenizer.token_id(t) for t in CHAT_TOKENS] + tokenizer.encode(" ticket")
    head = np.asarray(model.lm_head[...])
    mask = np.zeros(head.shape[-1], bool)
    mask[keep] = True
    model.lm_head[...] = np.where(mask, head * 20.0, 0.0).astype(head.dtype)
    return model


@pytest.fixture(scope="module")
def real_model(tokenizer):
    return chatty_model(tokenizer)


REAL_BUDGETS = Budgets(max_tool_turns=3, max_total_tokens=640, max_turn_tokens=12)
REAL_SAMPLING = SamplingParams(temperature=1.0, top_k=4, seed=7)


def run_real(model, tokenizer, tasks, *, num_slots, first_episode_id=0):
    engine = Engine(model, num_slots=num_slots, max_length=REAL_BUDGETS.max_total_tokens, steps_per_sync=4)
    runner = EpisodeRunner(engine, tokenizer, EpisodeSettings(budgets=REAL_BUDGETS, sampling=REAL_SAMPLING))
    return runner.run(tasks, first_episode_id=first_episode_id), engine


def test_real_model_episodes_do_not_depend_on_their_neighbours(real_model, tokenizer):
    tasks = ENTERPRISE[:3] + BROWSE[:1]
    together, engine = run_real(real_model, tokenizer, tasks, num_slots=3)  # 4 episodes, 3 slots: one refill
    k = int(np.argmax([len(t.turn_spans) for t in together]))  # the episode with the most turns, rerun alone
    alone, _ = run_real(real_model, tokenizer, [tasks[k]], num_slots=1, first_episode_id=k)
    assert together[k].tokens == alone[0].tokens and together[k].action_mask == alone[0].action_mask
    # fp32: a 1-row vs a 3-row decode sums in another order
    np.testing.assert_allclose(together[k].rollout_logprobs, alone[0].rollout_logprobs, atol=1e-5, rtol=0)
    assert engine.results == {} and not engine.parked  # every slot released
    reasons = {t.finish_reason for t in together}
    assert reasons <= {"answered", "turn_budget", "token_budget", "degenerate"}
    assert any(len(t.turn_spans) > 1 for t in together), "no multi-turn episode: the test exercises nothing"
    for traj in together:
        # action_mask marks exactly the sampled turns; everything else is prompt or observation
        marked = [i for i, m in enumerate(traj.action_mask) if m]
        assert marked == [i for a, b in traj.turn_spans for i in range(a, b)]
        assert [tokenizer.decode(traj.tokens[a:b]) for a, b in traj.turn_spans] == traj.assistant_texts
        assert all(lp < 0 for lp, m in zip(traj.rollout_logprobs, traj.action_mask) if m)
        assert all(lp == 0 for lp, m in zip(traj.rollout_logprobs, traj.action_mask) if not m)
        assert len(traj.tokens) <= REAL_BUDGETS.max_total_tokens
        assert 0.0 <= traj.reward <= 1.0


# -- environments that fail --

def twelve_tasks():
    return [{**TASKS[i % len(TASKS)], "task_id": f"t{i:02d}"} for i in range(12)]


def failing_factory(fail: dict):
    """`make_episode`, except that task `fail[stage]` fails at that stage ("open": world building raises,
    "list": listing the tools raises, "grade": grading raises)."""
    def factory(task, **options):
        episode = make_episode(task, **options)
        stage = next((s for s, task_id in fail.items() if task_id == task["task_id"]), None)
        if stage == "open":
            def broken_world():
                raise OSError("world database unreachable")
            episode._tools = broken_world
        elif stage == "list":
            async def broken_listing():
                raise RuntimeError("tools/list failed")
            episode.tools = broken_listing
        elif stage == "grade":
            def broken_grade(*args):
                raise KeyError("rubric")
            episode.grade = broken_grade
        return episode
    return factory


@pytest.mark.parametrize("stage", ["open", "list", "grade"])
def test_one_failing_environment_costs_its_episode_only(tokenizer, stage):
    from mercury_jax.rollout.failures import trainable

    tasks = twelve_tasks()
    engine = ScriptedEngine(None, num_slots=4)
    runner = EpisodeRunner(engine, tokenizer, EpisodeSettings(environment=failing_factory({stage: "t05"})))
    engine.script = oracle_script(tokenizer, tasks, runner.request_stride)
    trajectories = runner.run(tasks)
    # one entry per task, in order (consumers zip tasks with results); the failed one is a marked placeholder
    assert [t.task_id for t in trajectories] == [t["task_id"] for t in tasks]
    kept, dropped = trainable(trajectories)
    assert dropped == 1 and len(kept) == 11 and all(t.reward == 1.0 for t in kept)
    failed = trajectories[5]
    assert failed.reward == 0.0 and failed.env_failure.startswith("open:" if stage != "grade" else "grade:")
    if stage == "grade":  # the episode ran: its tokens are kept for the logs, never for training
        assert failed.tokens == trajectories[5 - len(TASKS)].tokens and failed.num_action_tokens > 0
    else:
        assert failed.tokens == [] and failed.num_action_tokens == 0
    (record,) = runner.failures
    assert (record.task_id, record.episode_id, record.stage) == ("t05", 5, "open" if stage != "grade" else "grade")
    assert {"open": "world database unreachable", "list": "tools/list failed", "grade": "rubric"}[stage] in record.error
    assert runner.stats()["env_failures"] == 1 and runner.stats()["episodes_finished"] == 11
    assert engine.results == {}  # the failed episode released its slot too


def test_grading_that_hangs_is_a_failure_after_grade_timeout_s(tokenizer):
    import threading

    release = threading.Event()

    def factory(task, **options):
        episode = make_episode(task, **options)
        if task["task_id"] == "t01":
            episode.grade = lambda *args: release.wait(20)
        return episode

    tasks = twelve_tasks()[:3]
    engine = ScriptedEngine(None)
    runner = EpisodeRunner(engine, tokenizer, EpisodeSettings(environment=factory,
                                                              limits=EnvLimits(grade_timeout_s=0.3)))
    engine.script = oracle_script(tokenizer, tasks, runner.request_stride)
    try:
        trajectories = runner.run(tasks)
    finally:
        release.set()
    assert [t.env_failure is None for t in trajectories] == [True, False, True]
    assert "grade_timeout_s=0.3" in trajectories[1].env_failure


def test_tool_timeouts_and_dead_servers_mark_the_trajectory(tokenizer):
    from mercury_jax.rollout.failures import trainable

    def call(name):
        return f"<tool_call>\n<function={name}>\n<parameter=x>\nq\n</parameter>\n</function>\n</tool_call>"
    think = "\n</think>\n\n"
    hang = {(0, 0): think + call("refuse") + "<|im_end|>", (0, 1): think + call("hang") + "<|im_end|>",
            (0, 2): think + call("refuse") + "<|im_end|>", (0, 3): "\n</think>\n\nGave up.<|im_end|>"}
    task = {**ENTERPRISE[0], "task_id": "faulty"}
    (traj,), _ = run_scripted(tokenizer, [task], overrides=hang, call_timeout_s=0.3,
                              factory=lambda t, **o: FaultyEpisode(t, **o))
    assert traj.env_failure == "tool 'hang' at turn 1: tool 'hang' timed out after 0.3 s"
    assert [r.get("failure") is None for r in traj.tool_results] == [True, False, True]
    assert traj.finish_reason == "answered" and traj.reward == 1.0  # graded as usual, but:
    assert trainable([traj]) == ([], 1)
    (clean,), _ = run_scripted(tokenizer, [ENTERPRISE[0]])
    assert clean.env_failure is None and all("failure" not in r for r in clean.tool_results)
    assert trainable([clean]) == ([clean], 0)


class BlockingEpisode(FaultyEpisode):
    """FaultyEpisode plus `block`, a plain-`def` tool that blocks its thread (a synchronous tool gone wrong)."""

    def _tools(self):
        import threading

        self.release = threading.Event()
        tools = super()._tools()

        def block(x: str) -> str:
            """Blocks its thread."""
            self.release.wait(10)
            return x

        return {**tools, "block": block}


def test_no_loop_callback_blocks_over_a_realistic_episode_mix(tokenizer, monkeypatch):
    """Enterprise and browse episodes (oracle replays: world building, searches, BM25, grading) and one episode
    whose tool blocks its thread, on one event loop: a heartbeat task ticking every 10 ms never waits > 0.1 s, no
    loop callback computes for > 0.1 s (its thread CPU time: what our code costs the loop, whatever else the
    machine runs), and the blocking call ends in the timeout observation."""
    import threading
    import time

    tasks = [{**task, "task_id": f"{task['task_id']}-{i}"} for i, task in enumerate(TASKS + TASKS)]
    blocked = {**ENTERPRISE[0], "task_id": "blocked"}
    think = "\n</think>\n\n"
    overrides = {(len(tasks), 0): think + "<tool_call>\n<function=block>\n<parameter=x>\nq\n</parameter>\n"
                                          "</function>\n</tool_call><|im_end|>",
                 (len(tasks), 1): "\n</think>\n\nGave up.<|im_end|>"}

    def factory(task, **options):
        return BlockingEpisode(task, **options) if task["task_id"] == "blocked" else make_episode(task, **options)

    gaps, callbacks, loop_thread = [], [], []
    run_callback = asyncio.events.Handle._run

    def timed_callback(handle):  # every task step and callback of the loop goes through Handle._run
        if threading.current_thread() is not loop_thread[0]:
            return run_callback(handle)
        cpu = time.thread_time()
        try:
            return run_callback(handle)
        finally:
            callbacks.append((time.thread_time() - cpu, repr(getattr(handle._callback, "__self__", handle))[:200]))

    async def main(runner):
        beat = asyncio.ensure_future(heartbeat(gaps))
        try:
            return await runner.run_async(tasks + [blocked])
        finally:
            beat.cancel()

    loop_thread.append(threading.current_thread())
    # The gaps are wall time, so another process holding both cores can stretch one past 0.1 s; and a full garbage
    # collection of the worker's inherited heap can land inside any callback (`frozen_heap` keeps that heap out).
    # Neither is our code: the mix runs up to twice and passes when one run has no slow callback and no long gap.
    # A callback that really blocks the loop stalls every run.
    worst = []
    with frozen_heap():
        for _ in range(2):
            gaps.clear()
            callbacks.clear()
            engine = ScriptedEngine(None, num_slots=4)
            runner = EpisodeRunner(engine, tokenizer, EpisodeSettings(environment=factory,
                                                                      limits=EnvLimits(call_timeout_s=0.3)))
            engine.script = oracle_script(tokenizer, tasks + [blocked], runner.request_stride, overrides)
            monkeypatch.setattr(asyncio.events.Handle, "_run", timed_callback)
            trajectories = asyncio.run(main(runner))
            monkeypatch.undo()
            assert all(t.reward == 1.0 and t.env_failure is None for t in trajectories[:-1])
            assert "timed out after 0.3 s" in trajectories[-1].env_failure
            assert len(callbacks) > 500 and len(gaps) > 20
            slowest = max(callbacks)
            worst.append((slowest, sorted(gaps)[-5:]))
            if slowest[0] < 0.1 and max(gaps) < 0.1:
                break
    slowest, worst_gaps = worst[-1]
    assert slowest[0] < 0.1, worst
    assert max(worst_gaps) < 0.1, worst
