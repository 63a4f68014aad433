"""Module latencies of single generation steps, from one run timed module by module.

The module timer (:class:`~flops_callbacks.timing.module_timer.ModuleTimer`: clock marks only, the hooks'
cost taken out) marks every module call of a whole run of its own; its spans are split here by the
model's own calls (a step's calls, as that run's marks count them: one, or a hand-chunked prefill's
several, summed), so that the prefill's tree and the middle decode step's carry the latencies of that
very step. Why not the counting run's module latencies: every op runs through Python
there, several times a clean run's time on a model of small ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flops_callbacks.module_tree import fill_uncalled
from flops_callbacks.phase_names import FORWARD
from flops_callbacks.timing.spans import ModuleSpan

__all__ = ["COUNTING_RUN_SOURCE", "MODULE_TIMING_SOURCE", "step_module_times"]

# where a generation's module latencies come from (the result's ``module_latencies``)
MODULE_TIMING_SOURCE = "a run of their own with clock marks on every module (the hooks' cost taken out)"
COUNTING_RUN_SOURCE = "the counting run (inflated by counting: proportions only)"


def step_module_times(spans: Sequence[ModuleSpan], steps: Sequence[int]) -> dict[int, dict[str, float]]:
    """Forward seconds per module name in each of ``steps`` (indices of the model's outermost calls),
    modules never called themselves (a ``ModuleList``) given their called submodules' sum. A step holds
    the module calls made between the model's call before it and its own end: an encoder-decoder's
    encoder, which ``generate()`` calls before the model's first call, is the prefill's, and the step's
    root time is the model's call and such calls before it (not the host's time between them)."""
    forward = sorted((s for s in spans if s.phase == FORWARD), key=lambda s: s.start)
    calls = [s for s in forward if s.name == ""]
    found: dict[int, dict[str, float]] = {}
    for step in steps:
        if not 0 <= step < len(calls):
            continue
        call = calls[step]
        after = calls[step - 1].start + calls[step - 1].duration if step else -math.inf
        end = call.start + call.duration
        table = {"": call.duration}  # the model's own call: not the next one, which may start at its end
        outer_end = after  # the end of the last call before the model's not inside another one
        for span in forward:
            if not span.name or not after <= span.start <= end:
                continue
            table[span.name] = table.get(span.name, 0.0) + span.duration
            if span.start < call.start and span.start >= outer_end:  # an outermost call before the model's
                table[""] += span.duration
                outer_end = span.start + span.duration
        fill_uncalled(table)
        found[step] = table
    return found
