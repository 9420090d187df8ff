"""Several engine replicas over the rollout devices, behind the one-engine interface.

    meshes = replica_meshes(rollout_devices, {"tensor": 4})        # R = len(devices) / 4 replicas
    engine = ReplicatedEngine(model, EngineSettings(num_slots=R * 32, max_length=24_576, replicas=meshes,
                                                    param_dtype="bfloat16"))
    engine.submit(Request(...)); engine.run(); engine.results[request_id]

Each replica is an `Engine` on its own mesh (weights cast to `param_dtype` and sharded, cache sharded with them)
with its own share of `num_slots` (the whole group's, split evenly) and continuous batching. A new request goes to
the least-loaded replica among those with an unclaimed slot (neither running, parked by a `keep_cache` sequence,
nor wanted by a queued request): a replica whose slots are all parked would refuse it ("every slot is parked")
while another has room. A continuation
goes to its parent's replica (where a `keep_cache` parent's cache is parked). `step()` dispatches
every replica's decode chunk before collecting any, so the replicas decode at the same time. Results are one dict
keyed by request id; a request's tokens depend only on (seed, request id, weights), not on its replica (sampling.py),
so the episode runner and the async worker run over this as over one engine and produce one trajectory stream.

`weights=` (one tree per local replica, already in its layout) replaces the first cast and move; `install_weights`
takes later ones the same way (the checkpoint sweep restores each checkpoint straight into the replicas).
`update_weights(model, version)` casts and moves the weights to every replica (device to device, by collectives
from a learner mesh: `publish.py`) before returning.

In a multi-process run every process builds this over all R meshes but drives only its own replicas (`engines`:
the meshes whose devices are its own; a replica spanning processes is refused), while the publish programs span
them all, so every process calls `update_weights` together; there the first weights also arrive by the publish
(a cross-process `device_put` is refused).
By default (`weights_swap="request"`) a replica swaps them once its running requests have finished, admitting no
new request meanwhile, so no request mixes two versions; each replica swaps on its own, so the others keep
sampling. Every token records the version that sampled it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import jax
from flax import nnx

from mercury_jax.parallel.distributed import local_meshes
from mercury_jax.rollout.engine import Request, Sample
from mercury_jax.rollout.publish import Publisher
from mercury_jax.rollout.settings import EngineSettings


def slots_per_replica(num_slots: int, replicas: int) -> int:
    """`num_slots` (the whole rollout group's) split evenly over `replicas`; ValueError when it does not split."""
    if num_slots % replicas:
        raise ValueError(f"{num_slots} rollout slots do not split evenly over {replicas} replicas; make "
                         "rollout.num_slots a multiple of the replica count")
    return num_slots // replicas


class ReplicatedEngine:
    """R engines (one per mesh of `settings.replicas`), `settings.num_slots / R` slots each, as one engine of
    `settings.num_slots` slots."""

    def __init__(self, model: nnx.Module, settings: EngineSettings, *, policy_version: int = 0,
                 weights_swap: str = "request", weights: Sequence | None = None):
        meshes, param_dtype = list(settings.replicas or ()), settings.param_dtype
        if settings.max_length is None:
            raise ValueError("ReplicatedEngine needs EngineSettings.max_length (the cache length of a slot)")
        if not meshes:
            raise ValueError("ReplicatedEngine needs at least one replica mesh (rollout.replica_meshes)")
        local = local_meshes(meshes)
        self.local_replicas = [i for i, mesh in enumerate(meshes) if mesh in local]  # indices into `meshes`
        self.publisher = Publisher(meshes, param_dtype)
        first = {}
        if weights is not None:  # already in each local replica's layout (a checkpoint restored there: sweep.py)
            if len(weights) != len(self.local_replicas):
                raise ValueError(f"{len(weights)} weight trees for this process's {len(self.local_replicas)} replicas")
            first = {"weights": dict(zip(self.local_replicas, weights))}
        elif jax.process_count() > 1:  # the first weights by the collective publish, on every process at once
            first = {"weights": dict(zip(self.local_replicas, self._published(model)))}
        num_slots, max_length = slots_per_replica(settings.num_slots, len(meshes)), settings.max_length
        self.engines = [settings.make_engine(model, num_slots=num_slots, max_length=max_length,
                                             steps_per_sync=settings.steps_per_sync, policy_version=policy_version,
                                             mesh=meshes[i], param_dtype=param_dtype, hbm_gib=settings.hbm_gib,
                                             weights_swap=weights_swap,
                                             **({"weights": first["weights"][i]} if first else {}))
                        for i in self.local_replicas]
        self._installed_version = policy_version  # what a process without replicas reports
        self.results: dict[int, Sample] = {}
        for engine in self.engines:
            engine.results = self.results  # one result dict: ids are unique across replicas
        self.num_slots, self.max_length = num_slots * len(self.engines), max_length
        self._seconds = 0.0  # wall time in `step`: the replicas decode at once, so theirs overlap
        self.slots_per_replica = num_slots
        self._replica_of: dict[int, int] = {}  # request id -> replica, while it is queued, running or kept

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    @property
    def policy_version(self) -> int:
        return self.engines[0].policy_version if self.engines else self._installed_version

    def replica_of(self, request_id: int) -> int:
        return self._replica_of[request_id]

    def submit(self, request: Request) -> None:
        if request.request_id in self._replica_of:
            raise ValueError(f"request id {request.request_id} is already in use; request ids key results and "
                             "sampling keys, so each request needs its own")
        parent = request.continue_from
        if parent is not None and parent in self._replica_of:
            replica = self._replica_of[parent]
        else:  # a new sequence (or a continuation of a forgotten parent, which the engine refuses)
            replica = self._replica_for_new()
        self.engines[replica].submit(request)
        self._replica_of[request.request_id] = replica

    def release(self, request_id: int) -> None:
        replica = self._replica_of.get(request_id)
        if replica is not None:
            self.engines[replica].release(request_id)

    def forget(self, request_id: int) -> Sample:
        sample = self.engines[self._replica_of[request_id]].forget(request_id)
        del self._replica_of[request_id]
        return sample

    def update_weights(self, model: nnx.Module, version: int | None = None) -> None:
        self.install_weights(self.prepare_weights(model), version)

    def prepare_weights(self, model) -> list:
        """`model`'s weights (a model or its `nnx.State`) cast and moved into every replica's layout, device to
        device: copies of their own, so the caller may donate what it passed once this returns. From a learner
        mesh apart from the replicas by `publish.Publisher`'s two collective programs; otherwise (weights on a
        shared or single device) cast + `device_put` per replica."""
        if self.engines:
            params = self.engines[0].sampler.weights_of(model)
            if not self.publisher.supports(params):
                return [engine.sampler.prepare_weights(params) for engine in self.engines]
        return self._published(model)

    def _published(self, model) -> list:
        """This process's replicas' weights by the collective publish (every process calls it together)."""
        params = model if isinstance(model, nnx.State) else nnx.state(model)
        if not self.publisher.supports(params):
            raise ValueError("a multi-process run publishes to its rollout replicas by collectives "
                             "(rollout/publish.py), which need the learner's weights on one mesh of a multiple of the "
                             "replica size, apart from the rollout devices; check config.devices and rollout.replica")
        trees = self.publisher(params)
        return [trees[i] for i in self.local_replicas]

    def install_weights(self, prepared: list, version: int | None = None) -> None:
        """Hand each replica its prepared weights; each swaps them by its `weights_swap` rule, on its own."""
        if version is None:
            version = max([e.latest_version for e in self.engines] + [self._installed_version]) + 1
        self._installed_version = version
        for engine, params in zip(self.engines, prepared, strict=True):
            engine.install_weights(params, version)

    def offload(self) -> None:
        """Every replica's `Engine.offload` (idle replicas only)."""
        for engine in self.engines:
            engine.offload()
        self._replica_of.clear()

    def run(self) -> dict[int, Sample]:
        while self.step():
            pass
        return self.results

    def step(self) -> bool:
        """Every replica admits and starts its decode chunk, then every replica collects its chunk."""
        start = time.perf_counter()
        pending = [engine.dispatch_step() for engine in self.engines]
        more = any([engine.collect_step(p) for engine, p in zip(self.engines, pending)])
        self._seconds += time.perf_counter() - start
        return more

    def stats(self) -> dict:
        per_replica = [engine.stats() for engine in self.engines]
        if not per_replica:
            return {"decode_steps": 0, "slot_steps": 0, "busy_slot_steps": 0, "generated_tokens": 0,
                    "prefill_tokens": 0, "seconds": 0.0,
                    "slot_occupancy": 0.0, "tokens_per_second": 0.0, "replicas": 0}
        seconds = self._seconds
        generated = sum(s["generated_tokens"] for s in per_replica)
        slot_steps = sum(s["slot_steps"] for s in per_replica)
        busy = sum(s["busy_slot_steps"] for s in per_replica)
        return {"decode_steps": max(s["decode_steps"] for s in per_replica), "slot_steps": slot_steps,
                "busy_slot_steps": busy, "generated_tokens": generated,
                "prefill_tokens": sum(s["prefill_tokens"] for s in per_replica), "seconds": seconds,
                "slot_occupancy": busy / slot_steps if slot_steps else 0.0,
                "tokens_per_second": generated / seconds if seconds else 0.0, "replicas": len(self.engines)}

    def _replica_for_new(self) -> int:
        """The least-loaded replica (ties: the lowest index) among those with an unclaimed slot; when none has one,
        the least-loaded of all (the request waits there for a slot)."""
        replicas = range(len(self.engines))
        open_ = [r for r in replicas if self._unclaimed_slots(r) > 0]
        return min(open_ or replicas, key=lambda r: (self._load(r), r))

    def _unclaimed_slots(self, replica: int) -> int:
        """Slots of `replica` that no running, parked or queued request will take. A queued continuation of a
        parked sequence takes that sequence's slot (the first of several continuations does; the others need one
        of their own)."""
        engine = self.engines[replica]
        continued = {r.continue_from for r in engine.queue if r.continue_from in engine.parked}
        claimed = sum(s is not None for s in engine.slots) + len(engine.parked) + len(engine.queue) - len(continued)
        return engine.num_slots - claimed

    def _load(self, replica: int) -> int:
        engine = self.engines[replica]
        return len(engine.queue) + sum(s is not None for s in engine.slots) + len(engine.parked)
