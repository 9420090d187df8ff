"""Ahead-of-time compile the learner programs of a released run for its TPU role topology, on this CPU host, through
the trainers' own code: the role mesh of the config (`train/placement.py`), the model with the config's runtime
(`config/model.py:model_runtime`), the optimiser (`train/optim.py`), and the real jitted steps of
`train/sao_learner.py` / `train/grpo_learner.py` with their micro-batching and pinned state shardings.

    PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.aot_tpu --config experiments/sao.py --program actor \
        [--topology v5p:2x4x4] [--rows 128] [--seq 24576] [--write]

Programs: `actor` (SAO DIS step, Adam), `critic` (SAO value step, Adam, the frozen token mixing as a non-trained
input), `values` (the critic forward + skip-observation GAE of `make_advantage_fn`), `grpo` (the pivot-GRPO step).
Nothing runs on a TPU and no array is allocated: every input is a `ShapeDtypeStruct` with the sharding the trainer
gives it. The model is the preset (`--preset`, the released checkpoint's architecture, since an HF directory is not
needed for shapes). Per-chip memory is `compiled.memory_analysis()`: arguments + outputs + temporaries - aliased
(donated parameters and optimiser state alias their outputs).
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies

from mercury_jax.bench import jax_setup
from mercury_jax.bench.abstract import abstract_opt_state, abstract_state, batch_spec, shardings
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.bench.rooflines import GIB, HBM_GIB, program_bytes, xla_cost
from mercury_jax.bench.run_config import apply_overrides, load_config
from mercury_jax.config.model import model_runtime
from mercury_jax.config.roles import role_mesh_sizes
from mercury_jax.parallel import make_mesh
from mercury_jax.train.grpo_learner import make_grpo_step
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.config import PRESETS
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable

ROLE = {"actor": "actor", "critic": "critic", "values": "critic", "grpo": "actor"}
HEADERS = ["program", "topology", "mesh", "rows x seq", "micro-batches", "remat", "attention", "moe", "gdn",
           "arguments GiB/chip", "temp GiB/chip", "total GiB/chip", "HBM GiB", "TFLOP/chip", "compile s"]


def lower_program(config, program: str, devices, preset: str, rows: int, seq: int):
    """(lowered, description) of one learner program on its role's mesh over `devices`."""
    role = ROLE[program]
    mesh = make_mesh(role_mesh_sizes(config, role, len(devices)), devices=devices)
    cfg = PRESETS[preset](param_dtype="float32", **model_runtime(config.model))
    if program in ("actor", "grpo"):
        return _lower_policy_step(config, program, cfg, mesh, rows, seq)
    f32, i32 = jnp.float32, jnp.int32
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeCritic(cfg, rngs=nnx.Rngs(0)), mesh,
                                              critic_trainable)
    keys = dict(tokens=i32, action_mask=f32, rollout_logprobs=f32, rewards=f32)
    if program == "values":
        fn = make_advantage_fn(graphdef, config.sao, mesh=mesh)
        return (fn.lower(params, frozen, batch_spec(mesh, rows, seq, keys, config.sao)), mesh,
                config.sao.critic_micro_batches)
    tx = make_optimizer(config.sao.critic_optimizer)
    opt_state = abstract_opt_state(tx, params, mesh)
    step = make_critic_step(graphdef, tx, config.sao, state_shardings=(shardings(params), shardings(opt_state)))
    keys.update(returns=f32, old_values=f32)
    return (step.lower(params, frozen, opt_state, batch_spec(mesh, rows, seq, keys, config.sao)), mesh,
            config.sao.critic_micro_batches)


