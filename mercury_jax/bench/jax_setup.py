"""JAX set up by a bench's `main()`, before its backend starts: which platforms it starts, libtpu's single-host
topology for ahead-of-time TPU compiles, XLA's dump of optimised HLO, a GPU client's share of memory.

Importing jax starts no backend; the first device query or computation does, and that is when XLA reads
`XLA_FLAGS` and the client its memory settings. `JAX_PLATFORMS`, though, is read when jax is imported, so a
platform chosen later goes through `jax.config`. So a bench imports everything at the top and calls `configure`
first thing in `main()`; it raises if the backend has already started, when the settings would be ignored.
"""
from __future__ import annotations

import os

import jax
from jax._src import xla_bridge

from mercury_jax.bench.hlo_bytes import dump_optimised_hlo


def configure(*, platforms: str = "", override_platforms: bool = False, tpu_topology: bool = False,
              hlo_dump: str = "", gpu_memory_fraction: float = 0.0) -> str | None:
    """Set JAX up for a bench's run; returns the folder of the optimised HLO dump (None: no dump).

    platforms: the platforms JAX starts ("cpu"), unless the environment's JAX_PLATFORMS names others (or in any
        case, with `override_platforms`); exported to the environment too, for the processes the bench starts.
    tpu_topology: a CPU host compiling for a TPU topology: libtpu's topology is a single host
        (TPU_WORKER_HOSTNAMES=localhost unless set), which silences its probe of the workers.
    hlo_dump: a module-name pattern: XLA dumps the optimised HLO of every module matching it
        (`hlo_bytes.dump_optimised_hlo`, for the byte and collective counts).
    gpu_memory_fraction: the share of a GPU's memory its client takes at the start (XLA_PYTHON_CLIENT_MEM_FRACTION,
        unless set; JAX's default 0.75 is less than the device check's actor step needs)."""
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jax_setup.configure() came after JAX started its backend, so XLA would ignore it; call "
                           "it first in the bench's main(), before any device query or computation")
    if platforms and (override_platforms or not os.environ.get("JAX_PLATFORMS")):
        os.environ["JAX_PLATFORMS"] = platforms
        jax.config.update("jax_platforms", platforms)
    if tpu_topology:
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if gpu_memory_fraction:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(gpu_memory_fraction))
    return dump_optimised_hlo(hlo_dump) if hlo_dump else None
