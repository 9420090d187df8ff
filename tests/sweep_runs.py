"""Fake pivot-GRPO runs for the sweep's tests: a run directory with config.json, the SentencePiece tokenizer trained
on oracle text, and Orbax checkpoints of a random tiny policy in the trainer's layout."""
from __future__ import annotations

import shutil
from pathlib import Path

import ml_collections

# The released structure on 8 CPU devices (as the pod bench's tests spread the tiny configs): a rollout group of its
# own, sharded replicas with the expert-parallel MoE.
RELEASED_STRUCTURE = {"devices": {"rollout": 4, "actor": 4}, "rollout.replica": {"fsdp": 2},
                      "model.moe_impl": "ep"}


def tiny_grpo_config(num_eval_tasks: int = 3, num_slots: int = 3) -> ml_collections.ConfigDict:
    """What the GRPO experiment's `:tiny` config holds for the sweep: a browse world and a rollout section."""
    from experiments import common

    c = common.base_config("grpo", world="browse")
    common.tiny_common(c)
    c.world.num_train_tasks, c.world.num_eval_tasks = 8, num_eval_tasks
    c.rollout = ml_collections.ConfigDict(dict(max_tool_turns=1, max_total_tokens=512, max_turn_tokens=24,
                                               temperature=1.0, top_p=1.0, num_slots=num_slots))
    return c


def released_structure(config: ml_collections.ConfigDict, param_dtype: str) -> ml_collections.ConfigDict:
    """`config` with `RELEASED_STRUCTURE` and rollout weights in `param_dtype` ("" keeps fp32)."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.devices = ml_collections.ConfigDict(RELEASED_STRUCTURE["devices"])
    config.rollout.replica = dict(RELEASED_STRUCTURE["rollout.replica"])
    config.rollout.param_dtype = param_dtype
    config.model.moe_impl = RELEASED_STRUCTURE["model.moe_impl"]
    return config


def start_run(workdir: Path, config: ml_collections.ConfigDict) -> Path:
    """config.json and the run's SentencePiece tokenizer in `workdir`."""
    from mercury_jax.chat import render
    from mercury_jax.config.world import oracle_messages, tool_schemas, world_tasks
    from mercury_jax.runs.run_reader import save_run_config
    from mercury_jax.runs.tokenizer import build_tokenizer

    save_run_config(config, workdir)
    tasks = world_tasks(config.world, "train") + world_tasks(config.world, "eval")
    texts = [render(m, t) for m, t in zip(oracle_messages(tasks), tool_schemas(tasks))]
    build_tokenizer(config.tokenizer, workdir, texts)
    return workdir


def save_checkpoints(workdir: Path, scales=(1.0, 1.5)) -> Path:
    """Checkpoints 0, 1, ... of the run's random tiny policy {"actor": {"params", "frozen"}}, step i's params the
    initial ones times `scales[i]`."""
    import jax
    from flax import nnx

    from mercury_jax.config.model import build_model
    from mercury_jax.runs.checkpoints import Checkpointer
    from mercury_jax.runs.run_reader import RunReader

    reader = RunReader(workdir)
    config = reader.config
    model = build_model(config.model, reader.tokenizer().vocab_size, config.seed)
    _, params, frozen = nnx.split(model, nnx.Param, ...)
    checkpointer = Checkpointer(Path(workdir) / "grpo" / "checkpoints", save_every=1, keep=10, async_save=False)
    for step, scale in enumerate(scales):
        checkpointer.save(step, {"actor": {"params": jax.tree.map(lambda x, s=scale: x * s, params),
                                           "frozen": frozen}}, {"step": step})
    checkpointer.close()
    return workdir


def same_run_with_config(source: Path, workdir: Path, config: ml_collections.ConfigDict) -> Path:
    """A copy of run `source` (tokenizer, checkpoints) whose config.json is `config` (same model weights)."""
    from mercury_jax.runs.run_reader import save_run_config

    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("sweep"))
    (workdir / "config.json").unlink()
    save_run_config(config, workdir)
    return workdir
