"""Dense peak FLOPS per device and compute dtype (MFU's denominator), and peak DRAM bandwidth per device
(the roofline's other roof), per single device, each figure with its datasheet named.

Datasheets' "with sparsity" figures are halved, never used as they are; where one name covers parts
with different memory (A100 40 / 80 GB), the device name picks the part. A name that matches nothing,
a MIG slice or a CPU gives no peak: we do not guess; ``peak_flops=`` / ``FLOPS_CALLBACKS_PEAK_FLOPS``
(a number, or ``measure``: the device's dense matmul rate, measured by ``peak_measure.py``) and
``peak_bandwidth=`` / ``FLOPS_CALLBACKS_PEAK_BANDWIDTH`` (bytes/s) set them instead. Why not
Lightning's ``get_available_flops``: the core depends on torch only, and its table has no B200, GB200,
GH200, AMD or fp8 entries, gives H200 with sparsity, an H100 NVL pair and the RTX 4090's FP32 rate
for bf16, and only warns on an unknown device.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from flops_callbacks.peak_measure import measured_matmul
from flops_callbacks.peak_table import (
    BANDWIDTHS,
    BF16,
    CHIPS,
    DTYPES,
    FP8,
    FP16,
    FP32,
    FP64,
    GB,
    TF32,
    Chip,
    T,
    bandwidth_for,
    chip_for,
)

__all__ = [
    "Bandwidth",
    "BANDWIDTH_ENV_VAR",
    "bandwidth_from_env",
    "BANDWIDTHS",
    "BF16",
    "check_peak_bandwidth",
    "check_peak_flops",
    "Chip",
    "chip_for",
    "CHIPS",
    "device_name",
    "DTYPES",
    "ENV_VAR",
    "MEASURE",
    "MEASURED",
    "FP16",
    "FP32",
    "FP64",
    "fp32_matmul_dtype",
    "FP8",
    "GB",
    "given_bandwidth",
    "given_peak",
    "measure_peak",
    "measured_dtype",
    "parameters_dtype",
    "Peak",
    "peak_from_env",
    "PeakToMeasure",
    "resolve_bandwidth",
    "resolve_peak",
    "T",
    "table_bandwidth",
    "table_peak",
    "TF32",
]

ENV_VAR = "FLOPS_CALLBACKS_PEAK_FLOPS"
MEASURE = "measure"  # peak_flops="measure", FLOPS_CALLBACKS_PEAK_FLOPS=measure: the matmul rate, measured
MEASURED = "measured: "  # how a measured peak's source starts
BANDWIDTH_ENV_VAR = "FLOPS_CALLBACKS_PEAK_BANDWIDTH"

_Figure = TypeVar("_Figure")  # Peak or Bandwidth
_Value = TypeVar("_Value")  # what an argument's check returns


def fp32_matmul_dtype(device: torch.device | None = None) -> str:
    """What an fp32 matmul runs in on ``device``: on a CPU, ``bf16`` where torch lets oneDNN run them in
    bf16 (AMX), else ``fp32`` (its "tf32" runs at the fp32 rate); elsewhere ``tf32`` when torch lets them
    use TF32 tensor cores, else ``fp32``."""
    if device is not None and device.type == "cpu":
        mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
        return BF16 if getattr(mkldnn, "fp32_precision", None) == "bf16" else FP32
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if isinstance(precision, str):  # torch >= 2.9; reading allow_tf32 there can raise after the new API
        return TF32 if precision == "tf32" else FP32
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return TF32 if tf32 else FP32


_HALF = {torch.bfloat16: BF16, torch.float16: FP16}  # the half precisions' DTYPES names


def parameters_dtype(model: torch.nn.Module) -> str | None:
    """The compute dtype of ``model``'s matmuls without autocast: its floating parameters' dtype, with
    fp32 as :func:`fp32_matmul_dtype` says (None for a dtype no matmul rate is known for).

    Args:
        model: the model whose parameters are read.
    """
    found = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = torch.float32 if found is None else found.dtype
    if dtype == torch.float32:
        return fp32_matmul_dtype(None if found is None else found.device)
    return FP64 if dtype == torch.float64 else _HALF.get(dtype)


def measured_dtype(declared: str | None, matmuls: torch.dtype | None) -> str | None:
    """The compute dtype a peak is read for: ``declared`` (the framework's precision, or the parameters'
    dtype), unless the counted matmuls produced a half precision it did not say (a loop's own
    ``torch.autocast``: the parameters stay fp32, the matmuls run in bf16 at a 15x higher peak).

    Args:
        declared: a :data:`DTYPES` name, or None.
        matmuls: the dtype most of the counted MACs produced (None: none counted).
    """
    half = _HALF.get(matmuls) if matmuls is not None else None
    return half if half is not None and declared in (None, FP32, TF32) else declared


def _positive(value: Any, name: str, what: str, example: str, also: str = "") -> float | None:
    """``value`` as a positive float, None for None; a ValueError naming ``name`` and ``what`` otherwise
    (``also``: another value the argument takes, said in the error)."""
    if value is None:
        return None
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's scalars too
    if not number or not 0 < value < float("inf"):
        unset = "unset" if name.isupper() else "None"  # an environment variable's name is upper case
        raise ValueError(
            f"{name} must be {what}, a positive number (e.g. {example}){also}, or {unset} to look the "
            f"device up; got {value!r}"
        )
    return float(value)


def _from_env(variable: str, check: Callable[[Any, str], _Value]) -> _Value | None:
    """The number an environment variable sets, checked as its argument is (None when unset)."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return None
    try:
        value: float | str = float(raw)
    except ValueError:
        value = raw  # reported as given
    return check(value, variable)


