"""A module call in time: the module timer's record of one span, which the Chrome trace draws.

Plain data in the timing layer, so that the timer that makes spans and the reports that show them
share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from flops_callbacks.phase_names import MODULE_PASSES, ModulePass

__all__ = ["ModuleSpan", "Phase"]

Phase = ModulePass  # a span's phase is one of the module's passes


@dataclass(frozen=True)
class ModuleSpan:
    """One call of one module in one phase; times in seconds from the start of the step."""

    name: str  # the module's qualified name, "" for the model
    phase: ModulePass
    start: float
    duration: float
    depth: int  # 0 for the model, as in ModuleProfile

    def __post_init__(self) -> None:
        if self.phase not in MODULE_PASSES:
            raise ValueError(
                f"ModuleSpan phase must be one of {', '.join(MODULE_PASSES)}; got {self.phase!r}"
            )
        if not self.duration >= 0:
            raise ValueError(f"ModuleSpan duration must be >= 0 seconds; got {self.duration!r}")
        if self.depth < 0:
            raise ValueError(f"ModuleSpan depth must be >= 0; got {self.depth!r}")
