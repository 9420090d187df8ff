"""The device check (`bench/device_check.py`) on CPU: the tiny config's decode chunk and actor step timed through the
same code an accelerator runs, small shapes; its parts (peaks by device kind, the released shapes per chip, the
reduced-depth model) checked by hand."""
from __future__ import annotations

import pytest

from mercury_jax.bench import device_check
from mercury_jax.bench.device_setup import KERNELS, check_model, chip_shapes
from mercury_jax.bench.peaks import chip_peak
from mercury_jax.bench.run_config import load_config

SMALL = ["--rows", "2", "--seq", "128", "--slots", "4", "--cache-length", "128", "--steps", "4", "--reps", "2"]


def table_rows(out: str) -> dict[str, list[str]]:
    """The printed table's rows by program name, cells stripped."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("rollout decode", "actor step"):
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow  # ~40 s of CPU
def test_cpu_run_times_both_programs(capsys):
    status = device_check.run(SMALL)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "backend cpu" in out and "gdn_impl=chunked, attention_impl=blockwise, moe_impl=blocked" in out
    assert "experiments/sao.py:tiny" in out and "peak unknown FLOP/s" in out
    rows = table_rows(out)
    assert set(rows) == {"rollout decode", "actor step"}, out
    headers = device_check.HEADERS
    for cells in rows.values():
        cell = dict(zip(headers, cells))
        assert float(cell["compile s"]) > 0, cell
        assert float(cell["time ms (median)"].split()[0]) > 0, cell
        tokens_per_s = float(cell["tokens/s"].replace(",", ""))
        assert 10 < tokens_per_s < 1e9, cell  # a tiny model on a CPU: more than a few, less than a chip's worth
        assert cell["MFU"] == "n/a", cell  # no peak for a CPU
    decode = dict(zip(headers, rows["rollout decode"]))
    assert float(decode["must-read GiB/step"]) > 0 and decode["bandwidth fraction"] == "n/a"
    assert "4 slots x 128-token caches, 4 steps a chunk" in decode["shape"]
    assert "2 x 128 tokens" in rows["actor step"][1]


def test_one_program_with_another_kernel(capsys):
    status = device_check.run([*SMALL, "--only", "decode", "--moe-impl", "ragged"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "moe_impl=ragged" in out and set(table_rows(out)) == {"rollout decode"}, out


def test_past_the_budget_it_stops_and_says_so(capsys):
    status = device_check.run([*SMALL, "--budget-s", "0"])
    out = capsys.readouterr().out
    assert status == 1
    assert "Stopped at the 0 s budget: not run: rollout decode, actor step." in out


def test_peaks_by_device_kind():
    assert chip_peak("TPU v5 lite").flops == 197e12  # v5e, before "TPU v5" (v5p) matches it
    assert chip_peak("TPU v5").flops == 459e12
    assert chip_peak("TPU v6 lite").hbm_bytes_per_s == 1640e9
    assert chip_peak("NVIDIA H100 80GB HBM3").hbm_bytes_per_s == 3350e9
    assert chip_peak("NVIDIA H100 PCIe").flops == 756e12
    assert chip_peak("NVIDIA H200").hbm_bytes_per_s == 4800e9
    assert chip_peak("NVIDIA A100-SXM4-80GB").hbm_bytes_per_s == 2039e9
    unknown = chip_peak("cpu")
    assert unknown.flops is None and unknown.hbm_bytes_per_s is None and "not in the table" in unknown.source
    given = chip_peak("cpu", tflops=2.0)
    assert given.flops == 2e12 and given.hbm_bytes_per_s is None and "command line" in given.source


def test_released_shapes_and_model_at_one_block():
    config = load_config("experiments/sao.py")
    shapes = chip_shapes(config)
    # 128 rows over 32 actor chips in 4 micro-batches: 1 row of 24,576 tokens; 128 slots over 16 replicas
    assert (shapes.rows, shapes.micro_batches, shapes.seq) == (1, 1, 24576)
    assert (shapes.slots, shapes.cache_length, shapes.steps) == (8, 24576, 8)
    cfg = check_model(config, blocks=1, vocab=0, kernels=KERNELS["tpu"])
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.num_experts, cfg.hidden_size, cfg.vocab_size, cfg.dtype) == (256, 2048, 248320, "bfloat16")
    assert (cfg.gdn_impl, cfg.attention_impl, cfg.moe_impl) == ("pallas", "splash", "ragged")
    assert check_model(config, blocks=2, vocab=32768, kernels={}).num_hidden_layers == 8
