"""The starting policy of every stage: the SFT warm start (oracle chats of the train tasks -> tokenizer -> (ids,
action mask) rows -> `sft.run_sft`) when the config asks for one, else `model.hf_path` or the preset. The "sft"
pipeline is the warm start alone."""
from __future__ import annotations

import json
import os

import ml_collections

from mercury_jax.chat import render
from mercury_jax.rollout.messages import trajectory_from_messages
from mercury_jax.train import setup
from mercury_jax.train.placement import role_meshes
from mercury_jax.train.rundir import RunDir, write_text
from mercury_jax.train.sft import run_sft


def prepare_sft_data(config: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir):
    """Train tasks -> oracle chats (with the `config.oracle` options when the config has them) -> tokenizer (trained
    on their text when SentencePiece) -> (ids, action mask)."""
    tasks = setup.world_tasks(config.world, "train")
    chats = setup.oracle_messages(tasks, config.oracle.to_dict() if "oracle" in config else None)
    tools = setup.tool_schemas(tasks)
    tokenizer = setup.build_tokenizer(config.tokenizer, workdir, [render(m, t) for m, t in zip(chats, tools)])
    trajectories = [trajectory_from_messages(tokenizer, m, t) for m, t in zip(chats, tools)]
    sequences = [(traj.tokens, traj.action_mask) for traj in trajectories]
    lengths = [len(s[0]) for s in sequences]
    print(f"SFT data: {len(sequences)} oracle trajectories, {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f}), vocabulary {tokenizer.vocab_size}", flush=True)
    return tokenizer, sequences


def run_sft_pipeline(config: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir):
    """The warm start, on the actor role's mesh (the policy is born there); returns (policy, tokenizer) and writes
    `sft_summary.json`."""
    run = workdir if isinstance(workdir, RunDir) else RunDir(workdir)
    tokenizer, sequences = prepare_sft_data(config, run)
    mesh = role_meshes(config, ("actor",))["actor"] if "devices" in config else None
    model = setup.build_model(config.model, tokenizer.vocab_size, config.seed, mesh=mesh)
    model, history = run_sft(config.sft, model, sequences, run.stage("sft").path, seed=config.seed,
                             checkpoint_cfg=config.sft.get("checkpoint") or config.checkpoint,
                             pad_id=tokenizer.pad_id, train_cfg=config.get("train"), mesh=mesh)
    summary = {"final_loss": history[-1]["loss"] if history else None, "steps": config.sft.steps}
    write_text(run.sft_summary, json.dumps(summary, indent=2))
    return model, tokenizer


def starting_policy(config: ml_collections.ConfigDict, run: RunDir, *, mesh=None):
    """(policy, tokenizer): the SFT warm start when `sft.enabled` (tiny demos), else `model.hf_path` / the preset
    created straight into its sharding on `mesh` (a SentencePiece tokenizer is still trained on, and cached beside,
    the warm start's oracle text)."""
    if config.sft.enabled:
        return run_sft_pipeline(config, run)
    if config.tokenizer.kind == "sentencepiece":
        tokenizer, _ = prepare_sft_data(config, run)
    else:
        tokenizer = setup.build_tokenizer(config.tokenizer, run, [])
    return setup.build_model(config.model, tokenizer.vocab_size, config.seed, mesh=mesh), tokenizer


def starting_policy_name(config: ml_collections.ConfigDict) -> str:
    """Which policy a stage starts from (the provenance pivot datasets record)."""
    if config.sft.enabled:
        return f"sft warm start ({config.sft.steps} steps, seed {config.seed})"
    return config.model.hf_path or f"{config.model.preset} preset, untrained (seed {config.seed})"


run = run_sft_pipeline  # the pipeline's entry (train/pipelines.py)