def check_peak_flops(value: Any, name: str = "peak_flops") -> float | Literal["measure"] | None:
    """``value`` as a positive float, ``"measure"`` as it is, None for None; ValueError naming ``name``
    otherwise.

    Args:
        value: the user's peak FLOPS, or ``"measure"``.
        name: the argument's name, as the error says it.
    """
    if isinstance(value, str) and value == MEASURE:  # not ``value == MEASURE``: an array compares elementwise
        return "measure"
    also = f", {MEASURE!r} to measure the device's dense matmul rate"
    return _positive(value, name, "the dense peak FLOPS of one device", "989e12", also)


def peak_from_env() -> float | Literal["measure"] | None:
    """The peak set by ``FLOPS_CALLBACKS_PEAK_FLOPS`` (FLOPS per device, e.g. ``989e12``, or ``measure``)."""
    return _from_env(ENV_VAR, check_peak_flops)


@dataclass(frozen=True)
class Peak:
    """The peak FLOPS of one device that MFU is computed against, and where it came from."""

    flops: float
    """FLOPS per device."""
    source: str
    """``peak_flops argument``, the environment variable, ``<chip> <dtype> dense, <datasheet>`` or
    ``measured: <dtype> dense matmul ...``."""

    @property
    def kind(self) -> str:
        """Where the figure came from, in a word: ``measured``, ``given`` (the argument or the environment
        variable) or ``datasheet`` (the peak table)."""
        if self.source.startswith(MEASURED):
            return "measured"
        return "given" if self.source.endswith(("argument", "environment variable")) else "datasheet"


@dataclass(frozen=True)
class PeakToMeasure(Peak):
    """A peak asked to be measured at the window's end, on the model's device in its compute dtype (no
    figure until :func:`resolve_peak` measures it); ``source``: what asked."""

    flops: float = math.nan
    source: str = f"peak_flops={MEASURE!r}"


def given_peak(peak_flops: float | str | None) -> Peak | None:
    """The user's peak: the argument, else the environment variable (both validated already); a
    :class:`PeakToMeasure` where the one that applies says ``measure``.

    Args:
        peak_flops: the ``peak_flops=`` argument: a number, ``"measure"`` or None.
    """
    value: float | str | None
    if peak_flops is not None:
        value, source, asked = peak_flops, "peak_flops argument", f"peak_flops={MEASURE!r}"
    else:
        value, source, asked = peak_from_env(), f"{ENV_VAR} environment variable", f"{ENV_VAR}={MEASURE}"
    if value is None:
        return None
    return PeakToMeasure(source=asked) if value == MEASURE else Peak(float(value), source)


def device_name(device: torch.device) -> str | None:
    """What the accelerator calls itself (``torch.cuda.get_device_name``); None for CPU and meta.

    Args:
        device: the device the model runs on.
    """
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    get_name = getattr(module, "get_device_name", None)
    return str(get_name(device)) if get_name is not None else None


def table_peak(name: str, dtype: str) -> tuple[Peak | None, str]:
    """The table's peak for a device name and compute dtype, or None and why not.

    Args:
        name: the device's name.
        dtype: the compute dtype, a :data:`DTYPES` name.
    """
    chip = chip_for(name)
    if chip is None:
        return None, f"device {name!r} is not in the peak table"
    if dtype == TF32 and TF32 not in chip.peaks:
        dtype = FP32  # no TF32 hardware (MI355X): fp32 matmuls run at the fp32 rate
    flops = chip.peaks.get(dtype)
    if flops is None:
        return None, f"the peak table has no {dtype} figure for {chip.name}"
    return Peak(flops, f"{chip.name} {dtype} dense, {chip.source}"), ""


def _name_or_why(device: torch.device, what: str, how: str) -> tuple[str | None, str]:
    """The device's name for the tables, or None and why there is no table entry for it."""
    name = device_name(device)
    return name, "" if name is not None else f"no {what} for a {device.type} device: {how}"


