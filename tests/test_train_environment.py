"""Each start of a run appends the software it ran on to WORKDIR/environment.json."""
import json
from importlib import metadata

import jax

from mercury_jax.runs.environment import ENVIRONMENT_FILE, record_environment


def test_each_start_appends_its_package_versions(tmp_path):
    path = record_environment(tmp_path)
    record_environment(tmp_path)
    runs = json.loads(path.read_text())
    assert str(path) == str(tmp_path / ENVIRONMENT_FILE) and len(runs) == 2
    assert runs[0]["packages"]["jax"] == jax.__version__ == metadata.version("jax")
    assert runs[0]["packages"]["numpy"] == metadata.version("numpy")
    assert runs[0]["devices"] == jax.device_count() and runs[0]["backend"] == jax.default_backend()
    assert not (tmp_path / "environment.tmp").exists()
