"""JAX is set up in each bench's `main()` (`bench/jax_setup.py`), not by import order: importing every bench module
starts no JAX backend, so the platform, the XLA flags (the optimised-HLO dump) and the client settings that `main()`
sets still take effect; every bench script answers `--help` after its setup without starting one either; and a setup
that comes after the backend started is refused rather than silently ignored."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from mercury_jax.bench import jax_setup

ROOT = Path(__file__).resolve().parents[1]

IMPORT_THEN_CONFIGURE = """
import importlib, json, os, pkgutil
import mercury_jax.bench
from jax._src import xla_bridge
names = [m.name for m in pkgutil.iter_modules(mercury_jax.bench.__path__)]
for name in names:
    importlib.import_module("mercury_jax.bench." + name)
started_by_imports = xla_bridge.backends_are_initialized()
from mercury_jax.bench import jax_setup
import jax, jax.numpy as jnp
dump = jax_setup.configure(platforms="cpu", tpu_topology=True, hlo_dump=".*")
jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()
dumped = [f for f in os.listdir(dump) if f.endswith("after_optimizations.txt")]
print(json.dumps(dict(modules=len(names), started_by_imports=started_by_imports, dumped=len(dumped),
                      platform=jax.default_backend(), platforms=jax.config.jax_platforms,
                      tpu_hosts=os.environ.get("TPU_WORKER_HOSTNAMES"))))
"""

EVERY_HELP = """
import json, pkgutil, runpy, sys
import mercury_jax.bench
from jax._src import xla_bridge
answered = {}
for module in pkgutil.iter_modules(mercury_jax.bench.__path__):
    source = open(module.module_finder.path + "/" + module.name + ".py").read()
    if 'if __name__ == "__main__":' not in source:
        continue
    sys.argv = [module.name, "--help"]
    try:
        runpy.run_module("mercury_jax.bench." + module.name, run_name="__main__")
        answered[module.name] = "no exit"
    except SystemExit as done:
        answered[module.name] = done.code
print(json.dumps(dict(answered=answered, started=xla_bridge.backends_are_initialized())))
"""


def _child(code: str) -> dict:
    """Run `code` in a fresh Python without the suite's JAX settings; returns its last line, a JSON object."""
    unset = ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_WORKER_HOSTNAMES")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_benches_starts_no_backend_and_main_setup_takes_effect():
    report = _child(IMPORT_THEN_CONFIGURE)
    assert report["modules"] > 20 and not report["started_by_imports"]
    assert report["platforms"] == "cpu" and report["platform"] == "cpu"  # set after `import jax`, through jax.config
    assert report["dumped"] >= 1  # XLA_FLAGS set after every import still reached XLA
    assert report["tpu_hosts"] == "localhost"


@pytest.mark.slow
def test_every_bench_answers_help_without_starting_the_backend():
    report = _child(EVERY_HELP)
    assert len(report["answered"]) > 20
    assert all(code == 0 for code in report["answered"].values()), report["answered"]
    assert not report["started"]


def test_a_setup_after_the_backend_started_is_refused():
    jax.devices()
    with pytest.raises(RuntimeError, match="after JAX started its backend"):
        jax_setup.configure(platforms="cpu")
