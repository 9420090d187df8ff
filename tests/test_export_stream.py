"""The streaming HF export of a run (`mercury_jax.export`): the same files, byte for byte, as the export before it
streamed (`bench.export_rss.export_in_memory`: the policy restored whole as host arrays, shards built in memory and
written by `save_file`), in bf16 and fp32, fused and unfused, in one file and in several shards; from a run given
as a `file://` URL; from a role item (`arrays_actor`, also as 5 processes write it); reading a scanned stack one
layer's row at a time; and a checkpoint that does not fit the run's model refused before anything is written.

The run: a tiny Qwen3.5-MoE (2 scanned (GDN, attention) blocks + a GDN tail layer) started from `model.hf_path`
(config.json and a tokenizer file there, no tokenizer to train), its policy saved as the trainers save it
(`Checkpointer`, {"actor": {"params", "frozen"}}; the mixers frozen, so both subtrees hold arrays), random values
everywhere so that every byte of the export says something.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx
from local_processes import run_reporting_script

from experiments import common
from mercury_jax.bench.export_rss import directories_identical, export_in_memory
from mercury_jax.export import ExportError, export_run, main
from mercury_jax.runs.checkpoint_tensors import CheckpointTensors, stored_arrays
from mercury_jax.runs.checkpoints import Checkpointer
from mercury_jax.runs.run_reader import PolicyItem, RunReader, RunReadError, read_checkpoint_arrays, save_run_config
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import write_hf

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

CFG = C.tiny(vocab_size=96, num_hidden_layers=5, full_attention_interval=2)
SHARD = 40_000  # bytes: several shards and an index


def run_config(hf_path):
    config = common.base_config("grpo")
    config.model.hf_path = str(hf_path)
    config.model.moe_impl, config.model.attention_impl, config.model.gdn_impl = "ragged", "dense", "chunked"
    return config


def random_policy(cfg, seed: int):
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))  # shapes only: filled below
    rng = np.random.default_rng(seed)
    for _, variable in nnx.to_flat_state(nnx.state(model)):
        variable.set_value(rng.standard_normal(variable.shape).astype(np.float32))
    frozen_filter = nnx.All(nnx.Param, nnx.PathContains("mixer"))
    _, frozen, params = nnx.split(model, frozen_filter, ...)
    return {"params": params, "frozen": frozen}


def make_run(root, cfg=CFG):
    hf = root / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(cfg.to_hf(composite=True, dtype="float32")))
    (hf / "tokenizer.json").write_text('{"made": "for the test"}')
    workdir = root / "run"
    save_run_config(run_config(hf), workdir)
    return workdir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run with pivot-GRPO checkpoints 1 and 2 (different random policies)."""
    workdir = make_run(tmp_path_factory.mktemp("export"))
    checkpointer = Checkpointer(workdir / "grpo" / "checkpoints", save_every=1, keep=10, async_save=False)
    for step in (1, 2):
        checkpointer.save(step, {"actor": random_policy(CFG, seed=step)}, {"step": step})
    checkpointer.close()
    return workdir


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("experts", ["fused", "unfused"])
def test_streaming_export_equals_the_in_memory_export_byte_for_byte(run, tmp_path, dtype, experts):
    ours = export_run(run, tmp_path / "ours", dtype=dtype, experts=experts, max_shard_size=SHARD)
    theirs = export_in_memory(run, tmp_path / "theirs", dtype=dtype, experts=experts, max_shard_bytes=SHARD)
    names = sorted(p.name for p in ours.iterdir())
    assert "model.safetensors.index.json" in names and "model-00003-of-" in " ".join(names)
    assert {"config.json", "chat_template.jinja", "mercury_export.json", "tokenizer.json"} <= set(names)
    assert directories_identical(ours, theirs)
    assert json.loads((ours / "mercury_export.json").read_text()) == {
        "workdir": str(run), "stage": "grpo", "step": 2, "dtype": dtype, "experts": experts}


def test_one_file_export_of_the_latest_and_of_an_older_step(run, tmp_path):
    latest = export_run(run, tmp_path / "latest")
    reference = export_in_memory(run, tmp_path / "reference")
    assert "model.safetensors" in {p.name for p in latest.iterdir()}
    assert directories_identical(latest, reference)
    older = export_run(run, tmp_path / "older", step=1)
    assert (older / "config.json").read_bytes() == (latest / "config.json").read_bytes()
    assert (older / "model.safetensors").read_bytes() != (latest / "model.safetensors").read_bytes()


def test_a_run_given_as_a_file_url_exports_the_same(run, tmp_path):
    by_path = export_run(run, tmp_path / "path", max_shard_size=SHARD)
    by_url = export_run(f"file://{run}", tmp_path / "url", max_shard_size=SHARD)
    assert directories_identical(by_path, by_url)


