"""How the reports name the steps a figure comes from: ``"step 5"``, ``"steps 5-9"``, ``"steps 5, 7"``.

One place, so that the console summary, the full report, the module tree's check and the communication rows
name the same steps the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["step_list", "steps_named"]


def step_list(steps: Sequence[int]) -> str:
    """``"14-19"`` for a run of more than two steps, ``"14, 16"`` otherwise, ``"none"`` for no step."""
    if not steps:
        return "none"
    if len(steps) > 2 and list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(str(s) for s in steps)


def steps_named(steps: Sequence[int]) -> str:
    """``"step 14"``, ``"steps 14-19"``, ``"steps 14, 16"`` (``"no step"`` for none)."""
    if not steps:
        return "no step"
    return f"step{'s' if len(steps) > 1 else ''} {step_list(steps)}"
