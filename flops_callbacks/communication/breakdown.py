"""Where a multi-process step's time goes: compute, communication hidden under it, exposed, idle.

From a step's classed events (:mod:`.events`), per phase (the marks' windows) and for the whole
step (first mark to last, to the last kernel's end on a GPU): communication time (its union), the part
under compute (overlapped), the part alone (exposed: what the step waits on), and idle (neither). On a
CPU, the compute thread's wait for a core beside communication is exposed too (:meth:`TimeSplit.charged`). The
method is HTA's temporal breakdown and comm/comp overlap and torchtitan's overlap analysis, online.
Per collective: calls, bytes, seconds and bus bandwidth with nccl-tests' factors, so that figures of
different ops and world sizes compare with the link's peak. The ranks' breakdowns combine here too.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flops_callbacks.communication.events import Call, StepEvents
from flops_callbacks.communication.intervals import Interval, clip, intersect, total
from flops_callbacks.phase_names import STEP_PHASES

__all__ = [
    "BUS_FACTORS",
    "CommBreakdown",
    "Collective",
    "CollectiveRow",
    "TimeSplit",
    "breakdown",
    "bus_factor",
    "combine",
    "mean_split",
]

# nccl-tests' busbw = algbw x factor (n ranks): the bytes each link carries per byte of the buffer
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def bus_factor(op: str, world: int) -> float | None:
    """nccl-tests' bus bandwidth factor of ``op`` over ``world`` ranks (None: no such figure)."""
    factor = BUS_FACTORS.get(op)
    return factor(world) if factor is not None and world > 0 else None


@dataclass(frozen=True)
class TimeSplit:
    """Seconds of one window of a step (a phase, or the whole step)."""

    span: float
    compute: float
    comm: float
    overlapped: float  # communication while compute runs
    core_wait: float = 0.0  # of the exposed time, the compute thread's wait for a core (:meth:`charged`)
    rank_wait: float = 0.0  # of the exposed time, the wait for a slower rank before the step (:meth:`waited`)

    @property
    def exposed(self) -> float:
        """Communication while no compute runs (on a CPU, compute waiting for a core counts as not
        running: :meth:`charged`): what the step waits on."""
        return self.comm - self.overlapped

    @property
    def idle(self) -> float:
        """Neither compute nor communication (the host's own gaps, a device starved of work)."""
        return max(self.span - (self.compute + self.comm - self.overlapped), 0.0)

    @property
    def overlap(self) -> float | None:
        """Overlapped / communication, 0..1 (None: no communication)."""
        return self.overlapped / self.comm if self.comm > 0 else None

    def charged(self, waited: float) -> TimeSplit:
        """The split with ``waited`` seconds of the compute thread's wait for a core (a CPU's: gloo's
        threads held it) moved from overlapped communication to exposed, up to the overlapped time:
        compute did not run then, and the op intervals counted it as running. Adds to ``core_wait``
        (a step's split is charged with the sum its windows moved)."""
        moved = min(max(waited, 0.0), self.overlapped)
        return dataclasses.replace(
            self,
            compute=self.compute - moved,
            overlapped=self.overlapped - moved,
            core_wait=self.core_wait + moved,
        )

    def waited(self, seconds: float) -> TimeSplit:
        """The split with ``seconds`` of waiting for a slower rank in the profiler's votes before the step
        added to it as exposed communication: without the votes the rank waits as long in the step's
        first collective. Adds to ``rank_wait``."""
        wait = max(seconds, 0.0)
        return dataclasses.replace(
            self, span=self.span + wait, comm=self.comm + wait, rank_wait=self.rank_wait + wait
        )

    @classmethod
    def of(cls, window: Interval, compute: list[Interval], comm: list[Interval]) -> TimeSplit:
        inside_compute, inside_comm = clip(compute, window), clip(comm, window)
        both = total(intersect(inside_compute, inside_comm))
        span = max(window[1] - window[0], 0.0)
        us = 1e-6  # the events' times are microseconds
        return cls(span * us, total(inside_compute) * us, total(inside_comm) * us, both * us)


@dataclass(frozen=True)
class Collective:
    """One op's calls in the step: how many, bytes (None: unknown), seconds of their work (its union)."""

    op: str
    calls: int
    nbytes: int | None
    seconds: float

    def bus_bandwidth(self, world: int) -> float | None:
        """Achieved bus bandwidth, bytes/s: bytes / seconds x nccl-tests' factor (None: unknown)."""
        factor = bus_factor(self.op, world)
        if factor is None or self.nbytes is None or self.seconds <= 0:
            return None
        return self.nbytes / self.seconds * factor


@dataclass(frozen=True)
class CommBreakdown:
    """One rank's communication step: the whole step's split, each phase's, and the collectives."""

    step: TimeSplit
    phases: dict[str, TimeSplit]
    collectives: tuple[Collective, ...]
    device: bool  # an accelerator's timeline (else the host's: gloo on CPU)
    events: StepEvents | None = None  # the classed intervals it was made of (the trace's)


def _windows(
    marks: list[tuple[str, float]], waits: Sequence[float | None]
) -> list[tuple[str, Interval, float]]:
    """Each phase's windows from the marks (a mark opens its phase until the next one; "" opens none),
    each with the seconds the compute thread waited for a core in it (0: a mark without a reading)."""
    waits = list(waits) + [None] * (len(marks) - len(waits))
    out: list[tuple[str, Interval, float]] = []
    for (name, start), (_, end), before, after in zip(marks, marks[1:], waits, waits[1:], strict=False):
        if name in STEP_PHASES and end > start:
            waited = after - before if before is not None and after is not None else 0.0
            out.append((name, (start, end), waited))
    return out


def _quiet_wait_rate(windows: Sequence[tuple[TimeSplit, float]]) -> float:
    """The compute thread's wait for a core per second of compute in the windows with no communication
    (a DDP step's forward and optimizer step): the machine's other load, which is not communication's
    and is taken out of each window's wait before it moves (0: no such window)."""
    quiet = [(split.compute, waited) for split, waited in windows if split.comm == 0]
    compute = sum(c for c, _ in quiet)
    return sum(w for _, w in quiet) / compute if compute > 0 else 0.0


def breakdown(events: StepEvents) -> CommBreakdown | None:
    """The split of a step's classed ``events`` (None: no phase mark, so no step to split). Where the
    marks carry the compute thread's wait for a core (a CPU's), each window's, less the quiet windows'
    rate (:func:`_quiet_wait_rate`), moves from overlapped to exposed (:meth:`TimeSplit.charged`)."""
    windows = _windows(events.marks, events.waits)
    if not windows:
        return None
    step_start = windows[0][1][0]
    step_end = max(end for _, (_, end), _ in windows)
    if events.device:  # kernels run behind their launches: the step ends with its last one
        step_end = max([step_end] + [end for _, end in events.comm + events.compute])
    plain = [(name, TimeSplit.of(w, events.compute, events.comm), waited) for name, w, waited in windows]
    rate = _quiet_wait_rate([(split, waited) for _, split, waited in plain])
    phases: dict[str, TimeSplit] = {}
    moved = 0.0
    for phase in STEP_PHASES:
        splits = [
            split.charged(waited - rate * split.compute) for name, split, waited in plain if name == phase
        ]
        if splits:
            moved += sum(split.core_wait for split in splits)
            phases[phase] = _summed(splits)
    step = TimeSplit.of((step_start, step_end), events.compute, events.comm).charged(moved)
    return CommBreakdown(step, phases, _collectives(events.calls), events.device, events)


def _collectives(calls: Sequence[Call]) -> tuple[Collective, ...]:
    """Each op's calls, bytes and seconds: the union of its works' times where each is known (two calls of
    one op at once, on gloo's two threads, are not twice the time), else their sum."""
    ops: dict[str, list[Call]] = {}
    for call in calls:
        ops.setdefault(call.op, []).append(call)
    found = []
    for op, each in ops.items():
        sizes = [c.nbytes for c in each]
        nbytes = None if None in sizes else sum(n for n in sizes if n is not None)
        works = [c.work for c in each if c.work is not None]
        seconds = total(works) if len(works) == len(each) else sum(c.seconds for c in each)
        found.append(Collective(op, len(each), nbytes, seconds))
    return tuple(found)


@dataclass(frozen=True)
class CollectiveRow:
    """One op over the ranks: calls and bytes (rank 0's), seconds and bus bandwidth as min .. max."""

    op: str
    calls: int
    nbytes: int | None
    seconds: tuple[float, float]
    bus_bandwidth: tuple[float, float] | None


def _summed(splits: Sequence[TimeSplit], how: Callable[[list[float]], float] = sum) -> TimeSplit:
    """Each field of ``splits`` combined by ``how``."""
    return TimeSplit(*(how([getattr(s, f.name) for s in splits]) for f in dataclasses.fields(TimeSplit)))


def mean_split(splits: Sequence[TimeSplit]) -> TimeSplit:
    return _summed(splits, statistics.fmean)


def combine(
    ranks: Sequence[CommBreakdown], world: int
) -> tuple[TimeSplit, dict[str, TimeSplit], list[CollectiveRow]]:
    """The job's figures of every rank's breakdown: each split's fields the ranks' mean, and the
    collectives' table with the ranks' range."""
    step = mean_split([r.step for r in ranks])
    phases: dict[str, TimeSplit] = {
        p: mean_split([r.phases[p] for r in ranks]) for p in STEP_PHASES if all(p in r.phases for r in ranks)
    }
    rows = []
    for op in dict.fromkeys(c.op for r in ranks for c in r.collectives):
        mine = [c for r in ranks for c in r.collectives if c.op == op]
        seconds = [c.seconds for c in mine]
        bus = [b for c in mine if (b := c.bus_bandwidth(world)) is not None]
        rows.append(
            CollectiveRow(
                op,
                mine[0].calls,
                mine[0].nbytes,
                (min(seconds), max(seconds)),
                (min(bus), max(bus)) if bus else None,
            )
        )
    return step, phases, rows
