"""Rollout: our JAX sampler with static-shape slots and continuous batching (docs/DESIGN.md, "Rollout").

    generate(model, prompts, *, max_new_tokens, ...)   -> list[Sample]   one-shot API
    Engine(model, num_slots=, max_length=)             continuous batching; Request(continue_from=) for multi-turn
    Engine(..., mesh=, param_dtype=)                   one replica: weights and cache sharded over its mesh
    ReplicatedEngine(model, EngineSettings(num_slots=, max_length=, replicas=replica_meshes(devices, {"tensor": 4})))
                                                       R replicas as one engine (replicas.py)
    Sampler                                            the jitted prefill / decode over slots
    sampling.sample_tokens                             temperature / top-k / top-p, recorded log-probs
"""
from mercury_jax.rollout.engine import Engine, Request, Sample
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.failures import EnvironmentFailure, EpisodeFailure, trainable
from mercury_jax.rollout.generate import generate
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.messages import trajectory_from_messages
from mercury_jax.rollout.replicas import ReplicatedEngine
from mercury_jax.rollout.sampler import Sampler
from mercury_jax.rollout.settings import Budgets, EngineSettings, EnvLimits, EpisodeSettings, SamplingParams
from mercury_jax.rollout.trajectory import Trajectory, batch_trajectories
from mercury_jax.rollout.worker import RolloutWorker

# Episodes and the asynchronous worker (issue 6):
#     EpisodeRunner(engine, tokenizer, EpisodeSettings(budgets=Budgets())).run(tasks) -> list[Trajectory]   MCP episodes
#     RolloutWorker(model, tokenizer, tasks, EpisodeSettings(), EngineSettings()).start(); .get(); .publish(state,
#         version); .stats(); .stop()
#     trajectory_from_messages(tokenizer, messages, tools)           -> Trajectory (oracle chats, SFT warm starts)
#     trainable(trajectories) -> (kept, dropped)    drops episodes an environment failure touched (failures.py)
__all__ = ["Budgets", "Engine", "EngineSettings", "EnvLimits", "EpisodeSettings", "ReplicatedEngine", "Request",
           "Sample", "Sampler", "SamplingParams", "generate", "replica_meshes"]

__all__ += ["EnvironmentFailure", "EpisodeFailure", "EpisodeRunner", "RolloutWorker", "Trajectory",
            "batch_trajectories", "trainable", "trajectory_from_messages"]
