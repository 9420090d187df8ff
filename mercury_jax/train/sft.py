"""The SFT algorithm (warm start): minimise -mean log p(action tokens) over packed trajectories (the jitted step,
micro-batched or not, is `sft_learner.py`).

Rows are packed with segment ids (documents never see each other) and batched in seeded epoch orders
(`streams.batch_rows`), so a resumed run (`loop.py`) continues with the same batches. A non-finite loss or
gradient raises or skips the step (`guards.py`), never trains on.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import ml_collections
import numpy as np

from mercury_jax.parallel.distributed import fetch
from mercury_jax.train.loop import Cadence, StepResult, run_loop
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.packing import pack_sequences
from mercury_jax.train.placement import batch_to_mesh, state_on_mesh, step_shardings
from mercury_jax.train.rundir import StageDir, as_path
from mercury_jax.train.sft_learner import make_sft_step
from mercury_jax.train.state import TrainState
from mercury_jax.train.streams import batch_rows


class Sft:
    stage = "sft"
    progress_keys = ("loss",)
    plot_keys = ("loss", "token_accuracy_proxy")

    def __init__(self, cfg: ml_collections.ConfigDict, model, sequences: list[tuple[list[int], list[int]]], *,
                 seed: int = 0, pad_id: int = 0, mesh=None):
        self.cfg, self.seed, self.steps, self.mesh = cfg, seed, cfg.steps, mesh
        self.packed = pack_sequences(sequences, cfg.row_length, pad_id=pad_id)
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

    def rows(self, step: int):
        """The packed-row indices of step `step` (1-based)."""
        return batch_rows(len(self.packed["tokens"]), self.cfg.batch_rows, step - 1, self.seed)

    def host_batch(self, step: int) -> dict:
        """The packed rows of step `step` (1-based), as host arrays."""
        rows = self.rows(step)
        return {k: v[rows] for k, v in self.packed.items()}

    def batch(self, step: int) -> dict:
        """The packed rows of step `step` (1-based), on the learner's mesh (or device)."""
        rows = self.host_batch(step)
        if self.mesh is not None:
            return batch_to_mesh(rows, self.mesh)
        return {k: jnp.asarray(v) for k, v in rows.items()}

    def step(self, step: int, *, version: int, guard) -> StepResult:
        batch = self.batch(step)
        state = self.state
        state.params, state.opt_state, metrics = self.update(state.params, state.frozen, state.opt_state, batch)
        metrics = fetch(metrics)
        applied = guard.check(step, metrics)  # raises before this step can be logged or saved
        # counted on the host: a process that holds none of the learner's devices cannot read the placed batch
        tokens = float(np.sum(self.packed["segment_ids"][self.rows(step)] > 0))
        return StepResult({**metrics, "tokens": tokens}, applied=applied)


def run_sft(cfg: ml_collections.ConfigDict, model, sequences: list[tuple[list[int], list[int]]],
            workdir: str | os.PathLike, *, seed: int = 0, checkpoint_cfg: ml_collections.ConfigDict | None = None,
            pad_id: int = 0, train_cfg: ml_collections.ConfigDict | None = None, algorithm: type[Sft] = Sft,
            mesh=None):
    """Train `model` on (tokens, action_mask) sequences in the stage directory `workdir`; returns the trained
    model and the metric history. `train_cfg` (the config's `train` section) sets the non-finite policy; `mesh`
    (the actor role's) shards the parameters, optimiser state and rows (None: the model's own device)."""
    sft = algorithm(cfg, model, sequences, seed=seed, pad_id=pad_id, mesh=mesh)
    checkpoint_cfg = checkpoint_cfg or ml_collections.ConfigDict(dict(every=0, keep=1, async_save=False))
    history = run_loop(sft, StageDir(as_path(workdir), "sft"),
                       Cadence.from_config(checkpoint_cfg, log_every=cfg.log_every), train_cfg=train_cfg)
    return sft.policy(), history
