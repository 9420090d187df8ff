"""Peak dense bf16 FLOP/s and HBM bandwidth of one accelerator chip, by JAX's `device.device_kind`.

Figures are the vendors' spec sheets, per chip, dense (NVIDIA quotes bf16 "with sparsity" at twice these):
Cloud TPU v4, v5e, v5p, v6e system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e); NVIDIA
H100 and H200 Tensor Core GPU datasheets; NVIDIA A100 Tensor Core GPU datasheet. A kind not listed (CPU, a newer
chip) has no peak unless `--peak-tflops` / `--peak-gbps` give one.
"""
from __future__ import annotations

import dataclasses

from mercury_jax.bench.rooflines import V5P_HBM_BYTES_PER_S, V5P_PEAK_FLOPS

# (words that must all appear in the lower-cased device_kind, chip name, bf16 FLOP/s, HBM bytes/s); first match wins,
# so a more specific kind ("tpu v5 lite") comes before the one it contains ("tpu v5")
CHIPS = (
    (("tpu v4",), "TPU v4", 275e12, 1200e9),
    (("tpu v5 lite",), "TPU v5e", 197e12, 819e9),
    (("tpu v5e",), "TPU v5e", 197e12, 819e9),
    (("tpu v5",), "TPU v5p", V5P_PEAK_FLOPS, V5P_HBM_BYTES_PER_S),  # v5p reports "TPU v5"
    (("tpu v6",), "TPU v6e", 918e12, 1640e9),                       # v6e reports "TPU v6 lite"
    (("h200", "nvl"), "NVIDIA H200 NVL", 835e12, 4800e9),
    (("h200",), "NVIDIA H200 SXM", 989e12, 4800e9),
    (("h100", "pcie"), "NVIDIA H100 PCIe", 756e12, 2000e9),
    (("h100", "nvl"), "NVIDIA H100 NVL", 835e12, 3900e9),
    (("h100",), "NVIDIA H100 SXM", 989e12, 3350e9),
    (("a100", "80gb", "pcie"), "NVIDIA A100 80GB PCIe", 312e12, 1935e9),
    (("a100", "80gb"), "NVIDIA A100 80GB SXM", 312e12, 2039e9),
    (("a100",), "NVIDIA A100 40GB", 312e12, 1555e9),
)


@dataclasses.dataclass(frozen=True)
class Peak:
    """A chip's peaks (None: unknown) and where they came from, in words."""
    flops: float | None
    hbm_bytes_per_s: float | None
    source: str

    def describe(self) -> str:
        tflops = f"{self.flops / 1e12:,.0f} TFLOP/s bf16" if self.flops else "unknown FLOP/s"
        gbps = f"{self.hbm_bytes_per_s / 1e9:,.0f} GB/s HBM" if self.hbm_bytes_per_s else "unknown bandwidth"
        return f"{tflops}, {gbps} ({self.source})"


def chip_peak(device_kind: str, tflops: float = 0.0, gbps: float = 0.0) -> Peak:
    """The peaks of a `device_kind` from `CHIPS`, each replaced by `tflops` (TFLOP/s) / `gbps` (GB/s) when given."""
    kind = device_kind.lower()
    match = next((row for row in CHIPS if all(word in kind for word in row[0])), None)
    flops, hbm = (match[2], match[3]) if match else (None, None)
    source = f"spec sheet: {match[1]}" if match else f"'{device_kind}' not in the table"
    if tflops or gbps:
        flops, hbm = (tflops * 1e12 if tflops else flops), (gbps * 1e9 if gbps else hbm)
        source = "given on the command line" + ("" if tflops and gbps else f"; the rest {source}")
    return Peak(flops, hbm, source)
