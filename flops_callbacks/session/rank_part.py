"""This rank's part of a window at its end, and what it tells the other ranks (:class:`RankRow`).

A first window's part is its counting step's profile and its clean steps (:class:`LocalWindow`). A
re-profile window (``profile_every``) needs new times, not new counts: a model's flops per batch shape and
its module tree do not change during training (the shape table holds them, and checks them with its
audits), so it runs no counting engine and no module timer: its part is the previous window's result and
this window's clean steps (:class:`ReusedWindow`), their flops from the table
(:func:`~flops_callbacks.session.flops_sources.clean_step_flops`). Both are built into the job's result
by one builder (:func:`~flops_callbacks.session.builder.build_result`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from flops_callbacks.communication.breakdown import CommBreakdown
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.profile import Profile
from flops_callbacks.session.energy_reads import rank_energy
from flops_callbacks.session.flops_sources import FlopsSources, clean_step_flops
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.vote_times import Vote, VoteMarks, rank_waits, vote_seconds, votes_own
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import CleanFigures, CleanStep, WindowStep, clean_figures
from flops_callbacks.timing.energy_figures import EnergySpan

__all__ = [
    "COUNTED",
    "LocalWindow",
    "RankRow",
    "ReusedWindow",
    "counted_totals",
    "local_part",
    "local_window",
    "reused_window",
    "vote_waits",
    "without_votes",
]

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
    # each clean step's votes of the profiler in its wall (() where the figures are not the clean steps')
    votes: tuple[tuple[Vote, ...], ...] = ()
    energy: EnergySpan | str = ""  # the energy counter over its clean steps, or why none ("": not read)
    comm_votes: tuple[tuple[Vote, ...], ...] = ()  # each communication step's votes in its wall

    @property
    def waits(self) -> tuple[float, ...]:
        """Each clean step's seconds in the profiler's votes (in its data time)."""
        return tuple(sum(v.seconds for v in votes) for votes in self.votes)

    @property
    def comm_waits(self) -> tuple[float, ...]:
        """Each communication step's seconds in the profiler's votes."""
        return tuple(sum(v.seconds for v in votes) for votes in self.comm_votes)


@dataclasses.dataclass
class LocalWindow:
    """This rank's part of a first window, before the ranks exchange their rows."""

    profile: Profile
    ran: list[WindowStep]  # the module-timing steps that ran
    module_steps: list[WindowStep]  # those of them whose batches the profile counted
    clean: list[WindowStep]
    figures: CleanFigures  # this rank's
    source: str  # where the latencies come from, in words
    counting: WindowStep
    sources: FlopsSources | None  # where each clean step's flops come from (this rank's)
    comm_steps: tuple[WindowStep, ...] = ()  # the communication steps that ran
    # the step whose batches the profile counted: the counting step's, or where the module-timing steps had
    # other shapes, the one timed (its batches counted off the clock)
    profiled: WindowStep | None = None
    energy: EnergySpan | str = "no clean step ran"  # the energy counter over the clean steps, or why none
    timed: list[WindowStep] = dataclasses.field(default_factory=list)  # the clean steps, or who stands in
    as_run: bool = False  # no clean step ran, and the one timed instead has its batch's flops as run
    matmul_dtype: torch.dtype | None = None  # what the counted matmuls produced (autocast's dtype)
    compiled: bool = False  # torch.compile'd code: eager on the counted and module-timing steps only

    @property
    def profile_step(self) -> WindowStep:
        return self.profiled or self.counting

    def row(self) -> RankRow:
        f, p, comm = self.figures, self.profile_step, self.comm_steps
        return RankRow(
            f.steps, counted_totals(self.profile), p.samples, p.tokens, self.counting.seconds()["iter"],
            tuple(s.comm for s in comm), tuple(s.seconds()["iter"] for s in comm),
            tuple(s.votes for s in self.clean),
            energy=self.energy, comm_votes=tuple(s.votes for s in comm),
        )  # fmt: skip


