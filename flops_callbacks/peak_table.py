"""The datasheet table: each device's dense peak FLOPS per compute dtype and its peak DRAM bandwidth,
with the datasheet named, and the device-name patterns that pick an entry (:func:`chip_for`). Adding a
device is an edit of this file alone (:mod:`flops_callbacks.peaks` resolves a run's peaks from it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "BANDWIDTHS",
    "BF16",
    "CHIPS",
    "DTYPES",
    "FP8",
    "FP16",
    "FP32",
    "FP64",
    "GB",
    "T",
    "TF32",
    "Chip",
    "bandwidth_for",
    "chip_for",
]

FP64, FP32, TF32, BF16, FP16, FP8 = "fp64", "fp32", "tf32", "bf16", "fp16", "fp8"
DTYPES = (FP64, FP32, TF32, BF16, FP16, FP8)  # fp64: no chip has a column (a peak is given or measured)
T = 1e12  # TFLOPS


@dataclass(frozen=True)
class Chip:
    """One device's dense peaks per compute dtype and where they come from."""

    name: str
    source: str
    peaks: dict[str, float]


# fp32 is the non-tensor (CUDA core / vector) rate: what an fp32 matmul gets when TF32 is off.
def _chip(
    name: str, source: str, fp32: float, bf16: float, tf32: float | None = None, fp8: float | None = None
) -> Chip:
    """A chip from its dense rates in TFLOPS (bf16 and fp16 run at one rate on every chip listed; a chip
    with no tf32 or fp8 figure has no such column)."""
    rates = {FP32: fp32, TF32: tf32, BF16: bf16, FP16: bf16, FP8: fp8}
    return Chip(name, source, {dtype: rate * T for dtype, rate in rates.items() if rate is not None})


# The H100 SXM datasheet's dense tensor rates (FP32 67, TF32 989, BF16/FP16 1,979, FP8 3,958 "with
# sparsity" -> halved): the GH200 and the H200 SXM run the same GH100 die at the same clocks.
_HOPPER_SXM = {"fp32": 67, "tf32": 989 / 2, "bf16": 1979 / 2, "fp8": 3958 / 2}