def test_a_role_item_checkpoint_exports_like_the_arrays_item(run, tmp_path):
    """The released layout's learner on some hosts saves the actor as its own item `arrays_actor` ({"params",
    "frozen"} at its root); here written by Orbax directly from the same arrays as step 2."""
    role_run = make_run(tmp_path / "roles")
    step_dir = role_run / "grpo" / "checkpoints" / "2"
    step_dir.mkdir(parents=True)
    ocp.PyTreeCheckpointer().save(step_dir / "arrays_actor", random_policy(CFG, seed=2))
    assert RunReader(role_run).policy_items("grpo", 2)[0].directory.name == "arrays_actor"
    ours = export_run(role_run, tmp_path / "roles-out", max_shard_size=SHARD)
    plain = export_run(run, tmp_path / "plain-out", max_shard_size=SHARD)
    weights = [p.name for p in plain.iterdir() if p.name != "mercury_export.json"]
    assert len(weights) > 5
    assert all((ours / name).read_bytes() == (plain / name).read_bytes() for name in weights)


@pytest.mark.slow
def test_role_items_written_by_several_processes_read_whole_and_by_row(tmp_path):
    """Role items as a pod saves them (tests/multihost_checkpoint_worker.py on 5 processes: each role's shards in
    the `ocdbt.process_N` stores of its hosts) read like Orbax's own restore reads them."""
    checkpoints = tmp_path / "checkpoints"
    run_reporting_script(Path(__file__).with_name("multihost_checkpoint_worker.py"), devices=2, processes=5,
                         args=(str(checkpoints),))
    for item in ("arrays_actor", "arrays_critic"):
        directory = epath.Path(checkpoints / "2" / item)
        assert len(list(directory.glob("ocdbt.process_*"))) == 2
        arrays = stored_arrays(PolicyItem(directory, ()))
        tensors = CheckpointTensors(arrays, unreadable=lambda error: error)
        expected = read_checkpoint_arrays(directory)
        assert set(arrays) == set(expected) and ("w",) in arrays
        for name, array in expected.items():
            np.testing.assert_array_equal(tensors(name, None, None), array)
            if array.ndim:
                np.testing.assert_array_equal(tensors(name, 1, None), array[1])


def test_scanned_stacks_are_read_one_row_at_a_time(run, tmp_path):
    reader = RunReader(run)
    model = reader.abstract_policy()
    tensors = CheckpointTensors.open(reader, "grpo", 2, model)
    reads = []

    def recording(name, index, dtype):
        reads.append((name, index))
        return tensors(name, index, dtype)

    write_hf(model.config, recording, tmp_path / "out", max_shard_size=SHARD)
    stacked = [(name, index) for name, index in reads if name[:2] == ("model", "blocks")]
    assert stacked and all(index in (0, 1) for _, index in stacked)
    assert all(index is None for name, index in reads if name[:2] != ("model", "blocks"))
    assert len(reads) == len(set(reads)) == len(tensors.arrays) + len(stacked) // 2  # each array or row once
    restored, _, _ = reader.restore_policy("grpo", 2)
    embed = tensors(("model", "embed"), None, None)
    np.testing.assert_array_equal(embed, np.asarray(restored.model.embed[...]))
    q_proj = restored.model.blocks.layers[0].mixer.q_proj[...]
    np.testing.assert_array_equal(tensors(("model", "blocks", "layers", "0", "mixer", "q_proj"), 1, None),
                                  np.asarray(q_proj)[1])


def test_a_checkpoint_that_does_not_fit_the_runs_model_is_refused_before_writing(run, tmp_path):
    other = make_run(tmp_path / "other", cfg=CFG.replace(num_experts=4, num_experts_per_tok=2))
    shutil.copytree(run / "grpo", other / "grpo")
    out = tmp_path / "out"
    with pytest.raises(RunReadError, match=r"arrays: model\.blocks\.layers\.0\.moe\.expert_down has shape "
                                           r"\(2, 8, 32, 64\), the model from the run's config.json expects "
                                           r"\(2, 4, 32, 64\)"):
        export_run(other, out)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_cli_errors_are_one_line_exit_2(run, tmp_path, capsys):
    for argv, message in (
            (["--workdir", str(tmp_path / "bare")], "config.json does not exist"),
            (["--workdir", str(run), "--step", "7"], r"grpo checkpoint step 7 does not exist in \S+; available "
                                                     r"steps: \[1, 2\]"),
            (["--workdir", str(run), "--stage", "sft"], r"no sft checkpoint in \S+; grpo has steps \[1, 2\]")):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert re.search(message, err), err
    with pytest.raises(ExportError, match="--dtype 'int8'"):
        export_run(run, tmp_path / "out", dtype="int8")
    assert issubclass(ExportError, RunReadError)
