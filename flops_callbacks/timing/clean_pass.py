"""Latencies of a model taken on passes where nothing counts, for a caller that owns the loop.

``get_model_profile`` runs the model itself, so it need not report the counting pass's latencies
(every op through Python: several times the true time on a model of small ops). After the counting
pass it collects the counting's garbage, times the modules on one pass with clock marks only
(:class:`~flops_callbacks.timing.module_timer.ModuleTimer`), and the model on one more pass with nothing on;
the model's outermost calls, marked on both, give the hooks' cost per call, taken out of the modules'
spans (:mod:`flops_callbacks.timing.outer_calls`).
The callbacks do the same on separate training steps (:mod:`flops_callbacks.session.step_session`).

Gradients the extra passes make are not left behind: each parameter's ``.grad`` is set aside before
them and put back after, so the model holds what the counting pass left, as it did before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from flops_callbacks.module_tree import dynamo_compiled_anything, has_compiled
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clock import CpuClock, clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls

__all__ = ["CLEAN_PASS_SOURCE", "time_clean"]

CLEAN_PASS_SOURCE = "a clean pass after the counting pass (modules: a pass with clock marks only)"


def time_clean(profile: Profile, model: torch.nn.Module, run: Callable[[], torch.Tensor | None]) -> Profile:
    """``profile`` with its latencies taken on clean passes of ``run`` (which returns the loss to
    back-propagate, or None for a forward only): modules on one pass, the model on the next."""
    collect_counting_garbage()  # not in any timed pass
    clock = clock_for(module_device(model))
    timer = ModuleTimer(model, clock)
    # the hooks' cost, in place: the clean pass marks the model's outermost calls (CPU clocks; CUDA
    # events do not hold the hooks' host time; hooks on compiled modules would make dynamo recompile)
    compiled = has_compiled(model.modules()) or dynamo_compiled_anything()
    marks_outer = isinstance(clock, CpuClock) and not compiled
    with _grads_set_aside(model):
        timer.start()
        try:
            loss = run()
            if loss is not None:
                timer.arm()
                loss.backward()
        finally:
            timer.stop()
        outer = OuterCalls(timer.outermost(), clock) if marks_outer else None
        start = clock.mark()
        if outer is not None:
            outer.start()
        try:
            loss = run()
        finally:
            if outer is not None:
                outer.stop()
        middle = clock.mark()
        if loss is not None:
            loss.backward()
        end = clock.mark()
        clock.synchronize()
    fwd, bwd = clock.seconds(start, middle), clock.seconds(middle, end) if loss is not None else 0.0
    cost = None
    if outer is not None:
        hooked, calls = timer.outer_calls()
        source = "the model's outer calls on the timed pass less on the clean pass"
        cost = hook_cost().measured(hooked, outer.seconds(), calls, source)
    elif isinstance(clock, CpuClock):
        cost = hook_cost()
    times = timer.times(timer.fitted(cost) if cost is not None else None)
    return dataclasses.replace(times.applied_to(profile), fwd_latency=fwd, bwd_latency=bwd)


@contextmanager
def _grads_set_aside(model: torch.nn.Module) -> Iterator[None]:
    params = list(dict.fromkeys(model.parameters()))
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad
