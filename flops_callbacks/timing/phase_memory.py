"""Peak device memory allocated in each phase (forward, backward, optimizer step) of a clean step.

On CUDA the caching allocator keeps a high-water mark of allocated bytes: reset at a phase's start and
read at its end, it is that phase's peak, read from host-side counters without synchronizing the
device. Other devices have no such counter in torch: their peaks are n/a (``None``). NB: afterwards
``torch.cuda.max_memory_allocated()`` counts from the window's last clean step (said in the docs).

Why not ``torch.cuda.memory._record_memory_history``: it records every allocation with a stack, which
costs time on the very steps whose time we report.
"""

from __future__ import annotations

import torch

__all__ = ["PhaseMemory", "phase_memory_for"]


class PhaseMemory:
    """The peak allocated bytes of each phase on one CUDA device (the largest over its spans).

    Args:
        device: the CUDA device read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {}

    def reset(self) -> None:
        """A phase starts: the high-water mark starts from what is allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def close(self, phase: str) -> None:
        """``phase`` ends: keep its high-water mark, and start the next phase's.

        Args:
            phase: the phase that ends.
        """
        peak = torch.cuda.max_memory_allocated(self.device)
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        torch.cuda.reset_peak_memory_stats(self.device)


def phase_memory_for(device: torch.device) -> PhaseMemory | None:
    """A recorder for ``device`` when it is a CUDA device (ROCm included), else None.

    Args:
        device: the device the model runs on.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return PhaseMemory(device)
