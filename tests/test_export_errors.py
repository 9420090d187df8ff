"""`python -m mercury_jax.export` under bad input (issue #55, round 3 probes): each ends in one `error:` line and exit
status 2 (`cli_errors.py`), with nothing lost.

- a full disk (RLIMIT_FSIZE: a write fails with EFBIG): the OS error and its fix, the previous export intact;
- a run whose SentencePiece model is garbage: the file named, not sentencepiece's "could not parse ModelProto";
- a run whose config.json has hidden_size=-96 (the HF config.json of `model.hf_path`, or `model.overrides` of a
  preset run): the file and the field named, before any model is built;
- `--out` naming an existing file: refused before anything is read, the file untouched.
"""
from __future__ import annotations

import json
import resource

import numpy as np
import pytest
from flax import nnx

from experiments import common
from experiments.sft import get_config
from mercury_jax import export
from mercury_jax.chat import train_sentencepiece_tokenizer
from mercury_jax.data.synthetic import write_corpus
from mercury_jax.runs.checkpoints import Checkpointer
from mercury_jax.runs.run_reader import save_run_config
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

CFG = C.tiny(vocab_size=96, num_hidden_layers=3, full_attention_interval=2)


def hf_run(root, cfg=CFG, *, hidden_size=None):
    """A pivot-GRPO run started from `root/hf` (its config.json, optionally with another hidden_size), with one
    checkpoint (step 1) of random weights."""
    (root / "hf").mkdir(parents=True)
    hf_config = cfg.to_hf(composite=True, dtype="float32")
    if hidden_size is not None:
        hf_config["text_config"]["hidden_size"] = hidden_size
    (root / "hf" / "config.json").write_text(json.dumps(hf_config))
    config = common.base_config("grpo")
    config.model.hf_path = str(root / "hf")
    config.model.moe_impl, config.model.attention_impl, config.model.gdn_impl = "ragged", "dense", "chunked"
    save_run_config(config, root / "run")
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    for _, variable in nnx.to_flat_state(nnx.state(model)):
        variable.set_value(rng.standard_normal(variable.shape).astype(np.float32))
    checkpointer = Checkpointer(root / "run" / "grpo" / "checkpoints", save_every=1, keep=2, async_save=False)
    checkpointer.save(1, {"actor": {"params": nnx.state(model, nnx.Param), "frozen": {}}}, {"step": 1})
    checkpointer.close()
    return root / "run"


def sentencepiece_run(root, *, tokenizer_bytes: bytes | None = None, hidden_size: int | None = None):
    """A tiny SFT run (a SentencePiece tokenizer, a preset model) with a committed-looking step 1: its tokenizer
    file is `tokenizer_bytes`, or a real model trained on a few chats; `hidden_size` overrides the preset's."""
    config = get_config("tiny")
    config.tokenizer.vocab_size = 512
    if hidden_size is not None:
        config.model.overrides.hidden_size = hidden_size
    save_run_config(config, root)
    (root / "sft" / "checkpoints" / "1" / "arrays").mkdir(parents=True)
    tokenizer_dir = root / "tokenizer"
    if tokenizer_bytes is None:
        write_corpus(root.parent / "chats.jsonl", 20, words=30)
        train_sentencepiece_tokenizer((root.parent / "chats.jsonl").read_text().splitlines(), vocab_size=512,
                                      cache_dir=tokenizer_dir)
    else:
        tokenizer_dir.mkdir()
        (tokenizer_dir / "spm-512-damaged.model").write_bytes(tokenizer_bytes)
    return root


def export_refusal(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exited:
        export.main(list(map(str, argv)))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return hf_run(tmp_path_factory.mktemp("export-errors"))


def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_old_export(run, tmp_path, capsys):
    out = tmp_path / "export"
    export.main(["--workdir", str(run), "--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        line = export_refusal(capsys, "--workdir", run, "--out", out, "--dtype", "float32")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert line == (f"error: writing the export to {out} failed: File too large; raise the file-size limit "
                    f"(`ulimit -f`) or use a filesystem that allows larger files; the export that was in {out} is "
                    f"unchanged")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging directory left behind


def test_a_garbage_tokenizer_file_is_one_line_naming_it(tmp_path, capsys):
    workdir = sentencepiece_run(tmp_path / "run", tokenizer_bytes=b"\x00not a sentencepiece model" * 40)
    model_file = workdir / "tokenizer" / "spm-512-damaged.model"
    assert export_refusal(capsys, "--workdir", workdir, "--out", tmp_path / "out") == (
        f"error: the run's SentencePiece model {model_file} cannot be read (INTERNAL: could not parse ModelProto): it "
        f"is damaged or not a SentencePiece model; restore it from a copy of the run directory (the checkpoints' "
        f"token ids mean something only with this model)")
    assert not (tmp_path / "out").exists()


def test_a_hf_config_json_with_a_negative_hidden_size_is_one_line(tmp_path, capsys):
    workdir = hf_run(tmp_path, hidden_size=-96)
    assert export_refusal(capsys, "--workdir", workdir, "--out", tmp_path / "out") == (
        f"error: {tmp_path / 'hf' / 'config.json'} (the run's model.hf_path) describes no model: hidden_size is -96; "
        f"expected a whole number >= 1; restore the config.json of the checkpoint the run started from")


def test_a_run_config_json_with_a_negative_hidden_size_is_one_line(tmp_path, capsys):
    workdir = sentencepiece_run(tmp_path / "run", hidden_size=-96)
    line = export_refusal(capsys, "--workdir", workdir, "--out", tmp_path / "out")
    assert line.startswith(f"error: {workdir / 'config.json'} describes no model (invalid Qwen35MoeConfig: "
                           f"hidden_size is -96; expected a whole number >= 1") and line.endswith(
        "restore the config.json the run wrote at its start (model.preset, model.overrides)"), line


def test_out_naming_an_existing_file_is_one_line_and_the_file_untouched(run, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert export_refusal(capsys, "--workdir", run, "--out", notes) == (
        f"error: --out {notes} is a file, not a directory; pass a directory path (a new one, or an earlier export to "
        f"replace), or move the file")
    assert notes.read_text() == "keep me"
