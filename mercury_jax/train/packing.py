"""Pack variable-length token sequences into fixed [rows, length] arrays with segment ids.

Sequences are placed first-fit in their given order (deterministic); each gets its own segment id (1, 2, ...
within a row; 0 marks padding), so attention and the GDN state never cross documents (the model resets both at a
segment change). A sequence longer than the row is an error naming its index and length.
"""
from __future__ import annotations

import numpy as np


def pack_sequences(sequences: list[tuple[list[int], list[int]]], row_length: int, *, pad_id: int = 0
                   ) -> dict[str, np.ndarray]:
    """(tokens, loss_mask) pairs -> {"tokens", "loss_mask", "segment_ids"} int32/float32/int32 [rows, row_length]."""
    rows: list[list[int]] = []  # indices of sequences per row
    fill: list[int] = []
    for i, (tokens, mask) in enumerate(sequences):
        if len(tokens) != len(mask):
            raise ValueError(f"sequence {i}: {len(tokens)} tokens but {len(mask)} mask entries")
        if len(tokens) > row_length:
            raise ValueError(f"sequence {i} has {len(tokens)} tokens, more than the row length {row_length}; "
                             f"raise the row length")
        for r in range(len(rows)):
            if fill[r] + len(tokens) <= row_length:
                rows[r].append(i)
                fill[r] += len(tokens)
                break
        else:
            rows.append([i])
            fill.append(len(tokens))
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
