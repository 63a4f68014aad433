"""The device's dense matmul peak, measured: MFU's denominator where no datasheet applies (a CPU, a device
the table lacks), asked for with ``peak_flops="measure"`` or ``FLOPS_CALLBACKS_PEAK_FLOPS=measure``.

Square matmuls in the compute dtype, on the model's device, growing until one call is long enough to
time or the matrices reach :data:`MAX_SIZE`; then repeated at the fastest size, the best rate kept, all
within :data:`MEASURE_SECONDS`. The best rate, not the median: a peak is what the device can do, and a
neighbour's load only ever slows a trial down. Measured once per process, device and dtype. Why not a
fixed figure per CPU: CPUs have no datasheet for their matmul rate (it hangs on the BLAS, the threads
and the clocks), and a datasheet's figure for a device the table lacks is a guess.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["MAX_SIZE", "MEASURE_SECONDS", "Measured", "measure_matmul", "measured_matmul"]

MEASURE_SECONDS = 2.0  # the whole measurement, warm-up and every size included
MAX_SIZE = {"cpu": 2048}  # the largest matrix side per device type (others: 8192)
_START, _ACCELERATOR_MAX = 256, 8192
_TRIAL = 0.025  # seconds a trial aims at: many calls of a small matrix, one of a large one
_LONG_ENOUGH = 0.02  # a call this long is timed well: the sizes stop growing
_DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_MARGIN = 0.85  # of the time allowed, what the trials may plan to fill: a slow last trial still fits
_cache: dict[tuple[str, str], Measured] = {}
_clock, _mm = time.perf_counter, torch.mm  # what the tests replace with a device of known speed


class Measured(NamedTuple):
    """A measured matmul rate and how it was taken."""

    flops: float  # the best rate, flops per second
    size: int  # the side of the square matrices it was taken on
    trials: int  # timed trials at that size (its first single call included)
    seconds: float  # the whole measurement's


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work (nothing on a CPU)."""
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if device.type == "cpu" or sync is None:
        return lambda: None
    if device.type == "mps":
        return sync
    return lambda: sync(device)


def measure_matmul(device: torch.device, dtype: str, seconds: float = MEASURE_SECONDS) -> Measured:
    """The best dense matmul rate of ``device`` in ``dtype`` (a peak table name), measured now in at most
    ``seconds``; ValueError for a dtype with no dense matmul to measure (fp8), RuntimeError from torch.

    Args:
        device: the device the model runs on.
        dtype: the compute dtype: ``fp32``, ``tf32`` (fp32 tensors, torch's matmul settings), ``bf16``,
            ``fp16``.
        seconds: the time allowed, warm-up included.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"no dense {dtype} matmul to measure (measured: {', '.join(_DTYPES)})")
    start = _clock()
    deadline = start + _MARGIN * seconds
    sync = _synchronizer(device)
    cap = MAX_SIZE.get(device.type, _ACCELERATOR_MAX)
    best, best_size, trials, size = 0.0, _START, 0, _START
    # random operands (a GPU's clock may rise on zeros), drawn from a fork: the run's random state is its own
    accelerator = device.type != "cpu"
    forked = torch.random.fork_rng(
        [device] if accelerator else [], device_type=device.type if accelerator else "cuda"
    )
    with forked, torch.no_grad():
        while True:
            a = torch.randn(size, size, device=device, dtype=_DTYPES[dtype])
            b, out = torch.randn_like(a), torch.empty_like(a)
            _mm(a, b, out=out)  # warm-up: the kernel chosen, the threads woken
            sync()
            once = _clock()
            _mm(a, b, out=out)
            sync()
            call = max(_clock() - once, 1e-9)
            rate = 2 * size**3 / call
            if rate > best:
                best, best_size = rate, size
            grow = size * 2 <= cap and call < _LONG_ENOUGH
            if not grow or _clock() + 16 * call > deadline:  # the next size: two calls of ~8x this one
                break
            size *= 2
        if best_size != size:  # the fastest size was a smaller one: time it again
            size = best_size
            a = torch.randn(size, size, device=device, dtype=_DTYPES[dtype])
            b, out = torch.randn_like(a), torch.empty_like(a)
        call = 2 * size**3 / best
        calls = max(1, int(_TRIAL / call))
        while _clock() + 2 * calls * call < deadline:  # the next trial, planned at twice its time
            sync()
            began = _clock()
            for _ in range(calls):
                _mm(a, b, out=out)
            sync()
            best = max(best, 2 * size**3 * calls / (_clock() - began))
            trials += 1
    return Measured(best, size, trials + 1, _clock() - start)


def measured_matmul(device: torch.device, dtype: str) -> Measured:
    """:func:`measure_matmul` once per process, device and dtype (a re-profiled window reuses it).

    Args:
        device: the device the model runs on.
        dtype: the compute dtype.
    """
    key = (str(device), dtype)
    if key not in _cache:
        _cache[key] = measure_matmul(device, dtype)
    return _cache[key]
