"""Export the policy of a training run as a Hugging Face checkpoint (released text-only layout, via `write_hf`).

    python -m mercury_jax.export --workdir runs/sao-20260101-120000 --out /tmp/sao-hf \
        [--step N] [--stage sao|sft|grpo] [--dtype bfloat16|float32] [--experts fused|unfused]

The run directory (a local path, `file:///abs/path` or `gs://bucket/run`) is read through
`mercury_jax.runs.run_reader` (what it must hold and the errors that say what is missing are documented there):
`config.json` says how the model was built and which tokenizer the run used; the Orbax checkpoints
`STAGE/checkpoints/STEP` hold the policy (SAO and pivot GRPO: `actor/params` + `actor/frozen`, in the `arrays` item
or a role item `arrays_actor`; SFT: `params` + `frozen`); the latest step unless `--step`.

The export streams: each HF tensor is built from the checkpoint arrays it comes from, read one at a time (a scanned
layer stack one layer's row at a time, `runs/checkpoint_tensors.py`), cast to the export dtype as it is read, and
written into its safetensors shard without holding the shard (`models/qwen35_moe/safetensors_shards.py`). Host
memory is bounded by a few times the largest checkpoint array, not the model's size (BENCHMARKS.md "HF export of a
run: host memory"); the critic and the optimiser moments are never read, and no accelerator is needed. The files
are byte for byte those of `save_hf` on the restored policy.
Next to the weights go `chat_template.jinja` (the template the run trained with, `BUILTIN_CHAT_TEMPLATE`, so that
transformers / vLLM / SGLang render the same prompts), the tokenizer files of `model.hf_path` when the run started
from an HF checkpoint, and for a SentencePiece run its model file as `sentencepiece.model` (a SentencePiece model
with the Qwen3.5 special tokens at ids 1..33, not an HF tokenizer; load it with
`mercury_jax.chat.SentencePieceTokenizer`); and `mercury_export.json` (run, stage, step, dtype, experts). All of it
goes into `--out` in one atomic swap: a killed export, or one that fails (a full disk, a file-size limit), leaves
`--out` as it was, or complete.

Exit codes (`cli_errors.py`): 0 done; 2 refused, with one `error:` line on stderr naming the problem and the fix (no
such run, step or stage; a run directory that lacks what the export needs or holds a damaged checkpoint, tokenizer
or config.json; `--out` naming a file; a write that failed, e.g. on a full disk); `--debug` or MERCURY_DEBUG=1 adds
the traceback; 1 a bug, with its traceback. A `gs://` run directory needs the optional package gcsfs.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path

import jax.numpy as jnp

from mercury_jax import cli_errors
from mercury_jax.chat import BUILTIN_CHAT_TEMPLATE
from mercury_jax.config.registry import stages
from mercury_jax.runs.checkpoint_faults import FIXES
from mercury_jax.runs.checkpoint_tensors import CheckpointTensors
from mercury_jax.runs.run_reader import RunReader, RunReadError
from models.qwen35_moe.hf import write_hf

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                      "special_tokens_map.json", "generation_config.json")


class ExportError(RunReadError):
    """An export argument is wrong (the run directory's own errors are `RunReadError`s)."""


def export_run(workdir: str | os.PathLike, out: str | Path, *, step: int | None = None, stage: str | None = None,
               dtype: str = "bfloat16", experts: str = "fused", max_shard_size: int | str = "5GB") -> Path:
    """Write the run's policy (checkpoint `step`, default latest) to `out` as an HF checkpoint; returns `out`."""
    if dtype not in ("bfloat16", "float32"):
        raise ExportError(f"--dtype {dtype!r}: use bfloat16 (release) or float32 (exact)")
    if experts not in ("fused", "unfused"):
        raise ExportError(f"--experts {experts!r}: use fused (released layout) or unfused (per-expert tensors)")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} is a file, not a directory; pass a directory path (a new one, or an earlier "
                          f"export to replace), or move the file")
    reader = RunReader(workdir)
    stage, step = reader.resolve_step(stage, step)
    model = reader.abstract_policy()
    tensors = CheckpointTensors.open(reader, stage, step, model)
    existed = os.path.isdir(out)
    try:
        write_hf(model.config, tensors, out, dtype=jnp.dtype(dtype), experts=experts, max_shard_size=max_shard_size,
                 extra_files=extra_files(reader, stage, step, dtype, experts))
    except OSError as error:  # a full disk, a file-size limit, permissions: the swap never happened
        raise ExportError(write_failure(error, out, existed)) from None
    return Path(out)


def write_failure(error: OSError, out: str | Path, existed: bool) -> str:
    """The one-line message of an export whose write failed: the OS error, its fix, and what `out` holds now (the
    atomic swap never ran, so the old export or nothing)."""
    name = errno.errorcode.get(error.errno, "")
    fix = FIXES.get(name, "fix the cause and export again")
    where = f" ({error.filename})" if error.filename else ""
    kept = f"the export that was in {out} is unchanged" if existed else f"{out} was not created"
    return f"writing the export to {out} failed: {error.strerror or error}{where}; {fix}; {kept}"


def extra_files(reader: RunReader, stage: str, step: int, dtype: str, experts: str) -> dict[str, str | Path]:
    """The files written next to the weights (module docstring)."""
    files: dict[str, str | Path] = {}
    hf_path = reader.config.model.hf_path
    if hf_path:
        for name in HF_TOKENIZER_FILES:
            if (Path(hf_path) / name).exists():
                files[name] = Path(hf_path) / name
    spm_file = reader.tokenizer_file()
    if spm_file is not None:
        files["sentencepiece.model"] = Path(spm_file)
    files["chat_template.jinja"] = BUILTIN_CHAT_TEMPLATE
    files["mercury_export.json"] = json.dumps(
        {"workdir": os.fspath(reader.root), "stage": stage, "step": step, "dtype": dtype, "experts": experts},
        indent=2) + "\n"
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mercury_jax.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the run directory: a path, file:///abs/path or gs:// URI")
    parser.add_argument("--out", required=True, help="output directory of the HF checkpoint (local)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--stage", choices=stages(), default=None, help="which policy (default: the run's pipeline)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--experts", choices=("fused", "unfused"), default="fused")
    cli_errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    out = cli_errors.run_entry_point(lambda: export_run(args.workdir, args.out, step=args.step, stage=args.stage,
                                                        dtype=args.dtype, experts=args.experts), argv)
    print(f"exported {args.workdir} -> {out}", flush=True)


if __name__ == "__main__":
    main()