CHIPS: dict[str, Chip] = {
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): SXM4 and PCIe,
    # 40 and 80 GB alike. TF32 156, BF16/FP16 312 dense (312 / 624 with sparsity). No fp8.
    "a100": _chip("A100", "NVIDIA A100 datasheet", fp32=19.5, tf32=156, bf16=312),
    # NVIDIA A10 datasheet: TF32 62.5, BF16/FP16 125 dense (125 / 250 with sparsity).
    "a10": _chip("A10", "NVIDIA A10 datasheet", fp32=31.2, tf32=62.5, bf16=125),
    # A10G (AWS G5): NVIDIA publishes no datasheet. AWS/NVIDIA figures as tabulated in Baseten's "NVIDIA
    # A10 vs A10G": FP32 35, TF32 35, BF16/FP16 70 dense; = 80 SMs at 1.71 GHz at GA102's FP32-accumulate
    # tensor rate (half the A10's, whose 72 SMs run it at full rate).
    "a10g": _chip("A10G", "AWS G5 A10G figures", fp32=35, tf32=35, bf16=70),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67, TF32 989, BF16/FP16 1,979,
    # FP8 3,958 "with sparsity" -> halved.
    "h100 sxm": _chip("H100 SXM", "NVIDIA H100 datasheet", **_HOPPER_SXM),
    # NVIDIA H100 PCIe datasheet: FP32 51, TF32 756, BF16/FP16 1,513, FP8 3,026 with sparsity -> halved.
    "h100 pcie": _chip(
        "H100 PCIe", "NVIDIA H100 PCIe datasheet", fp32=51.2, tf32=756 / 2, bf16=1513 / 2, fp8=3026 / 2
    ),
    # NVIDIA H100 datasheet, H100 NVL column (one 94 GB card, not the NVLink pair): FP32 60, TF32 835,
    # BF16/FP16 1,671, FP8 3,341 with sparsity -> halved.
    "h100 nvl": _chip(
        "H100 NVL", "NVIDIA H100 datasheet (NVL)", fp32=60, tf32=835 / 2, bf16=1671 / 2, fp8=3341 / 2
    ),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the H100 SXM tensor rates (FP8 3,958 with sparsity).
    "gh200": _chip("GH200", "NVIDIA GH200 datasheet", **_HOPPER_SXM),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: as H100 SXM (same GH100 die).
    "h200 sxm": _chip("H200 SXM", "NVIDIA H200 datasheet", **_HOPPER_SXM),
    # NVIDIA H200 datasheet, H200 NVL column: FP32 60, TF32 835, BF16/FP16 1,671, FP8 3,341 with sparsity.
    "h200 nvl": _chip(
        "H200 NVL", "NVIDIA H200 datasheet (NVL)", fp32=60, tf32=835 / 2, bf16=1671 / 2, fp8=3341 / 2
    ),
    # NVIDIA HGX B200 specifications, "individual Blackwell GPU": FP32 75 TFLOPS; TF32 2.2, FP16/BF16 4.5,
    # FP8 9 PFLOPS with sparsity -> halved.
    "b200": _chip(
        "B200", "NVIDIA HGX B200 specifications", fp32=75, tf32=2200 / 2, bf16=4500 / 2, fp8=9000 / 2
    ),
    # NVIDIA GB200 NVL72 specifications, per Blackwell GPU: FP32 80 TFLOPS; TF32 2.5, FP16/BF16 5, FP8 10
    # PFLOPS with sparsity -> halved.
    "gb200": _chip(
        "GB200", "NVIDIA GB200 NVL72 specifications", fp32=80, tf32=2500 / 2, bf16=5000 / 2, fp8=10000 / 2
    ),
    # NVIDIA L4 datasheet: FP32 30.3; TF32 120, BF16/FP16 242, FP8 485 with sparsity -> halved.
    "l4": _chip("L4", "NVIDIA L4 datasheet", fp32=30.3, tf32=120 / 2, bf16=242 / 2, fp8=485 / 2),
    # NVIDIA L40 datasheet: FP32 90.5; TF32 90.5, BF16/FP16 181.05, FP8 362 dense.
    "l40": _chip("L40", "NVIDIA L40 datasheet", fp32=90.5, tf32=90.5, bf16=181.05, fp8=362),
    # NVIDIA L40S datasheet (dense | sparse columns): FP32 91.6; TF32 183, BF16/FP16 362.05, FP8 733 dense.
    "l40s": _chip("L40S", "NVIDIA L40S datasheet", fp32=91.6, tf32=183, bf16=362.05, fp8=733),
    # NVIDIA Ada GPU architecture whitepaper v2.1, appendix (GeForce RTX 4090), dense, FP32 accumulate (what
    # training uses): FP32 82.6, TF32 82.6, BF16/FP16 165.2, FP8 330.3.
    "rtx 4090": _chip(
        "GeForce RTX 4090", "NVIDIA Ada architecture whitepaper", fp32=82.6, tf32=82.6, bf16=165.2, fp8=330.3
    ),
    # AMD Instinct MI300X datasheet (dense; sparsity listed apart): FP32 matrix 163.4, TF32 653.7,
    # FP16/BF16 1,307.4, FP8 2,614.9.
    "mi300x": _chip(
        "Instinct MI300X", "AMD Instinct MI300X datasheet", fp32=163.4, tf32=653.7, bf16=1307.4, fp8=2614.9
    ),
    # AMD Instinct MI325X datasheet: the MI300X compute (same CDNA 3 die and clock), more HBM.
    "mi325x": _chip(
        "Instinct MI325X", "AMD Instinct MI325X datasheet", fp32=163.4, tf32=653.7, bf16=1307.4, fp8=2614.9
    ),
    # AMD Instinct MI355X datasheet (dense): FP32 157.3, FP16/BF16 2,516.6 (2.5 PF), FP8 5,033.2 (5 PF).
    # CDNA 4 has no TF32 hardware: a tf32 request falls back to fp32 below.
    "mi355x": _chip("Instinct MI355X", "AMD Instinct MI355X datasheet", fp32=157.3, bf16=2516.6, fp8=5033.2),
}

GB = 1e9  # GB/s, in bytes per second (decimal, as the datasheets count)

