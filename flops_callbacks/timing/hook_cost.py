"""What the timing hooks of one module call cost (:class:`HookCost`), and the bounds that keep a measure
taken in place (the model's outermost calls on a module-timing step against the same calls on clean
steps) believable (:meth:`HookCost.measured`). The module timer takes the cost out of its spans
(:mod:`flops_callbacks.timing.module_timer`); a synthetic probe gives the fallback
(:mod:`flops_callbacks.timing.hook_probe`)."""

from __future__ import annotations

import dataclasses

__all__ = ["HookCost", "MIN_CALLS", "PROBE_CEILING"]

# A cost measured in place is kept between the probe's (a floor: its hooks run hot in a tight loop) and
# this many times it: HF's modules, called with keyword arguments through torch's slow call path, cost
# 3-5x the probe's per call (GPT-2, hooks on and off in a plain loop); a pause on the timed step reads more.
PROBE_CEILING = 8.0
MIN_CALLS = 20  # fewer calls inside the outer ones: a step's noise outweighs their hooks, the probe stands


@dataclasses.dataclass(frozen=True)
class HookCost:
    """What the timing hooks of one module call cost, in seconds: ``per_call`` in all (what it adds to
    its caller's span), of which ``own`` lies inside the call's own span (between its two marks);
    ``source`` says how it was found in a few words, ``detail`` in full."""

    per_call: float
    own: float
    source: str
    detail: str = ""

    def instead(self, why: str) -> HookCost:
        """This (probe's) cost, with why no in-place measure replaced it.

        Args:
            why: why no in-place measure replaced the probe's cost.
        """
        return dataclasses.replace(self, detail=f"{self.detail}; not measured in place: {why}")

    def measured(self, hooked: float, clean: float, calls: int, detail: str, noise: float = 0.0) -> HookCost:
        """The cost measured in place: the outermost module calls with the timer's hooks on (seconds)
        less the same calls on clean steps, over the ``calls`` made inside them (the outer calls' own
        share, under a percent at ``MIN_CALLS``, is left in), kept between this (probe's) cost and
        ``PROBE_CEILING`` times it; the share inside a call's own span is the probe's. ``noise``: how
        much the clean steps' same calls vary (seconds, highest less lowest); where the hooks' cost as
        the probe reads it is less, the difference is the steps' noise more than the hooks' (a model of
        large ops: a 30-ms GPT-2 forward varied 3 ms from step to step on two busy cores, its 30 calls'
        hooks cost 0.6 ms) and the probe's cost stands: a few percent of such a model's time at most.

        Args:
            hooked: the outermost calls on the module-timing step, seconds.
            clean: the same calls on the clean steps, seconds.
            calls: the module calls made inside them.
            detail: how the cost was measured, as the report says it.
            noise: how much the clean steps' same calls vary, seconds.
        """
        if calls < MIN_CALLS:
            return self.instead(f"{calls} module call(s) inside the model's, fewer than {MIN_CALLS}")
        if calls * self.per_call < noise:
            return self.instead(
                f"the clean steps' outer calls vary by {noise * 1e3:.2f} ms, more than the hooks of "
                f"{calls} calls cost by the probe ({calls * self.per_call * 1e3:.2f} ms)"
            )
        measured = (hooked - clean) / calls
        per_call = min(max(measured, self.per_call), PROBE_CEILING * self.per_call)
        source = "measured in place"
        if per_call != measured:
            bound = "the probe's" if per_call == self.per_call else f"{PROBE_CEILING:g}x the probe's"
            source += f", kept to {bound}"
            detail += f" ({measured * 1e6:.1f} us, kept to {bound}: {self.per_call * 1e6:.1f} us a call)"
        share = self.own / self.per_call if self.per_call > 0 else 0.0
        return HookCost(per_call, per_call * share, source, detail)