def resolve_peak(given: Peak | None, device: torch.device, dtype: str | None) -> tuple[Peak | None, str]:
    """The peak to use: the user's if given, else the table's for ``device`` at ``dtype``; or None and
    a sentence saying why there is none (no guessing).

    Args:
        given: the user's peak, or None.
        device: the device the model runs on.
        dtype: the compute dtype, or None when unknown.
    """
    if isinstance(given, PeakToMeasure):
        return measure_peak(device, dtype, given.source)
    how = f"pass peak_flops= (a number, or {MEASURE!r}) or set {ENV_VAR}"
    name, why = _name_or_why(device, "peak FLOPS", how)
    if given is not None or name is None:
        return given, "" if given is not None else why
    if dtype is None:
        return None, f"unknown compute dtype on {name!r}: {how}"
    peak, why = table_peak(name, dtype)
    return peak, f"{why}: {how}" if peak is None else ""


def measure_peak(device: torch.device, dtype: str | None, asked_by: str) -> tuple[Peak | None, str]:
    """The device's dense matmul rate in ``dtype``, measured (once per process, device and dtype, in at
    most 2 s: ``peak_measure.py``), as a peak whose source says "measured"; or None and why not.

    Args:
        device: the device the model runs on.
        dtype: the compute dtype, or None when unknown.
        asked_by: what asked for the measure (the argument or the environment variable).
    """
    how = f"pass peak_flops= a number instead of {MEASURE!r}"
    if device.type == "meta":
        return None, f"no matmul to measure on a meta device ({asked_by}): {how}"
    if dtype is None:
        return None, f"unknown compute dtype, no matmul to measure ({asked_by}): {how}"
    try:
        found = measured_matmul(device, dtype)
    except (ValueError, RuntimeError) as error:  # fp8, a dtype the device lacks, out of memory
        return None, f"could not measure a {dtype} matmul on {device} ({error}; {asked_by}): {how}"
    on = device_name(device) or device.type
    source = (
        f"{MEASURED}{dtype} dense matmul {found.size}x{found.size} on {on}, best of {found.trials} "
        f"in {found.seconds:.1f} s, {asked_by}"
    )
    return Peak(found.flops, source), ""


@dataclass(frozen=True)
class Bandwidth:
    """The peak memory bandwidth of one device that the roofline is drawn with, and where it came from."""

    bytes_per_sec: float
    source: str  # "peak_bandwidth argument", the environment variable, or "<chip>, <datasheet>"


def check_peak_bandwidth(value: Any, name: str = "peak_bandwidth") -> float | None:
    """``value`` as a positive float, None for None; ValueError naming ``name`` otherwise.

    Args:
        value: the user's peak bandwidth, bytes/s.
        name: the argument's name, as the error says it.
    """
    return _positive(value, name, "the peak memory bandwidth of one device in bytes/s", "3.35e12")


def bandwidth_from_env() -> float | None:
    """The bandwidth set by ``FLOPS_CALLBACKS_PEAK_BANDWIDTH`` (bytes/s per device, e.g. ``3.35e12``)."""
    return _from_env(BANDWIDTH_ENV_VAR, check_peak_bandwidth)


def table_bandwidth(name: str) -> Bandwidth | None:
    """The table's peak memory bandwidth for a device name, or None (unknown, or a MIG slice).

    Args:
        name: the device's name.
    """
    found = bandwidth_for(name)
    return None if found is None else Bandwidth(*found)


def resolve_bandwidth(given: Bandwidth | None, device: torch.device) -> tuple[Bandwidth | None, str]:
    """The bandwidth to use: the user's if given, else the table's for ``device``; or None and a
    sentence saying why there is none.

    Args:
        given: the user's bandwidth, or None.
        device: the device the model runs on.
    """
    how = f"pass peak_bandwidth= or set {BANDWIDTH_ENV_VAR}"
    name, why = _name_or_why(device, "peak bandwidth", how)
    if given is not None or name is None:
        return given, "" if given is not None else why
    found = table_bandwidth(name)
    return found, "" if found is not None else f"device {name!r} is not in the bandwidth table: {how}"


def given_bandwidth(peak_bandwidth: float | None) -> Bandwidth | None:
    """The user's peak bandwidth: the argument, else the environment variable (validated here).

    Args:
        peak_bandwidth: the ``peak_bandwidth=`` argument, or None.
    """
    return _given(peak_bandwidth, "peak_bandwidth", bandwidth_from_env, BANDWIDTH_ENV_VAR, Bandwidth)


def _given(
    value: float | None,
    argument: str,
    from_env: Callable[[], float | None],
    env_var: str,
    make: Callable[[float, str], _Figure],
) -> _Figure | None:
    """The argument's figure, else the environment variable's, each with its source; None for neither."""
    if value is not None:
        return make(float(value), f"{argument} argument")
    found = from_env()
    return make(found, f"{env_var} environment variable") if found is not None else None
