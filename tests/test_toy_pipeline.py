"""The wiring is written once: a fourth pipeline of ~50 lines (tests/toy_pipeline.py: its algorithm, its registry
entry, its config) runs two steps through `python -m mercury_jax.main` on the tiny world, checkpointed and logged
like the others."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_toy_pipeline_module_is_about_fifty_lines():
    code = [line for line in (ROOT / "tests" / "toy_pipeline.py").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 60, f"tests/toy_pipeline.py has {len(code)} code lines; the shared wiring should carry the rest"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fourth_pipeline_runs_two_steps_through_main(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": ""}
    result = subprocess.run([sys.executable, "-m", "mercury_jax.main", "--config", "tests/toy_pipeline.py",
                             "--workdir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=850)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "toy" / "toy_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward"] <= 1.0 for m in metrics)
    assert (tmp_path / "run" / "toy" / "checkpoints").is_dir()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["pipeline"] == "toy"
