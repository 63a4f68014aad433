"""A re-profile window (``profile_every``): the previous window's profile with this window's clean steps.

A long run's second look needs new times, not new counts: a model's flops per batch shape do not change
during training (the shape table holds them, and checks them with its audits), and neither does its
module tree. So a re-profile window runs no Tracer and no module timer: it takes the previous window's
result (its counts, module latencies, spans, peaks; each still says the step it came from) and puts in
this window's clean-step figures, with their flops from the table
(:func:`~flops_callbacks.session.flops_sources.clean_step_flops`). It costs the clean steps it times,
plus a shape-counting step for a shape the table has never seen.

Apart from :mod:`.builder` because it builds from a result, not from a counting step's trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from flops_callbacks.counting.engine import Tracer
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.builder import (
    LocalWindow,
    RankRow,
    build_result,
    clean_peak_memory,
    counted_totals,
    job_figures,
    local_window,
    phases,
    window_shapes,
)
from flops_callbacks.session.flops_sources import FlopsSources, clean_step_flops
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import ShapeFlops
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import CleanFigures, WindowStep, clean_figures

__all__ = ["ReusedWindow", "local_part", "reused_window", "window_result"]


@dataclasses.dataclass
class ReusedWindow:
    """This rank's part of a re-profile window, before the ranks exchange their rows."""

    base: WindowResult  # the previous window's result (this rank's profile)
    steps: list[WindowStep]
    clean: list[WindowStep]
    figures: CleanFigures  # this rank's
    sources: FlopsSources

    def row(self) -> RankRow:
        """What this rank tells the others: its clean steps' figures; the counted part is the base's
        (the same on every rank: the job's figures of the window it reuses)."""
        f, base = self.figures, self.base
        totals = counted_totals(base.profile)
        return RankRow(f.steps, totals, base.samples, base.tokens, base.counting_iter or 0.0)

    def result(self, rows: Sequence[RankRow], flops: ShapeFlops, global_step: int) -> WindowResult:
        """The job's result: the base's with this window's steps, latencies and rates."""
        base, clean = self.base, self.clean
        figures = job_figures(rows)
        fwd, bwd, step = phases(figures.median_step())
        shapes, counted, predicted = window_shapes(self.steps, flops)
        steps = dataclasses.replace(
            base.steps,
            first=self.steps[0].number,
            clean=tuple(s.number for s in clean),
            skipped=tuple(
                s.number for s in self.steps if s.kind in (Kind.CLEAN, Kind.SKIPPED) and s not in clean
            ),
            latency_source=f"median of {len(clean)} clean step(s)",
            shape_counting=tuple(s.number for s in self.steps if s.kind in (Kind.CHECK, Kind.SHAPE_COUNTING)),
            shapes=shapes,
            shapes_counted=counted,
            shapes_predicted=predicted,
            model_forward=(),  # no clean step of a re-profile window marks it (no module hook runs)
            model_forward_shapes_match=False,
        )
        return dataclasses.replace(
            base,
            profile=dataclasses.replace(base.profile, fwd_latency=fwd, bwd_latency=bwd),
            steps=steps,
            fwd_latency=fwd,
            bwd_latency=bwd,
            step_latency=step,
            peak_memory=clean_peak_memory(clean),
            rank_latencies=[phases(CleanFigures(r.steps).median_step()) for r in rows],
            published_at=global_step,
            clean=figures,
            model_forward=None,
            model_forward_high=None,
            flops_sources=self.sources,
        )


def reused_window(steps: list[WindowStep], base: WindowResult, flops: ShapeFlops) -> ReusedWindow | None:
    """This rank's part of a re-profile window over ``steps`` on ``base``; None when no clean step ran
    (a window the run's end cut short, or one whose every batch shape was new: nothing to publish)."""
    clean = [s for s in steps if s.kind == Kind.CLEAN and s.counts is not None]
    if not clean:
        return None
    each, sources = clean_step_flops(steps, clean, flops)
    return ReusedWindow(base, steps, clean, clean_figures(clean, each=each), sources)


def local_part(
    steps: list[WindowStep], flops: ShapeFlops, tracer: Tracer | None, base: WindowResult | None
) -> LocalWindow | ReusedWindow | None:
    """This rank's part of the window that ended: a re-profile window's on ``base`` (the previous
    result), else the counting step's trace's; None when it has nothing (no micro-batch, no clean step)."""
    if base is not None:
        return reused_window(steps, base, flops)
    if tracer is None or not steps or not steps[0].signatures:
        return None
    return local_window(steps, tracer, flops)


def window_result(
    local: LocalWindow | ReusedWindow,
    steps: list[WindowStep],
    rows: Sequence[RankRow],
    model: torch.nn.Module,
    context: TrainingContext,
    flops: ShapeFlops,
    global_step: int,
    peaks: tuple[Peak | None, Bandwidth | None],
) -> WindowResult:
    """The job's result of the window that ended, from every rank's ``rows``."""
    if isinstance(local, ReusedWindow):
        return local.result(rows, flops, global_step)
    return build_result(steps, local, rows, model, context, flops, global_step, peaks=peaks)
