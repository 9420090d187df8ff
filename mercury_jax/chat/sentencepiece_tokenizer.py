"""A small SentencePiece BPE tokenizer trained from text, for tiny models on the synthetic worlds.

Same interface and the same 33 special-token strings as Qwen3.5, each a single id: <unk> is 0 and the specials
are user-defined symbols at 1..33 in Qwen3.5 order, so `<|endoftext|>`, `<think>`, `<tool_call>` ... are matched
inside text on encode and decode back to their text. Byte fallback makes every string encodable; identity
normalisation, no dummy prefix and kept whitespace make `decode(encode(s)) == s` and let observation ids be
appended to a trajectory without re-tokenising it.

Training is deterministic (sorted, de-duplicated input; one thread; fixed seed; no sampling) and cached on disk
under a hash of the corpus and every training option, so a second call loads the model file.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from mercury_jax.chat.special_tokens import SPECIAL_TOKENS
from mercury_jax.chat.tokenizer import Tokenizer

_TRAINER_OPTIONS = dict(
    model_type="bpe",
    character_coverage=1.0,
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    max_sentencepiece_length=16,
    unk_id=0,
    bos_id=-1,
    eos_id=-1,
    pad_id=-1,
    shuffle_input_sentence=False,
    input_sentence_size=0,
    num_threads=1,
    hard_vocab_limit=False,
    minloglevel=2,
)
_SEED = 0
_FORMAT_VERSION = 1  # bump when the options above change meaning


class SentencePieceTokenizer(Tokenizer):
    """A trained SentencePiece model behind the shared interface."""
    def __init__(self, model_file: str | Path):
        self.model_file = Path(model_file)
        self._processor = spm.SentencePieceProcessor(model_file=str(self.model_file))
        self.special_ids = {tok: self._processor.piece_to_id(tok) for tok in SPECIAL_TOKENS}
        expected = {tok: i + 1 for i, tok in enumerate(SPECIAL_TOKENS)}
        if self.special_ids != expected:
            raise ValueError(f"{self.model_file} does not hold the 33 Qwen3.5 special tokens at ids 1..33; "
                             "train it with train_sentencepiece_tokenizer")
        self.vocab_size = self._processor.get_piece_size()

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if allow_special:
            return list(self._processor.encode(text))
        # Break every special-token string so SentencePiece cannot match it, then encode the pieces' bytes.
        ids: list[int] = []
        for piece in _split_specials(text):
            ids += self._processor.encode(piece) if piece not in self.special_ids else self._bytes_ids(piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._processor.decode(list(ids))

    def _bytes_ids(self, text: str) -> list[int]:
        return [self._processor.piece_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]


def train_sentencepiece_tokenizer(texts: Iterable[str], *, vocab_size: int = 1024, cache_dir: str | Path,
                                  atomic_pattern: str = "") -> SentencePieceTokenizer:
    """Train (or load from `cache_dir`) a SentencePiece BPE on `texts` with the Qwen3.5 special tokens.

    `atomic_pattern` (a regex): every distinct string of the corpus it matches becomes one piece (ids from 34 on,
    sorted), matched anywhere in text like the specials (registered with spaces as U+2581, the form SentencePiece
    matches and decodes back to spaces). Tiny worlds use it for record ids (`T-3`: copying an id out of an
    observation is copying one token, not an induction over `T`, `-`, `3`) and for the chat template's tool block
    (one token instead of ~400, so a 10M-parameter model's attention is not spread over boilerplate).

    The cache key hashes the sorted, de-duplicated corpus, `vocab_size` and the trainer options; the model is
    written atomically, so concurrent callers at worst train twice.
    """

    corpus = sorted(set(t for t in texts if t))
    if not corpus:
        raise ValueError("train_sentencepiece_tokenizer needs a non-empty corpus")
    atomic = sorted({m for t in corpus for m in re.findall(atomic_pattern, t)}) if atomic_pattern else []
    if any(not m or m in SPECIAL_TOKENS for m in atomic):
        raise ValueError(f"atomic_pattern {atomic_pattern!r} matches an empty string or a special token")
    minimum = 1 + len(SPECIAL_TOKENS) + 256 + len(atomic) + 2
    if vocab_size < minimum:
        atomic_part = f", the {len(atomic)} strings atomic_pattern {atomic_pattern!r} matches" if atomic else ""
        raise ValueError(f"vocab_size {vocab_size} is too small: the 33 specials, <unk>, 256 byte pieces{atomic_part} "
                         f"take {minimum - 2}; use at least {minimum}")
    symbols = list(SPECIAL_TOKENS) + [a.replace(" ", "\u2581") for a in atomic]
    options = dict(_TRAINER_OPTIONS, vocab_size=vocab_size, user_defined_symbols=symbols)
    digest = hashlib.sha256(json.dumps([_FORMAT_VERSION, _SEED, spm.__version__, options, corpus],
                                       ensure_ascii=False).encode()).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    model_file = cache_dir / f"spm-{vocab_size}-{digest}.model"
    if not model_file.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        model = io.BytesIO()
        spm.set_random_generator_seed(_SEED)
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, **options)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as file:
            file.write(model.getvalue())
        os.replace(tmp, model_file)
    return SentencePieceTokenizer(model_file)


def _split_specials(text: str) -> list[str]:
    """`text` cut into special-token strings and the text between them."""
    pieces, start, i = [], 0, 0
    while i < len(text):
        if text[i] == "<":
            match = next((tok for tok in SPECIAL_TOKENS if text.startswith(tok, i)), None)
            if match:
                if start < i:
                    pieces.append(text[start:i])
                pieces.append(match)
                i += len(match)
                start = i
                continue
        i += 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces
