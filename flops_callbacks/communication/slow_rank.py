"""The rank the others wait for: named at the window's end from every rank's figures, with the part of
its step where its extra time is and what the others spend waiting for it.

Every rank of a data-parallel step waits for the slowest at each collective, so each rank's step is its
own work plus its waiting, and the ranks' steps are as long as the slowest rank's own work. The phase
latencies alone cannot say who that is (DDP's all-reduce evens out every rank's backward: a rank slow in
its backward compute looks like the others there); its own time, the phase less what the rank waited,
can. Each rank's own time, per part of its step:

* ``data``: the wait for its batch on the clean steps, less the seconds it waited in the profiler's votes
  before its forward (a vote is a barrier: a rank quick with its batch waits there for a slow one);
* ``forward``, ``backward``, ``optimizer_step``: with communication steps, each phase less its exposed
  communication on each of them (compute, and the host's own gaps: :mod:`.breakdown`); without, the clean
  steps' phase latencies, which hold the waits: only the forward and the optimizer step are told then,
  where they hold no collective (DDP; not FSDP or ZeRO-3, which gather in the forward; under ZeRO-1/2 the
  step's gather evens the ranks' steps out), and the backward is said to be untold.

A rank's own time in a part is its steps' mean less their highest and lowest (the median for up to four
steps): a hiccup of one step moves it little, and a rank that stalls every other step shows its stalls'
share. It stands out when that exceeds the other ranks' median by more than :data:`NOISE_TIMES` times
the other ranks' step-to-step spread in that part (the largest one's: 1.4826 x the median absolute
deviation of its steps, a standard deviation where the steps scatter normally; not its own, which a
rank's intermittent stalls widen), and by more than :data:`FLOOR_SHARE` of the step (a difference of a
few microseconds of a long step is no straggler). Of the ranks that stand out, the largest extra is
named. Where no rank's own work stands out, a rank whose exposed communication does
is named with its own ``communication``, where the others wait for it in the votes. The others' wait for
it is their waiting beyond its own: in the profiler's votes and in exposed communication (without
communication steps the backward, which holds DDP's all-reduce), the differences step by step as one
(their mean less the highest and lowest, as above), so that what slowed a step on every rank (gloo's own
scatter on a busy CPU) cancels. A rank is
named only where the others wait for it, at least :data:`WAIT_SHARE` of its extra: an extra the others
spend on work of their own holds nobody back (and the rank whose exposed communication is the largest is
the one waiting, not the one waited for).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from flops_callbacks import metrics as names
from flops_callbacks.communication.breakdown import CommBreakdown
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP, STEP_PHASES

__all__ = [
    "COMMUNICATION",
    "DATA",
    "FLOOR_SHARE",
    "MAD_TO_SD",
    "MIN_EXTRA",
    "NOISE_TIMES",
    "PARTS",
    "RankParts",
    "RankTimes",
    "SlowRank",
    "WAIT_SHARE",
    "find_slow_rank",
]

DATA = "data"
COMMUNICATION = "communication"
PARTS = (DATA, *STEP_PHASES)  # a rank's own time, part by part, in the step's order
NOISE_TIMES = 4.0  # how many times the ranks' step-to-step spread an extra must exceed
FLOOR_SHARE = 0.02  # ...and this share of the step (data + fwd + bwd + step, waits in: the ranks' median)
MIN_EXTRA = 50e-6  # ...and never under 50 microseconds
WAIT_SHARE = 0.5  # ...and the others wait for it at least this share of its extra
MAD_TO_SD = 1.4826  # a normal distribution's standard deviation per median absolute deviation


class RankTimes(NamedTuple):
    """One rank's figures that the slow rank is told from, each a step's, in order."""

    data: tuple[float, ...]  # each clean step's wait for data (the profiler's votes in it)
    phases: dict[str, tuple[float, ...]]  # each clean step's seconds of each phase, by phase
    waits: tuple[float, ...]  # each clean step's seconds in the profiler's votes before its forward
    comm: tuple[CommBreakdown | None, ...] = ()  # each communication step's split (None: unread)
    comm_waits: tuple[float, ...] = ()  # each communication step's seconds in the profiler's votes
    # each clean / communication step's wait in the votes for a slower rank, the ranks lined up after the
    # profiler's own work before each vote (:func:`~flops_callbacks.session.vote_times.rank_waits`; ():
    # not told, the seconds above stand in)
    vote_waits: tuple[float, ...] = ()
    comm_vote_waits: tuple[float, ...] = ()


@dataclass(frozen=True)
class RankParts:
    """One rank's median step, part by part: its own time in each part told (see the module doc), the
    part's step-to-step spread, and its waiting (the profiler's votes; exposed communication and idle
    time where communication steps ran)."""

    own: dict[str, float]  # seconds by part (:data:`PARTS`; the backward and step without comm: waits in)
    spread: dict[str, float]  # seconds by part: 1.4826 x the median absolute deviation over its steps
    votes: float  # seconds in the profiler's votes before the forward
    exposed: float | None = None  # the step's exposed communication (None: no communication step)
    idle: float | None = None  # the step's idle time, neither compute nor communication (part of ``own``)


@dataclass(frozen=True)
class SlowRank:
    """The rank the others wait for, or the nearest one to standing out (module doc)."""

    ranks: tuple[RankParts, ...]  # by rank
    told: tuple[str, ...]  # the parts compared (of :data:`PARTS`, and :data:`COMMUNICATION`)
    comm: bool  # told with the communication steps (else from the clean steps alone)
    rank: int  # the rank named, or the nearest to standing out
    part: str  # where its extra time is
    extra: float  # its own seconds a step in ``part`` beyond the other ranks' median
    threshold: float  # what an extra in ``part`` had to exceed to stand out (the noise, or the floor)
    stands_out: bool  # False: no rank stands out (``rank`` and ``part`` are the nearest)
    waits: tuple[float, ...] = ()  # each rank's seconds a step waiting for it (its own: 0; none: ())
    collective: str | None = None  # where the others wait, when in exposed communication: the op's name
    untold: tuple[str, ...] = ()  # the parts that could not be told (no communication step, sharded)
    # where none stands out though the nearest is beyond the noise: the others' mean wait a step for it,
    # under WAIT_SHARE of its extra (None: the nearest is within the noise)
    unwaited: float | None = None

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def wait(self) -> float:
        """Seconds a step each other rank waits for it, their mean (0 when no rank stands out)."""
        others = [w for r, w in enumerate(self.waits) if r != self.rank]
        return sum(others) / len(others) if others else 0.0

    def metrics(self) -> dict[str, float]:
        """Its ``flops_profiler/slow_rank*`` metrics (rank -1, 0 seconds: no rank stands out)."""
        named = self.stands_out
        return {
            names.SLOW_RANK: float(self.rank) if named else -1.0,
            names.SLOW_RANK_EXTRA_LATENCY: self.extra if named else 0.0,
            names.SLOW_RANK_WAIT_LATENCY: self.wait,
        }


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _typical(values: Sequence[float]) -> float:
    """A rank's steps as one: their mean less the highest and the lowest from three steps on (the median
    for up to four), 0 for none (module doc)."""
    ordered = sorted(values)
    if len(ordered) >= 3:
        ordered = ordered[1:-1]
    return sum(ordered) / len(ordered) if ordered else 0.0


def _spread(values: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation of ``values`` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(v - middle) for v in values)


def _own_samples(rank: RankTimes, comm: bool) -> dict[str, list[float]]:
    """Each part's own seconds, step by step (module doc); a part without a sample is left out."""
    data = [d - w for d, w in zip(rank.data, rank.waits, strict=False)] or list(rank.data)
    found: dict[str, list[float]] = {DATA: [max(d, 0.0) for d in data]}
    for phase in STEP_PHASES:
        if comm:
            split = [c.phases[phase] for c in rank.comm if c is not None and phase in c.phases]
            found[phase] = [s.span - s.exposed for s in split]
        else:
            found[phase] = list(rank.phases.get(phase, ()))
    return {part: samples for part, samples in found.items() if samples}


def _parts(rank: RankTimes, comm: bool) -> tuple[RankParts, dict[str, list[float]]]:
    samples = _own_samples(rank, comm)
    read = [c for c in rank.comm if c is not None] if comm else []
    exposed = [c.step.exposed for c in read]
    parts = RankParts(
        own={part: _typical(values) for part, values in samples.items()},
        spread={part: _spread(values) for part, values in samples.items()},
        votes=_typical(rank.waits),
        exposed=_typical(exposed) if read else None,
        idle=_typical([c.step.idle for c in read]) if read else None,
    )
    if read:
        samples[COMMUNICATION] = exposed
    return parts, samples


class _Candidate(NamedTuple):
    rank: int
    part: str
    extra: float
    threshold: float  # never 0: the floor is above it


def _candidates(
    samples: Sequence[dict[str, list[float]]], parts: Sequence[str], floor: float
) -> list[_Candidate]:
    """Every rank's extra in each of ``parts`` over the other ranks' median, with its threshold there (the
    other ranks' spread: its own stalls widen its own)."""
    found = []
    for part in parts:
        typical = [_typical(s[part]) for s in samples]
        spreads = [_spread(s[part]) for s in samples]
        for rank, mine in enumerate(typical):
            others = _median([m for r, m in enumerate(typical) if r != rank])
            noise = max(w for r, w in enumerate(spreads) if r != rank)
            found.append(_Candidate(rank, part, mine - others, max(NOISE_TIMES * noise, floor)))
    return found


