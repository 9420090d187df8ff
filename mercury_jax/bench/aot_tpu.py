"""Ahead-of-time compile the full-size model's forward+backward for a TPU topology on this CPU host.

Proves that the real Qwen3.5-35B-A3B step lowers for TPU (XLA + our sharding rules) and reports what
`compiled.memory_analysis()` says one chip needs, against the chip's HBM. Needs `libtpu` installed (not a
runtime dependency; `pip install "libtpu==0.0.42.*"` for jax 0.10); nothing runs on a TPU.

    python -m mercury_jax.bench.aot_tpu --topology v5p:2x2x2 --mesh fsdp=8 --batch 8 --seq 4096
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from mercury_jax.bench.report import markdown_table, write_section  # noqa: E402
from mercury_jax.parallel.mesh import make_mesh  # noqa: E402
from mercury_jax.parallel.sharding import variable_sharding  # noqa: E402
from models.qwen35_moe.config import PRESETS  # noqa: E402
from models.qwen35_moe.logprobs import token_logprobs  # noqa: E402
from models.qwen35_moe.model import Qwen35MoeForCausalLM  # noqa: E402

HBM_GIB = {"v5p": 95, "v5e": 16, "v6e": 32, "v4": 32}


def compile_step(preset: str, topology: str, mesh_shape: dict, batch: int, seq: int, remat: str):
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = make_mesh(mesh_shape, devices=devices)
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", remat_policy=remat)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(state)
    args = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(p, v, mesh)) for p, v in flat]
    param_shardings = [a.sharding for a in args]
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                               sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))

    def loss_fn(arrays, ids_BxT):
        rebuilt = nnx.from_flat_state([(p, v.replace(a)) for (p, v), a in zip(flat, arrays)])
        model = nnx.merge(graphdef, rebuilt)
        hidden, _ = model.hidden_states(ids_BxT)
        logp = token_logprobs(hidden[:, :-1], model.lm_head_weight(), ids_BxT[:, 1:], chunk_size=1024)
        return -jnp.mean(logp)

    step = jax.jit(jax.value_and_grad(loss_fn), out_shardings=(None, param_shardings))
    start = time.perf_counter()
    compiled = step.lower(args, ids).compile()
    seconds = time.perf_counter() - start
    n_params = sum(a.size for a in args)
    return compiled.memory_analysis(), seconds, n_params, len(devices)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--mesh", default="fsdp=8", help="comma list axis=size over (data, fsdp, expert, tensor)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    mesh_shape = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
    memory, seconds, n_params, n_devices = compile_step(args.preset, args.topology, mesh_shape, args.batch,
                                                        args.seq, args.remat)
    gib = 2 ** 30
    per_chip = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes)
    hbm = HBM_GIB.get(args.topology.split(":")[0])
    row = [args.preset, args.topology, args.mesh, f"{args.batch}x{args.seq}", f"{n_params / 1e9:.2f}B", args.remat,
           f"{memory.argument_size_in_bytes / gib:.1f}", f"{memory.output_size_in_bytes / gib:.1f}",
           f"{memory.temp_size_in_bytes / gib:.1f}", f"{per_chip / gib:.1f}",
           f"{hbm} ({'fits' if hbm and per_chip < hbm * gib else 'does not fit'})", f"{seconds:.0f}"]
    headers = ["model", "topology", "mesh", "batch x seq", "params", "remat", "arguments GiB/chip",
               "outputs GiB/chip", "temp GiB/chip", "total GiB/chip", "HBM GiB", "compile s"]
    table = markdown_table(headers, [row])
    print(table)
    if args.write:
        command = ("python -m mercury_jax.bench.aot_tpu " + f"--preset {args.preset} --topology {args.topology} "
                   f"--mesh {args.mesh} --batch {args.batch} --seq {args.seq} --remat {args.remat} --write")
        body = ("Forward + backward of the policy log-likelihood (fp32 master weights, bf16 compute, chunked "
                "log-probs) compiled ahead of time for a TPU topology on a CPU host with libtpu; memory from "
                "`compiled.memory_analysis()` per chip. Pure-JAX chunked GDN (the Pallas kernel is compiled on its "
                "own by bench/gated_delta_aot.py), experts sharded by the logical rules (no explicit all-to-all "
                "dispatch yet).\n\n" + table)
        write_section("aot_tpu", "TPU ahead-of-time compile: memory per chip", body, command)


if __name__ == "__main__":
    main()
