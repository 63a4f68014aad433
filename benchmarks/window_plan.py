"""The profile window's global steps as the run plan lays them out (flops_callbacks.session.run_plan), for
the benchmarks: no table may count a window step (counting, module timing, clean) as unprofiled, and a
run meant to finish its window must run all of it, whatever the window's layout becomes.

Imported by the scripts beside it (``python benchmarks/x.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from flops_callbacks.options import Options
from flops_callbacks.session.run_plan import RunPlan

__all__ = ["window_steps"]


def window_steps(profile_step: int, clean_steps: int = 0) -> range:
    """The global steps of a window counted at ``profile_step`` with ``clean_steps`` clean steps, in a
    run from step 0 with one global step per optimizer step; ``.stop`` is the first step after it (the
    one at which the window has ended, and the ``max_steps`` of a run that ends with it)."""
    plan = RunPlan.of(Options(profile_step=profile_step, clean_steps=clean_steps), 0, None, 1)
    return range(plan.first, plan.last + 1)
