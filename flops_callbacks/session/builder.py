"""The window's steps -> one :class:`~flops_callbacks.session.result.WindowResult`, built once at the
window's end, for a first window and a re-profile window alike: which steps stand for what, the job's
figures of every rank's rows (the slowest rank's times, the ranks' mean work per device), the peaks, and
where each figure comes from, in words.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from flops_callbacks.communication.breakdown import CommBreakdown
from flops_callbacks.communication.figures import CommFigures, comm_figures, comm_means, median_comm
from flops_callbacks.communication.slow_rank import RankTimes, SlowRank, find_slow_rank
from flops_callbacks.counting.estimate import estimate_rows, model_config
from flops_callbacks.parallel import sharded_params
from flops_callbacks.peaks import Bandwidth, Peak, measured_dtype, resolve_bandwidth, resolve_peak
from flops_callbacks.phase_names import STEP_PHASES
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.energy_reads import job_energy
from flops_callbacks.session.rank_part import LocalWindow, RankRow, ReusedWindow, vote_waits, without_votes
from flops_callbacks.session.result import BatchLayout, WindowResult, WindowSteps
from flops_callbacks.session.shape_flops import ShapeFlops
from flops_callbacks.session.vote_times import Vote
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import CleanFigures, CleanStep, StepWork, WindowStep, mean
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.kernel_clock import KernelClock
from flops_callbacks.timing.module_timer import ModuleTimes, median_step, nearest_step
from flops_callbacks.timing.outer_calls import OuterCalls

__all__ = ["build_result", "clean_peak_memory", "job_figures", "phases", "slow_rank", "window_shapes"]


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
    return {phase: max(peaks.get(phase, 0) for peaks in recorded) for phase in STEP_PHASES}


def _own_forwards(clean: list[WindowStep]) -> list[tuple[WindowStep, OuterCalls]]:
    """The clean steps that marked the model's outermost module calls and caught at least one, with their
    marks: what both the hooks' in-place cost and the own-forward row read (a step that caught no call
    would read 0 seconds)."""
    return [(s, s.outer) for s in clean if s.outer is not None and s.outer.calls()]


def _same_shapes(module_steps: list[WindowStep], clean: list[WindowStep]) -> list[OuterCalls] | None:
    """The model's outermost calls marked on clean steps of the module-timing steps' batch shapes, on a
    CPU clock (a GPU's CUDA events do not hold the hooks' host time, and its kernel clock times what
    differs from the marks); ``None`` off a CPU clock."""
    timers = [s.timer for s in module_steps if s.timer is not None]
    if not timers or not isinstance(timers[0].clock, CpuClock):
        return None
    return [outer for s, outer in _own_forwards(clean) if s.signatures == module_steps[0].signatures]


def _hook_cost(
    module_steps: list[WindowStep], clean: list[WindowStep], same: list[OuterCalls] | None
) -> HookCost | None:
    """What one module call's timing hooks cost on the module-timing steps: measured in place where
    clean steps of the same batch shapes marked their outermost module calls (``same``: the median of
    those calls on the module-timing steps against theirs), else the probe's. CPU clocks only
    (:func:`_same_shapes`)."""
    if same is None:
        return None
    probe = hook_cost()
    if not _own_forwards(clean):  # none ran, or compiled code in the process: hooks could change its guards
        return probe.instead("no clean step marked the model's calls (none ran, or dynamo compiled code)")
    if not same:
        return probe.instead("no clean step had the module-timing step's batch shapes")
    outer = [s.timer.outer_calls() for s in module_steps if s.timer is not None]
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
) -> tuple[ModuleTimes, HookCost | None, int, str]:
    """The module latencies of one module-timing step, the hooks' cost taken out (its share inside a
    call's own span fitted on each step), that step's cost, that step, and how it was chosen
    (:attr:`~flops_callbacks.session.result.WindowSteps.module_trace_by`): on a CPU where clean steps of
    the same shapes marked the model's outermost calls, the step whose same calls, less their hooks'
    cost, are nearest theirs; else the median by the model's forward + backward."""
    same = _same_shapes(module_steps, clean)
    cost = _hook_cost(module_steps, clean, same)
    each = []
    for s in module_steps:
        if s.timer is not None:
            fitted = s.timer.fitted(cost) if cost is not None else None
            seconds, calls = s.timer.outer_calls()
            forward = seconds - calls * (cost.per_call if cost is not None else 0.0)
            each.append((s.number, fitted, s.timer.times(fitted), forward))
    timed = [t for _, _, t, _ in each]
    times, by = None, "nearest"
    if same:
        reference = statistics.median(o.seconds() for o in same)
        times = nearest_step(timed, [f for _, _, _, f in each], reference)
    if times is None:
        times, by = median_step(timed), "median"
    return next((times, c, number, by) for number, c, t, _ in each if t is times)


