"""Pack variable-length token sequences into fixed [rows, length] arrays with segment ids.

Each sequence gets its own segment id (1, 2, ... within a row; 0 marks padding), so attention and the GDN state
never cross documents (the model resets both at a segment change). A sequence longer than the row is an error
naming its index and length.

- `pack_sequences` (SFT): first-fit in the given order, as many rows as it takes.
- `place_rows` + `pack_batch` (the RL learners, `sao.pack_rows` / `grpo.pack_rows`): a right-padded [B, T] batch
  repacked into the same [B, T] shape, first-fit decreasing by token count, the filled rows laid out so that the
  tokens fill the first micro-batches (`microbatch.split_rows` order) and the trailing micro-batches stay empty
  (the learner step skips them). A 24,576-token trajectory keeps a row to itself while sixteen short ones share
  one. The maps `unpack_index` / `pack_index` carry per-token arrays between the two layouts (GAE runs on the
  trajectories as they are).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _first_fit(lengths: Sequence[int], order, row_length: int) -> tuple[list[list[int]], list[int]]:
    """(members, fill) of rows filled first-fit: each sequence, visited in `order`, joins the first row with room
    (a new row if none has); members[r] lists row r's sequences in the order they joined."""
    members: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        if lengths[i] > row_length:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the row length {row_length}; raise "
                             f"the row length")
        room = next((r for r, used in enumerate(fill) if used + lengths[i] <= row_length), None)
        if room is None:
            members.append([])
            fill.append(0)
            room = len(fill) - 1
        members[room].append(i)
        fill[room] += lengths[i]
    return members, fill


def pack_sequences(sequences: list[tuple[list[int], list[int]]], row_length: int, *, pad_id: int = 0
                   ) -> dict[str, np.ndarray]:
    """(tokens, loss_mask) pairs -> {"tokens", "loss_mask", "segment_ids"} int32/float32/int32 [rows, row_length]."""
    for i, (tokens, mask) in enumerate(sequences):
        if len(tokens) != len(mask):
            raise ValueError(f"sequence {i}: {len(tokens)} tokens but {len(mask)} mask entries")
    rows, _ = _first_fit([len(tokens) for tokens, _ in sequences], range(len(sequences)), row_length)
    out = {"tokens": np.full((len(rows), row_length), pad_id, np.int32),
           "loss_mask": np.zeros((len(rows), row_length), np.float32),
           "segment_ids": np.zeros((len(rows), row_length), np.int32)}
    for r, members in enumerate(rows):
        offset = 0
        for segment, i in enumerate(members, start=1):
            tokens, mask = sequences[i]
            n = len(tokens)
            out["tokens"][r, offset:offset + n] = tokens
            out["loss_mask"][r, offset:offset + n] = mask
            out["segment_ids"][r, offset:offset + n] = segment
            offset += n
    return out


def place_rows(lengths: Sequence[int], row_length: int, rows: int, micro_batches: int = 1
               ) -> tuple[np.ndarray, np.ndarray]:
    """(row [N], offset [N]) of N sequences of `lengths` tokens packed into `rows` rows of `row_length`.

    First-fit decreasing: the longest sequence first (ties by index), each into the first row with room. The
    filled rows, fullest first, then take the rows of micro-batch 0, 1, ... in `microbatch.split_rows` order
    (micro-batch m holds rows m, m + M, m + 2M, ...), so every data shard gets rows of about the same fill and
    empty rows gather in the last micro-batches."""
    if rows % micro_batches:
        raise ValueError(f"{rows} rows do not split into {micro_batches} micro-batches")
    members, fill = _first_fit(lengths, sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), row_length)
    if len(fill) > rows:
        raise ValueError(f"{len(lengths)} sequences need {len(fill)} rows of {row_length} tokens; only {rows} "
                         f"are given")
    per_micro = rows // micro_batches
    row_of, offset_of = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    for rank, packed in enumerate(sorted(range(len(fill)), key=lambda r: (-fill[r], r))):
        row = (rank % per_micro) * micro_batches + rank // per_micro
        offset = 0
        for i in members[packed]:
            row_of[i], offset_of[i] = row, offset
            offset += lengths[i]
    return row_of, offset_of


def pack_batch(batch: dict[str, np.ndarray], lengths: Sequence[int], micro_batches: int = 1, *, pad_id: int = 0
               ) -> dict[str, np.ndarray]:
    """The [B, T] arrays of `batch` (right-padded, row b holding `lengths[b]` tokens) repacked into [B, T] by
    `place_rows` (other entries dropped), plus
      segment_ids  [B, T] int32: 1, 2, ... per sequence within a packed row, 0 on padding;
      unpack_index [B, T] int32: for token t of sequence b, its flat index in the packed arrays (B * T past the
                   sequence's end), so `take(packed.ravel(), unpack_index, fill 0)` restores the padded layout;
      pack_index   [B, T] int32: for each packed slot, the flat index b * T + t of its token (B * T on padding).
    `tokens` is padded with `pad_id`, everything else with 0."""
    B, T = np.shape(batch["tokens"])
    row_of, offset_of = place_rows(lengths, T, B, micro_batches)
    packed = {k: np.full_like(v, pad_id if k == "tokens" else 0) for k, v in batch.items() if np.ndim(v) == 2}
    segment_ids = np.zeros((B, T), np.int32)
    unpack_index = np.full((B, T), B * T, np.int32)
    pack_index = np.full((B, T), B * T, np.int32)
    for b in np.argsort(offset_of, kind="stable"):  # within a row, segments numbered left to right
        n, row, start = int(lengths[b]), int(row_of[b]), int(offset_of[b])
        for key, values in packed.items():
            values[row, start:start + n] = batch[key][b, :n]
        segment_ids[row, start:start + n] = segment_ids[row, :start].max(initial=0) + 1
        unpack_index[b, :n] = row * T + start + np.arange(n)
        pack_index[row, start:start + n] = b * T + np.arange(n)
    return {**packed, "segment_ids": segment_ids, "unpack_index": unpack_index, "pack_index": pack_index}


def rows_used(batch: dict[str, np.ndarray]) -> int:
    """Rows of a learner batch that hold any token: the packed rows, or every row of a padded batch."""
    if "segment_ids" not in batch:
        return len(batch["tokens"])
    return int(np.any(batch["segment_ids"] > 0, axis=1).sum())