def _held(rank: RankTimes, comm: bool) -> list[float | None]:
    """A rank's waiting in communication, step by step: each communication step's exposed time (None:
    unread), or without them each clean step's backward (it holds DDP's all-reduce)."""
    if comm:
        return [None if c is None else c.step.exposed for c in rank.comm]
    return list(rank.phases.get(BACKWARD, ()))


def _beyond(mine: Sequence[float | None], theirs: Sequence[float | None]) -> float:
    """How much more ``theirs`` is than ``mine`` a step: the differences step by step as one
    (:func:`_typical`) where both ranks ran the same steps (what slowed a step on both cancels), else the
    difference of each as one."""
    if len(mine) == len(theirs):
        pairs = [t - m for m, t in zip(mine, theirs, strict=True) if m is not None and t is not None]
        if pairs:
            return _typical(pairs)
    return _typical([t for t in theirs if t is not None]) - _typical([m for m in mine if m is not None])


def _votes(rank: RankTimes, comm: bool) -> tuple[float, ...]:
    """A rank's seconds in the profiler's votes, step by step, on the steps its communication waits are
    read from (:func:`_held`): a clean step votes at each micro-batch and a communication step at its
    first only, so that with gradient accumulation the two kinds split one wait differently, and a wait
    told from one kind's votes and the other's exposed time was counted up to twice. Its waits lined up
    after the profiler's own work where told: a rank made late there by that work held nobody back (rank 0
    writing its trace at a vote read as the slow rank's wait, +-20 ms)."""
    if comm and len(rank.comm_waits) == len(rank.comm):
        return rank.comm_vote_waits or rank.comm_waits
    return rank.vote_waits or rank.waits


def _waits(
    ranks: Sequence[RankTimes], slow: int, comm: bool, part: str = DATA
) -> tuple[tuple[float, ...], bool]:
    """Each rank's waiting a step beyond the slow rank's own, in the profiler's votes and in communication
    on the same steps (0 at least; its own: 0), and whether the others wait more in communication than in
    the votes. Where the slow rank's ``part`` is its own communication, the others' wait is in the votes
    alone (its exposed time beyond theirs is the extra, not their wait)."""
    mine = ranks[slow]
    beyond = [
        (
            _beyond(_votes(mine, comm), _votes(rank, comm)),
            0.0 if part == COMMUNICATION else _beyond(_held(mine, comm), _held(rank, comm)),
        )
        for r, rank in enumerate(ranks)
        if r != slow
    ]
    waits = [max(votes + held, 0.0) for votes, held in beyond]
    waits.insert(slow, 0.0)
    in_comm = sum(held for _, held in beyond) > sum(votes for votes, _ in beyond)
    return tuple(waits), in_comm


