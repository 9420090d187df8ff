"""A pod step's seconds from its programs' rooflines: the formulas `bench.pod`'s step estimate and `bench.pod_search`
share, every one a lower bound on time.

    rollout   a batch of E episodes of G generated tokens on S = replicas x slots slots: ceil(E G / S) decode steps
              plus the prefills spread over the replicas, never less than one episode (its tokens come one decode
              step after another)
    learner   SAO: values + max(K critic steps, actor step) (the critic and the actor have chips of their own);
              the other pipelines: the sum of their learner programs
    step      sync: rollout + learner + publish; async: max(rollout, assembly + learner), never less than an
              episode over the staleness bound, + publish
    MFU       model FLOPs of a step / (chips x peak x step seconds): an upper bound, as the time is a lower bound
    program   its roofline, or with its collectives (`links.py`) under one of two overlap models:
              none     roofline + collectives: nothing hides, an upper bound on what the collectives add
              async    max(roofline, async collectives) + the rest: XLA issues some collectives as a start / done
                       pair (or an async computation) and its latency-hiding scheduler places independent compute
                       between the two, so at best they finish under the compute; a collective issued
                       synchronously blocks the compute that follows it and adds in full

The learner's batch size comes from the pipeline that `config.pipeline` names (`config/registry.py`).
"""
from __future__ import annotations

import math

from mercury_jax.config.registry import pipeline as registered_pipeline

# Async across hosts (train/async_batches.py): a batch's trajectories reach every process by a host all-gather, in
# rounds. Per token a trajectory carries its id (int32), log-prob (fp32), action mask and policy version (int32):
# ~13 bytes, pickled. Assumed: 12.5 GB/s (100 Gb/s) of data-centre network a host, and two rounds of ~1 ms a batch.
TRAJECTORY_BYTES_PER_TOKEN = 13
DCN_BYTES_PER_S = 12.5e9
ASSEMBLY_ROUNDS_S = 2 * 1e-3

# the rows one step of each registered pipeline trains on: SFT's packed rows, SAO's episodes (one a prompt), GRPO's
# states x their group, the group baseline's prompts x their group
_LEARNER_ROWS = {
    "sft": lambda config: config.sft.batch_rows,
    "sao": lambda config: config.sao.batch_prompts,
    "grpo": lambda config: config.grpo.batch_states * config.grpo.group_size,
    "group_baseline": lambda config: config.group_baseline.batch_prompts * config.group_baseline.group_size,
}


def pipeline_name(config) -> str:
    """`config.pipeline`, checked against the registry (ValueError naming the registered ones)."""
    return registered_pipeline(config.pipeline).name


def learner_rows(config) -> int:
    """The rows (for an RL pipeline: the episodes) one learner step of the config's pipeline trains on."""
    name = pipeline_name(config)
    if name not in _LEARNER_ROWS:
        raise ValueError(f"the benches do not know the batch of pipeline {name!r}; add it to step_time._LEARNER_ROWS")
    return _LEARNER_ROWS[name](config)


def episodes_per_step(config) -> int:
    """The episodes an RL step trains on: SAO's prompts, GRPO's states x their group, the group baseline's prompts
    x their group."""
    return learner_rows(config)


def max_staleness(config) -> int:
    """The policy versions an async trajectory may lag (`sao.max_staleness`; 0, no bound, for the sync pipelines)."""
    return config.sao.max_staleness if pipeline_name(config) == "sao" else 0


def rollout_seconds(episodes: int, generated: int, prefilled: int, replicas: int, slots: int, decode_step_s: float,
                    prefill_tokens: int, prefill_s: float) -> tuple[float, float]:
    """(rollout seconds for a batch, seconds for one episode): the batch's decode steps with all `replicas x slots`
    slots busy plus its prefills (ceil(prefilled / prefill_tokens) calls an episode) spread over the replicas, never
    less than one episode, whose tokens come one decode step after another."""
    prefills = math.ceil(prefilled / prefill_tokens)
    episode_s = generated * decode_step_s + prefills * prefill_s
    batch_s = (math.ceil(episodes * generated / (replicas * slots)) * decode_step_s
               + math.ceil(episodes * prefills / replicas) * prefill_s)
    return max(batch_s, episode_s), episode_s


def async_step_seconds(rollout_s: float, learner_s: float, episode_s: float, max_staleness: int) -> float:
    """An async step: the rollout and the learner overlap, and a step is never shorter than an episode over the
    staleness bound (a trajectory may lag at most that many policy versions)."""
    free = max(rollout_s, learner_s)
    return max(free, episode_s / max_staleness) if max_staleness else free


def assembly_seconds(episodes: int, tokens: int) -> float:
    """Seconds to hand an async batch of `episodes` trajectories of `tokens` tokens to every host: the bytes over
    the data-centre network plus the all-gather's rounds."""
    return episodes * tokens * TRAJECTORY_BYTES_PER_TOKEN / DCN_BYTES_PER_S + ASSEMBLY_ROUNDS_S


def learner_seconds(pipeline: str, seconds: dict[str, float]) -> float:
    """A learner step from its programs' seconds a step (`seconds`: program name -> roofline x runs a step): SAO's
    critic steps and actor step run on their own chips at the same time, after the values; any other pipeline's
    programs run one after another."""
    if pipeline == "sao":
        return seconds["values + GAE"] + max(seconds["critic step"], seconds["actor step"])
    return sum(seconds.values())


def step_seconds(async_mode: bool, rollout_s: float, learner_s: float, episode_s: float, staleness: int,
                 publish_s: float = 0.0, assembly_s: float = 0.0) -> float:
    """A step: sync, the rollout then the learner then the publish; async, the two sides overlap (the learner after
    the batch reaches every host) within the staleness bound, and the rollout hosts join every publish."""
    if async_mode:
        return async_step_seconds(rollout_s, assembly_s + learner_s, episode_s, staleness) + publish_s
    return rollout_s + learner_s + publish_s


def model_flop_utilisation(flops: float, chips: int, peak_flops: float, step_s: float) -> float:
    """The share of `chips` chips' peak that a step's model FLOPs fill in `step_s` seconds."""
    return flops / (chips * peak_flops * step_s)


# how a program's collectives add to its roofline: None the roofline alone (collectives free), then the two models
OVERLAPS = (None, "none", "async")
OVERLAP_TEXT = {None: "rooflines only (collectives free)", "none": "+ collectives, none hidden",
                "async": "+ collectives, async ones hidden"}


def program_seconds(compute_s: float, async_s: float, sync_s: float, overlap: str | None) -> float:
    """A program's seconds a run from its roofline `compute_s` and its collectives' seconds (`async_s` issued
    asynchronously, `sync_s` not): `overlap` None the roofline alone, "none" everything in turn, "async" the async
    collectives hidden behind the compute as far as it lasts."""
    if overlap is None:
        return compute_s
    if overlap == "none":
        return compute_s + async_s + sync_s
    if overlap == "async":
        return max(compute_s, async_s) + sync_s
    raise ValueError(f"overlap {overlap!r} is not one of {OVERLAPS}")
