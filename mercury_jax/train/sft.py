"""The SFT algorithm (warm start): minimise -mean log p(action tokens) over packed chats (the jitted step,
micro-batched or not, is `sft_learner.py`).

Rows come from grain (`train/sft_data.py`, `data/sft_rows.py`): the corpus (a user's files, `sft.data`, or the
oracle chats of the world's train tasks) rendered by the chat path, packed with segment ids (documents never see
each other), read per data shard by the processes whose devices hold it, in a seeded order reshuffled every epoch.
The stream's position is saved with every checkpoint (grain's checkpoint handler, `loop.py`), so a resumed run
trains on exactly the rows it would have. `WORKDIR/sft/batches.jsonl` lists the record ids of each step's rows. A
non-finite loss or gradient raises or skips the step (`guards.py`), never trains on.
"""
from __future__ import annotations

import json
import os

import ml_collections

from mercury_jax.parallel.distributed import fetch
from mercury_jax.runs.rundir import StageDir, append_line, as_path
from mercury_jax.train.loop import Cadence, StepResult, run_loop
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.placement import state_on_mesh, step_shardings
from mercury_jax.train.sft_data import SftData
from mercury_jax.train.sft_learner import make_sft_step
from mercury_jax.train.state import TrainState


class Sft:
    stage = "sft"
    progress_keys = ("loss",)
    plot_keys = ("loss", "token_accuracy_proxy")

    def __init__(self, cfg: ml_collections.ConfigDict, model, corpus, stage: StageDir, *, tokenizer=None,
                 seed: int = 0, mesh=None):
        """`corpus`: a grain random-access source of (index, record, where) (`data/corpus.py`); `tokenizer` renders
        chat records and gives the padding id (records given as {"tokens", "loss_mask"} need none: padding 0)."""
        self.cfg, self.steps, self.mesh, self.stage_dir = cfg, cfg.steps, mesh, stage
        self.logs = (stage.batches,)
        self.data = SftData(cfg, corpus, tokenizer, seed=seed, pad_id=getattr(tokenizer, "pad_id", 0), mesh=mesh)
        self.data_stream = self.data.stream  # checkpointed by the loop
        if mesh is None:
            self.state = TrainState.create(model, make_optimizer(cfg.optimizer))
            self.update = make_sft_step(self.state.graphdef, self.state.tx, cfg)
        else:
            self.state = state_on_mesh(model, cfg.optimizer, mesh)
            self.update = make_sft_step(self.state.graphdef, self.state.tx, cfg,
                                        state_shardings=step_shardings(self.state))

    def arrays(self) -> dict:
        return self.state.arrays()

    def meta(self) -> dict:
        return {}

    def restore(self, arrays: dict, meta: dict) -> None:
        self.state = self.state.replace_arrays(arrays)

    def policy(self):
        return self.state.model()

    def batch(self, step: int, local: dict) -> dict:
        """Step `step`'s batch (`local`: this process's shards' rows) on the learner's mesh (or device)."""
        return self.data.place(local)

    def step(self, step: int, *, version: int, guard) -> StepResult:
        local = self.data.next()
        batch = self.batch(step, local)
        state = self.state
        state.params, state.opt_state, metrics = self.update(state.params, state.frozen, state.opt_state, batch)
        metrics = fetch(metrics)
        applied = guard.check(step, metrics)  # raises before this step can be logged or saved
        summary = self.data.summary(local)
        append_line(self.stage_dir.batches, json.dumps({"step": step, "rows": summary["rows"],
                                                        "bad_records": summary["bad_records"]}))
        return StepResult({**metrics, "tokens": float(summary["tokens"]), "bad_records": summary["bad_records"]},
                          applied=applied)


def run_sft(cfg: ml_collections.ConfigDict, model, corpus, workdir: str | os.PathLike, *, tokenizer=None,
            seed: int = 0, checkpoint_cfg: ml_collections.ConfigDict | None = None,
            train_cfg: ml_collections.ConfigDict | None = None, algorithm: type[Sft] = Sft, mesh=None):
    """Train `model` on `corpus` in the stage directory `workdir`; returns the trained model and the metric
    history. `train_cfg` (the config's `train` section) sets the non-finite policy; `mesh` (the actor role's)
    shards the parameters, optimiser state and rows (None: the model's own device)."""
    stage = StageDir(as_path(workdir), "sft")
    sft = algorithm(cfg, model, corpus, stage, tokenizer=tokenizer, seed=seed, mesh=mesh)
    checkpoint_cfg = checkpoint_cfg or ml_collections.ConfigDict(dict(every=0, keep=1, async_save=False))
    history = run_loop(sft, stage, Cadence.from_config(checkpoint_cfg, log_every=cfg.log_every), train_cfg=train_cfg)
    return sft.policy(), history
