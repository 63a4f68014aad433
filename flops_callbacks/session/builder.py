"""The window's steps -> one :class:`~flops_callbacks.session.result.WindowResult`, built once at the
window's end.

Apart from :mod:`flops_callbacks.session.step_session` (which decides what each step does) because this is the
other half of the job: which steps stand for what, what a rank tells the others (:class:`RankRow`), the
job's figures of every rank's (the slowest rank's times, the ranks' mean work per device), the peak, and
where each figure comes from, in words.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from flops_callbacks.counting.engine import Tracer
from flops_callbacks.counting.estimate import estimate_rows
from flops_callbacks.parallel import sharded_params
from flops_callbacks.peaks import Bandwidth, Peak, resolve_bandwidth, resolve_peak
from flops_callbacks.profile import Profile
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.comm_step import CommFigures, comm_figures, comm_means, median_comm
from flops_callbacks.session.flops_sources import FlopsSources, clean_step_flops
from flops_callbacks.session.result import WindowResult, WindowSteps
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import (
    CleanFigures,
    CleanStep,
    StepWork,
    WindowStep,
    clean_figures,
    mean,
)
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.comm_breakdown import CommBreakdown
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimes, median_step
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phases import PHASES

__all__ = [
    "COUNTED",
    "LocalWindow",
    "RankRow",
    "build_result",
    "clean_peak_memory",
    "job_figures",
    "local_window",
    "phases",
    "window_shapes",
]


def _model_config(model: torch.nn.Module) -> Any:
    """The model's config (a transformers config: ``model.config``, or a submodule's), if it has one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return config
    return None


def window_shapes(steps: list[WindowStep], flops: ShapeFlops) -> tuple[int, int, int]:
    """Distinct micro-batch shape signatures of the counted and clean steps: all of them, those whose
    flops were counted (as every micro-batch of theirs appeared: a step's first, or a later one), and
    those predicted."""
    seen: dict[Any, set[bool]] = {}
    for s in steps:
        if s.kind is not None and (s.kind.counted or s.kind == Kind.CLEAN):
            for i, sig in enumerate(s.signatures):
                seen.setdefault(sig, set()).add(i > 0)
    counted = sum(all((later, sig) in flops.counted for later in kinds) for sig, kinds in seen.items())
    return len(seen), counted, len(seen) - counted


def clean_peak_memory(steps: list[WindowStep]) -> dict[str, int] | None:
    """The largest peak allocated bytes of each phase over the clean steps (None off CUDA)."""
    recorded = [s.phases.memory.peaks for s in steps if s.phases.memory is not None]
    if not recorded:
        return None
    return {phase: max(peaks.get(phase, 0) for peaks in recorded) for phase in PHASES}


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


COUNTED = (
    "fwd_flops",
    "bwd_flops",
    "recompute_flops",
    "fwd_macs",
    "bwd_macs",
    "recompute_macs",
    "fwd_bytes",
    "bwd_bytes",
    "recompute_bytes",
    "saved_bytes",
)  # the counting step's totals the job sums


def counted_totals(profile: Profile) -> dict[str, int]:
    """The counting step's totals a rank tells the others, by name."""
    return {name: getattr(profile, name) for name in COUNTED}


class RankRow(NamedTuple):
    """What one rank tells the others at the window's end: each clean step's work and times, and its
    counting step's totals (by :data:`COUNTED`) and samples and tokens."""

    steps: tuple[CleanStep, ...]  # each clean step's, in order
    counted: dict[str, int]  # the counting step's totals, by name (:data:`COUNTED`)
    counted_samples: int | float | None
    counted_tokens: int | float | None
    counting_iter: float  # the counting step's fwd + bwd + step seconds (what a count costs)
    comm: tuple[CommBreakdown | None, ...] = ()  # each communication step's split (None: unread trace)
    comm_iters: tuple[float, ...] = ()  # each one's fwd + bwd + step seconds (what one costs)


