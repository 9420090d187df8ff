"""The episode runner: many multi-turn tool episodes at once on one continuous-batching `Engine`.

One episode (docs/ENVIRONMENTS.md section 4; docs/ALGORITHMS.md "Shared definitions"):

    prompt = environment.prompt(tokenizer, tools)   (envs: system + user rendered; a pivot state: its prefix ids)
    loop:  sample a turn (stops: <|im_end|>, <|endoftext|>)  ->  parse_assistant(text, tools)
           no tool calls                      -> finish "answered"
           tool calls, turn budget spent      -> finish "turn_budget" (the calls are not executed)
           else execute each call through MCP (a call with parse errors is not executed: its error text is the
           observation), append observation_ids, continue the same engine sequence (continue_from +
           keep_cache: the history is never recomputed)
    then   grade = ep.grade(final answer, transcript); reward, parts = reward_fn(task, trajectory, grade)
           (default `rewards.EffectsReward`: effects_fraction * behaviour multiplier)

The environment builds the prompt: a world's episode renders the task's system and user prompts (message text never
becomes control ids); a pivot state's (`envs/prefix_episode.py`) is its chat prefix, already rendered, run as a
one-turn episode (`max_tool_turns = 0`). What every episode shares (budgets, sampling, the environment factory and
its limits, the reward) is one `settings.EpisodeSettings`.

Finish reasons: "answered"; "turn_budget" (a tool-calling turn after `max_tool_turns` executed tool turns; the
model always gets a turn to answer after its last allowed tool turn); "token_budget" (the turn was cut by
`max_total_tokens` / the engine's `max_length`, or an observation plus one sampled token would not fit: the
observation is then not appended); "degenerate" (a turn cut by `max_turn_tokens` without a stop token, e.g.
rambling inside `<think>`). "token_budget" and "degenerate" are truncations for the behaviour multiplier.

Concurrency: each episode is a coroutine; `EpisodeRunner.drive()` is the one task that touches the engine. Episodes
hand it requests and await futures; between decode chunks (run in a thread with `overlap=True`, so tool calls
proceed meanwhile) the driver submits new requests and releases, resolves finished turns, and calls
`before_step` (the worker applies published weights there). At most `engine.num_slots` episodes run at once
(each holds one slot, running or parked), so a finished episode's slot goes straight to the next one.

Determinism: turn k of episode e is request `e * request_stride + k` with the runner's seed, so an episode's
tokens do not depend on which other episodes share the engine or when they arrive.

Environment failures (`failures.py`): an environment that fails to open (world building, MCP connect, tools/list)
or to grade does not stop the run: `run` returns a placeholder trajectory in that task's place (`env_failure` set,
reward 0), `run_episode` raises `EnvironmentFailure` (the worker records it and goes on), and `failures` /
`stats()["env_failures"]` count it. A tool call that times out or finds its server gone marks the trajectory
(`env_failure`) but the episode goes on. Trainers drop marked trajectories with `failures.trainable`.

The event loop is shared by every episode, so nothing slow runs on it: the engine step (and `before_step`, the
weight swap) runs in a thread while episodes wait; tools, world building and grading run in the bounded
`envs.tool_threads` pool (grading within `grade_timeout_s`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from mercury_jax.chat import observation_ids, parse_assistant
from mercury_jax.chat.tokenizer import Tokenizer
from mercury_jax.envs.tool_threads import run_blocking
from mercury_jax.rollout.decode import decode_known
from mercury_jax.rollout.engine import Request, Sample
from mercury_jax.rollout.episode_record import EpisodeRecord
from mercury_jax.rollout.failures import EnvironmentFailure, EpisodeFailure, failure_placeholder
from mercury_jax.rollout.rewards import plain
from mercury_jax.rollout.settings import EpisodeSettings
from mercury_jax.rollout.trajectory import Trajectory


class EpisodeRunner:
    """Runs episodes on `engine` (an `Engine`, or anything with its submit / step / results / release API) with
    `settings` (budgets, sampling, environment and its limits, reward). `before_step()` runs before every engine
    step (the worker swaps in published weights there); `failure_log_size`: how many `EpisodeFailure` records
    `failures` keeps."""

    def __init__(self, engine, tokenizer: Tokenizer, settings: EpisodeSettings = EpisodeSettings(), *,
                 overlap: bool = True, before_step: Callable[[], None] | None = None, failure_log_size: int = 256):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.budgets, self.sampling, self.reward = settings.budgets, settings.sampling, settings.scorer()
        self.overlap, self.before_step = overlap, before_step
        self.failures: collections.deque[EpisodeFailure] = collections.deque(maxlen=failure_log_size)
        self.env_failures = 0  # episodes whose environment failed (any stage but "close")
        self.env_failure_stages: collections.Counter[str] = collections.Counter()
        self.request_stride = self.budgets.max_tool_turns + 1  # tool turns + the answer turn
        self.stop_token_ids = tuple(tokenizer.stop_token_ids)
        self._futures: dict[int, asyncio.Future] = {}
        self._inbox: list[Request] = []
        self._releases: list[int] = []
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self.episodes_started = self.episodes_finished = 0

    # -- public API --

    def run(self, tasks: Iterable[Mapping], *, first_episode_id: int = 0,
            episode_ids: Sequence[int] | None = None) -> list[Trajectory]:
        """Run one episode per task (concurrently, refilling slots) and return their trajectories in task order.
        Episode i's id (its requests' ids and sampling keys) is `first_episode_id + i`, or `episode_ids[i]`."""
        return asyncio.run(self.run_async(list(tasks), first_episode_id=first_episode_id, episode_ids=episode_ids))

    async def run_async(self, tasks: list[Mapping], *, first_episode_id: int = 0,
                        episode_ids: Sequence[int] | None = None) -> list[Trajectory]:
        """`run` inside a running event loop. An episode whose environment failed to open or grade is a placeholder
        trajectory with `env_failure` set (see `failures.py`); any other exception fails the run."""
        self._wake = self._slots = None  # asyncio primitives belong to one event loop
        ids = list(episode_ids) if episode_ids is not None else [first_episode_id + i for i in range(len(tasks))]
        if len(ids) != len(tasks):
            raise ValueError(f"{len(ids)} episode ids for {len(tasks)} tasks")
        episodes = [asyncio.ensure_future(self._run_or_placeholder(task, episode_id))
                    for task, episode_id in zip(tasks, ids)]
        driver = asyncio.ensure_future(self.drive(lambda: all(e.done() for e in episodes)))
        try:
            await asyncio.wait([driver, *episodes], return_when=asyncio.FIRST_EXCEPTION)
            for task in (driver, *episodes):  # a failure, if any, before results (some may be unfinished)
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            return [e.result() for e in episodes]
        finally:
            for task in (driver, *episodes):
                task.cancel()
            await asyncio.gather(driver, *episodes, return_exceptions=True)

    async def run_episode(self, task: Mapping, episode_id: int) -> Trajectory:
        """One episode of `task`; its turns are requests episode_id * request_stride + k. Waits for a free slot.
        Raises `EnvironmentFailure` (already recorded in `failures`) when the environment fails to open or grade."""
        async with self._slot_semaphore():
            self.episodes_started += 1
            try:
                trajectory = await self._episode(task, episode_id)
            except EnvironmentFailure as failed:
                failed.trajectory.episode_id = episode_id
                raise
            self.episodes_finished += 1
            trajectory.episode_id = episode_id
            return trajectory

    def stats(self) -> dict:
        """Counters for the trainers' logs: episodes started / finished, `env_failures` (episodes the environment
        failed, at any stage but "close"), and those failures by stage."""
        return {"episodes_started": self.episodes_started, "episodes_finished": self.episodes_finished,
                "env_failures": self.env_failures, "env_failure_stages": dict(self.env_failure_stages)}

    async def drive(self, done: Callable[[], bool]) -> None:
        """The engine loop: until `done()`, feed requests in, step the engine, hand finished turns out."""
        wake = self._wake_event()
        while not done():
            self._sync()
            if self._futures:
                if self.overlap:
                    await asyncio.to_thread(self._step)
                else:
                    self._step()
                self._collect()
                await asyncio.sleep(0)
            else:
                wake.clear()
                try:  # asyncio.timeout, not wait_for, which can swallow a cancellation on Python 3.11
                    async with asyncio.timeout(0.05):
                        await wake.wait()
                except TimeoutError:
                    pass
        for request_id in self._releases:  # the last episodes' slots
            self._forget(request_id)
        self._releases.clear()

    # -- one episode --

    async def _episode(self, task: Mapping, episode_id: int) -> Trajectory:
        start = time.perf_counter()
        async with self._environment(task, episode_id) as env:
            try:
                tools = await env.tools()
            except Exception as error:  # noqa: BLE001 (an MCP list_tools failure ends this episode only)
                raise self._env_failure(task, episode_id, "open", error) from error
            prompt_messages, prompt = env.prompt(self.tokenizer, tools, enable_thinking=self.settings.enable_thinking)
            record = EpisodeRecord(list(prompt), list(prompt_messages))
            budget = self.budgets.max_total_tokens
            limit = min(budget, getattr(self.engine, "max_length", budget))
            if len(prompt) >= limit:
                raise ValueError(f"task {task.get('task_id')}: prompt of {len(prompt)} tokens leaves no room under "
                                 f"the token budget {limit}")
            await self._turns(env, tools, record, episode_id, limit)
            grade = await self._grade(env, task, episode_id, record)
        record.timings["total_s"] = time.perf_counter() - start
        spoiled = next((r for r in record.results if r.get("failure")), None)
        env_failure = None
        if spoiled is not None:  # delivered (for the logs) but marked: the trainers drop it
            env_failure = f"tool {spoiled['name']!r} at turn {spoiled['turn']}: {spoiled['failure']}"
            self._record(task, episode_id, "tool", env_failure)
        trajectory = record.trajectory(str(task.get("task_id", "")), env_failure)
        reward, parts = self.reward(task, trajectory, grade)
        trajectory.reward, trajectory.reward_parts = reward, plain(parts)
        return trajectory

    async def _turns(self, env, tools: list[dict], record: EpisodeRecord, episode_id: int, limit: int) -> None:
        """Sample turns and execute their tool calls until the episode finishes (`record.finish` set); the last
        turn's slot is released however this ends."""
        feed, parent, last_request = record.prompt, None, None
        try:
            for turn in itertools.count():
                request_id = episode_id * self.request_stride + turn
                room = limit - len(record.tokens)
                sample = await self._sample(feed, parent, request_id, room, record)
                last_request = request_id
                calls = self._read_turn(sample, tools, turn, room, record)
                if record.finish is not None:
                    return
                feed = await self._observe(env, calls, turn, record)
                if len(record.tokens) + len(feed) + 1 > limit:
                    record.finish = "token_budget"
                    return
                record.add_inserted(feed)
                parent = request_id
        finally:
            if last_request is not None:
                self._release(last_request)

    async def _sample(self, feed: list[int], parent: int | None, request_id: int, room: int,
                      record: EpisodeRecord) -> Sample:
        """One turn from the engine: `feed` continues the parent request's sequence (its cache kept)."""
        budgets, sampling = self.budgets, self.sampling
        max_new = room if budgets.max_turn_tokens is None else min(room, budgets.max_turn_tokens)
        t0 = time.perf_counter()
        sample = await self._generate(Request(
            request_id, feed, max_new_tokens=max_new, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop_token_ids=self.stop_token_ids, continue_from=parent,
            keep_cache=True))
        record.timings["generate_s"] += time.perf_counter() - t0
        record.add_sampled(sample)
        return sample

    def _read_turn(self, sample: Sample, tools: list[dict], turn: int, room: int, record: EpisodeRecord) -> list:
        """Parse a sampled turn into the record; sets `record.finish` when the episode ends with it, else returns
        the tool calls to execute."""
        n = len(sample.tokens)
        text, unknown = decode_known(self.tokenizer, sample.tokens)
        if unknown:
            record.format_errors.append(f"turn {turn}: sampled ids outside the tokenizer's vocabulary: {unknown}")
        record.texts.append(text)
        parsed = parse_assistant(text, tools)
        record.transcript.append(parsed.to_message())
        if sample.finish_reason != "stop":
            record.format_errors.append(f"turn {turn}: cut off after {n} tokens without a stop token")
            record.finish = "token_budget" if n >= room else "degenerate"
            return []
        record.format_errors += [f"turn {turn}: {e}" for e in parsed.errors]
        if not parsed.tool_calls:
            record.finish, record.final_text = "answered", parsed.content
        elif turn >= self.budgets.max_tool_turns:  # every turn before this one executed its tools
            record.finish = "turn_budget"
        return list(parsed.tool_calls)

    async def _observe(self, env, calls: list, turn: int, record: EpisodeRecord) -> list[int]:
        """Execute a turn's tool calls; returns the observation ids that continue the sequence."""
        t0 = time.perf_counter()
        observed = []
        for call in calls:
            record.calls.append({"turn": turn, "name": call.name, "arguments": dict(call.arguments), "ok": call.ok})
            observation = await self._call(env, call)
            observed.append(observation["text"])
            record.results.append({"turn": turn, **observation})
            record.transcript.append({"role": "tool", "name": call.name, "content": observation["text"]})
        record.timings["tools_s"] += time.perf_counter() - t0
        return observation_ids(self.tokenizer, record.tokens, observed, enable_thinking=self.settings.enable_thinking)

    async def _grade(self, env, task: Mapping, episode_id: int, record: EpisodeRecord) -> dict:
        """The environment's grade of the finished episode, within `grade_timeout_s`; a grader that raises or
        hangs is an environment failure of this episode (its placeholder keeps the tokens)."""
        timeout_s = self.settings.limits.grade_timeout_s
        t0 = time.perf_counter()
        try:
            grade = await run_blocking(env.grade, record.final_text, record.transcript, timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 (a grader that raises or hangs ends this episode only)
            if isinstance(error, TimeoutError):
                error = TimeoutError(f"grading did not finish within grade_timeout_s={timeout_s:g} s")
            raise self._env_failure(task, episode_id, "grade", error, **record.columns()) from error
        record.timings["grade_s"] = time.perf_counter() - t0
        return grade

    async def _call(self, ep, call) -> dict:
        """One tool call as an observation dict (with "failure" when the environment spoiled it); nothing a tool
        or the model does raises out of here."""
        try:
            observation = await ep.call(call)
            result = {"name": call.name, "text": observation.text, "is_error": observation.is_error,
                      "executed": observation.executed}
            failure = getattr(observation, "failure", None)
        except Exception as error:  # noqa: BLE001 (a broken tool or server is an observation, not a crash)
            failure = f"{type(error).__name__}: {error}"
            result = {"name": call.name, "text": f"Error calling tool {call.name!r}: {failure}", "is_error": True,
                      "executed": False}
        if failure:
            result["failure"] = failure
        return result

    # -- environment failures --

    @contextlib.asynccontextmanager
    async def _environment(self, task: Mapping, episode_id: int):
        """The opened episode; an open failure raises `EnvironmentFailure`, a close failure is only recorded."""
        # a bad task (unknown world) raises here
        ep = self.settings.environment(task, **self.settings.limits.episode_options())
        try:
            await ep.__aenter__()
        except Exception as error:  # noqa: BLE001 (world building / MCP connect failures end this episode only)
            await self._close(ep, task, episode_id)
            raise self._env_failure(task, episode_id, "open", error) from error
        try:
            yield ep
        finally:
            await self._close(ep, task, episode_id)

    async def _close(self, ep, task: Mapping, episode_id: int) -> None:
        try:
            await ep.__aexit__(None, None, None)
        except Exception as error:  # noqa: BLE001 (recorded; the graded trajectory stands)
            self._record(task, episode_id, "close", f"{type(error).__name__}: {error}")

    def _env_failure(self, task: Mapping, episode_id: int, stage: str, error: BaseException,
                     **recorded) -> EnvironmentFailure:
        """Record the failure and return the exception (with its placeholder trajectory) to raise."""
        reason = f"{type(error).__name__}: {error}"
        failure = self._record(task, episode_id, stage, reason)
        return EnvironmentFailure(failure, failure_placeholder(failure.task_id, f"{stage}: {reason}", **recorded))

    def _record(self, task: Mapping, episode_id: int, stage: str, reason: str) -> EpisodeFailure:
        failure = EpisodeFailure(str(task.get("task_id", "")), episode_id, stage, reason)
        self.failures.append(failure)
        self.env_failure_stages[stage] += 1
        self.env_failures += stage != "close"
        return failure

    async def _run_or_placeholder(self, task: Mapping, episode_id: int) -> Trajectory:
        try:
            return await self.run_episode(task, episode_id)
        except EnvironmentFailure as failed:
            return failed.trajectory

    # -- the engine side (only the driver touches the engine) --

    async def _generate(self, request: Request) -> Sample:
        future = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = future
        self._inbox.append(request)
        self._wake_event().set()
        return await future

    def _release(self, request_id: int) -> None:
        self._releases.append(request_id)
        self._wake_event().set()

    def _sync(self) -> None:
        for request_id in self._releases:
            self._forget(request_id)
        self._releases.clear()
        inbox, self._inbox = self._inbox, []
        for request in inbox:
            try:
                self.engine.submit(request)
            except Exception as error:  # noqa: BLE001 (fail that episode, not the driver)
                self._futures.pop(request.request_id).set_exception(error)

    def _step(self) -> None:
        """`before_step` (e.g. swap in published weights), then one engine step: one thread call, off the loop."""
        if self.before_step is not None:
            self.before_step()
        self.engine.step()

    def _collect(self) -> None:
        for request_id in [r for r in self._futures if r in self.engine.results]:
            sample = self.engine.results[request_id]
            future = self._futures.pop(request_id)
            if future.cancelled():  # its episode was cancelled while the turn ran: free the slot
                self._forget(request_id)
            elif not future.done():
                future.set_result(sample)
            if request_id % self.request_stride:  # the previous turn's result is no longer needed
                self._forget(request_id - 1)

    def _forget(self, request_id: int) -> None:
        """Drop a consumed result and free its parked slot (a long-running worker must not grow `results`)."""
        if request_id in self.engine.results:
            self.engine.forget(request_id)
        else:
            self.engine.release(request_id)

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def _slot_semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.engine.num_slots)
        return self._slots