def _lower_policy_step(config, program: str, cfg, mesh, rows: int, seq: int):
    """(lowered, mesh, micro-batches) of the SAO actor step or the pivot-GRPO step."""
    f32, i32 = jnp.float32, jnp.int32
    section = config.sao if program == "actor" else config.grpo
    graphdef, params, frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh, nnx.Param)
    tx = make_optimizer(section.actor_optimizer)
    opt_state = abstract_opt_state(tx, params, mesh)
    make = make_actor_step if program == "actor" else make_grpo_step
    step = make(graphdef, tx, section, state_shardings=(shardings(params), shardings(opt_state)))
    keys = dict(tokens=i32, action_mask=f32, rollout_logprobs=f32, advantages=f32)
    if program == "actor":
        keys["rewards"] = f32
    else:
        keys["ref_logprobs"] = f32
    micro = section.actor_micro_batches if program == "actor" else section.micro_batches
    return step.lower(params, frozen, opt_state, batch_spec(mesh, rows, seq, keys, section)), mesh, micro


def default_rows(config, program: str) -> int:
    """A step's rows of `program`: SAO's batch of prompts, a GRPO minibatch of states x their group."""
    if program == "grpo":
        return config.grpo.batch_states * config.grpo.group_size // config.grpo.minibatches
    return config.sao.batch_prompts


def compile_cells(lowered, hbm) -> list[str]:
    """The table's arguments, temp, total GiB a chip, HBM verdict and TFLOP cells of a lowered program; a compile
    the TPU compiler refuses (temporaries over HBM) is a row too, with the temporaries it asked for."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        needed = re.search(r"HLO temporaries \(([\d.]+)G\)", str(error))
        if needed is None:
            raise
        return ["-", f"{float(needed.group(1)):.1f}", "-", f"{hbm} (does not fit: compile refused)", "-"]
    memory = compiled.memory_analysis()
    flops, _ = xla_cost(compiled)
    total_bytes = program_bytes(memory)
    return [f"{memory.argument_size_in_bytes / GIB:.1f}", f"{memory.temp_size_in_bytes / GIB:.1f}",
            f"{total_bytes / GIB:.1f}", f"{hbm} ({'fits' if hbm and total_bytes < hbm * GIB else 'does not fit'})",
            f"{flops / 1e12:.0f}"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/sao.py")
    parser.add_argument("--program", default="actor", choices=sorted(ROLE))
    parser.add_argument("--preset", default="qwen3.5-35b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--topology", default="v5p:2x4x4", help="the role's slice (released actor/critic: 32 chips)")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: the config's batch)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default: rollout.max_total_tokens)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set model.moe_impl=ep (repeatable)")
    parser.add_argument("--write", action="store_true", help="append the row to BENCHMARKS.md's aot_tpu section")
    return parser.parse_args(argv)


def main(argv=None):
    jax_setup.configure(platforms="cpu")
    args = parse_args(argv)
    config = load_config(args.config)
    apply_overrides(config, args.set)
    rows = args.rows if args.rows is not None else default_rows(config, args.program)
    seq = args.seq or config.rollout.max_total_tokens
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    start = time.perf_counter()
    lowered, mesh, micro = lower_program(config, args.program, devices, args.preset, rows, seq)
    arguments, temp, total, verdict, flops = compile_cells(lowered, HBM_GIB.get(args.topology.split(":")[0]))
    seconds = time.perf_counter() - start
    sizes = {k: v for k, v in mesh.shape.items() if v > 1}
    row = [args.program, args.topology, ",".join(f"{k}={v}" for k, v in sizes.items()), f"{rows}x{seq}",
           str(micro), config.model.remat_policy, config.model.attention_impl, config.model.moe_impl,
           config.model.gdn_impl, arguments, temp, total, verdict, flops, f"{seconds:.0f}"]
    table = markdown_table(HEADERS, [row])
    print(table, flush=True)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.aot_tpu --config {args.config} "
                   f"--program {args.program} --preset {args.preset} --topology {args.topology} "
                   f"--rows {rows} --seq {seq}" + "".join(f" --set {item}" for item in args.set) + " --write")
        write_section(f"aot_tpu_{args.program}", f"TPU ahead-of-time compile of the {args.program} program", table,
                      command)


if __name__ == "__main__":
    main()
