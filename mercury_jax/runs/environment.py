"""The software a run ran on, written next to its config: `WORKDIR/environment.json` (one entry per start, so a
resumed run shows each environment it ran in). Results of the tiny demos depend on these versions, and on the host
CPU's vector extensions (XLA:CPU compiles for them), through the numerics of a short warm start; a run that cannot
be reproduced starts the search here."""
from __future__ import annotations

import json
import platform
import sys
import time
from importlib import metadata

import jax
from etils import epath

from mercury_jax.runs.rundir import RunDir, write_atomically

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "sentencepiece", "tiktoken",
            "mcp", "bm25s", "grain", "ml-collections", "safetensors")
ENVIRONMENT_FILE = "environment.json"
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def cpu_features() -> list[str]:
    """Which of `CPU_FEATURES` the host CPU reports (Linux /proc/cpuinfo; [] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [name for name in CPU_FEATURES if name in flags]


def environment() -> dict:
    """Python, platform, JAX backend and devices, and the installed version of each of `PACKAGES` (None if absent)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_features": cpu_features(),
            "backend": jax.default_backend(), "devices": jax.device_count(), "packages": versions}


def record_environment(workdir) -> epath.Path:
    """Append this start's `environment()` to `WORKDIR/environment.json` (process 0 only); returns the path."""
    path = RunDir(workdir).environment
    if jax.process_index() != 0:
        return path
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(environment())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(runs, indent=1) + "\n")
    return path