# Peak memory bandwidth per chip: (pattern on the device name, bytes/s) pairs, the first that matches
# wins ("" matches every name), and the datasheet they come from. Keys are CHIPS' keys.
BANDWIDTHS: dict[str, tuple[tuple[tuple[str, float], ...], str]] = {
    # NVIDIA A100 datasheet: 40 GB (PCIe and SXM) 1,555 GB/s; 80 GB PCIe 1,935 GB/s; 80 GB SXM 2,039 GB/s.
    "a100": (
        (
            (r"\b80 ?gb\b.*\bpcie\b|\bpcie\b.*\b80 ?gb\b", 1935 * GB),
            (r"\b80 ?gb\b", 2039 * GB),
            ("", 1555 * GB),
        ),
        "NVIDIA A100 datasheet",
    ),
    "a10": ((("", 600 * GB),), "NVIDIA A10 datasheet"),  # 600 GB/s GDDR6
    "a10g": ((("", 600 * GB),), "AWS G5 A10G figures"),  # 600 GB/s GDDR6 (24 GB)
    "h100 sxm": ((("", 3350 * GB),), "NVIDIA H100 datasheet"),  # SXM column: 3.35 TB/s HBM3
    "h100 pcie": ((("", 2000 * GB),), "NVIDIA H100 PCIe datasheet"),  # 2 TB/s HBM2e
    "h100 nvl": ((("", 3900 * GB),), "NVIDIA H100 datasheet (NVL)"),  # NVL column: 3.9 TB/s per card
    # NVIDIA GH200 datasheet: 96 GB HBM3 at 4 TB/s, 144 GB HBM3e at 4.9 TB/s ("GH200 480GB" is the first).
    "gh200": (((r"\b144 ?g|\bhbm3e\b", 4900 * GB), ("", 4000 * GB)), "NVIDIA GH200 datasheet"),
    "h200 sxm": ((("", 4800 * GB),), "NVIDIA H200 datasheet"),  # 4.8 TB/s HBM3e
    "h200 nvl": ((("", 4800 * GB),), "NVIDIA H200 datasheet (NVL)"),
    "b200": ((("", 8000 * GB),), "NVIDIA HGX B200 specifications"),  # 8 TB/s per GPU
    "gb200": ((("", 8000 * GB),), "NVIDIA GB200 NVL72 specifications"),  # 576 TB/s over 72 GPUs
    "l4": ((("", 300 * GB),), "NVIDIA L4 datasheet"),  # 300 GB/s GDDR6
    "l40": ((("", 864 * GB),), "NVIDIA L40 datasheet"),  # 864 GB/s GDDR6
    "l40s": ((("", 864 * GB),), "NVIDIA L40S datasheet"),  # 864 GB/s GDDR6
    "rtx 4090": ((("", 1008 * GB),), "NVIDIA Ada architecture whitepaper"),  # 1,008 GB/s GDDR6X
    "mi300x": ((("", 5300 * GB),), "AMD Instinct MI300X datasheet"),  # 5.3 TB/s HBM3
    "mi325x": ((("", 6000 * GB),), "AMD Instinct MI325X datasheet"),  # 6 TB/s HBM3E
    "mi355x": ((("", 8000 * GB),), "AMD Instinct MI355X datasheet"),  # 8 TB/s HBM3E
}

# Device-name patterns, most specific first, on the name lowercased with "-" and "_" as spaces.
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bmi355x\b", "mi355x"),
    (r"\bmi325x\b", "mi325x"),
    (r"\bmi300x\b", "mi300x"),
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
    (r"\bgh200\b", "gh200"),
    (r"\bh200\b.*\bnvl\b", "h200 nvl"),
    (r"\bh200\b", "h200 sxm"),
    (r"\bh100\b.*\bnvl\b", "h100 nvl"),
    (r"\bh100\b.*\b(pcie|hbm2e)\b", "h100 pcie"),
    (r"\bh100\b", "h100 sxm"),  # "NVIDIA H100 80GB HBM3": the SXM part names neither PCIe nor NVL
    (r"\ba100\b", "a100"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\brtx 4090\b(?! (d|laptop)\b)", "rtx 4090"),  # the 4090 D and the laptop part are other chips
)


def _normalized(device_name: str) -> str:
    return re.sub(r"[\s_-]+", " ", device_name.lower()).strip()


def _chip_key(device_name: str) -> str | None:
    name = _normalized(device_name)
    if re.search(r"\bmig\b", name):
        return None  # a MIG instance has a fraction of the GPU's SMs: the full GPU's peak would be wrong
    return next((key for pattern, key in _PATTERNS if re.search(pattern, name)), None)


def chip_for(device_name: str) -> Chip | None:
    """The table entry of a ``torch.cuda.get_device_name()`` string, or None (unknown, or a MIG slice).

    Args:
        device_name: what ``torch.cuda.get_device_name()`` returned.
    """
    key = _chip_key(device_name)
    return CHIPS[key] if key is not None else None


def bandwidth_for(device_name: str) -> tuple[float, str] | None:
    """The table's peak memory bandwidth (bytes/s) of a device name and where it comes from, or None
    (unknown, or a MIG slice).

    Args:
        device_name: what ``torch.cuda.get_device_name()`` returned.
    """
    key = _chip_key(device_name)
    if key is None:
        return None
    variants, source = BANDWIDTHS[key]
    normalized = _normalized(device_name)
    found = next(value for pattern, value in variants if re.search(pattern, normalized))
    return found, f"{CHIPS[key].name}, {source}"
