"""The run's tokenizer: Qwen3.5's BPE, or a SentencePiece model trained deterministically on the run's oracle text
and cached in the run directory's `tokenizer/` (`run_reader.RunReader.tokenizer` reads it back)."""
from __future__ import annotations

import os
from pathlib import Path

import ml_collections

from mercury_jax.chat import qwen35_tokenizer, train_sentencepiece_tokenizer
from mercury_jax.config.defaults import setting
from mercury_jax.runs.rundir import RunDir


def build_tokenizer(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir, corpus_texts: list[str]):
    """The Qwen3.5 BPE, or a SentencePiece model trained (deterministically, cached in the run's `tokenizer/`) on
    `corpus_texts`. SentencePiece reads local files only: a remote run directory gets a copy of the model trained
    in a local cache."""
    if cfg.kind == "qwen35":
        return qwen35_tokenizer()
    if cfg.kind == "sentencepiece":
        run = workdir if isinstance(workdir, RunDir) else RunDir(workdir)
        cache = run.tokenizer if run.local else Path.home() / ".cache" / "mercury_jax" / "tokenizer"
        tokenizer = train_sentencepiece_tokenizer(corpus_texts, vocab_size=cfg.vocab_size,
                                                  cache_dir=Path(os.fspath(cache)),
                                                  atomic_pattern=setting(cfg, "atomic_pattern"))
        if not run.local:
            run.tokenizer.mkdir(parents=True, exist_ok=True)
            (run.tokenizer / tokenizer.model_file.name).write_bytes(tokenizer.model_file.read_bytes())
        return tokenizer
    raise ValueError(f"tokenizer.kind {cfg.kind!r} is not 'qwen35' or 'sentencepiece'")
