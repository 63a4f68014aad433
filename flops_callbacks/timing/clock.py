"""Synchronized clocks: one interface for CPU wall time, CUDA events and other accelerators.

A clock hands out opaque marks without blocking and turns pairs of marks into seconds later, so a
profiled step pays one synchronization at the end, not one per module (DeepSpeed synchronizes in
every module hook).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "clock_for", "CpuClock", "CudaClock", "module_device", "NullClock", "SyncClock"]


class Clock(Protocol):
    """Marks points in time on a device and measures between them."""

    def mark(self) -> Any:
        """A point in time on this device, recorded without waiting for queued work."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (may synchronize the device).

        Args:
            start: the first mark.
            end: the second mark.
        """

    def synchronize(self) -> None:
        """Wait for all work queued on the device."""

    def done(self, mark: Any) -> bool:
        """Whether the device has reached ``mark``: its seconds can be read without waiting (never blocks).

        Args:
            mark: a mark of this clock.
        """


class CpuClock:
    """``time.perf_counter``; CPU work is synchronous, so marks are exact."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass

    def done(self, mark: float) -> bool:
        return True


class CudaClock:
    """CUDA events on the current stream: marks cost microseconds and never stall the GPU.

    Args:
        device: the CUDA device timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()


class SyncClock:
    """Other accelerators (XPU, MPS, ...): synchronize, then ``perf_counter``.

    Args:
        device: the device synchronized before each mark.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        module = getattr(torch, self.device.type, None)
        sync = getattr(module, "synchronize", None)
        if sync is not None:
            sync()

    def done(self, mark: float) -> bool:
        return True  # marked after a synchronize


class NullClock:
    """Meta tensors run no kernels: there is nothing to time."""

    def mark(self) -> None:
        return None

    def seconds(self, start: None, end: None) -> float:
        return 0.0

    def synchronize(self) -> None:
        pass

    def done(self, mark: None) -> bool:
        return True


def clock_for(device: torch.device | str) -> Clock:
    """The right clock for ``device``.

    Args:
        device: the device the model runs on.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return CpuClock()
    if device.type == "cuda":
        return CudaClock(device)
    if device.type == "meta":
        return NullClock()
    return SyncClock(device)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for a stateless module).

    Args:
        module: the module.
    """
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")
