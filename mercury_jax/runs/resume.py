"""Resume hygiene shared by the training loops: run logs that survive a kill, and a resumed run that must be the
same run.

- JSONL logs (metrics, SAO's evals.jsonl, GRPO's samples.jsonl) are appended line by line, so a kill can leave the
  last line torn: `read_jsonl` drops it with a warning (and rewrites the file, so the next append starts on a
  line of its own); a bad line anywhere else is corruption and raises `ResumeError`.
- A resumed run replays the steps after its checkpoint, so rows logged after that step (e.g. an evaluation
  written just before a kill, its checkpoint never committed) are dropped first: `truncate_jsonl`.
- A rerun in a workdir holds that run's state (checkpoints, tokenizer, datasets). `check_run_config` compares the
  new config with the workdir's `config.json` on the fields that change shapes or data (`resume_fields`: the
  common ones and the pipeline's own, registered in `config/registry.py`) and
  refuses a mismatch, naming each field, unless forced.
- An SFT corpus (`sft.data`) rewritten between a kill and the resume would put other chats under the record ids the
  checkpoint's data position and `batches.jsonl` hold. `check_corpus` records the corpus's fingerprint
  (`data/fingerprint.py`: each file's size and modification time) in `WORKDIR/sft_corpus.json` when the run starts,
  and refuses a resume whose files differ from it, naming each, unless forced.
"""
from __future__ import annotations

import json
import os
import warnings

from mercury_jax.config.defaults import DEFAULTS, setting
from mercury_jax.config.registry import COMMON_RESUME_FIELDS, PIPELINES
from mercury_jax.data.fingerprint import corpus_fingerprint, fingerprint_changes
from mercury_jax.runs.rundir import RunDir, as_path, write_atomically


def resume_fields(*pipeline_names: str) -> tuple[str, ...]:
    """The fields (dotted prefixes) a resumed run must share with the run that wrote its checkpoints: the common
    ones and each named pipeline's own (`config/registry.py`); an unknown name adds none."""
    fields = COMMON_RESUME_FIELDS
    for name in pipeline_names:
        if name in PIPELINES:
            fields += tuple(f for f in PIPELINES[name].resume_fields if f not in fields)
    return fields


class ResumeError(ValueError):
    """The workdir's state cannot be resumed as it is."""


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL log ([] when missing). A torn last line (a kill mid-write) is dropped with a
    warning and the file rewritten without it; an unreadable line before the last raises `ResumeError`."""
    path = as_path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ResumeError(f"{path} line {number} is not JSON ({error}) and is not the last line, so it is "
                                  f"not a write cut short by a kill; repair or delete the file to resume") from error
            warnings.warn(f"{path}: dropped a torn last line ({len(line)} characters, a kill mid-write); the "
                          f"resumed run logs that step again", stacklevel=2)
            write_jsonl(path, records)
            return records
    if text and not text.endswith("\n"):  # cut just before its newline: complete, but the next append would join it
        write_jsonl(path, records)
    return records


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """Replace the file with `records`, one JSON object a line (through a temporary file and a rename)."""
    write_atomically(as_path(path), "".join(json.dumps(r) + "\n" for r in records))


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> list[dict]:
    """Keep the records with `step <= last_step` (a resumed run replays the later steps); returns them."""
    records = [r for r in read_jsonl(path) if r["step"] <= last_step]
    if as_path(path).exists():
        write_jsonl(path, records)
    return records


def differing_fields(saved: dict, current: dict, fields: tuple[str, ...] | None = None) -> dict:
    """{dotted field: (saved value, current value)} for every leaf under `fields` that differs (a field only one
    side has counts as differing unless the other's value is its default in `config/defaults.DEFAULTS`, a field
    neither has does not). `fields`: the resume fields of both configs' pipelines by default."""
    if fields is None:
        fields = resume_fields(str(saved.get("pipeline")), str(current.get("pipeline")))
    saved_flat, current_flat = _flatten(saved), _flatten(current)
    out = {}
    for key in sorted(set(saved_flat) | set(current_flat)):
        if any(key == f or key.startswith(f + ".") for f in fields):
            absent = DEFAULTS.get(key.rsplit(".", 1)[-1], "<absent>")  # an older config lacks a defaulted field
            before, after = saved_flat.get(key, absent), current_flat.get(key, absent)
            if before != after:
                out[key] = (before, after)
    return out


def check_run_config(workdir: str | os.PathLike, config, *, force: bool = False) -> dict:
    """Compare `config` (a ConfigDict) with `workdir/config.json` when the workdir holds an earlier run; raise
    `ResumeError` naming the differing `resume_fields` unless `force` (then warn). Returns the differences."""
    run = RunDir(workdir)
    path, workdir = run.config, os.fspath(run.root)
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    current = json.loads(config.to_json_best_effort())  # tuples -> lists, as config.json holds them
    differences = differing_fields(saved, current)
    if not differences:
        return {}
    listed = "; ".join(f"{k}: {before!r} in the workdir's run, {after!r} now" for k, (before, after) in
                       differences.items())
    if force:
        warnings.warn(f"resuming {workdir} with a config that differs in shape/data fields (forced): {listed}",
                      stacklevel=2)
        return differences
    raise ResumeError(f"{workdir} holds a run whose config differs from this one in fields that change shapes or "
                      f"data: {listed}. Use a new --workdir, restore those fields, or pass --resume_force_config to "
                      f"resume anyway")


def check_corpus(workdir: str | os.PathLike, config, *, force: bool = False) -> list[str]:
    """Compare the files of `config.sft.data` with the fingerprint the run recorded at its start
    (`RunDir.corpus_fingerprint`); raise `ResumeError` naming each changed file unless `force` (then warn and record
    the new fingerprint). A run without one (a new run, or one started before fingerprints) records it. Returns the
    changes; a config without `sft.data` has none."""
    spec = setting(config.sft, "data") if "sft" in config else None
    if not spec:
        return []
    run = RunDir(workdir)
    path, workdir = run.corpus_fingerprint, os.fspath(run.root)
    current = corpus_fingerprint(spec)
    saved = json.loads(path.read_text()) if path.exists() else None
    changes = [] if saved is None else fingerprint_changes(saved, current)
    if changes and not force:
        raise ResumeError(f"{workdir} holds a run whose SFT corpus changed since it started (sft.data {spec!r}): "
                          f"{'; '.join(changes)}. Resumed, it would read other chats under the record ids of its "
                          f"checkpoint and batches.jsonl. Restore the corpus, use a new --workdir, or pass "
                          f"--resume_force_config to resume on the changed corpus")
    if changes:
        warnings.warn(f"resuming {workdir} on a changed SFT corpus (forced): {'; '.join(changes)}", stacklevel=2)
    if saved is None or changes:
        write_atomically(path, json.dumps(current, indent=1) + "\n")
    return changes


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}
