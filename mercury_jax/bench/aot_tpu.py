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

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from mercury_jax.bench.report import markdown_table, write_section  # noqa: E402
from mercury_jax.config.model import model_runtime  # noqa: E402
from mercury_jax.config.roles import role_mesh_sizes  # noqa: E402
from mercury_jax.parallel import make_mesh, variable_sharding  # noqa: E402
from mercury_jax.train.grpo_learner import make_grpo_step  # noqa: E402
from mercury_jax.train.optim import make_optimizer  # noqa: E402
from mercury_jax.train.placement import batch_sharding  # noqa: E402
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step  # noqa: E402
from models.qwen35_moe import Qwen35MoeForCausalLM  # noqa: E402
from models.qwen35_moe.config import PRESETS  # noqa: E402
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable  # noqa: E402

HBM_GIB = {"v5p": 95, "v5e": 16, "v6e": 32, "v4": 32}
ROLE = {"actor": "actor", "critic": "critic", "values": "critic", "grpo": "actor"}
GIB = 2.0 ** 30


def load_config(path: str):
    file, _, variant = path.partition(":")
    spec = importlib.util.spec_from_file_location("_aot_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant or None)


def apply_overrides(config, items: list[str]) -> None:
    """`--set a.b=VALUE` for each item: a Python literal (a dict becomes a ConfigDict; a field may be new), cast to
    the type of the scalar it replaces (a bool from "True"), else the bare string."""
    for item in items:
        field, _, text = item.partition("=")
        *path, name = field.split(".")
        section = config
        for key in path:
            section = section[key]
        old = section.get(name)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if isinstance(value, dict):
            value = ml_collections.ConfigDict(value)
        elif isinstance(old, bool):
            value = text == "True"
        elif old is not None and not isinstance(old, ml_collections.ConfigDict):
            value = type(old)(value)
        section[name] = value


def abstract_state(module_fn, mesh, trainable):
    """(graphdef, params, frozen) of the module with every leaf a ShapeDtypeStruct in its sharding on `mesh`."""
    model = nnx.eval_shape(module_fn)
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=variable_sharding(path, variable, mesh)))
    return nnx.split(model, trainable, ...)


def abstract_opt_state(tx, params, mesh):
    """The optimiser state's shapes laid out as the trainer's eager `tx.init` on sharded parameters lays them out:
    a moment (mu, nu) like the parameter it mirrors (its path ends with that parameter's path), anything else (step
    counts) replicated over the mesh (`placement.onto_mesh`). A jitted init would replicate the moments: its
    zeros depend on no input, so nothing propagates the parameters' layout to them."""
    by_path = {jax.tree_util.keystr(path): leaf.sharding for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_param(path, shape):
        key = jax.tree_util.keystr(path)
        sharding = next((s for p, s in by_path.items() if key.endswith(p)), replicated)
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(like_param, jax.eval_shape(tx.init, params))


def shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def batch_spec(mesh, rows: int, seq: int, keys: dict, section) -> dict:
    """The learner batch as sharded shapes; a packed one (`pack_rows`) also carries segment ids and the index maps
    between the packed and the padded layout, as the trainers' batches do (train/packing.py)."""
    if section.get("pack_rows"):
        keys = dict(keys, segment_ids=jnp.int32, unpack_index=jnp.int32, pack_index=jnp.int32)
    sharding = batch_sharding(mesh, (rows, seq))
    return {k: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding) for k, dtype in keys.items()}


def lower_program(config, program: str, devices, preset: str, rows: int, seq: int):
    """(lowered, description) of one learner program on its role's mesh over `devices`."""
    role = ROLE[program]
    mesh = make_mesh(role_mesh_sizes(config, role, len(devices)), devices=devices)
    cfg = PRESETS[preset](param_dtype="float32", **model_runtime(config.model))
    f32, i32 = jnp.float32, jnp.int32
    if program in ("actor", "grpo"):
        section = config.sao if program == "actor" else config.grpo
        graphdef, params, frozen = abstract_state(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh,
                                                  nnx.Param)
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


def main(argv=None):
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
    args = parser.parse_args(argv)
    config = load_config(args.config)
    apply_overrides(config, args.set)
    if args.rows is None:
        args.rows = (config.sao.batch_prompts if "sao" in config
                     else config.grpo.batch_states * config.grpo.group_size // config.grpo.minibatches)
    seq = args.seq or config.rollout.max_total_tokens
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    start = time.perf_counter()
    lowered, mesh, micro = lower_program(config, args.program, devices, args.preset, args.rows, seq)
    hbm = HBM_GIB.get(args.topology.split(":")[0])
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:  # the TPU compiler refuses a program whose temporaries exceed HBM
        needed = re.search(r"HLO temporaries \(([\d.]+)G\)", str(error))
        if needed is None:
            raise
        compiled, temp, arguments, total, flops = None, float(needed.group(1)), "-", "-", "-"
        verdict = f"{hbm} (does not fit: compile refused)"
    seconds = time.perf_counter() - start
    if compiled is not None:
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        total_bytes = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                       - memory.alias_size_in_bytes)
        temp, arguments = memory.temp_size_in_bytes / GIB, f"{memory.argument_size_in_bytes / GIB:.1f}"
        total, flops = f"{total_bytes / GIB:.1f}", f"{float(cost.get('flops', np.nan)) / 1e12:.0f}"
        verdict = f"{hbm} ({'fits' if hbm and total_bytes < hbm * GIB else 'does not fit'})"
    sizes = {k: v for k, v in mesh.shape.items() if v > 1}
    row = [args.program, args.topology, ",".join(f"{k}={v}" for k, v in sizes.items()), f"{args.rows}x{seq}",
           str(micro), config.model.remat_policy, config.model.attention_impl, config.model.moe_impl,
           config.model.gdn_impl, arguments, f"{temp:.1f}", total, verdict, flops, f"{seconds:.0f}"]
    headers = ["program", "topology", "mesh", "rows x seq", "micro-batches", "remat", "attention", "moe", "gdn",
               "arguments GiB/chip", "temp GiB/chip", "total GiB/chip", "HBM GiB", "TFLOP/chip", "compile s"]
    table = markdown_table(headers, [row])
    print(table, flush=True)
    if args.write:
        command = (f"PYTHONPATH=<libtpu dir>:. python -m mercury_jax.bench.aot_tpu --config {args.config} "
                   f"--program {args.program} --preset {args.preset} --topology {args.topology} "
                   f"--rows {args.rows} --seq {seq}" + "".join(f" --set {item}" for item in args.set) + " --write")
        write_section(f"aot_tpu_{args.program}", f"TPU ahead-of-time compile of the {args.program} program", table,
                      command)


if __name__ == "__main__":
    main()
