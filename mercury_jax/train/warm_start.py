"""The SFT warm start: oracle chats of the train tasks -> tokenizer -> (ids, action mask) rows -> `run_sft`. The
"sft" pipeline, and the first stage of SAO and pivot GRPO when their config asks for a warm start."""
from __future__ import annotations

import json
from pathlib import Path

import ml_collections

from mercury_jax.chat import render
from mercury_jax.rollout.messages import trajectory_from_messages
from mercury_jax.train import setup
from mercury_jax.train.sft import run_sft


def prepare_sft_data(config: ml_collections.ConfigDict, workdir: Path):
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


def run_sft_pipeline(config: ml_collections.ConfigDict, workdir: str | Path):
    workdir = Path(workdir)
    tokenizer, sequences = prepare_sft_data(config, workdir)
    model = setup.build_model(config.model, tokenizer.vocab_size, config.seed)
    model, history = run_sft(config.sft, model, sequences, workdir / "sft", seed=config.seed,
                             checkpoint_cfg=config.sft.get("checkpoint") or config.checkpoint,
                             pad_id=tokenizer.pad_id, train_cfg=config.get("train"))
    summary = {"final_loss": history[-1]["loss"] if history else None, "steps": config.sft.steps}
    (workdir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return model, tokenizer
