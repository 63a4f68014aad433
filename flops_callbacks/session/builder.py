"""The window's steps -> one :class:`~flops_callbacks.session.result.WindowResult`, built once at the
window's end.

Apart from :mod:`flops_callbacks.session.step_session` (which decides what each step does) because this is the
other half of the job: which steps stand for what, the slowest rank's times, the peak, and where each
figure comes from, in words.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

import torch

from flops_callbacks.counting.engine import Tracer
from flops_callbacks.counting.estimate import estimate_rows
from flops_callbacks.guard import Guard
from flops_callbacks.parallel import sharded_params
from flops_callbacks.peaks import Bandwidth, Peak, resolve_bandwidth, resolve_peak
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.distributed import gather_latencies
from flops_callbacks.session.result import WindowResult, WindowSteps
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_steps import Kind, WindowStep, clean_figures
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimes, median_step
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phases import PHASES

__all__ = ["build_result"]


def _model_config(model: torch.nn.Module) -> Any:
    """The model's config (a transformers config: ``model.config``, or a submodule's), if it has one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return config
    return None


def _shapes(steps: list[WindowStep], flops: ShapeFlops) -> tuple[int, int, int]:
    """Distinct micro-batch shape signatures of the counted and clean steps: all of them, those whose
    flops were counted (as every micro-batch of theirs appeared: a step's first, or a later one), and
    those predicted."""
    seen: dict[Any, set[bool]] = {}
    for s in steps:
        if s.kind in (Kind.COUNTING, Kind.SHAPE_COUNTING, Kind.CLEAN):
            for i, sig in enumerate(s.signatures):
                seen.setdefault(sig, set()).add(i > 0)
    counted = sum(all((later, sig) in flops.counted for later in kinds) for sig, kinds in seen.items())
    return len(seen), counted, len(seen) - counted


def _peak_memory(steps: list[WindowStep]) -> dict[str, int] | None:
    """The largest peak allocated bytes of each phase over the clean steps (None off CUDA)."""
    recorded = [s.phases.memory.peaks for s in steps if s.phases.memory is not None]
    if not recorded:
        return None
    return {phase: max(peaks.get(phase, 0) for peaks in recorded) for phase in PHASES}


def _total(steps: list[WindowStep]) -> BatchCounts:
    """The counts of ``steps`` summed (those whose counts are known)."""
    known = (s.counts for s in steps if s.counts is not None)
    return functools.reduce(BatchCounts.plus, known, BatchCounts.zero())


def _own_forwards(clean: list[WindowStep]) -> list[tuple[WindowStep, OuterCalls]]:
    """The clean steps that marked the model's outermost module calls and caught at least one, with their
    marks: what both the hooks' in-place cost and the own-forward row read (a step that caught no call
    would read 0 seconds)."""
    return [(s, s.outer) for s in clean if s.outer is not None and s.outer.calls()]


def _hook_cost(module_steps: list[WindowStep], clean: list[WindowStep]) -> HookCost | None:
    """What one module call's timing hooks cost on the module-timing steps: measured in place where
    clean steps of the same batch shapes marked their outermost module calls (the median of those calls
    on the module-timing steps against theirs), else the probe's. CPU clocks only: a GPU's CUDA events
    do not hold the hooks' host time unless the model is launch-bound."""
    timers = [s.timer for s in module_steps if s.timer is not None]
    if not timers or not isinstance(timers[0].clock, CpuClock):
        return None
    probe = hook_cost()
    marked_steps = _own_forwards(clean)
    if not marked_steps:  # none ran, or compiled code in the process: hooks could change its guards
        return probe.instead("no clean step marked the model's calls (none ran, or dynamo compiled code)")
    same = [outer for s, outer in marked_steps if s.signatures == module_steps[0].signatures]
    if not same:
        return probe.instead("no clean step had the module-timing step's batch shapes")
    outer = [t.outer_calls() for t in timers]
    calls = round(statistics.median(c for _, c in outer))
    marked = [o.seconds() for o in same]
    return probe.measured(
        statistics.median(seconds for seconds, _ in outer),
        statistics.median(marked),
        calls,
        f"the model's outer calls on the module-timing step(s) less on {len(same)} clean step(s), over "
        f"{calls} calls inside",
        noise=max(marked) - min(marked),
    )


def _model_forward(
    clean: list[WindowStep], shapes: list[Signature] | None
) -> tuple[tuple[float, float] | None, tuple[int, ...], bool]:
    """The model's own forward (its outermost module calls: no loss, no framework code around them),
    median and highest over the clean steps that marked them; those steps; whether they all had the batch
    ``shapes`` (of the module-timing steps: only then is the tree's root to match it). ``None`` where none
    marked."""
    marked = _own_forwards(clean)
    if not marked:
        return None, (), False
    seconds = [outer.seconds() for _, outer in marked]
    steps = tuple(s.number for s, _ in marked)
    return (statistics.median(seconds), max(seconds)), steps, all(s.signatures == shapes for s, _ in marked)