def _device_busy(
    module_steps: list[WindowStep], clean: list[WindowStep], trace: int | None
) -> dict[str, float] | None:
    """The device's kernel seconds launched in each phase of the module-timing step whose tree is shown
    (a CUDA device's kernel clock), where every clean step ran its batch shapes: what the phases' latencies
    are set against (None: no kernel clock, or other shapes)."""
    step = next((s for s in module_steps if s.number == trace), None)
    if step is None or step.timer is None or not isinstance(step.timer.clock, KernelClock):
        return None
    if not clean or any(s.signatures != step.signatures for s in clean):
        return None
    return step.timer.clock.phase_seconds()


PHASE_FIELDS = dict(zip(STEP_PHASES, ("fwd", "bwd", "step"), strict=True))  # a clean step's, by phase


def phases(step: CleanStep) -> tuple[float, float, float]:
    return step.latency("fwd"), step.latency("bwd"), step.latency("step")


def _job_step(steps: Sequence[CleanStep], held_back: int | None) -> CleanStep:
    """One step of every rank's as the job saw it: the times of the rank every other waited for (the
    ``held_back`` rank, else the step's slowest), the ranks' mean work per device (their own batches)."""
    timed = steps[held_back] if held_back is not None else max(steps, key=lambda s: s.latency("iter"))
    return CleanStep(StepWork.combined([s.work for s in steps], mean), timed.seconds)


def job_figures(rows: Sequence[RankRow], held_back: int | None = None) -> CleanFigures:
    """The job's clean steps, step by step (:func:`_job_step`); ranks that timed different numbers of
    steps: their median steps, as one. ``held_back``: the slow rank, where one stands out: its times on
    every step. The others' steps are as long as its (they wait for it at each collective), so the
    slowest by a few microseconds is any rank's, and the phases flipped between the slow rank's (its
    forward 50 ms) and a waiting rank's (its backward 50 ms: the wait) from one run to the next."""
    if len({len(r.steps) for r in rows}) == 1:
        steps = zip(*(r.steps for r in rows), strict=True)
        return CleanFigures(tuple(_job_step(step, held_back) for step in steps))
    return CleanFigures((_job_step([CleanFigures(r.steps).median_step() for r in rows], held_back),))


def build_result(
    local: LocalWindow | ReusedWindow,
    steps: list[WindowStep],
    rows: Sequence[RankRow],
    model: torch.nn.Module,
    context: TrainingContext,
    flops: ShapeFlops,
    global_step: int,
    peaks: tuple[Peak | None, Bandwidth | None],
    not_apart: str = "",
) -> WindowResult:
    """The job's result of the window that ended: this rank's part (a first window's, or a re-profile
    window's on the result it reuses) and every rank's ``rows`` (by rank); ``peaks``: the user's peak
    FLOPS and bandwidth, if given; ``not_apart``: why a padded or packed batch's model work is its run's.
    The clean steps' figures are built here for both."""
    job = without_votes(rows)  # the training's own figures; the slow rank reads the rows as timed
    slow = slow_rank(rows, model)
    figures = job_figures(job, slow.rank if slow is not None and slow.stands_out else None)
    energy, no_energy = job_energy([r.energy for r in rows])
    fwd, bwd, step = phases(figures.median_step())
    if isinstance(local, ReusedWindow):  # no clean step of a re-profile window marks the model's forward
        base = local.base
        kept = dataclasses.replace(base.steps, model_forward=(), model_forward_shapes_match=False)
        base = dataclasses.replace(base, steps=kept, model_forward=None, model_forward_high=None)
    else:
        base = _counted(local, rows, model, context, peaks, (fwd, bwd, step))
    clean = local.clean
    if isinstance(local, ReusedWindow):
        layout = batch_layout(clean, not_apart)
    else:  # the clean steps, or the step timed instead of them (its batch counted as run: said)
        why = "no clean step ran: the step timed instead was counted as run" if local.as_run else not_apart
        layout = batch_layout(local.timed, why)
    shapes, counted, predicted = window_shapes(steps, flops)
    window = dataclasses.replace(  # this window's own steps, on what it counted or reuses
        base.steps,
        first=steps[0].number,
        clean=tuple(s.number for s in clean),
        skipped=tuple(s.number for s in steps if s.kind in (Kind.CLEAN, Kind.SKIPPED) and s not in clean),
        compiled=tuple(s.number for s in steps if s.kind == Kind.COMPILED),
        latency_source=local.source,
        shape_counting=tuple(s.number for s in steps if s.kind in (Kind.CHECK, Kind.SHAPE_COUNTING)),
        shapes=shapes,
        shapes_counted=counted,
        shapes_predicted=predicted,
    )
    return dataclasses.replace(
        base,
        profile=dataclasses.replace(base.profile, fwd_latency=fwd, bwd_latency=bwd),
        steps=window,
        fwd_latency=fwd,
        bwd_latency=bwd,
        step_latency=step,  # fmt: skip
        peak_memory=clean_peak_memory(clean),
        rank_latencies=[phases(CleanFigures(r.steps).median_step()) for r in rows],
        published_at=global_step,
        clean=figures,
        flops_sources=local.sources,
        energy=energy,
        slow_rank=slow,
        no_energy_reason=no_energy,
        layout=layout,
    )