@dataclasses.dataclass
class LocalWindow:
    """This rank's part of the window, before the ranks exchange their rows."""

    profile: Profile
    ran: list[WindowStep]  # the module-timing steps that ran
    module_steps: list[WindowStep]  # those of them with the counting step's batch shapes
    clean: list[WindowStep]
    figures: CleanFigures  # this rank's
    source: str  # where the latencies come from, in words
    counting: WindowStep
    sources: FlopsSources | None  # where each clean step's flops come from (this rank's)
    comm_steps: tuple[WindowStep, ...] = ()  # the communication steps that ran

    def row(self) -> RankRow:
        f, c, comm = self.figures, self.counting, self.comm_steps
        return RankRow(
            f.steps, counted_totals(self.profile), c.samples, c.tokens, c.seconds()["iter"],
            tuple(s.comm for s in comm), tuple(s.seconds()["iter"] for s in comm),
        )  # fmt: skip


def local_window(steps: list[WindowStep], tracer: Tracer, flops: ShapeFlops) -> LocalWindow:
    """This rank's profile and clean-step figures (module latencies are added in :func:`build_result`)."""
    counting = steps[0]
    profile = tracer.profile()
    ran = [s for s in steps if s.kind == Kind.MODULE_TIMING and s.signatures and s.timer is not None]
    module_steps = [s for s in ran if s.signatures == counting.signatures]
    if ran and not module_steps:  # another batch's latencies would mix two batches
        profile.modules = {
            name: dataclasses.replace(m, fwd_latency=0.0, bwd_latency=0.0, recompute_latency=0.0)
            for name, m in profile.modules.items()
        }
    clean = [s for s in steps if s.kind == Kind.CLEAN and s.counts is not None]
    sources: FlopsSources | None = None
    each: list[BatchCounts] | None = None
    counts: BatchCounts | None = None  # each timed step's own
    if clean:
        timed, source = clean, f"median of {len(clean)} clean step(s)"  # the median step: by FLOPS
        each, sources = clean_step_flops(steps, clean, flops)  # counted, predicted, or estimated
    else:
        known = [s for s in ran if s.counts is not None]
        timed = known or ran[:1] or [counting]
        source = (
            f"the {timed[0].kind} step{'s' if len(timed) > 1 else ''} alone (no clean step ran: inflated "
            f"by {'module hooks' if ran else 'counting'})"
        )
        counts = None if known else BatchCounts.of(profile)
    figures = clean_figures(timed, counts, each)
    comm = tuple(s for s in steps if s.kind == Kind.COMMUNICATION and s.signatures)
    return LocalWindow(profile, ran, module_steps, clean, figures, source, counting, sources, comm)


def phases(step: CleanStep) -> tuple[float, float, float]:
    return step.latency("fwd"), step.latency("bwd"), step.latency("step")


def _job_step(steps: Sequence[CleanStep]) -> CleanStep:
    """One step of every rank's as the job saw it: the slowest rank's times (every rank waited for it),
    the ranks' mean work per device (every rank's own batches)."""
    slowest = max(steps, key=lambda s: s.latency("iter"))
    return CleanStep(StepWork.combined([s.work for s in steps], mean), slowest.seconds)


def job_figures(rows: Sequence[RankRow]) -> CleanFigures:
    """The job's clean steps, step by step (:func:`_job_step`); ranks that timed different numbers of
    steps: their median steps, as one."""
    if len({len(r.steps) for r in rows}) == 1:
        return CleanFigures(tuple(_job_step(step) for step in zip(*(r.steps for r in rows), strict=True)))
    return CleanFigures((_job_step([CleanFigures(r.steps).median_step() for r in rows]),))


