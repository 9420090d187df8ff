"""The starting policy of every stage: the SFT warm start (a chat corpus, `sft.data`, or the oracle chats of the
train tasks -> tokenizer -> `sft.run_sft`, which renders and packs them in grain) when the config asks for one, else
`model.hf_path` or the preset. The "sft" pipeline is the warm start alone."""
from __future__ import annotations

import json
import os

import ml_collections

from mercury_jax.chat import render
from mercury_jax.config.defaults import setting
from mercury_jax.config.model import build_model
from mercury_jax.config.world import oracle_messages, tool_schemas, world_tasks
from mercury_jax.data.chat_records import BadRecord, parse_record
from mercury_jax.data.corpus import InMemoryCorpus, chat_corpus
from mercury_jax.runs.rundir import RunDir, write_text
from mercury_jax.runs.tokenizer import build_tokenizer
from mercury_jax.train.placement import role_meshes
from mercury_jax.train.sft import run_sft

TOKENIZER_SAMPLE = 512  # records of a user corpus a SentencePiece tokenizer is trained on


def prepare_sft_data(config: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir):
    """(tokenizer, corpus): the files of `sft.data` (docs/DATA.md), or the train tasks' oracle chats (with the
    `config.oracle` options when the config has them) as in-memory records. A SentencePiece tokenizer is trained on
    the chats' rendered text (of a user corpus: its first `TOKENIZER_SAMPLE` records that parse)."""
    if setting(config.sft, "data"):
        corpus = chat_corpus(config.sft.data)
        texts = corpus_texts(corpus) if config.tokenizer.kind == "sentencepiece" else []
        tokenizer = build_tokenizer(config.tokenizer, workdir, texts)
        print(f"SFT data: {len(corpus)} records from {config.sft.data}, vocabulary {tokenizer.vocab_size}",
              flush=True)
        return tokenizer, corpus
    tasks = world_tasks(config.world, "train")
    chats = oracle_messages(tasks, config.oracle.to_dict() if "oracle" in config else None)
    tools = tool_schemas(tasks)
    tokenizer = build_tokenizer(config.tokenizer, workdir, [render(m, t) for m, t in zip(chats, tools)])
    print(f"SFT data: {len(chats)} oracle chats of the train tasks, vocabulary {tokenizer.vocab_size}", flush=True)
    return tokenizer, InMemoryCorpus([{"messages": m, "tools": t} for m, t in zip(chats, tools)], "oracle chat")


def corpus_texts(corpus) -> list[str]:
    texts = []
    for i in range(min(len(corpus), TOKENIZER_SAMPLE)):
        index, raw, where = corpus[i]
        try:
            record = parse_record(raw, index, where)
            texts.append(render(record["messages"], record["tools"] or None))
        except (BadRecord, ValueError, KeyError, TypeError):
            continue  # named when the pipeline reaches it
    return texts


def run_sft_pipeline(config: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir):
    """The warm start, on the actor role's mesh (the policy is born there); returns (policy, tokenizer) and writes
    `sft_summary.json`."""
    run = workdir if isinstance(workdir, RunDir) else RunDir(workdir)
    tokenizer, corpus = prepare_sft_data(config, run)
    mesh = role_meshes(config, ("actor",))["actor"] if "devices" in config else None
    model = build_model(config.model, tokenizer.vocab_size, config.seed, mesh=mesh)
    model, history = run_sft(config.sft, model, corpus, run.stage("sft").path, tokenizer=tokenizer,
                             seed=config.seed, checkpoint_cfg=config.sft.get("checkpoint") or config.checkpoint,
                             train_cfg=config.get("train"), mesh=mesh)
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
        tokenizer = build_tokenizer(config.tokenizer, run, [])
    return build_model(config.model, tokenizer.vocab_size, config.seed, mesh=mesh), tokenizer


def starting_policy_name(config: ml_collections.ConfigDict) -> str:
    """Which policy a stage starts from (the provenance pivot datasets record)."""
    if config.sft.enabled:
        return f"sft warm start ({config.sft.steps} steps, seed {config.seed})"
    return config.model.hf_path or f"{config.model.preset} preset, untrained (seed {config.seed})"


run = run_sft_pipeline  # the pipeline's entry (config/registry.py)