def slow_rank(rows: Sequence[RankRow], model: torch.nn.Module) -> SlowRank | None:
    """The rank the others wait for (:mod:`~flops_callbacks.communication.slow_rank`), from every rank's
    clean steps, with its waits in the profiler's votes, and communication steps (None: one rank, or a
    rank's figures are not its clean steps'); the clean steps alone tell the forward only when no
    parameter is sharded (FSDP and ZeRO-3 gather in the forward)."""

    def lined_up(votes: list[tuple[tuple[Vote, ...], ...]]) -> list[Any]:
        return vote_waits(votes) if len({len(v) for v in votes}) == 1 else [()] * len(votes)

    lined, comm_lined = lined_up([r.votes for r in rows]), lined_up([r.comm_votes for r in rows])
    times = [
        RankTimes(
            tuple(s.latency("data") for s in r.steps) if len(r.waits) == len(r.steps) else (),
            {p: tuple(s.latency(f) for s in r.steps) for p, f in PHASE_FIELDS.items()},
            r.waits,
            r.comm,
            r.comm_waits,
            tuple(waits),
            tuple(comm_waits),
        )
        for r, waits, comm_waits in zip(rows, lined, comm_lined, strict=True)
    ]
    return find_slow_rank(times, unsharded=sharded_params(model) is None)


def batch_layout(clean: list[WindowStep], not_apart: str) -> BatchLayout | None:
    """The clean steps' token batches as laid out (None: no batch told its layout; an encoder-decoder's
    layout is its encoder's, its decoders' padding in where a batch's decoder spans were not read)."""
    read = [lo for s in clean for lo in s.laid_out if lo is not None]
    if not read:
        return None
    rows, sequences = sum(lo.rows for lo in read), sum(lo.sequences for lo in read)
    real, positions = sum(lo.real_tokens for lo in read), sum(lo.positions for lo in read)
    separated = all(lo.plain for lo in read) or not not_apart
    whole_decoders = any(lo.whole_decoders for lo in read)  # (only an encoder-decoder's are read so)
    return BatchLayout(rows, sequences, real, positions, "" if separated else not_apart, whole_decoders)


