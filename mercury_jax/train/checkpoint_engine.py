"""Episodes sampled with one checkpoint's policy after another, on the run's own rollout layout (the sweep's engine).

    engine = CheckpointEngine(RunReader(workdir), "grpo")
    engine.load(0)                                         # restore step 0 into the rollout layout
    trajectories = engine.runner(seed).run(tasks, first_episode_id=0)
    engine.load(20)                                        # the same compiled engine, new weights

With `rollout.replica` in the run's config (the released runs): a `ReplicatedEngine` of replicas of that shape over
every device of every process (as many whole replicas as the devices hold; the run's slots per replica, weights in
`rollout.param_dtype`, the run's `model.moe_impl` on each replica's mesh). Each checkpoint is restored straight into
the replicas' layout (`replica_restore.py`: each device reads its own shard, cast as it is read) after the previous
weights are freed, and the engine, compiled once, takes them between checkpoints. On several processes each runs
the episodes its replicas own and every process gets every trajectory (`ShardedRunner`), as in the trainers.
A request's tokens depend only on (seed, request id, weights), so the replica count does not change them.

Without `rollout.replica` (the `:tiny` demos): one `Engine` on the first device, the policy restored whole there
(cast to `rollout.param_dtype` when set). Seams: `load_policy(reader, step)` gives that path's model and
`make_engine(model, num_slots=, max_length=, policy_version=)` its engine (tests pass scripted ones).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax

from mercury_jax.config.roles import role_devices, rollout_layout
from mercury_jax.config.rollout import episode_settings
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.replicas import ReplicatedEngine, slots_per_replica
from mercury_jax.rollout.settings import EngineSettings
from mercury_jax.rollout.sharded_runner import ShardedRunner
from mercury_jax.runs.replica_restore import restore_into_replicas, restore_on_device
from mercury_jax.runs.run_reader import RunReader


def default_load_policy(reader: RunReader, stage: str, step: int, dtype=None):
    """The single-engine path's model: checkpoint `step` restored whole onto the first device."""
    return restore_on_device(reader, stage, step, jax.devices()[0], dtype=dtype)


class CheckpointEngine:
    """One rollout engine over the run's rollout layout, given each checkpoint's weights in turn."""

    def __init__(self, reader: RunReader, stage: str, *, load_policy: Callable | None = None,
                 make_engine: Callable = Engine):
        self.reader, self.stage, self.config = reader, stage, reader.config
        rollout = self.config.rollout
        self.replica, self.param_dtype = rollout_layout(rollout)
        self.load_policy, self.make_engine = load_policy, make_engine
        self.engine = None
        self.meshes, self.owners = None, []
        if self.replica:
            size = math.prod(self.replica.values())
            run_replicas = max(1, role_devices(self.config, "rollout") // size)
            self.slots = slots_per_replica(rollout.num_slots, run_replicas)
            devices = jax.devices()
            self.meshes = replica_meshes(devices[:len(devices) // size * size], self.replica)
            self.owners = [int(m.devices.flat[0].process_index) for m in self.meshes]
        elif jax.process_count() > 1:
            raise ValueError("a sweep on several processes samples on rollout replicas, each within one host; the "
                             "run's config has no rollout.replica: run the sweep as one process")
        else:
            self.slots = rollout.num_slots

    @property
    def num_replicas(self) -> int:
        return len(self.meshes) if self.meshes else 1

    def load(self, step: int) -> None:
        """Sample with checkpoint `step`'s policy from now on (its policy version is `step`)."""
        if self.meshes is None:
            model = (self.load_policy(self.reader, step) if self.load_policy is not None else
                     default_load_policy(self.reader, self.stage, step, self.param_dtype))
            if self.engine is None:
                self.engine = self.make_engine(model, num_slots=self.slots, max_length=self.config.rollout.
                                               max_total_tokens, policy_version=step)
            else:
                self.engine.update_weights(model, step)
            return
        if self.engine is not None:
            self.engine.offload()  # the previous checkpoint's weights are freed before the next one is read
        weights = restore_into_replicas(self.reader, self.stage, step, self.meshes, dtype=self.param_dtype)
        if self.engine is None:
            settings = EngineSettings(num_slots=self.slots * len(self.meshes), replicas=self.meshes,
                                      max_length=self.config.rollout.max_total_tokens, param_dtype=self.param_dtype)
            self.engine = ReplicatedEngine(self.reader.abstract_policy(), settings, policy_version=step,
                                           weights=weights)
        else:
            self.engine.install_weights(weights, step)

    def runner(self, seed: int):
        """An episode runner on the engine with the run's budgets, reward and sampling (seed `seed`)."""
        runner = EpisodeRunner(self.engine, self.reader.tokenizer(), episode_settings(self.config, seed))
        return ShardedRunner(runner, self.owners) if jax.process_count() > 1 else runner
