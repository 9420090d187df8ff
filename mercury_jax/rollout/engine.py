"""Continuous batching over a fixed number of slots: queued requests fill slots as soon as slots free up.

Loop: admit queued requests into free slots (one 1-row `prefill` each, which also samples the first token), run
`steps_per_sync` decode steps for all slots on device, collect the emitted tokens, free the slots whose request
finished, repeat. A slot that finishes mid-chunk idles until the chunk ends (the price of syncing with the host
every `steps_per_sync` steps instead of every step).

Results never depend on the batch: prefill runs on the slot's row alone, decode rows do not interact, and every
token's key is fold_in(fold_in(PRNGKey(seed), request_id), token_index) (see sampling.py).

Continuations (multi-turn): `Request(continue_from=parent_id, prompt=observation_tokens)` extends the finished
sequence `parent_id` with the observation and generates the next turn. If the parent was submitted with
`keep_cache=True`, its slot stays parked after it finishes (its cache row is kept addressable) and the
continuation feeds only [parent's last sampled token] + observation tokens into that row: the history is never
recomputed. Otherwise the continuation re-prefills the whole history (prompt + all turns + observation) into a
free slot, costing a prefill over the full history per turn. A parked slot is unavailable to other requests until
a continuation uses it (and parks it again if it also has keep_cache) or `release(parent_id)` frees it. Several
continuations of one parent are allowed (e.g. K samples from one state): the first takes the parked cache, the
others re-prefill.

    engine.submit(Request(1, prompt_ids, max_new_tokens=512, stop_token_ids=(im_end,), keep_cache=True))
    engine.run()                                    # engine.results[1]: the first assistant turn
    engine.submit(Request(2, observation_ids, max_new_tokens=512, stop_token_ids=(im_end,), continue_from=1,
                          keep_cache=True))
    engine.run()                                    # engine.results[2].history: the whole episode so far
    engine.release(2)                               # episode over: free the slot

Weights: `update_weights(model, version)` between `step()` calls; every sampled token records its version.
`weights_swap="chunk"` (default) swaps them at the next decode chunk: in-flight requests continue with the new
weights. `weights_swap="request"` keeps every request on one version from its first token to its last: while new
weights wait, no request is admitted; once the running ones have finished (parked caches do not count), the
weights are swapped and admission resumes. The price is a drain: the replica idles its free slots until its
longest running request ends.

On a mesh (`mesh=`, `param_dtype=`): one rollout replica, its weights and cache sharded over the mesh's devices
(sampler.py); `replicas.py` runs several such engines as one.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mercury_jax.rollout.sampler import Sampler, TokenSampling


@dataclasses.dataclass
class Request:
    """One generation: new tokens after `prompt` (or, with `continue_from`, after that finished sequence + `prompt`)."""
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    continue_from: int | None = None
    keep_cache: bool = False


@dataclasses.dataclass
class Sample:
    """A finished generation. `logprobs[i]` = log_softmax(logits)[tokens[i]] at temperature 1 (the behaviour
    policy's log-prob, `rollout_logprobs`); `sampling_logprobs[i]` = the log-prob under the temperature/top-k/top-p
    distribution it was drawn from (0 for greedy). `history` is the whole sequence: prompt (with all earlier turns
    for a continuation) + tokens. `policy_versions[i]` is the weights version that sampled tokens[i] (weights can
    change between decode chunks: `Engine.update_weights`)."""
    request_id: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    history: list[int] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)  # weights version per sampled token

    @property
    def policy_version(self) -> int:
        """The oldest weights version that sampled any of `tokens` (-1 if none)."""
        return min(self.policy_versions) if self.policy_versions else -1


@dataclasses.dataclass
class _Running:
    request: Request
    history: list[int]  # everything before the first new token
    limit: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """When an engine admits requests (`refill`) and when new weights take effect (`weights_swap`)."""
    refill: bool = True         # False: a static batch, admitted only when every slot is free
    weights_swap: str = "chunk"  # "chunk": at the next decode chunk; "request": once the running requests end

    def __post_init__(self):
        if self.weights_swap not in ("chunk", "request"):
            raise ValueError(f"weights_swap {self.weights_swap!r} is not 'chunk' (at the next decode chunk) or "
                             "'request' (between requests: no request mixes versions)")


def check_engine_size(**counts) -> None:
    """ValueError unless each of `counts` (num_slots, max_length, steps_per_sync) is a whole number >= 1. An engine
    built from the library skips the config checks, and with 0 slots the episode runner would wait forever for a
    free one."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            why = (": with no slot it would run no request, and an episode runner would wait forever for one"
                   if name == "num_slots" else "")
            raise ValueError(f"Engine {name}={value!r}: use a whole number >= 1{why}")


