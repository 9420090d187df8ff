"""Decoding sampled ids that may fall outside the tokenizer's vocabulary."""
from __future__ import annotations

from mercury_jax.chat.tokenizer import Tokenizer


def decode_known(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """Text of sampled `ids`, and the ids the tokenizer cannot decode (the model's embedding is padded past the
    vocabulary: 248320 rows for 248077 Qwen3.5 tokens), which are dropped from the text rather than crash."""
    try:
        return tokenizer.decode(ids), []
    except Exception:  # noqa: BLE001 (find the offending ids one by one)
        known, unknown = [], []
        for token in ids:
            try:
                tokenizer.decode([token])
                known.append(token)
            except Exception:  # noqa: BLE001
                unknown.append(token)
        return tokenizer.decode(known), unknown
