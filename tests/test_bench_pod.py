"""The pod proof (`bench/pod.py`) on the tiny configs over the 8 CPU devices: the same code path as the released
runs on a v5p topology (role meshes from the config, the trainers' jitted programs from abstract shapes), here
compiled for CPU; plus its parts checked by hand."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.bench import pod
from mercury_jax.bench.report import replace_subsection
from mercury_jax.parallel import make_mesh
from models.qwen35_moe.config import PRESETS

TWO_LAYERS = ["--set", "model.overrides.num_hidden_layers=2"]  # one GDN + one attention layer: faster compiles
# the tiny configs with the released structure: separate device groups, sharded bf16 rollout replicas that the
# actor publishes to by the collective programs, every learner mesh of more than one device
SAO_SPREAD = ["--set", "devices.rollout=4", "--set", "devices.actor=2", "--set", "devices.critic=2",
              "--set", "rollout.replica={'fsdp': 2}", "--set", "rollout.param_dtype=bfloat16",
              "--set", "model.moe_impl=ep", *TWO_LAYERS]
SAO_PROGRAMS = ("rollout decode", "rollout prefill", "publish stage", "publish send", "values + GAE", "critic step",
                "actor step")


@pytest.mark.slow
def test_pod_compiles_every_program_of_the_tiny_sao_run(capsys):
    status = pod.run(["--config", "experiments/sao.py:tiny", "--topology", "cpu", "--no-write", *SAO_SPREAD])
    out = capsys.readouterr().out
    assert status == 0, out
    for name in SAO_PROGRAMS:
        assert f"| {name} |" in out, name
    assert "Every program fits" in out
    assert "Step estimate (sao, sync mode)" in out and "MFU" in out


@pytest.mark.slow
def test_pod_compiles_the_tiny_grpo_learner_programs(capsys):
    spread = ["--set", "devices.rollout=4", "--set", "devices.actor=4", "--set", "rollout.replica={'fsdp': 2}",
              "--set", "rollout.param_dtype=bfloat16", *TWO_LAYERS]
    # the rollout and publish programs are the SAO test's; here the GRPO learner's two
    status = pod.run(["--config", "experiments/grpo.py:tiny", "--topology", "cpu", "--no-write", *spread,
                      "--only", "reference log-probs,grpo step"])
    out = capsys.readouterr().out
    assert status == 0, out
    for name in ("reference log-probs", "grpo step"):
        assert f"| {name} |" in out, name
    assert "Every program fits" in out


def test_pod_fails_naming_the_program_over_the_threshold(capsys):
    status = pod.run(["--config", "experiments/sao.py:tiny", "--topology", "cpu", "--no-write", "--only",
                      "values + GAE", "--headroom", "1e-9"])
    out = capsys.readouterr().out
    assert status == 1
    assert "Does not fit" in out and "- values + GAE:" in out and "over 0% of" in out


def test_shared_device_counts_the_other_roles_arrays():
    """On the `:tiny` configs every role shares one device: a learner step's chip also holds the engine and the
    other learner."""
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    meshes = {"rollout": mesh, "actor": mesh, "critic": mesh}
    programs = [pod.Program("actor step", "actor", lambda: None, role="actor"),
                pod.Program("values + GAE", "critic", lambda: None, resident_bytes=5, resident_note="moments",
                            role="critic")]
    pod.add_shared_residency(programs, meshes, {"rollout": 100, "actor": 20, "critic": 3})
    assert programs[0].resident_bytes == 103
    assert programs[1].resident_bytes == 5 + 120 and programs[1].resident_note.startswith("moments + ")
    apart = {"rollout": make_mesh({"fsdp": 1}, devices=jax.devices()[:1]),
             "actor": make_mesh({"fsdp": 1}, devices=jax.devices()[1:2]),
             "critic": make_mesh({"fsdp": 1}, devices=jax.devices()[2:3])}
    alone = [pod.Program("actor step", "actor", lambda: None, role="actor")]
    pod.add_shared_residency(alone, apart, {"rollout": 100, "actor": 20, "critic": 3})
    assert alone[0].resident_bytes == 0
    counted = [pod.Program("grpo step", "actor", lambda: None, resident_bytes=7, role="actor",
                           counted=("reference",))]
    pod.add_shared_residency(counted, {"actor": mesh, "reference": mesh}, {"actor": 20, "reference": 7})
    assert counted[0].resident_bytes == 7


def test_per_chip_bytes_counts_one_shard():
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    split = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    whole = jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    assert pod.per_chip_bytes([split, whole]) == 2 * 6 * 4 + 3 * 2


def test_active_parameters_of_the_released_model():
    """35B-A3B: ~35B parameters, ~3B used per token (the name's claim; routed experts count 8 of 256)."""
    active, total = pod.active_parameters(PRESETS["qwen3.5-35b-a3b"]())
    assert 34e9 < total < 36.5e9
    assert 2.5e9 < active < 3.6e9


def test_verdicts_name_the_shortfall():
    program = pod.Program("actor step", "actor", lambda: None, resident_bytes=2 * 2 ** 30)
    over = pod.Result(program, total=80 * 2 ** 30)
    fine = pod.Result(pod.Program("critic step", "critic", lambda: None), total=70 * 2 ** 30)
    refused = pod.Result(pod.Program("values + GAE", "critic", lambda: None), error="XlaRuntimeError: RESOURCE")
    problems = pod.verdicts([over, fine, refused], 95 * 2 ** 30, 0.8)
    assert len(problems) == 2
    assert problems[0].startswith("actor step: 82.00 GiB a chip") and "by 6.00 GiB" in problems[0]
    assert problems[1].startswith("values + GAE: the compile failed")
    assert np.isclose(fine.peak, 70 * 2 ** 30)


def test_subsections_replace_only_their_own_run(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n<!-- begin:other -->\nkept\n<!-- end:other -->\n")
    replace_subsection("pod", "run A", "first A", "cmd a", path=path)
    replace_subsection("pod", "run B", "first B", "cmd b", path=path)
    replace_subsection("pod", "run A", "second A", "cmd a", path=path)
    text = path.read_text()
    assert "kept" in text and "second A" in text and "first B" in text and "first A" not in text
    assert text.index("### run A") < text.index("### run B")
    assert text.count("<!-- begin:pod -->") == 1 and text.count("<!-- end:pod -->") == 1
