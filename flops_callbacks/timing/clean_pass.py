"""Latencies of a model taken on passes where nothing counts, for a caller that owns the loop.

``get_model_profile`` runs the model itself, so it need not report the counting pass's latencies
(every op through Python: several times the true time on a model of small ops). After the counting
pass it collects the counting's garbage, times the modules on one pass with clock marks only
(:class:`~flops_callbacks.timing.module_timer.ModuleTimer`), and the model on one more pass with nothing on;
the model's outermost calls, marked on both, give the hooks' cost per call, taken out of the modules'
spans (:mod:`flops_callbacks.timing.outer_calls`).
The callbacks do the same on separate training steps (:mod:`flops_callbacks.session.step_session`).

Gradients the extra passes make are not left behind: each parameter's ``.grad`` is set aside before
them and put back after (:func:`grads_set_aside`, which ``get_model_profile`` also holds around its
counting pass: the caller's gradients come back bitwise as they were).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from flops_callbacks.module_tree import dynamo_compiled_anything, has_compiled
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clock import CpuClock, clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls

__all__ = ["CLEAN_PASS_SOURCE", "eval_mode", "grads_set_aside", "time_clean"]

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
    with grads_set_aside(model.parameters()):
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
def grads_set_aside(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Each tensor's ``.grad`` set to None for the body and the very same object put back after it,
    whatever the body raised: gradients the body makes are dropped, the caller's stay bitwise."""
    params = list(dict.fromkeys(tensors))
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` for the body, then every submodule's own mode back, whatever the body raised."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
