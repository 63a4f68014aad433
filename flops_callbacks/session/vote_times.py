"""What the ranks' votes hold of a window step's time: each vote's marks and seconds, the part that is the
exchange itself, and each rank's wait in them for a slower rank.

A vote (:mod:`.window_plan`) is a collective every rank reaches in lock step, so a rank that arrives
first waits there for the last. That wait is the training's (without the votes the rank waits as long
in the step's first collective) unless the last rank came late through the profiler's own work since
its previous vote (a trace's start or stop taking longer on one rank): each vote carries that work's
seconds on its rank, and a rank's wait is what is left once it is lined up with every other's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from flops_callbacks.timing.clock import Clock

__all__ = ["Vote", "VoteMarks", "rank_waits", "vote_seconds", "votes_own"]


class VoteMarks(NamedTuple):
    """One vote's marks on the steps' clock (read once the device ran the steps: :func:`vote_seconds`), and
    the profiler's own seconds on this rank since its previous vote."""

    clock: Clock
    start: Any
    end: Any
    own: float = 0.0


def vote_seconds(marks: Sequence[Sequence[VoteMarks]]) -> list[tuple[Vote, ...]]:
    """Each window step's votes (:attr:`~.window_plan.WindowPlan.marks`) in seconds."""
    return [tuple(Vote(m.clock.seconds(m.start, m.end), own=m.own) for m in step) for step in marks]


class Vote(NamedTuple):
    """One vote this rank took part in, in a step's wall: its seconds on the step's clock (the part of its
    time the vote held), and whether it lies in the step's data time: a micro-batch's vote does (before its
    forward, or between micro-batches, where the phases are stopped), the previous step's end vote where the
    data time starts at that step's end (Lightning's starts at its fetch, after our batch end's vote);
    ``own``: the profiler's own seconds on this rank since its previous vote (what made it later there)."""

    seconds: float
    in_data: bool = True
    own: float = 0.0


def votes_own(seconds: Sequence[Sequence[float]]) -> list[float] | None:
    """Each of one step's votes' own seconds (``seconds``: each rank's seconds in each vote, by rank): its
    least over the ranks (the last rank to reach a vote waits for none: its time there is the exchange
    itself); None with one rank, or where the ranks' votes do not line up."""
    if len(seconds) < 2 or len({len(mine) for mine in seconds}) != 1:
        return None
    return [min(same) for same in zip(*seconds, strict=True)]


def rank_waits(seconds: Sequence[Sequence[float]]) -> list[float]:
    """Each rank's wait for a slower rank in one step's votes (``seconds``: each rank's seconds in each of
    the step's votes with the profiler's own seconds before each (:attr:`Vote.own`), by rank): its seconds
    beyond each vote's least (:func:`votes_own`). A rank that waited only while another did the profiler's
    own work ends level with it: no wait. Zeros with one rank, or where the ranks' votes do not line up."""
    least = votes_own(seconds)
    if least is None:
        return [0.0] * len(seconds)
    return [sum(s - low for s, low in zip(mine, least, strict=True)) for mine in seconds]
