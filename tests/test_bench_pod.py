"""The pod proof (`bench/pod.py`) on the tiny configs over the 8 CPU devices: the same code path as the released
runs on a v5p topology (role meshes from the config, the trainers' jitted programs from abstract shapes), here
compiled for CPU; plus its parts checked by hand (a program's seconds with its collectives, their table)."""
from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.bench import links, pod, pod_programs
from mercury_jax.bench.report import replace_subsection
from mercury_jax.bench.run_config import load_config, model_config
from mercury_jax.config.registry import PIPELINES
from mercury_jax.parallel import make_mesh

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
    # the collectives' table (here "not counted": the test's jax started before an HLO dump could be set up; the
    # command line counts them) and the step given with and without them
    assert "Collectives per program, priced on TPU v5p ICI" in out
    for variant in ("rooflines only (collectives free)", "+ collectives, none hidden", "+ collectives, async ones"):
        assert f"| {variant}" in out, variant


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
    programs = [pod_programs.Program("actor step", "actor", lambda: None, role="actor"),
                pod_programs.Program("values + GAE", "critic", lambda: None, resident_bytes=5, resident_note="moments",
                            role="critic")]
    pod_programs.add_shared_residency(programs, meshes, {"rollout": 100, "actor": 20, "critic": 3})
    assert programs[0].resident_bytes == 103
    assert programs[1].resident_bytes == 5 + 120 and programs[1].resident_note.startswith("moments + ")
    apart = {"rollout": make_mesh({"fsdp": 1}, devices=jax.devices()[:1]),
             "actor": make_mesh({"fsdp": 1}, devices=jax.devices()[1:2]),
             "critic": make_mesh({"fsdp": 1}, devices=jax.devices()[2:3])}
    alone = [pod_programs.Program("actor step", "actor", lambda: None, role="actor")]
    pod_programs.add_shared_residency(alone, apart, {"rollout": 100, "actor": 20, "critic": 3})
    assert alone[0].resident_bytes == 0
    counted = [pod_programs.Program("grpo step", "actor", lambda: None, resident_bytes=7, role="actor",
                           counted=("reference",))]
    pod_programs.add_shared_residency(counted, {"actor": mesh, "reference": mesh}, {"actor": 20, "reference": 7})
    assert counted[0].resident_bytes == 7


# the programs of a step of each registered pipeline's :tiny config (every role on one device: no publish programs)
STEP_PROGRAMS = {
    "sao": ["rollout decode", "rollout prefill", "values + GAE", "critic step", "actor step"],
    "grpo": ["rollout decode", "rollout prefill", "reference log-probs", "grpo step"],
    "group_baseline": ["rollout decode", "rollout prefill", "actor step"],
    "sft": ["sft step"],
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_the_pipeline_and_its_roles_come_from_config_pipeline(name):
    """Nothing compiled: the programs a step of each pipeline runs, on the meshes of its registered roles (the
    group baseline's config has an `sft` section and is not an SFT run)."""
    config = load_config(f"experiments/{name}.py:tiny")
    meshes = pod_programs.pipeline_meshes(config, jax.devices())
    assert tuple(meshes) == PIPELINES[name].roles
    programs, facts = pod_programs.step_programs(config, model_config(config, "tiny"), meshes)
    assert [p.name for p in programs] == STEP_PROGRAMS[name]
    assert (facts is None) == (name == "sft")


def test_verdicts_name_the_shortfall():
    program = pod_programs.Program("actor step", "actor", lambda: None, resident_bytes=2 * 2 ** 30)
    over = pod.Result(program, total=80 * 2 ** 30)
    fine = pod.Result(pod_programs.Program("critic step", "critic", lambda: None), total=70 * 2 ** 30)
    refused = pod.Result(pod_programs.Program("values + GAE", "critic", lambda: None),
                         error="XlaRuntimeError: RESOURCE")
    problems = pod.verdicts([over, fine, refused], 95 * 2 ** 30, 0.8)
    assert len(problems) == 2
    assert problems[0].startswith("actor step: 82.00 GiB a chip") and "by 6.00 GiB" in problems[0]
    assert problems[1].startswith("values + GAE: the compile failed")
    assert np.isclose(fine.peak, 70 * 2 ** 30)


def test_a_program_with_its_collectives_by_hand():
    """Roofline 10 ms (XLA's FLOPs at v5p's peak); 6 ms of async collectives: none hidden 16 ms, hidden 10 ms."""
    program = pod_programs.Program("actor step", "actor", lambda: None, per_step=2)
    priced = links.CollectiveTime({"all-reduce": 0.004, "all-gather": 0.002}, 0.006, 0.0)
    result = pod.Result(program, flops=459e12 * 0.010, bytes_accessed=0.0, collectives={"all-reduce": 2 ** 30},
                        collective_time=priced)
    assert result.seconds() == result.roofline_s == pytest.approx(0.010)
    assert result.seconds("none") == pytest.approx(0.016) and result.seconds("async") == pytest.approx(0.010)
    refused = pod.Result(pod_programs.Program("critic step", "critic", lambda: None), error="XlaRuntimeError")
    text = pod.collectives_table([result, refused], links.slice_fabric("v5p"))
    assert "placement unknown" in text
    assert ("| actor step | 2 | all-reduce 1.00 | all-reduce 4.00 + all-gather 2.00 | 100% | 10.00 | 16.00 | 10.00 |"
            in text)
    assert "| critic step | 1 | refused |" in text


def test_program_coords_follow_the_device_assignment():
    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    compiled = jax.jit(lambda x: x * 2).lower(
        jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))).compile()
    assert links.program_coords(compiled, 4) == [None] * 4  # CPU devices have no coordinates
    chips = np.array([types.SimpleNamespace(coords=(i % 2, i // 2, 0)) for i in (2, 0, 3, 1)])
    fake = types.SimpleNamespace(input_shardings=((types.SimpleNamespace(mesh=types.SimpleNamespace(devices=chips)),),
                                                  {}))
    assert links.program_coords(fake, 4) == [(0, 1, 0), (0, 0, 0), (1, 1, 0), (1, 0, 0)]
    assert links.program_coords(types.SimpleNamespace(input_shardings=((), {})), 3) == [None] * 3


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
