"""Export the policy of a training run as a Hugging Face checkpoint (released text-only layout, via `save_hf`).

    python -m mercury_jax.export --workdir runs/sao-20260101-120000 --out /tmp/sao-hf \
        [--step N] [--stage sao|sft|grpo] [--dtype bfloat16|float32] [--experts fused|unfused]

What a run directory must hold, and where it comes from:
- `config.json`: the run's full config, written by `save_run_config` (`mercury_jax.main` calls it before the
  pipeline starts). It says how the model was built (`model.hf_path` or `model.preset` + `overrides`) and which
  tokenizer the run used. A run started before this file existed can be given one with
  `save_run_config(get_config("tiny"), workdir)` (plus the same overrides as the run).
- the tokenizer: for `tokenizer.kind = "sentencepiece"` the model trained into `workdir/tokenizer/`; for
  `"qwen35"` the Qwen3.5 BPE. Its vocabulary size fixes the embedding shape of a from-scratch (`preset`) model.
- the Orbax checkpoints `workdir/sao/checkpoints/STEP` (SAO: `arrays/actor/params`),
  `workdir/grpo/checkpoints/STEP` (pivot GRPO, same layout; step 0 is its starting policy) or
  `workdir/sft/checkpoints/STEP` (SFT: `arrays/params`); the latest step unless `--step`.

Only the policy's parameters are read (partial restore, as host numpy arrays): the critic and the optimiser
moments are never loaded, and no accelerator is needed. Host memory holds the fp32 policy (35B-A3B: ~140 GB).
Next to the weights go `chat_template.jinja` (the template the run trained with, `BUILTIN_CHAT_TEMPLATE`, so that
transformers / vLLM / SGLang render the same prompts), the tokenizer files of `model.hf_path` when the run started
from an HF checkpoint, and for a SentencePiece run its model file as `sentencepiece.model` (a SentencePiece model
with the Qwen3.5 special tokens at ids 1..33, not an HF tokenizer; load it with
`mercury_jax.chat.SentencePieceTokenizer`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mercury_jax.chat import BUILTIN_CHAT_TEMPLATE, SentencePieceTokenizer, qwen35_tokenizer
from mercury_jax.train.checkpoint_faults import describe, named_file
from mercury_jax.train.checkpoint_roles import ROLE_ITEM_PREFIX, is_arrays_item
from mercury_jax.train.rundir import POLICY_ARRAYS, STAGES, RunDir
from mercury_jax.train.setup import build_model, model_runtime
from models.qwen35_moe import Qwen35MoeConfig, Qwen35MoeForCausalLM, save_hf

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                      "special_tokens_map.json", "generation_config.json")


class ExportError(ValueError):
    """The run directory lacks what the export needs; the message says what and how to get it."""


def save_run_config(config: ml_collections.ConfigDict, workdir: str | Path):
    """Write the run's config to `workdir/config.json` (process 0 only), for tools that rebuild the run's model."""
    return RunDir(workdir).write_config(config)


def load_run_config(workdir: str | Path) -> ml_collections.ConfigDict:
    run = RunDir(workdir)
    path = run.config
    if not path.exists():
        raise ExportError(f"{path} does not exist: runs started by `python -m mercury_jax.main` write it; for an older "
                          f"run write it with mercury_jax.export.save_run_config(config, {str(workdir)!r}) using the "
                          f"run's experiment config and overrides")
    return run.read_config()


def checkpoint_steps(checkpoint_dir: str | Path) -> list[int]:
    """The finished (committed) checkpoint steps of an Orbax checkpoint directory, ascending."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                  if p.name.isdigit() and any(is_arrays_item(q.name) for q in p.iterdir()))


