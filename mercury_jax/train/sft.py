"""SFT warm start: minimise -mean log p(action tokens) over packed trajectories (token-mean over the batch).

    loss = - sum_t mask[t] * log p(x[t] | x[<t], same document) / sum_t mask[t]
Rows are packed with segment ids (documents never see each other), reshuffled every epoch by the seed, and the
run checkpoints (weights, optimiser, step) so a restart continues where it stopped (also after a SIGTERM:
`preemption.py`). A non-finite loss or gradient raises or skips the step (`guards.py`), never trains on.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mercury_jax.train import preemption
from mercury_jax.train.checkpoints import Checkpointer
from mercury_jax.train.guards import NonFiniteGuard
from mercury_jax.train.metrics import MetricsLogger
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.packing import pack_sequences
from mercury_jax.train.state import TrainState, make_update_step
from models.qwen35_moe.logprobs import sequence_logprobs


def sft_loss(model, batch):
    logp = sequence_logprobs(model, batch["tokens"], segment_ids_BxT=batch["segment_ids"])
    mask = batch["loss_mask"]
    count = jnp.maximum(jnp.sum(mask), 1.0)
    loss = -jnp.sum(logp * mask) / count
    return loss, {"action_tokens": jnp.sum(mask), "token_accuracy_proxy": jnp.sum(jnp.exp(logp) * mask) / count}


@functools.lru_cache(maxsize=4)
def epoch_order(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch `epoch`: a permutation seeded by (seed, epoch), so a restart reproduces it."""
    return np.random.default_rng([seed, epoch]).permutation(num_items)


def batch_order(num_rows: int, batch_rows: int, step: int, seed: int) -> np.ndarray:
    """Row indices of batch `step` (epochs follow `epoch_order`)."""
    per_epoch = max(num_rows // batch_rows, 1)
    epoch, index = divmod(step, per_epoch)
    perm = epoch_order(num_rows, seed, epoch)
    rows = perm[index * batch_rows:(index + 1) * batch_rows]
    return np.resize(rows, batch_rows)  # fewer rows than a batch: repeat


def run_sft(cfg: ml_collections.ConfigDict, model, sequences: list[tuple[list[int], list[int]]], workdir: str | Path,
            *, seed: int = 0, checkpoint_cfg: ml_collections.ConfigDict | None = None, pad_id: int = 0,
            train_cfg: ml_collections.ConfigDict | None = None):
    """Train `model` on (tokens, action_mask) sequences; returns the trained model and the metric history.
    `train_cfg` (the config's `train` section) sets the non-finite policy (`guards.py`; default: raise)."""
    workdir = Path(workdir)
    packed = pack_sequences(sequences, cfg.row_length, pad_id=pad_id)
    tx = make_optimizer(cfg.optimizer)
    state = TrainState.create(model, tx)
    step_fn = make_update_step(state.graphdef, tx, sft_loss)
    checkpointer = None
    start = 0
    if checkpoint_cfg is not None:
        checkpointer = Checkpointer(workdir / "checkpoints", save_every=checkpoint_cfg.every, keep=checkpoint_cfg.keep,
                                    async_save=checkpoint_cfg.async_save)
        latest = checkpointer.latest_step()
        if latest is not None:
            arrays, meta = checkpointer.restore(latest, state.arrays())
            state = state.replace_arrays(arrays)
            start = meta["step"]
    logger = MetricsLogger(workdir, total_steps=cfg.steps, name="sft")
    logger.truncate(start)
    guard = NonFiniteGuard.from_config(train_cfg, name="sft", history=logger.history)
    params, frozen, opt_state = state.params, state.frozen, state.opt_state
    try:
        for step in range(start + 1, cfg.steps + 1):
            rows = batch_order(len(packed["tokens"]), cfg.batch_rows, step - 1, seed)
            batch = {k: jnp.asarray(v[rows]) for k, v in packed.items()}
            t0 = time.perf_counter()
            params, opt_state, metrics = step_fn(params, frozen, opt_state, batch)
            metrics = jax.device_get(metrics)
            applied = guard.check(step, metrics)  # raises before this step can be logged or saved
            seconds = time.perf_counter() - t0
            if step % cfg.log_every == 0 or step == cfg.steps or step == start + 1 or not applied:
                logger.log(step, {**metrics, "tokens_per_s": float(np.sum(batch["segment_ids"] > 0)) / seconds,
                                  "step_time_s": seconds, "nonfinite_skipped": guard.skipped}, progress_keys=("loss",))
            if checkpointer is not None and checkpointer.should_save(step, last=step == cfg.steps):
                checkpointer.save(step, {"params": params, "frozen": frozen, "opt_state": opt_state}, {"step": step})
            preemption.exit_if_requested(step, "sft", checkpointer)
    except BaseException:  # a non-finite step, a preemption, a failure: the last good save still gets committed
        if checkpointer is not None:
            checkpointer.close_after_error()
        raise
    if checkpointer is not None:
        checkpointer.close()
    logger.plot(["loss", "token_accuracy_proxy"])
    logger.close()
    state.params, state.frozen, state.opt_state = params, frozen, opt_state
    return state.model(), logger.history