def _counted(
    local: LocalWindow,
    rows: Sequence[RankRow],
    model: torch.nn.Module,
    context: TrainingContext,
    peaks: tuple[Peak | None, Bandwidth | None],
    latencies: tuple[float, float, float],
) -> WindowResult:
    """What a first window counted and timed on its own steps: the profile with its module times, the
    peaks, the sizes, the model's forward, the communication steps (:func:`build_result` puts in the
    clean steps' figures)."""
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
    trace_by = "median"
    busy: dict[str, float] | None = None
    if module_steps:
        times, cost, trace_step, trace_by = _module_times(module_steps, clean)
        spans = times.spans
        profile = times.applied_to(profile)
        busy = _device_busy(module_steps, clean, trace_step)
    fwd, bwd, step = latencies
    device = torch.device(profile.device)
    dtype = measured_dtype(context.compute_dtype, local.matmul_dtype)
    peak, no_peak_reason = resolve_peak(peaks[0], device, dtype)
    bandwidth, no_bandwidth_reason = resolve_bandwidth(peaks[1], device)
    profile = dataclasses.replace(profile, fwd_latency=fwd, bwd_latency=bwd)
    counted = local.profile_step  # the step whose batches the profile counted
    batches = [b for b in counted.batches if b is not None]
    extra = context.extra_lines(batches, profile) if context.extra_lines is not None else []
    if counted.tokens:  # what "6 x params x tokens" claims (with active parameters, for an MoE)
        extra += estimate_rows(
            profile, counted.tokens, model_config(model), model=model, samples=counted.samples
        )
    model_forward, forward_steps, forward_shapes_match = _model_forward(
        clean, module_steps[0].signatures if module_steps else None
    )
    return WindowResult(
        profile=profile,
        steps=WindowSteps(
            counting=counting.number,
            module_timing=tuple(s.number for s in (ran if local.profiled else module_steps or ran)),
            clean=(),  # this window's clean steps and where the latencies come from: build_result's
            skipped=(),
            latency_source="",
            module_shapes_match=bool(module_steps) or not ran,
            module_trace=trace_step,
            module_trace_by="batch" if local.profiled is not None else trace_by,
            model_forward=forward_steps,
            model_forward_shapes_match=forward_shapes_match,
            communication=tuple(s.number for s in local.comm_steps),
            profile_step=local.profiled.number if local.profiled is not None else None,
            eager_tree=local.compiled,
            module_kernels=any(
                s.timer is not None and isinstance(s.timer.clock, KernelClock) for s in module_steps
            ),
        ),
        fwd_latency=fwd,
        bwd_latency=bwd,
        step_latency=step,
        samples=mean([r.counted_samples for r in rows]),
        tokens=mean([r.counted_tokens for r in rows]),
        micro_batches=len(counted.signatures),
        parallel=context.parallel,
        compute_dtype=dtype,
        peak=peak,
        no_peak_reason=no_peak_reason,
        bandwidth=bandwidth,
        no_bandwidth_reason=no_bandwidth_reason,
        rank_counts=[r.counted for r in rows],
        sharded_model_params=sharded_params(model),
        extra_lines=extra,
        spans=spans,
        hook_cost=cost,
        model_forward=model_forward[0] if model_forward else None,
        model_forward_high=model_forward[1] if model_forward else None,
        counting_iter=max(r.counting_iter for r in rows),  # audits fall on the same steps on every rank
        comm=_comm(local, rows),
        device_busy=busy,
    )


def _with_vote_waits(
    splits: Sequence[CommBreakdown | None], waits: Sequence[float]
) -> list[CommBreakdown | None]:
    """A rank's communication steps' splits, each with its wait for a slower rank in the profiler's votes
    before it as exposed communication (:meth:`~flops_callbacks.communication.breakdown.TimeSplit.waited`;
    as they are where the waits are not known)."""
    if len(waits) != len(splits):
        return list(splits)
    return [
        s if s is None else dataclasses.replace(s, step=s.step.waited(w))
        for s, w in zip(splits, waits, strict=True)
    ]


def _comm(local: LocalWindow, rows: Sequence[RankRow]) -> CommFigures | None:
    """The communication steps' figures for the job: every rank's split of the median step, with its wait
    for a slower rank in the votes before it (None: none ran, or no rank could read its trace)."""
    if not local.comm_steps:
        return None
    each = [
        _with_vote_waits(r.comm, waits)
        for r, waits in zip(rows, vote_waits([r.comm_votes for r in rows]), strict=True)
    ]
    exposed = [[None if s is None else s.step.exposed for s in splits] for splits in each]
    i = median_comm(exposed)
    splits = [mine[i] if i < len(mine) else None for mine in each]
    cost = max((r.comm_iters[i] for r in rows if i < len(r.comm_iters)), default=0.0)
    steps = tuple(s.number for s in local.comm_steps)
    return comm_figures(splits, local.comm_steps[i].comm, steps, steps[i], cost, comm_means(exposed))