def run_tokenizer_file(config: ml_collections.ConfigDict, workdir: str | Path) -> Path | None:
    """The SentencePiece model a run trained (None for the Qwen3.5 BPE)."""
    if config.tokenizer.kind != "sentencepiece":
        return None
    directory = Path(os.fspath(RunDir(workdir).tokenizer))
    files = sorted(directory.glob(f"spm-{config.tokenizer.vocab_size}-*.model"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise ExportError(f"no SentencePiece model spm-{config.tokenizer.vocab_size}-*.model in {directory}; the run "
                          f"trains it at start-up (tokenizer.kind = 'sentencepiece'), so the workdir is incomplete")
    return files[-1]  # several only if the corpus changed between restarts; the newest is the one in use


def run_tokenizer(config: ml_collections.ConfigDict, workdir: str | Path):
    """The tokenizer the run trained with: its SentencePiece model, or the Qwen3.5 BPE."""
    if config.tokenizer.kind == "qwen35":
        return qwen35_tokenizer()
    if config.tokenizer.kind == "sentencepiece":
        return SentencePieceTokenizer(run_tokenizer_file(config, workdir))
    raise ExportError(f"tokenizer.kind {config.tokenizer.kind!r} is not 'qwen35' or 'sentencepiece'")


def run_vocab_size(config: ml_collections.ConfigDict, workdir: str | Path) -> int:
    return run_tokenizer(config, workdir).vocab_size


def abstract_policy(config: ml_collections.ConfigDict, workdir: str | Path):
    """The run's policy with abstract (shape-only) parameters, built as `setup.build_model` builds it."""


    model_cfg = config.model
    if model_cfg.hf_path:  # the structure comes from the HF config; the weights come from our checkpoint
        config_file = Path(model_cfg.hf_path) / "config.json"
        if not config_file.exists():
            raise ExportError(f"the run started from model.hf_path {model_cfg.hf_path}, whose config.json is not "
                              f"here; copy that checkpoint's config.json to {config_file}")
        cfg = Qwen35MoeConfig.from_hf(config_file, param_dtype="float32", **model_runtime(model_cfg))
        return nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))

    vocab_size = run_vocab_size(config, workdir)
    return nnx.eval_shape(lambda: build_model(model_cfg, vocab_size, config.seed))


@contextlib.contextmanager
def _quiet_absl():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def read_checkpoint_arrays(arrays_dir: str | Path, subtree: tuple[str, ...] = ()
                           ) -> dict[tuple[str, ...], np.ndarray]:
    """The arrays under `subtree` of an Orbax checkpoint item (e.g. `.../sao/checkpoints/3/arrays`, ("actor",
    "params")) as host numpy arrays keyed by their path below `subtree` (nnx `value` leaves named by their
    variable); nothing else is read, and the saving devices need not exist."""

    arrays_dir = Path(arrays_dir).absolute()  # Orbax resolves a relative path against no directory of ours
    checkpointer = ocp.PyTreeCheckpointer()
    with _quiet_absl(), _damaged(arrays_dir):  # an item directory has no step-level _CHECKPOINT_METADATA; Orbax
        metadata = checkpointer.metadata(arrays_dir) if arrays_dir.is_dir() else None  # warns on every read
    if metadata is None or metadata.item_metadata is None:
        raise ExportError(f"{arrays_dir} holds no readable Orbax checkpoint item (no array metadata); the save was "
                          f"interrupted or the path is wrong; pick another step (`--step`) or rerun the training")
    tree = metadata.item_metadata.tree
    for key in subtree:
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    if not tree:
        return {}
    part = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    for key in reversed(subtree):
        part = {key: part}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), part)
    with _quiet_absl(), _damaged(arrays_dir):
        restored = checkpointer.restore(arrays_dir, args=ocp.args.PyTreeRestore(
            item=part, restore_args=restore_args, partial_restore=True))
    for key in subtree:
        restored = restored[key]
    arrays = {}
    for path, array in jax.tree_util.tree_flatten_with_path(restored)[0]:
        names = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        arrays[names[:-1] if names and names[-1] == "value" else names] = np.asarray(array)
    return arrays


