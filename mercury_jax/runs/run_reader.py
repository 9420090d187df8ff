"""Reading a finished (or running) run back: its config, tokenizer, checkpoint steps and a checkpoint's policy.

    run = RunReader("gs://bucket/runs/grpo")            # or a local path, or file:///abs/path
    config = run.config                                 # WORKDIR/config.json
    steps = run.steps("grpo")                           # committed checkpoint steps, ascending
    step = run.resolve_step("grpo", None)               # the latest, or a named one (errors list what exists)
    model = run.abstract_policy()                       # the run's policy with shape-only parameters
    items = run.policy_items("grpo", step)              # the Orbax items holding the policy's arrays

The one place that knows how a run directory is read; the trainers (the SAO evaluation seed), the checkpoint sweep
(`mercury_jax.sweep`) and the export (`mercury_jax.export`) all read through it. Every path is an `etils.epath`
path (`rundir.as_path`), so a `gs://` run directory reads like a local one and `file:///abs/path` is the local path.
Errors are `RunReadError`s that say what is missing and how to get it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from mercury_jax.chat import SentencePieceTokenizer, qwen35_tokenizer
from mercury_jax.config.model import build_model, model_runtime, preset_config
from mercury_jax.config.registry import PIPELINES, stages
from mercury_jax.runs.checkpoint_faults import describe, named_file
from mercury_jax.runs.checkpoint_roles import ROLE_ITEM_PREFIX
from mercury_jax.runs.rundir import RunDir, checkpoint_steps
from mercury_jax.data.uris import check_remote
from models.qwen35_moe import Qwen35MoeConfig, Qwen35MoeForCausalLM
from models.qwen35_moe.checkpoint_errors import CheckpointError

EVAL_SEED_OFFSET = 1_000_003  # held-out episodes sample from config.seed + this (SAO's evaluations, the sweep)
TOKENIZER_CACHE = Path.home() / ".cache" / "mercury_jax" / "run_tokenizers"  # remote runs' SentencePiece models


class RunReadError(ValueError):
    """The run directory lacks what a reader needs; the message says what and how to get it."""


def eval_seed(config: ml_collections.ConfigDict) -> int:
    """The sampling seed of held-out evaluations: the SAO trainer's and the sweep's default."""
    return int(config.seed) + EVAL_SEED_OFFSET


def save_run_config(config: ml_collections.ConfigDict, workdir: str | os.PathLike):
    """Write the run's config to `workdir/config.json` (process 0 only), for tools that rebuild the run's model."""
    return RunDir(workdir).write_config(config)


@dataclasses.dataclass(frozen=True)
class PolicyItem:
    """Where part of a checkpoint's policy sits: the Orbax item directory and the keys of its subtree there."""
    directory: epath.Path
    subtree: tuple[str, ...]