class Engine:
    """Continuous batching engine. `submit(...)` requests, `run()` until all are done, read `results` / `stats()`.

    The keywords `refill` and `weights_swap` are the `Scheduling` fields. `refill=False` gives a static batch for
    comparison: new requests are admitted only when every slot is free.
    """

    def __init__(self, model: nnx.Module, *, num_slots: int, max_length: int, steps_per_sync: int = 8,
                 policy_version: int = 0, mesh: Mesh | None = None, param_dtype=None, hbm_gib: float | None = None,
                 weights=None, **scheduling):
        check_engine_size(num_slots=num_slots, max_length=max_length, steps_per_sync=steps_per_sync)
        self.scheduling = Scheduling(**scheduling)
        self._pending_weights = None  # (prepared params, version) waiting for the running requests to finish
        self.sampler = Sampler(model, num_slots=num_slots, max_length=max_length, policy_version=policy_version,
                               mesh=mesh, param_dtype=param_dtype, hbm_gib=hbm_gib, weights=weights)
        self.num_slots, self.max_length = num_slots, max_length
        self.steps_per_sync = steps_per_sync
        self.state = self.sampler.init_state()
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[_Running | None] = [None] * num_slots
        self.parked: dict[int, int] = {}  # request id -> slot holding its finished sequence's cache
        self.results: dict[int, Sample] = {}
        self._decode_steps = self._busy_slot_steps = self._generated = 0
        self._prefill_tokens = 0
        self._seconds = 0.0

    def update_weights(self, model: nnx.Module, version: int | None = None) -> None:
        """New weights (same structure; a model or its `nnx.State`): from the next prefill / decode chunk on
        (`weights_swap="chunk"`), or from the first request admitted after the running ones finish ("request").
        `version` defaults to the latest one + 1; every token records the version that sampled it."""
        self.install_weights(self.sampler.prepare_weights(model), version)

    def install_weights(self, prepared, version: int | None = None) -> None:
        """`update_weights` with weights already cast and placed (`sampler.prepare_weights`)."""
        version = self.latest_version + 1 if version is None else version
        # nothing running: nothing to keep on one version
        if self.scheduling.weights_swap == "chunk" or not any(self.slots):
            self.sampler.set_weights(prepared, version)
            self._pending_weights = None
        else:
            self._pending_weights = (prepared, version)  # a later publish replaces a waiting one

    def offload(self) -> None:
        """Free the device memory of an idle engine's weights and decode state (e.g. an evaluator's between
        evaluations, while a worker's engine samples on the same devices). Parked caches and unread results are
        dropped; `policy_version` is -1 until `update_weights` hands over new weights, and the next step starts
        from an empty state."""
        if self.queue or any(self.slots):
            raise RuntimeError(f"offload() needs an idle engine: {len(self.queue)} queued and "
                               f"{sum(s is not None for s in self.slots)} running requests")
        self.parked.clear()
        self.results.clear()
        self._pending_weights = None
        self.sampler.drop_weights()
        self.state = None

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    @property
    def latest_version(self) -> int:
        """The version of the newest weights handed over: the waiting ones', else the sampling ones'."""
        return self._pending_weights[1] if self._pending_weights is not None else self.policy_version

    @property
    def weights_waiting(self) -> bool:
        """New weights wait for the running requests to finish (`weights_swap="request"`)."""
        return self._pending_weights is not None

    def submit(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.results or any(r.request_id == rid for r in self.queue) or any(
                s is not None and s.request.request_id == rid for s in self.slots):
            raise ValueError(f"request id {rid} is already in use; request ids key results and sampling keys, so "
                             "each request needs its own")
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.continue_from is None and not request.prompt:
            raise ValueError(f"request {request.request_id}: empty prompt (a new sequence needs at least one token)")
        if request.continue_from is None and len(request.prompt) >= self.max_length:
            raise ValueError(f"request {request.request_id}: prompt of {len(request.prompt)} tokens leaves no room "
                             f"under max_length {self.max_length}; raise max_length or shorten the prompt")
        if request.continue_from is not None and request.continue_from not in self.results:
            raise ValueError(f"request {request.request_id} continues {request.continue_from}, which is not a finished "
                             "request of this engine (run() it first; a forget()-ten request cannot be continued)")
        self.queue.append(request)

    def release(self, request_id: int) -> None:
        """Free the parked slot of a finished `keep_cache` request (no continuation will follow)."""
        self.parked.pop(request_id, None)

    def forget(self, request_id: int) -> Sample:
        """Remove and return a finished result (and free its parked slot): a long-running worker calls this once
        it has consumed a sample, so `results` does not grow without bound. It cannot be continued afterwards."""
        self.release(request_id)
        return self.results.pop(request_id)

    def run(self) -> dict[int, Sample]:
        """Run until the queue is empty and every slot is idle. Returns all results so far (by request id)."""
        while self.step():
            pass
        return self.results

    def step(self) -> bool:
        """Admit queued requests into free slots, then run one decode chunk (`steps_per_sync` steps). Returns
        whether work remains (queued or running requests). Finished samples appear in `results` as they end."""
        return self.collect_step(self.dispatch_step())

    def dispatch_step(self):
        """The first half of `step`: admit, then start the decode chunk on the device without waiting for it.
        Returns what `collect_step` needs (None when no slot runs). Several engines on disjoint devices dispatch
        first and collect after, so their chunks run at the same time."""
        start = time.perf_counter()
        if self._pending_weights is not None and not any(self.slots):
            self.sampler.set_weights(*self._pending_weights)
            self._pending_weights = None
        if not self.sampler.has_weights:  # before anything leaves the queue
            raise RuntimeError("this engine was offloaded (offload()); hand it weights with update_weights before "
                               "it samples")
        if self.state is None:  # offloaded
            self.state = self.sampler.init_state()
        while self._admit() and not any(self.slots) and self.queue:
            pass  # every admitted request ended at its first token: admit again before decoding
        pending = None
        if any(self.slots):
            self.state, out, version = self.sampler.decode(self.state, self.steps_per_sync)
            pending = (out, version)
        elif self.queue:
            self._seconds += time.perf_counter() - start
            raise RuntimeError(f"{len(self.queue)} requests wait but every slot is parked by a keep_cache "
                               "request; continue or release() those sequences, or use more slots")
        self._seconds += time.perf_counter() - start
        return pending

    def collect_step(self, pending) -> bool:
        """The second half of `step`: wait for the chunk, hand out its tokens. Returns whether work remains."""
        if pending is None:
            return False
        start = time.perf_counter()
        self._collect_chunk(*pending)
        self._seconds += time.perf_counter() - start
        return bool(self.queue) or any(self.slots)

    def stats(self) -> dict:
        """Slot occupancy (busy slot-steps / all slot-steps of decode) and generated tokens per second."""
        slot_steps = self._decode_steps * self.num_slots
        return {"decode_steps": self._decode_steps, "slot_steps": slot_steps, "busy_slot_steps": self._busy_slot_steps,
                "generated_tokens": self._generated,
                "prefill_tokens": self._prefill_tokens, "seconds": self._seconds,
                "slot_occupancy": self._busy_slot_steps / slot_steps if slot_steps else 0.0,
                "tokens_per_second": self._generated / self._seconds if self._seconds else 0.0}

    # -- internals --

    def _free_slots(self) -> list[int]:
        held = set(self.parked.values())
        return [s for s in range(self.num_slots) if self.slots[s] is None and s not in held]

    def _admit(self) -> int:
        """Start queued requests in free (or their parked) slots; returns how many were started."""
        if (not self.scheduling.refill or self._pending_weights is not None) and any(self.slots):
            return 0
        deferred, started = collections.deque(), []
        while self.queue:
            request = self.queue.popleft()
            parent = request.continue_from
            if parent is not None and parent in self.parked:
                started.append(self._start(request, self.parked.pop(parent), kept=True))
                continue
            free = self._free_slots()
            if not free:
                deferred.append(request)
                continue
            started.append(self._start(request, free[0], kept=False))
        self.queue = deferred
        # one host sync for all prefills of this round: they are dispatched back to back
        started = [s for s in started if s is not None]
        firsts = jax.device_get([first for _, _, first, _ in started])
        for (slot, running, _, version), (token, logprob, sampling_logprob, done) in zip(started, firsts):
            self._append(running, int(token), float(logprob), float(sampling_logprob), version)
            if done:
                self._finish(running, self._reason(running), slot)
        return len(started)

    def _start(self, request: Request, slot: int, *, kept: bool):
        """Dispatch the prefill of `request` into `slot` (`kept`: the slot holds the parent's cache). Returns
        (slot, running, first-token device values, policy version), or None if the request ended without one."""
        prompt = [int(t) for t in request.prompt]
        history = feed = prompt
        if request.continue_from is not None:
            parent = self.results[request.continue_from]
            history = parent.history + prompt
            # the parent's last sampled token was never fed to the model: it leads the appended tokens
            feed = [parent.history[-1]] + prompt if kept else history
        limit = min(request.max_new_tokens, self.max_length - len(history))
        running = _Running(request, history, limit)
        if limit < 1:  # a continuation with no room left under max_length
            self._finish(running, "length", slot=None)
            return None
        sampling = TokenSampling(request.request_id, request.seed, request.temperature, request.top_k, request.top_p,
                                 request.stop_token_ids)
        self.state, first, version = self.sampler.prefill(self.state, slot, feed, sampling, reset=not kept,
                                                          limit=limit)
        self._prefill_tokens += len(feed)
        self.slots[slot] = running
        return slot, running, first, version

    def _collect_chunk(self, out, version: int) -> None:
        out = jax.device_get(out)
        emitted = np.asarray(out["emitted"])
        self._decode_steps += emitted.shape[0]
        self._busy_slot_steps += int(emitted.sum())
        for slot, running in enumerate(self.slots):
            if running is None:
                continue
            for step in np.nonzero(emitted[:, slot])[0]:
                self._append(running, int(out["token"][step, slot]), float(out["logprob"][step, slot]),
                             float(out["sampling_logprob"][step, slot]), version)
            if self._is_done(running):
                self._finish(running, self._reason(running), slot)

    def _append(self, running: _Running, token: int, logprob: float, sampling_logprob: float, version: int) -> None:
        running.tokens.append(token)
        running.policy_versions.append(version)
        running.logprobs.append(logprob)
        running.sampling_logprobs.append(sampling_logprob)
        self._generated += 1

    def _is_done(self, running: _Running) -> bool:
        return bool(running.tokens) and (running.tokens[-1] in running.request.stop_token_ids
                                         or len(running.tokens) >= running.limit)

    def _reason(self, running: _Running) -> str:
        return "stop" if running.tokens and running.tokens[-1] in running.request.stop_token_ids else "length"

    def _finish(self, running: _Running, reason: str, slot: int | None) -> None:
        request = running.request
        self.results[request.request_id] = Sample(
            request.request_id, running.tokens, running.logprobs, reason, running.sampling_logprobs,
            running.history + running.tokens, running.policy_versions)
        if slot is not None:
            self.slots[slot] = None
            if request.keep_cache:
                self.parked[request.request_id] = slot