def _named(
    candidates: Sequence[_Candidate], ranks: Sequence[RankTimes], comm: bool
) -> tuple[_Candidate, tuple[float, ...], bool] | None:
    """The largest extra beyond its threshold that the other ranks wait for (their mean wait at least
    :data:`WAIT_SHARE` of it), with each rank's wait for it and whether they wait in communication; None
    where no rank stands out."""
    for c in sorted((c for c in candidates if c.extra > c.threshold), key=lambda c: c.extra, reverse=True):
        waits, in_comm = _waits(ranks, c.rank, comm, c.part)
        if sum(waits) / (len(waits) - 1) >= WAIT_SHARE * c.extra:
            return c, waits, in_comm
    return None


def _collective(ranks: Sequence[RankTimes], slow: int) -> str | None:
    """The collective whose calls took the other ranks the most time (on their communication steps)."""
    seconds: dict[str, float] = {}
    for r, rank in enumerate(ranks):
        for split in rank.comm:
            if r != slow and split is not None:
                for call in split.collectives:
                    seconds[call.op] = seconds.get(call.op, 0.0) + call.seconds
    return max(seconds, key=lambda op: seconds[op]) if seconds else None


def find_slow_rank(ranks: Sequence[RankTimes], unsharded: bool = True) -> SlowRank | None:
    """The rank the others wait for, from every rank's ``ranks`` (by rank; module doc); None with one rank
    or where a rank timed no clean step. ``unsharded``: whether every rank holds the parameters whole, so
    that the forward and the optimizer step hold no collective and the clean steps alone can tell them."""
    if len(ranks) < 2 or any(not r.data for r in ranks):
        return None
    comm = all(any(c is not None for c in r.comm) for r in ranks)
    read = [_parts(r, comm) for r in ranks]
    parts, samples = [p for p, _ in read], [s for _, s in read]
    wanted = PARTS if comm else (DATA, FORWARD, OPTIMIZER_STEP) if unsharded else (DATA,)
    told = tuple(p for p in wanted if all(p in s for s in samples))
    untold = tuple(p for p in PARTS if p not in told)
    step = _median([_typical(r.data) + sum(_typical(v) for v in r.phases.values()) for r in ranks])
    floor = max(FLOOR_SHARE * step, MIN_EXTRA)
    candidates = _candidates(samples, told, floor)
    found = _named(candidates, ranks, comm)
    # no rank's own work beyond the noise: a rank's own communication, where the others wait for it (where
    # own work stands out unwaited, as two ranks slow in different parts lined up by the votes, it is not)
    if comm and not any(c.extra > c.threshold for c in candidates):
        more = _candidates(samples, (COMMUNICATION,), floor)
        candidates, told, found = candidates + more, (*told, COMMUNICATION), _named(more, ranks, comm)
    if not candidates:
        return None
    pick = max(candidates, key=lambda c: c.extra / c.threshold) if found is None else found[0]
    waits, in_comm = ((), False) if found is None else found[1:]
    unwaited = None
    if found is None and pick.extra > pick.threshold:  # beyond the noise: the others do not wait for it
        theirs = [w for r, w in enumerate(_waits(ranks, pick.rank, comm, pick.part)[0]) if r != pick.rank]
        unwaited = sum(theirs) / len(theirs)
    return SlowRank(
        ranks=tuple(parts),
        told=told,
        comm=comm,
        rank=pick.rank,
        part=pick.part,
        extra=pick.extra,
        threshold=pick.threshold,
        stands_out=found is not None,
        waits=waits,
        collective=_collective(ranks, pick.rank) if comm and in_comm else None,
        untold=untold,
        unwaited=unwaited,
    )