class RunReader:
    """A run directory read back (local path, `file://` URL or `gs://` URI); see the module docstring."""

    def __init__(self, workdir: str | os.PathLike | RunDir):
        if not isinstance(workdir, RunDir):
            check_remote(workdir, "run directory")  # gs:// without gcsfs: one line naming the install
        self.run = RunDir(workdir)
        self.root = self.run.root
        self._config = None

    def __repr__(self) -> str:
        return f"RunReader({os.fspath(self.root)!r})"

    @property
    def name(self) -> str:
        return self.root.name

    def exists(self) -> bool:
        return self.root.is_dir()

    @property
    def config(self) -> ml_collections.ConfigDict:
        if self._config is None:
            if not self.run.config.exists():
                raise RunReadError(
                    f"{os.fspath(self.run.config)} does not exist: runs started by `python -m mercury_jax.main` write "
                    f"it; for an older run write it with mercury_jax.runs.run_reader.save_run_config(config, "
                    f"{os.fspath(self.root)!r}) using the run's experiment config and overrides")
            self._config = self.run.read_config()
        return self._config

    # ------------------------------------------------------------------------------------------------ tokenizer
    def tokenizer_file(self) -> Path | None:
        """The SentencePiece model the run trained, as a local file (None for the Qwen3.5 BPE). A remote run's
        model is copied once into `TOKENIZER_CACHE` (SentencePiece reads local files only)."""
        tokenizer = self.config.tokenizer
        if tokenizer.kind != "sentencepiece":
            return None
        directory = self.run.tokenizer
        files = sorted(directory.glob(f"spm-{tokenizer.vocab_size}-*.model"), key=lambda p: p.stat().mtime)
        if not files:
            raise RunReadError(f"no SentencePiece model spm-{tokenizer.vocab_size}-*.model in "
                               f"{os.fspath(directory)}; the run trains it at start-up (tokenizer.kind = "
                               f"'sentencepiece'), so the workdir is incomplete")
        newest = files[-1]  # several only if the corpus changed between restarts; the newest is the one in use
        if self.run.local:
            return Path(os.fspath(newest))
        data = newest.read_bytes()
        local = TOKENIZER_CACHE / hashlib.sha256(data).hexdigest()[:16] / newest.name
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            staging = local.with_suffix(".tmp")
            staging.write_bytes(data)
            staging.replace(local)
        return local

    def tokenizer(self):
        """The tokenizer the run trained with: its SentencePiece model, or the Qwen3.5 BPE."""
        kind = self.config.tokenizer.kind
        if kind == "qwen35":
            return qwen35_tokenizer()
        if kind == "sentencepiece":
            return self._sentencepiece(self.tokenizer_file())
        raise RunReadError(f"tokenizer.kind {kind!r} is not 'qwen35' or 'sentencepiece'")

    def _sentencepiece(self, file: Path) -> SentencePieceTokenizer:
        try:
            return SentencePieceTokenizer(file)
        except Exception as error:  # noqa: BLE001 - sentencepiece reports a damaged model as a bare RuntimeError
            reason = " ".join(str(error).replace(f" from {file}", "").split())
            raise RunReadError(f"the run's SentencePiece model {file} cannot be read ({reason}): it is damaged or not "
                               f"a SentencePiece model; restore it from a copy of the run directory (the "
                               f"checkpoints' token ids mean something only with this model)") from None

    # ------------------------------------------------------------------------------------------------ checkpoints
    def checkpoints(self, stage: str) -> epath.Path:
        return self.run.stage(stage).checkpoints

    def steps(self, stage: str) -> list[int]:
        return checkpoint_steps(self.checkpoints(stage))

    def resolve_step(self, stage: str | None, step: int | None) -> tuple[str, int]:
        """(stage, step): the run's pipeline and latest step unless named; errors list what the run has."""
        stage = stage or self.config.pipeline
        if stage not in stages():
            raise RunReadError(f"stage {stage!r} is not one of {stages()}")
        steps = self.steps(stage)
        where = os.fspath(self.checkpoints(stage))
        if not steps:
            others = {s: self.steps(s) for s in stages() if s != stage}
            hint = "; ".join(f"{s} has steps {v} (pass --stage {s})" for s, v in others.items() if v)
            raise RunReadError(f"no {stage} checkpoint in {where}" + (f"; {hint}" if hint else
                               "; the run has not saved one yet (checkpoint.every) or the workdir is wrong"))
        step = steps[-1] if step is None else step
        if step not in steps:
            raise RunReadError(f"{stage} checkpoint step {step} does not exist in {where}; available steps: {steps}")
        return stage, step

    def policy_items(self, stage: str, step: int) -> list[PolicyItem]:
        """The Orbax items (and subtrees) holding the policy of checkpoint `step`: a role saved as its own item
        (`arrays_actor`) or the `arrays` item (checkpoint_roles.py)."""
        step_dir = self.checkpoints(stage) / str(step)
        items = []
        for keys in PIPELINES[stage].policy_arrays:
            role_item = step_dir / (ROLE_ITEM_PREFIX + keys[0])
            items.append(PolicyItem(role_item, keys[1:]) if role_item.is_dir() else PolicyItem(step_dir / "arrays",
                                                                                               keys))
        return items

    def unreadable_step(self, stage: str, step: int, error: Exception) -> RunReadError:
        """The error for checkpoint `step` that cannot be read: what failed, and the older step to use instead."""
        steps = self.steps(stage)
        older = [s for s in steps if s < step]
        fix = (f"use an older step, --step {older[-1]} (available steps: {steps})" if older else
               "no older step exists; rerun the training")
        return RunReadError(f"{stage} checkpoint step {step} cannot be read: {error}; {fix}")

    # ------------------------------------------------------------------------------------------------ the model
    def abstract_policy(self) -> Qwen35MoeForCausalLM:
        """The run's policy with abstract (shape-only) parameters, built as `config.model.build_model` builds it."""
        model_cfg = self.config.model
        if model_cfg.hf_path:  # the structure comes from the HF config; the weights come from our checkpoint
            config_file = Path(model_cfg.hf_path) / "config.json"
            if not config_file.exists():
                raise RunReadError(f"the run started from model.hf_path {model_cfg.hf_path}, whose config.json is "
                                   f"not here; copy that checkpoint's config.json to {config_file}")
            try:
                cfg = Qwen35MoeConfig.from_hf(config_file, param_dtype="float32", **model_runtime(model_cfg))
            except CheckpointError as error:  # checked field by field before anything is derived or allocated
                raise RunReadError(f"{config_file} (the run's model.hf_path) describes no model: {error}; restore "
                                   f"the config.json of the checkpoint the run started from") from None
            return nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
        vocab_size = self.tokenizer().vocab_size
        try:
            preset_config(model_cfg, vocab_size)  # the model config's own checks, before any shape is built
        except ValueError as error:
            raise RunReadError(f"{os.fspath(self.run.config)} describes no model ({error}); restore the config.json "
                               f"the run wrote at its start (model.preset, model.overrides)") from None
        return nnx.eval_shape(lambda: build_model(model_cfg, vocab_size, self.config.seed))

    def restore_policy(self, stage: str | None = None, step: int | None = None, *, shardings=None, dtype=None):
        """(policy model with checkpoint `step`'s weights, stage, step). Default: host numpy arrays. With
        `shardings` (a function from a parameter's name tuple and abstract variable to a `jax.sharding.Sharding`)
        every array is restored straight into its sharding, read shard by shard, and cast to `dtype` (floating
        parameters; None keeps the checkpoint's) while it is read: no host copy of the whole model."""
        stage, step = self.resolve_step(stage, step)
        graphdef, abstract_state = nnx.split(self.abstract_policy())
        flat = nnx.to_flat_state(abstract_state)
        wanted = {tuple(str(k) for k in path): variable for path, variable in flat}
        arrays, item = {}, None
        try:
            for item in self.policy_items(stage, step):
                arrays.update(read_item_arrays(item, None if shardings is None else _restore_args(
                    wanted, shardings, dtype)))
        except RunReadError as error:
            raise self.unreadable_step(stage, step, error) from None
        where = os.fspath(item.directory) if item else os.fspath(self.checkpoints(stage) / str(step))
        check_policy_arrays(where, wanted, {name: tuple(a.shape) for name, a in arrays.items()})
        for name, variable in wanted.items():
            array = arrays[name]
            variable.set_value(np.asarray(array, dtype=variable.dtype) if shardings is None else array)
        return nnx.merge(graphdef, nnx.from_flat_state(flat)), stage, step


