"""The roofline verdict of a module: is its time bound by arithmetic, by memory bandwidth, or by neither?

Given a module's flops, the bytes its ops move (:mod:`flops_callbacks.counting.bytes_moved`) and its measured
latency, and the device's peak FLOPS and peak memory bandwidth, the roofline model says the fastest the
module could run: ``bound = max(flops / peak FLOPS, bytes / peak bandwidth)``. Which term is larger is
the ``limiter``; ``bound / latency`` is the ``roofline_fraction`` it achieved. A module far below both
roofs (under :data:`OVERHEAD_FRACTION`) is limited by neither: its time goes to kernel launches,
Python and framework code, which fusing or ``torch.compile`` removes.

Plain numbers in, plain data out: no torch, no framework. Why not torch's or an existing tool's:
inductor's and Nsight's rooflines are per kernel, torchao's ``PerformanceCounterMode`` merges forward
and backward; none gives a verdict per ``nn.Module`` of a training step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from flops_callbacks.phase_names import ROOFLINE_PASSES
from flops_callbacks.profile import ModuleProfile, Profile

__all__ = [
    "COMPUTE",
    "MEMORY",
    "OVERHEAD_FRACTION",
    "Roofline",
    "as_data",
    "module_rooflines",
    "roofline",
]

COMPUTE, MEMORY = "compute", "memory"
OVERHEAD_FRACTION = 0.1  # below a tenth of the roofline: neither roof is what limits the module


@dataclass(frozen=True)
class Roofline:
    """One module in one pass, against the device's two roofs."""

    flops: int
    bytes: int
    seconds: float  # the measured latency
    intensity: float | None  # flops per byte moved (None when no byte was moved)
    flops_per_sec: float  # achieved: flops / seconds
    bound_seconds: float  # max(flops / peak FLOPS, bytes / peak bandwidth)
    roofline_fraction: float  # bound_seconds / seconds
    limiter: str  # COMPUTE or MEMORY: the larger of the two terms

    @property
    def overhead_bound(self) -> bool:
        """Far below both roofs: launch and Python overhead, not arithmetic or memory, take the time."""
        return self.roofline_fraction < OVERHEAD_FRACTION

    def verdict(self) -> str:
        """``"memory-bound at 12% of the roofline"``, or ``"overhead-bound at 0.3% of the roofline
        (memory roof)"`` far below both roofs."""
        share = 100 * self.roofline_fraction  # two digits below 10%, whole percents above (not 1e+02%)
        at = f"{share:.0f}% of the roofline" if share >= 10 else f"{share:.2g}% of the roofline"
        if self.overhead_bound:
            return f"overhead-bound at {at} ({self.limiter} roof)"
        return f"{self.limiter}-bound at {at}"


def roofline(
    flops: int, moved: int, seconds: float, peak_flops: float, peak_bandwidth: float
) -> Roofline | None:
    """The verdict for ``flops`` and ``moved`` bytes done in ``seconds``; None without a latency or work.

    Args:
        flops: the work done.
        moved: the bytes moved.
        seconds: the measured latency.
        peak_flops: the device's peak FLOPS.
        peak_bandwidth: the device's peak memory bandwidth, bytes/s.
    """
    if seconds <= 0 or (flops <= 0 and moved <= 0):
        return None
    compute, memory = flops / peak_flops, moved / peak_bandwidth
    bound = max(compute, memory)
    return Roofline(
        flops=flops,
        bytes=moved,
        seconds=seconds,
        intensity=flops / moved if moved else None,
        flops_per_sec=flops / seconds,
        bound_seconds=bound,
        roofline_fraction=bound / seconds,
        limiter=COMPUTE if compute > memory else MEMORY,
    )


def _of(m: ModuleProfile, phase: str, peak_flops: float, peak_bandwidth: float) -> Roofline | None:
    flops, moved = getattr(m, f"{phase}_flops"), getattr(m, f"{phase}_bytes")
    return roofline(flops, moved, getattr(m, f"{phase}_latency"), peak_flops, peak_bandwidth)


def module_rooflines(
    profile: Profile, peak_flops: float, peak_bandwidth: float
) -> dict[str, dict[str, Roofline]]:
    """Every module's forward and backward roofline, where it has a latency and did work.

    Args:
        profile: the profile whose modules are judged.
        peak_flops: the device's peak FLOPS.
        peak_bandwidth: the device's peak memory bandwidth, bytes/s.
    """
    found: dict[str, dict[str, Roofline]] = {}
    for name, m in profile.modules.items():
        phases = {phase: r for phase in ROOFLINE_PASSES if (r := _of(m, phase, peak_flops, peak_bandwidth))}
        if phases:
            found[name] = phases
    return found


def as_data(rooflines: dict[str, dict[str, Roofline]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``rooflines`` as JSON-ready plain data (the JSON's module entries, the picture's points).

    Args:
        rooflines: module name -> pass -> roofline, as :func:`module_rooflines` returns them.
    """
    return {
        name: {phase: {**asdict(r), "overhead_bound": r.overhead_bound} for phase, r in phases.items()}
        for name, phases in rooflines.items()
    }