def _module_times(
    module_steps: list[WindowStep], clean: list[WindowStep]
) -> tuple[ModuleTimes, HookCost | None, int]:
    """The module latencies of the median module-timing step (by the model's time), the hooks' cost taken
    out (its share inside a call's own span fitted on each step), that step's cost, and that step."""
    cost = _hook_cost(module_steps, clean)
    each = []
    for s in module_steps:
        if s.timer is not None:
            fitted = s.timer.fitted(cost) if cost is not None else None
            each.append((s.number, fitted, s.timer.times(fitted)))
    times = median_step([t for _, _, t in each])
    return next((times, c, number) for number, c, t in each if t is times)


def build_result(
    steps: list[WindowStep],
    tracer: Tracer,
    model: torch.nn.Module,
    context: TrainingContext,
    flops: ShapeFlops,
    global_step: int,
    *,
    peaks: tuple[Peak | None, Bandwidth | None],
    guard: Guard,
) -> WindowResult:
    """The result of a window's steps (every rank joins the gather of the clean steps' times); ``peaks``:
    the user's peak FLOPS and bandwidth, if given; ``guard`` runs the gather as the profiler's own work."""
    counting = steps[0]
    profile = tracer.profile()
    spans: list[Any] = []
    ran = [s for s in steps if s.kind == Kind.MODULE_TIMING and s.signatures and s.timer is not None]
    module_steps = [s for s in ran if s.signatures == counting.signatures]
    if ran and not module_steps:  # another batch's latencies would mix two batches
        profile.modules = {
            name: dataclasses.replace(m, fwd_latency=0.0, bwd_latency=0.0, recompute_latency=0.0)
            for name, m in profile.modules.items()
        }
    clean = [s for s in steps if s.kind == Kind.CLEAN and s.counts is not None]
    cost: HookCost | None = None
    trace_step: int | None = None
    if module_steps:
        times, cost, trace_step = _module_times(module_steps, clean)
        spans = times.spans
        profile = times.applied_to(profile)
    if clean:
        timed, source = clean, f"median of {len(clean)} clean step(s)"
        counts = _total(clean)
    else:
        known = [s for s in ran if s.counts is not None]
        timed = known or ran[:1] or [counting]
        source = (
            f"the {timed[0].kind} step{'s' if len(timed) > 1 else ''} alone (no clean step ran: inflated "
            f"by {'module hooks' if ran else 'counting'})"
        )
        counts = _total(known) if known else BatchCounts.of(profile)
    local = clean_figures(timed, counts)
    device = torch.device(profile.device)
    rows = [local.gathered()]
    with guard.own_work("gathering every rank's latencies", "this rank's latencies are reported"):
        rows = gather_latencies(local.gathered(), device)
    figures = local.from_gathered(max(rows, key=lambda row: row[0] + row[1] + row[2]))  # fwd+bwd+step sums
    spreads = figures.spreads
    peak, no_peak_reason = resolve_peak(peaks[0], device, context.compute_dtype)
    bandwidth, no_bandwidth_reason = resolve_bandwidth(peaks[1], device)
    profile = dataclasses.replace(
        profile, fwd_latency=spreads["fwd"].median, bwd_latency=spreads["bwd"].median
    )
    extra = context.extra_lines(counting.batches, profile) if context.extra_lines is not None else []
    if counting.tokens:  # what "6 x params x tokens" claims (with active parameters, for an MoE)
        extra += estimate_rows(
            profile, counting.tokens, _model_config(model), model=model, samples=counting.samples
        )
    shapes, counted, predicted = _shapes(steps, flops)
    model_forward, forward_steps, forward_shapes_match = _model_forward(
        clean, module_steps[0].signatures if module_steps else None
    )
    return WindowResult(
        profile=profile,
        steps=WindowSteps(
            counting=counting.number,
            module_timing=tuple(s.number for s in module_steps or ran),
            clean=tuple(s.number for s in clean),
            skipped=tuple(s.number for s in steps if s.kind in (Kind.CLEAN, Kind.SKIPPED) and s not in clean),
            latency_source=source,
            shape_counting=tuple(s.number for s in steps if s.kind == Kind.SHAPE_COUNTING),
            shapes=shapes,
            shapes_counted=counted,
            shapes_predicted=predicted,
            module_shapes_match=bool(module_steps) or not ran,
            module_trace=trace_step,
            model_forward=forward_steps,
            model_forward_shapes_match=forward_shapes_match,
        ),
        fwd_latency=spreads["fwd"].median,
        bwd_latency=spreads["bwd"].median,
        step_latency=spreads["step"].median,
        samples=counting.samples,
        tokens=counting.tokens,
        micro_batches=len(counting.signatures),
        parallel=context.parallel,
        compute_dtype=context.compute_dtype,
        peak=peak,
        no_peak_reason=no_peak_reason,
        bandwidth=bandwidth,
        no_bandwidth_reason=no_bandwidth_reason,
        peak_memory=_peak_memory(clean),
        rank_latencies=[(row[5], row[8], row[11]) for row in rows],  # (fwd, bwd, step) medians, by rank
        sharded_model_params=sharded_params(model),
        extra_lines=extra,
        spans=spans,
        published_at=global_step,
        clean=figures,
        hook_cost=cost,
        model_forward=model_forward[0] if model_forward else None,
        model_forward_high=model_forward[1] if model_forward else None,
    )
