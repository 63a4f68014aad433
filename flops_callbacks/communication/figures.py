"""The communication steps' figures for the job: every rank's split of its median step, combined.

A multi-process step's backward holds the gradient all-reduce that compute did not hide, an FSDP
forward its all-gathers: the phase latencies cannot say so. Three window steps, or up to 25 while
their exposed times disagree (:meth:`~flops_callbacks.session.window_plan.WindowPlan.comm_settled`),
after the module-timing steps and only with several ranks, run under ``torch.profiler`` on every rank
(:mod:`.recorder`);
each rank splits each of its steps (:mod:`.breakdown`) and tells the others
at the window's end; the job keeps one step, the same on every rank: the median by the ranks' mean
exposed time (:func:`median_comm`). Here its splits become the job's:
each figure the ranks' mean (a rank that waited on a slower one shows it as exposed time, as the sync costs
it), the exposed time's range over the ranks and over the steps, and the collectives' table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flops_callbacks.communication.breakdown import CollectiveRow, CommBreakdown, TimeSplit, combine
from flops_callbacks.communication.events import StepEvents

__all__ = ["CommFigures", "comm_figures", "comm_means", "median_comm", "ranks_mean"]


@dataclass(frozen=True)
class CommFigures:
    """Where the communication steps' time went, for the job (module doc)."""

    steps: tuple[int, ...]  # the global steps they ran at
    world: int
    step: TimeSplit  # the whole step's, the ranks' mean
    phases: dict[str, TimeSplit]  # each phase's (forward, backward, optimizer_step), the ranks' mean
    collectives: list[CollectiveRow]
    exposed_range: tuple[float, float]  # the ranks' exposed communication, min .. max
    device: bool  # a GPU's timeline (else the host's)
    iter_seconds: float  # its fwd + bwd + step on the phase clock, the slowest rank's: what it cost
    median_step: int  # of ``steps``, the one the figures are (the same on every rank)
    step_exposed: tuple[float | None, ...] = ()  # each step's exposed seconds, the ranks' mean (None: unread)
    timeline: StepEvents | None = None  # this rank's classed intervals of it (the Chrome trace's)

    def responsible(self) -> CollectiveRow | None:
        """The collective whose calls took the most time (the slowest rank's): what exposed time waits on."""
        return max(self.collectives, key=lambda row: row.seconds[1], default=None)


def comm_figures(
    ranks: Sequence[CommBreakdown | None],
    mine: CommBreakdown | None,
    steps: tuple[int, ...],
    median_step: int,
    iter_seconds: float,
    step_exposed: Sequence[float | None] = (),
) -> CommFigures | None:
    """The job's figures of every rank's split of one step, global step ``median_step`` (None where no rank
    recorded one); ``mine`` is this rank's; ``step_exposed``: every step's exposed seconds, the ranks'
    mean, as the figures' spread."""
    known = [r for r in ranks if r is not None]
    if not known:
        return None
    step, phases, rows = combine(known, len(ranks))
    exposed = [r.step.exposed for r in known]
    return CommFigures(
        steps,
        len(ranks),
        step,
        phases,
        rows,
        (min(exposed), max(exposed)),
        any(r.device for r in known),
        iter_seconds,
        median_step,
        tuple(step_exposed),
        mine.events if mine is not None else None,
    )


def ranks_mean(values: Sequence[float | None]) -> float | None:
    """The mean of the ranks' ``values`` that were read (None: no rank's was): one communication step's
    figure for the job, in the window's vote and at its end alike."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def comm_means(exposed: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Each communication step's exposed seconds, the ranks' mean (None: no rank read its trace);
    ``exposed``: each rank's exposed seconds per step (None: its trace unread)."""
    steps = max((len(rank) for rank in exposed), default=0)
    return [ranks_mean([rank[i] if i < len(rank) else None for rank in exposed]) for i in range(steps)]


def median_comm(exposed: Sequence[Sequence[float | None]]) -> int:
    """Of the communication steps, the one whose exposed time, the ranks' mean, is the median (the lower
    one of an even count); ``exposed`` as :func:`comm_means` takes it. The same step on every rank, so
    that the job's figures are one step's. A step no rank read is no candidate; where none was read,
    the first."""
    means = sorted((m, i) for i, m in enumerate(comm_means(exposed)) if m is not None)
    return means[(len(means) - 1) // 2][1] if means else 0