def build_result(
    steps: list[WindowStep],
    local: LocalWindow,
    rows: Sequence[RankRow],
    model: torch.nn.Module,
    context: TrainingContext,
    flops: ShapeFlops,
    global_step: int,
    *,
    peaks: tuple[Peak | None, Bandwidth | None],
) -> WindowResult:
    """The job's result of a window: this rank's profile and module times, every rank's ``rows`` (by
    rank); ``peaks``: the user's peak FLOPS and bandwidth, if given."""
    counting, profile, ran, module_steps, clean = (
        local.counting,
        local.profile,
        local.ran,
        local.module_steps,
        local.clean,
    )
    spans: list[Any] = []
    cost: HookCost | None = None
    trace_step: int | None = None
    if module_steps:
        times, cost, trace_step = _module_times(module_steps, clean)
        spans = times.spans
        profile = times.applied_to(profile)
    figures = job_figures(rows)
    median = figures.median_step()
    fwd, bwd, step = (median.latency(name) for name in ("fwd", "bwd", "step"))
    device = torch.device(profile.device)
    peak, no_peak_reason = resolve_peak(peaks[0], device, context.compute_dtype)
    bandwidth, no_bandwidth_reason = resolve_bandwidth(peaks[1], device)
    profile = dataclasses.replace(profile, fwd_latency=fwd, bwd_latency=bwd)
    extra = context.extra_lines(counting.batches, profile) if context.extra_lines is not None else []
    if counting.tokens:  # what "6 x params x tokens" claims (with active parameters, for an MoE)
        extra += estimate_rows(
            profile, counting.tokens, _model_config(model), model=model, samples=counting.samples
        )
    shapes, counted, predicted = window_shapes(steps, flops)
    model_forward, forward_steps, forward_shapes_match = _model_forward(
        clean, module_steps[0].signatures if module_steps else None
    )
    return WindowResult(
        profile=profile,
        steps=WindowSteps(
            first=counting.number,
            counting=counting.number,
            module_timing=tuple(s.number for s in module_steps or ran),
            clean=tuple(s.number for s in clean),
            skipped=tuple(s.number for s in steps if s.kind in (Kind.CLEAN, Kind.SKIPPED) and s not in clean),
            latency_source=local.source,
            shape_counting=tuple(s.number for s in steps if s.kind in (Kind.CHECK, Kind.SHAPE_COUNTING)),
            shapes=shapes,
            shapes_counted=counted,
            shapes_predicted=predicted,
            module_shapes_match=bool(module_steps) or not ran,
            module_trace=trace_step,
            model_forward=forward_steps,
            model_forward_shapes_match=forward_shapes_match,
            communication=tuple(s.number for s in local.comm_steps),
        ),
        fwd_latency=fwd,
        bwd_latency=bwd,
        step_latency=step,
        samples=mean([r.counted_samples for r in rows]),
        tokens=mean([r.counted_tokens for r in rows]),
        micro_batches=len(counting.signatures),
        parallel=context.parallel,
        compute_dtype=context.compute_dtype,
        peak=peak,
        no_peak_reason=no_peak_reason,
        bandwidth=bandwidth,
        no_bandwidth_reason=no_bandwidth_reason,
        peak_memory=clean_peak_memory(clean),
        rank_latencies=[phases(CleanFigures(r.steps).median_step()) for r in rows],
        rank_counts=[r.counted for r in rows],
        sharded_model_params=sharded_params(model),
        extra_lines=extra,
        spans=spans,
        published_at=global_step,
        clean=figures,
        hook_cost=cost,
        model_forward=model_forward[0] if model_forward else None,
        model_forward_high=model_forward[1] if model_forward else None,
        flops_sources=local.sources,
        counting_iter=max(r.counting_iter for r in rows),  # audits fall on the same steps on every rank
        comm=_comm(local, rows),
    )


def _comm(local: LocalWindow, rows: Sequence[RankRow]) -> CommFigures | None:
    """The communication steps' figures for the job: every rank's split of the median step (None: none
    ran, or no rank could read its trace)."""
    if not local.comm_steps:
        return None
    exposed = [[None if s is None else s.step.exposed for s in r.comm] for r in rows]
    i = median_comm(exposed)
    splits = [r.comm[i] if i < len(r.comm) else None for r in rows]
    cost = max((r.comm_iters[i] for r in rows if i < len(r.comm_iters)), default=0.0)
    steps = tuple(s.number for s in local.comm_steps)
    return comm_figures(splits, local.comm_steps[i].comm, steps, steps[i], cost, comm_means(exposed))