@dataclasses.dataclass
class ReusedWindow:
    """This rank's part of a re-profile window, before the ranks exchange their rows."""

    base: WindowResult  # the previous window's result (this rank's profile)
    clean: list[WindowStep]
    figures: CleanFigures  # this rank's
    sources: FlopsSources
    energy: EnergySpan | str = "no clean step ran"  # the energy counter over the clean steps, or why none

    @property
    def source(self) -> str:
        """Where the latencies come from, in words."""
        return f"median of {len(self.clean)} clean step(s)"

    def row(self) -> RankRow:
        """What this rank tells the others: its clean steps' figures; the counted part is the base's
        (the same on every rank: the job's figures of the window it reuses)."""
        f, base = self.figures, self.base
        totals = counted_totals(base.profile)
        votes = tuple(s.votes for s in self.clean)
        row = RankRow(f.steps, totals, base.samples, base.tokens, base.counting_iter or 0.0, votes=votes)
        return row._replace(energy=self.energy)


def without_votes(rows: Sequence[RankRow]) -> list[RankRow]:
    """Every rank's row with the profiler's votes' own time taken out of its clean steps' data and wall
    time: the training's figures, not the profiler's. A vote's own time is its least over the ranks on the
    steps' clock (the last rank to reach it waits for none: its time there is the exchange itself; on a
    GPU, what of it the device waited, 0 where a device stayed busy through it); the rest of a rank's
    time in it is its wait for a slower rank, which stays (without the vote it would wait in the
    training's next collective). With one rank, or votes that do not line up, the rows as they are.
    The energy stays as read: the counter cannot tell the votes' joules apart, and the device draws less
    in them than in the steps' work (a share of the span's joules would take out too much)."""
    votes = [r.votes for r in rows]
    if len({len(each) for each in votes}) != 1 or any(len(r.votes) != len(r.steps) for r in rows):
        return list(rows)
    own = []  # each clean step's votes' own seconds, each vote's
    for same in zip(*votes, strict=True):  # one step's votes, by rank
        least = votes_own([[v.seconds for v in step] for step in same])
        if least is None:
            return list(rows)
        own.append(least)
    return [_less(r, own) for r in rows]


def vote_waits(votes: Sequence[Sequence[Sequence[Vote]]]) -> list[list[float]]:
    """Each rank's wait for a slower rank in the profiler's votes of each of its steps (``votes``: each
    rank's steps' votes, by rank; :func:`~flops_callbacks.session.vote_times.rank_waits`). Without the
    votes it waits as long in the step's first collective. Zeros where the ranks' steps do not line up."""
    if len({len(each) for each in votes}) != 1:
        return [[0.0] * len(each) for each in votes]
    by_step = [
        rank_waits([[v.seconds + v.own for v in step] for step in same]) for same in zip(*votes, strict=True)
    ]
    return [list(waits) for waits in zip(*by_step, strict=True)] if by_step else [[] for _ in votes]


def _less(row: RankRow, votes: Sequence[Sequence[float]]) -> RankRow:
    """``row`` less each clean step's votes' own seconds (``votes``: each vote's), from its wall, and from
    its data time those that lie in it (:func:`without_votes`)."""
    steps = []
    for step, own, mine in zip(row.steps, votes, row.votes, strict=True):
        seconds = step.seconds
        if seconds.wall > 0:  # 0: not known
            data = seconds.data - sum(o for o, vote in zip(own, mine, strict=True) if vote.in_data)
            seconds = seconds._replace(data=max(data, 0.0), wall=max(seconds.wall - sum(own), 0.0))
        steps.append(CleanStep(step.work, seconds))
    return row._replace(steps=tuple(steps))


