"""The names of the three sets of phases: an optimizer step's phases, a module's passes and their short
forms in the profile's fields (``fwd_flops``, ``bwd_latency``), of which the roofline judges two.

One module at the base names them all, so a phase is spelled one way everywhere and each set has a name
of its own: a step's ``forward`` and a module's ``forward`` are the same word, but ``recompute`` is a
pass and never a step phase, and the optimizer step is a phase and never a pass.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BACKWARD",
    "FORWARD",
    "MODULE_PASSES",
    "ModulePass",
    "OPTIMIZER_STEP",
    "PROFILE_PASSES",
    "RECOMPUTE",
    "ROOFLINE_PASSES",
    "STEP_PHASES",
    "StepPhase",
]

ModulePass = Literal["forward", "backward", "recompute"]  # recompute: a checkpointed forward in the backward
StepPhase = Literal["forward", "backward", "optimizer_step"]

FORWARD: Literal["forward"] = "forward"
BACKWARD: Literal["backward"] = "backward"
RECOMPUTE: Literal["recompute"] = "recompute"
OPTIMIZER_STEP: Literal["optimizer_step"] = "optimizer_step"

STEP_PHASES: tuple[StepPhase, ...] = (FORWARD, BACKWARD, OPTIMIZER_STEP)  # in the order they run
MODULE_PASSES: tuple[ModulePass, ...] = (FORWARD, BACKWARD, RECOMPUTE)  # also the trace's track order
PROFILE_PASSES = ("fwd", "bwd", "recompute")  # MODULE_PASSES as the profile's field prefixes
ROOFLINE_PASSES = PROFILE_PASSES[:2]  # the passes the roofline judges: a module's forward and backward
