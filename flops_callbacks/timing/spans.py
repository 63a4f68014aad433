"""A module call in time: the module timer's record of one span, which the Chrome trace draws.

Plain data in the timing layer, so that the timer that makes spans and the reports that show them
share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BACKWARD", "FORWARD", "OPTIMIZER_STEP", "PHASES", "RECOMPUTE", "ModuleSpan", "Phase", "StepPhase"]

Phase = Literal["forward", "backward", "recompute"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute")  # also the order of the tracks
StepPhase = Literal["forward", "backward", "optimizer_step"]  # the phases of an optimizer step

# The one vocabulary of phase names: a module's passes (forward, backward, recompute inside the backward)
# and an optimizer step's phases (forward, backward, optimizer step) share their first two.
FORWARD: Phase = "forward"
BACKWARD: Phase = "backward"
RECOMPUTE: Phase = "recompute"
OPTIMIZER_STEP: StepPhase = "optimizer_step"


@dataclass(frozen=True)
class ModuleSpan:
    """One call of one module in one phase; times in seconds from the start of the step."""

    name: str  # the module's qualified name, "" for the model
    phase: Phase
    start: float
    duration: float
    depth: int  # 0 for the model, as in ModuleProfile

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"ModuleSpan phase must be one of {', '.join(PHASES)}; got {self.phase!r}")
        if not self.duration >= 0:
            raise ValueError(f"ModuleSpan duration must be >= 0 seconds; got {self.duration!r}")
        if self.depth < 0:
            raise ValueError(f"ModuleSpan depth must be >= 0; got {self.depth!r}")
