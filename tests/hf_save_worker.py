"""Fork server for the SIGKILL test of `save_hf`: builds two tiny models once, then forks savers on request.

    python tests/hf_save_worker.py WEIGHTS_A.npz WEIGHTS_B.npz TARGET

Reads commands from stdin, answers one line each on stdout:
  `fork I`    forks a child that overwrites TARGET with `save_hf` forever, alternating the two weight sets starting
              with set I (0 = A, 1 = B); answers the child's pid. The test SIGKILLs it.
  `reap PID`  waits for that child to end; answers its raw wait status.
  `quit`      exits.
The models hold numpy arrays, so JAX's backend is never started and forking cannot copy runtime threads; a fresh
interpreter per kill would cost a JAX import (seconds) each time.
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import traceback
from pathlib import Path

import numpy as np
from flax import nnx

from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.hf import save_hf
from models.qwen35_moe.model import Qwen35MoeForCausalLM

SAVE_KWARGS = dict(dtype=np.float32, max_shard_size="64KB")  # fp32: a save/load round trip is bit-exact


@functools.lru_cache(maxsize=2)
def _abstract(cfg: Qwen35MoeConfig):
    return nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))


def parameter_shapes(cfg: Qwen35MoeConfig) -> dict[str, tuple[int, ...]]:
    """'/'-joined parameter path -> shape, for every parameter of the model."""
    return {"/".join(map(str, path)): variable.shape for path, variable in nnx.to_flat_state(_abstract(cfg)[1])}


def numpy_model(cfg: Qwen35MoeConfig, arrays: dict[str, np.ndarray]) -> Qwen35MoeForCausalLM:
    """A model whose parameters are the given host arrays (keyed by '/'-joined parameter path)."""
    graphdef, state = _abstract(cfg)
    flat = nnx.to_flat_state(copy.deepcopy(state))
    for path, variable in flat:
        variable.set_value(arrays["/".join(map(str, path))])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def main(weights_a: str, weights_b: str, target: str) -> None:
    cfg = Qwen35MoeConfig.from_hf(Path(target))
    models = [numpy_model(cfg, dict(np.load(weights))) for weights in (weights_a, weights_b)]
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "fork":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    which = int(args[0])
                    while True:
                        save_hf(models[which], target, **SAVE_KWARGS)
                        which = 1 - which
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif command == "reap":
            print(os.waitpid(int(args[0]), 0)[1], flush=True)
        elif command == "quit":
            return


if __name__ == "__main__":
    main(*sys.argv[1:])