def check_policy_arrays(where: str, wanted: dict, shapes: dict) -> None:
    """RunReadError unless the checkpoint's arrays (`shapes`: name -> shape, found in `where`) are exactly the
    policy's parameters (`wanted`: name -> abstract variable), each with its shape."""
    for name, variable in wanted.items():
        if name not in shapes:
            raise RunReadError(f"{where} has no array for policy parameter {'.'.join(name)}; the run's "
                               f"config.json does not describe the model this checkpoint holds")
        if tuple(shapes[name]) != tuple(variable.shape):
            raise RunReadError(f"{where}: {'.'.join(name)} has shape {tuple(shapes[name])}, the model from the "
                               f"run's config.json expects {tuple(variable.shape)}")
    extra = sorted(set(shapes) - set(wanted))
    if extra:
        raise RunReadError(f"{where} holds policy arrays the rebuilt model lacks: {extra[:10]}")


def _restore_args(wanted: dict, shardings, dtype):
    """name tuple -> Orbax restore args placing that array into `shardings(name, variable)` as `dtype`."""
    def args(name):
        variable = wanted.get(name)
        if variable is None:
            return None
        floating = jax.numpy.issubdtype(variable.dtype, jax.numpy.floating)
        return ocp.ArrayRestoreArgs(sharding=shardings(name, variable),
                                    dtype=dtype if dtype is not None and floating else None)
    return args