def _median_batch(ran: list[WindowStep]) -> WindowStep:
    """The module-timing step of the median batch size (its micro-batches' tensor elements; of an even
    count, the smaller middle one): the tree's batch, chosen from the data alone, so that two runs of one
    configuration show the same tree and log the same flops whatever their timings."""

    def size(step: WindowStep) -> int:
        return sum(math.prod(shape) for signature in step.signatures for shape, _ in signature)

    ranked = sorted(ran, key=size)  # stable: of equal sizes, the earlier step
    return ranked[(len(ranked) - 1) // 2]


def local_window(
    steps: list[WindowStep],
    engine: CountingEngine,
    flops: ShapeFlops,
    count_step: Callable[[WindowStep], Profile | None] | None = None,
) -> LocalWindow:
    """This rank's profile and clean-step figures (module latencies are added by the builder).
    ``count_step``: a step's module tree counted off the clock, for module-timing steps of other shapes
    than the counting step's (then the tree is the timed step's own batch's)."""
    counting = steps[0]
    profile = engine.profile()
    ran = [s for s in steps if s.kind == Kind.MODULE_TIMING and s.signatures and s.timer is not None]
    module_steps = [s for s in ran if s.signatures == counting.signatures]
    profiled = None
    if ran and not module_steps and count_step is not None:
        chosen = _median_batch(ran)
        counted = count_step(chosen)
        if counted is not None:
            profile, profiled, module_steps = counted, chosen, [chosen]
            if len(chosen.signatures) == 1:  # its one micro-batch's counts: a point of the shape table
                flops.record(chosen.signatures[0], BatchCounts.of(counted.model))
    if ran and not module_steps:  # another batch's latencies would mix two batches
        profile.modules = {
            name: dataclasses.replace(m, fwd_latency=0.0, bwd_latency=0.0, recompute_latency=0.0)
            for name, m in profile.modules.items()
        }
    clean = [s for s in steps if s.kind == Kind.CLEAN and s.counts is not None]
    sources: FlopsSources | None = None
    each: list[BatchCounts] | None = None
    counts: BatchCounts | None = None  # each timed step's own
    as_run = False  # the step timed instead of clean ones has its batch's flops as run
    if clean:
        timed, source = clean, f"median of {len(clean)} clean step(s)"  # the median step: by FLOPS
        each, sources = clean_step_flops(steps, clean, flops)  # counted, predicted, or estimated
    else:
        known = [s for s in ran if s.counts is not None]
        # else the step whose batch the profile counted, as run: another's latencies would go with its flops
        timed, as_run = known or module_steps[:1] or [counting], not known
        source = (
            f"the {timed[0].kind} step{'s' if len(timed) > 1 else ''} alone (no clean step ran: inflated "
            f"by {'counting' if timed[0] is counting else 'module hooks'})"
        )
        counts = None if known else BatchCounts.of(profile)
    figures = clean_figures(timed, counts, each)
    comm = tuple(s for s in steps if s.kind == Kind.COMMUNICATION and s.signatures)
    energy = rank_energy(steps, clean)
    return LocalWindow(
        profile, ran, module_steps, clean, figures, source, counting, sources, comm, profiled, energy, timed,
        as_run, engine.matmul_dtype(), engine.compiled,
    )  # fmt: skip


def reused_window(steps: list[WindowStep], base: WindowResult, flops: ShapeFlops) -> ReusedWindow | None:
    """This rank's part of a re-profile window over ``steps`` on ``base``; None when no clean step ran
    (a window the run's end cut short, or one whose every batch shape was new: nothing to publish)."""
    clean = [s for s in steps if s.kind == Kind.CLEAN and s.counts is not None]
    if not clean:
        return None
    each, sources = clean_step_flops(steps, clean, flops)
    return ReusedWindow(base, clean, clean_figures(clean, each=each), sources, rank_energy(steps, clean))


def local_part(
    steps: list[WindowStep],
    flops: ShapeFlops,
    engine: CountingEngine | None,
    base: WindowResult | None,
    count_step: Callable[[WindowStep], Profile | None] | None = None,
    votes: Sequence[Sequence[VoteMarks]] = (),
) -> LocalWindow | ReusedWindow | None:
    """This rank's part of the window that ended: a re-profile window's on ``base`` (the previous
    result), else the counting step's engine's; None when it has nothing (no micro-batch, no clean step).
    ``votes``: each step's votes of the profiler in its wall, in order, as marked."""
    for step, own, marks in zip(steps, vote_seconds(votes), votes, strict=False):
        start = step.fetch or step.start_mark  # where its data time starts
        after = [start is None or m.start is None or m.clock.seconds(start, m.start) >= 0 for m in marks]
        step.votes = tuple(vote._replace(in_data=inside) for vote, inside in zip(own, after, strict=True))
    if base is not None:
        return reused_window(steps, base, flops)
    if engine is None or not steps or not steps[0].signatures:
        return None
    return local_window(steps, engine, flops, count_step)