@contextlib.contextmanager
def _damaged(arrays_dir: Path):
    """An Orbax/tensorstore failure to read `arrays_dir` (a truncated data file, a deleted manifest.ocdbt) as an
    `ExportError` naming the file, in one line."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - tensorstore reports a damaged file as ValueError, JSON as others
        file = named_file(error)
        raise ExportError(f"{arrays_dir} cannot be read ({describe(error)})"
                          + (f"; the damaged or missing file is {file}" if file else "")
                          + "; the save was interrupted or the checkpoint was damaged") from None


def restore_policy(workdir: str | Path, *, step: int | None = None, stage: str | None = None):
    """(policy model with the checkpoint's weights as host arrays, stage, step) of a run."""
    workdir = Path(workdir)
    config = load_run_config(workdir)
    stage = stage or config.pipeline
    if stage not in STAGES:
        raise ExportError(f"stage {stage!r} is not one of {STAGES}")
    checkpoint_dir = RunDir(workdir).stage(stage).checkpoints
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        others = {s: checkpoint_steps(RunDir(workdir).stage(s).checkpoints) for s in STAGES if s != stage}
        hint = "; ".join(f"{s} has steps {v} (pass --stage {s})" for s, v in others.items() if v)
        raise ExportError(f"no {stage} checkpoint in {checkpoint_dir}" + (f"; {hint}" if hint else
                          "; the run has not saved one yet (checkpoint.every) or the workdir is wrong"))
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ExportError(f"{stage} checkpoint step {step} does not exist in {checkpoint_dir}; available steps: "
                          f"{steps}")

    model = abstract_policy(config, workdir)
    graphdef, abstract_state = nnx.split(model)
    flat = nnx.to_flat_state(abstract_state)
    step_dir = checkpoint_dir / str(step)
    arrays_dir = step_dir / "arrays"
    by_path = {}
    try:
        for keys in POLICY_ARRAYS[stage]:
            role_item = step_dir / (ROLE_ITEM_PREFIX + keys[0])  # a role saved as its own item
            if role_item.is_dir():
                arrays_dir = role_item
                by_path.update(read_checkpoint_arrays(role_item, keys[1:]))
            else:
                by_path.update(read_checkpoint_arrays(arrays_dir, keys))
    except ExportError as error:
        older = [s for s in steps if s < step]
        fix = (f"export an older step with --step {older[-1]} (available steps: {steps})" if older else
               "no older step exists; rerun the training")
        raise ExportError(f"{stage} checkpoint step {step} cannot be exported: {error}; {fix}") from None
    for path, variable in flat:
        name = tuple(str(k) for k in path)
        if name not in by_path:
            raise ExportError(f"{arrays_dir} has no array for policy parameter {'.'.join(name)}; the run's "
                              f"config.json does not describe the model this checkpoint holds")
        array = by_path.pop(name)
        if tuple(array.shape) != tuple(variable.shape):
            raise ExportError(f"{arrays_dir}: {'.'.join(name)} has shape {tuple(array.shape)}, the model from the "
                              f"run's config.json expects {tuple(variable.shape)}")
        variable.set_value(np.asarray(array, dtype=variable.dtype))
    if by_path:
        raise ExportError(f"{arrays_dir} holds policy arrays the rebuilt model lacks: {sorted(by_path)[:10]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), stage, step


def export_run(workdir: str | Path, out: str | Path, *, step: int | None = None, stage: str | None = None,
               dtype: str = "bfloat16", experts: str = "fused") -> Path:
    """Write the run's policy (checkpoint `step`, default latest) to `out` as an HF checkpoint; returns `out`.

    Weights, config, tokenizer files, chat template and `mercury_export.json` go in one atomic swap (`save_hf`'s
    `extra_files`): a killed export leaves `out` as it was or complete."""
    if dtype not in ("bfloat16", "float32"):
        raise ExportError(f"--dtype {dtype!r}: use bfloat16 (release) or float32 (exact)")
    if experts not in ("fused", "unfused"):
        raise ExportError(f"--experts {experts!r}: use fused (released layout) or unfused (per-expert tensors)")
    workdir, out = Path(workdir), Path(out)
    model, stage, step = restore_policy(workdir, step=step, stage=stage)
    config = load_run_config(workdir)
    extra_files: dict[str, str | Path] = {}
    if config.model.hf_path:
        for name in HF_TOKENIZER_FILES:
            if (Path(config.model.hf_path) / name).exists():
                extra_files[name] = Path(config.model.hf_path) / name
    spm_file = run_tokenizer_file(config, workdir)
    if spm_file is not None:
        extra_files["sentencepiece.model"] = Path(spm_file)
    extra_files["chat_template.jinja"] = BUILTIN_CHAT_TEMPLATE
    extra_files["mercury_export.json"] = json.dumps(
        {"workdir": str(workdir.absolute()), "stage": stage, "step": step, "dtype": dtype, "experts": experts},
        indent=2) + "\n"
    save_hf(model, out, dtype=jnp.dtype(dtype), experts=experts, extra_files=extra_files)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mercury_jax.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the run directory (holds config.json and checkpoints)")
    parser.add_argument("--out", required=True, help="output directory of the HF checkpoint")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--stage", choices=STAGES, default=None, help="which policy (default: the run's pipeline)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--experts", choices=("fused", "unfused"), default="fused")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.workdir, args.out, step=args.step, stage=args.stage, dtype=args.dtype,
                         experts=args.experts)
    except ExportError as error:
        parser.exit(2, f"mercury_jax.export: error: {error}\n")
    print(f"exported {args.workdir} -> {out}", flush=True)


if __name__ == "__main__":
    main()