@contextlib.contextmanager
def _quiet_absl():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def damaged_item(directory):
    """An Orbax/tensorstore failure to read `directory` (a truncated data file, a deleted manifest.ocdbt) as a
    `RunReadError` naming the file, in one line."""
    try:
        yield
    except RunReadError:
        raise
    except Exception as error:  # noqa: BLE001 - tensorstore reports a damaged file as ValueError, JSON as others
        file = named_file(error)
        raise RunReadError(f"{os.fspath(directory)} cannot be read ({describe(error)})"
                           + (f"; the damaged or missing file is {file}" if file else "")
                           + "; the save was interrupted or the checkpoint was damaged") from None


def _absolute(directory) -> epath.Path:
    directory = epath.Path(directory)
    return directory if "://" in os.fspath(directory) else epath.Path(os.path.abspath(os.fspath(directory)))


def item_tree(directory) -> dict:
    """The array metadata tree of an Orbax item (nested dicts of `ArrayMetadata`); RunReadError when unreadable."""
    directory = _absolute(directory)  # Orbax resolves a relative path against no directory of ours
    with _quiet_absl(), damaged_item(directory):  # an item directory has no step-level _CHECKPOINT_METADATA; Orbax
        metadata = ocp.PyTreeCheckpointer().metadata(directory) if directory.is_dir() else None  # warns otherwise
    if metadata is None or metadata.item_metadata is None:
        raise RunReadError(f"{os.fspath(directory)} holds no readable Orbax checkpoint item (no array metadata); the "
                           f"save was interrupted or the path is wrong; pick another step (`--step`) or rerun the "
                           f"training")
    return metadata.item_metadata.tree


def leaf_name(path) -> tuple[str, ...]:
    """A tree path as a name tuple, nnx's trailing `value` dropped (("model", "embed") for .../embed/value)."""
    names = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def read_item_arrays(item: PolicyItem, restore_args=None) -> dict[tuple[str, ...], object]:
    """The arrays under `item.subtree` keyed by their name below it. Default: host numpy arrays; with
    `restore_args` (name -> `ocp.ArrayRestoreArgs` or None to skip) jax arrays placed as those say. Nothing else is
    read, and the saving devices need not exist."""
    directory = _absolute(item.directory)
    tree = item_tree(directory)
    for key in item.subtree:
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    if not tree:
        return {}
    part = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    if restore_args is None:
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), part)
    else:
        chosen = {leaf_name(path): restore_args(leaf_name(path))
                  for path, _ in jax.tree_util.tree_flatten_with_path(part)[0]}
        part = _prune(part, lambda path: chosen[leaf_name(path)] is not None)
        args = jax.tree_util.tree_map_with_path(lambda path, _: chosen[leaf_name(path)], part)
    for key in reversed(item.subtree):
        part, args = {key: part}, {key: args}
    with _quiet_absl(), damaged_item(directory):
        restored = ocp.PyTreeCheckpointer().restore(directory, args=ocp.args.PyTreeRestore(
            item=part, restore_args=args, partial_restore=True))
    for key in item.subtree:
        restored = restored[key]
    return {leaf_name(path): array for path, array in jax.tree_util.tree_flatten_with_path(restored)[0]}


def read_checkpoint_arrays(item_dir, subtree: tuple[str, ...] = ()) -> dict[tuple[str, ...], np.ndarray]:
    """The arrays under `subtree` of the Orbax item `item_dir` (e.g. `.../sao/checkpoints/3/arrays`, ("actor",
    "params")) as host numpy arrays keyed by their name below `subtree`."""
    return {name: np.asarray(a) for name, a in read_item_arrays(PolicyItem(epath.Path(item_dir),
                                                                            tuple(subtree))).items()}


def _prune(tree, keep):
    """`tree` (nested dicts) without the leaves whose path `keep` refuses, nor the dicts left empty."""
    def walk(node, path):
        if not isinstance(node, dict):
            return node if keep(path) else None
        kept = {k: v for k, v in ((k, walk(child, (*path, jax.tree_util.DictKey(k)))) for k, child in node.items())
                if v is not None and not (isinstance(v, dict) and not v)}
        return kept
    return walk(tree, ())
