"""The device check: the released run's two hot programs measured on the one accelerator chip at hand.

    pip install -U "jax[tpu]"      # on a TPU VM;   pip install -U "jax[cuda12]" on a GPU machine
    python -m mercury_jax.bench.device_check [--budget-s 300] [--vocab 32768] [--only decode|actor] [--slots 32]
    python -m mercury_jax.bench.device_check          # on CPU: the :tiny config, as CI runs it

On the default backend's first device, without a mesh, it builds the released SAO run's model (`experiments/sao.py`:
the Qwen3.5-35B-A3B architecture) cut to `--blocks` repeats of its layer pattern (one block: 3 GDN + 1 attention
layers, all 256 experts, hidden 2048, the released vocabulary unless `--vocab`; bf16 compute, fp32 master weights)
with the kernels that exist there (`device_setup.KERNELS`: Pallas Mosaic GDN and splash attention on TPU; the
chunked GDN and blockwise attention on GPU and CPU; sort + ragged_dot experts on TPU, expert-aligned
row blocks elsewhere: `models/qwen35_moe/moe_blocked.py`), and times, at one chip's share of
the released shapes (`device_setup.chip_shapes`):
  - the rollout engine's decode chunk (`rollout/sampler.py`): 8 slots x 24,576-token caches, 8 steps a chunk, bf16
    weights, every slot busy halfway into its cache;
  - the SAO actor step (`train/sao_learner.py`: DIS loss, gradient, Adam) on one released micro-batch, 1 row x
    24,576 tokens (85 GiB on a v5p chip with the released vocabulary, 73 GiB with `--vocab 32768`).
Each is compiled first (compile seconds apart), run once untimed, then `--reps` times to completion. Printed: a
header (backend, device kind, jax version, kernels, the chip's peaks), the model, and a table with per program the
median time, tokens/s, model TFLOP/s (hand count: 6 N per trained token, 2 N per decoded token, N the active
parameters, plus causal attention; `bench/flops.py`), MFU against the chip's bf16 peak, the HBM bytes a decode step
must read (`bench/rooflines.py:decode_read_bytes`) and the fraction of the bandwidth roofline that achieves. Peaks
come from `bench/peaks.py` by `device_kind`; an unknown chip (CPU) reports "n/a". The header also names the chip's
links (`bench/links.py`: NVLink for H100 / H200, ICI for a TPU), the bandwidth a pod step's collectives are priced
with (`bench.pod`), for reading a one-chip time against a step of many. Past `--budget-s` it stops,
says so, and exits 1 (also when a program fails, e.g. out of memory: its row says why).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import jax

from mercury_jax.bench import jax_setup
from mercury_jax.bench.device_programs import Program, actor_program, decode_program, init_model
from mercury_jax.bench.device_setup import KERNELS, Shapes, check_model, chip_shapes, platform
from mercury_jax.bench.flops import active_parameters
from mercury_jax.bench.links import describe_chip_links
from mercury_jax.bench.peaks import Peak, chip_peak
from mercury_jax.bench.report import markdown_table, replace_subsection
from mercury_jax.bench.rooflines import GIB
from mercury_jax.bench.run_config import load_config
from mercury_jax.bench.timing import Timing, measure
from models.qwen35_moe.config import ATTENTION_IMPLS, GDN_IMPLS, MOE_IMPLS

HEADERS = ["program", "shape", "compile s", "time ms (median)", "tokens/s", "model TFLOP/s", "MFU",
           "must-read GiB/step", "bandwidth fraction"]


def row(name: str, program: Program | None, timing: Timing | None, peak: Peak, error: str = "") -> list:
    """One table row: the program's measured time against the chip's peaks (or why there is none)."""
    if program is None or timing is None or not timing.run_s:
        return [name, program.shape if program else "", f"{timing.compile_s:.1f}" if timing else "",
                error or "not run", "", "", "", "", ""]
    seconds = timing.median_s
    flops_per_s = program.model_flops / seconds
    per_step = program.read_bytes / program.steps
    return [name, program.shape, f"{timing.compile_s:.1f}",
            f"{seconds * 1e3:.2f} ({len(timing.run_s)} runs)", f"{program.tokens / seconds:,.0f}",
            f"{flops_per_s / 1e12:.3f}", f"{flops_per_s / peak.flops:.1%}" if peak.flops else "n/a",
            f"{per_step / GIB:.3f}" if per_step else "",
            (f"{program.read_bytes / seconds / peak.hbm_bytes_per_s:.1%}" if peak.hbm_bytes_per_s else "n/a")
            if per_step else ""]


def describe_model(cfg, vocab_reduced: bool, param_dtype) -> str:
    """The checked model in words: its blocks, widths, dtypes and parameter counts."""
    active, total = active_parameters(cfg)
    pattern, blocks, _ = cfg.block_layout()
    return (f"{blocks} block(s) of {'+'.join(t.split('_')[0] for t in pattern)} = {cfg.num_hidden_layers} layers, "
            f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, vocab "
            f"{cfg.vocab_size:,} ({'reduced' if vocab_reduced else 'as configured'}), {cfg.dtype} compute, "
            f"{cfg.remat_policy} remat, rollout weights {param_dtype or cfg.param_dtype}; {active / 1e6:,.1f}M "
            f"active of {total / 1e6:,.1f}M parameters")


def memory_note(device) -> str:
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return ""
    limit = stats.get("bytes_limit")
    return (f"Device memory: peak {stats['peak_bytes_in_use'] / GIB:.1f} GiB in use"
            + (f" of {limit / GIB:.1f} GiB." if limit else "."))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="", help="default: experiments/sao.py on an accelerator, "
                        "experiments/sao.py:tiny on CPU")
    parser.add_argument("--tiny", action="store_true", help="the :tiny config (the CPU default)")
    parser.add_argument("--blocks", type=int, default=1, help="repeats of the layer pattern (3 GDN + 1 attention)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the architecture's)")
    for name in ("rows", "micro-batches", "seq", "slots", "cache-length", "steps"):
        parser.add_argument(f"--{name}", type=int, default=0, help="override the run's per-chip shape (0: keep)")
    for field, choices in (("moe_impl", MOE_IMPLS), ("gdn_impl", GDN_IMPLS), ("attention_impl", ATTENTION_IMPLS)):
        parser.add_argument(f"--{field.replace('_', '-')}", choices=choices, default="",
                            help=f"model.{field} (default: the platform's, device_setup.KERNELS)")
    parser.add_argument("--only", choices=("decode", "actor"), default="", help="run one of the two programs")
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each program")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop (exit 1) once this many seconds pass")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the chip's bf16 peak (default: by kind)")
    parser.add_argument("--peak-gbps", type=float, default=0.0, help="the chip's HBM GB/s (default: by kind)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md (device_check)")
    return parser.parse_args(argv)


def time_programs(makers, reps: int, deadline: float, peak: Peak) -> tuple[list, list, list]:
    """(table rows, programs stopped by the deadline, programs that failed): each (name, make) in turn built,
    compiled and timed `reps` times, its arrays freed before the next one."""
    rows, stopped, failed = [], [], []
    for name, make in makers:
        if time.monotonic() > deadline:
            stopped.append(name)
            continue
        program, timing, error = None, None, ""
        try:
            program = make()
            timing = measure(program.lower, program.run, reps, deadline)
        except Exception as exc:  # a program that does not fit or compile is a result: reported, exit 1
            error = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            failed.append(name)
        rows.append(row(name, program, timing, peak, error))
        print(f"  {name}: " + (error or f"compile {timing.compile_s:.1f} s, {timing.median_s * 1e3:.2f} ms"),
              flush=True)
        del program
        gc.collect()
    return rows, stopped, failed


def run(argv=None) -> int:
    """Time the run's decode chunk and actor step on this backend's first device; 1 when one is stopped by the
    budget or fails."""
    started = time.monotonic()
    args = parse_args(argv)
    deadline = started + args.budget_s
    device, where = jax.devices()[0], platform()
    config_path = args.config or ("experiments/sao.py:tiny" if args.tiny or where == "cpu" else "experiments/sao.py")
    config = load_config(config_path)
    kernels = {field: getattr(args, field) or impl for field, impl in KERNELS.get(where, KERNELS["cpu"]).items()}
    cfg = check_model(config, blocks=args.blocks, vocab=args.vocab, kernels=kernels)
    released = chip_shapes(config)
    shapes = Shapes(**{field: getattr(args, field) or value for field, value in vars(released).items()})
    peak = chip_peak(device.device_kind, args.peak_tflops, args.peak_gbps)
    param_dtype = config.rollout.get("param_dtype", "") or None
    header = (f"backend {jax.default_backend()}, device {device.device_kind} ({jax.device_count()} visible, 1 used), "
              f"jax {jax.__version__}; kernels: " + ", ".join(f"{k}={v}" for k, v in kernels.items())
              + f"; peak {peak.describe()}; {describe_chip_links(device.device_kind)}")
    changed = [f"{field} {value} (run: {getattr(released, field)})" for field, value in vars(shapes).items()
               if value != getattr(released, field)]
    model_line = (f"{config_path}: {describe_model(cfg, bool(args.vocab), param_dtype)}; shapes: one chip's share "
                  f"of the run's" + (f", overridden: {', '.join(changed)}" if changed else ""))
    print(header, flush=True)
    print(model_line, flush=True)
    model = init_model(cfg, args.seed)
    makers = tuple((name, make) for name, make, key in (
        ("rollout decode", lambda: decode_program(model, shapes, param_dtype, args.seed), "decode"),
        ("actor step", lambda: actor_program(model, config.sao, shapes, args.seed), "actor"))
        if args.only in ("", key))
    # decode first: the actor step donates (spends) the model's weights
    rows, stopped, failed = time_programs(makers, args.reps, deadline, peak)
    table = markdown_table(HEADERS, rows)
    elapsed = time.monotonic() - started
    verdict = " ".join(filter(None, [
        (f"Stopped at the {args.budget_s:.0f} s budget: not run: {', '.join(stopped)}." if stopped
         else f"Done in {elapsed:.0f} s (budget {args.budget_s:.0f} s)."),
        f"Failed: {', '.join(failed)}." if failed else ""]))
    print(table)
    print(" ".join(filter(None, [memory_note(device), verdict])))
    if args.write:
        command = "python -m mercury_jax.bench.device_check " + " ".join(argv if argv is not None else sys.argv[1:])
        label = (f"CPU, {config_path}: the code path CI runs, not accelerator figures" if where == "cpu"
                 else f"{device.device_kind}, {config_path}")
        replace_subsection("device_check", label,
                           f"{header}.\n\n{model_line}.\n\n{table}\n\n{verdict}", command.strip())
    return 1 if stopped or failed else 0


def main() -> int:
    """A GPU client taking 95% of the chip's memory (JAX's 75% default is less than the actor step needs), then
    `run`."""
    jax_setup.configure(gpu_memory_fraction=0.95)
    return run()


if __name__ == "__main__":
    sys.exit(main())
