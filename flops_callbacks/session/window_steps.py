"""The steps of a profile window and the figures made of its clean steps.

Each window step keeps what it did: its micro-batches' shape signatures, samples, tokens, flops (from
:class:`~flops_callbacks.session.shape_flops.ShapeFlops`), attention masks, phase marks, and the clock
marks of
its wall step (from the previous step's end to its own). The clean steps' figures are:

* the median step: the clean step whose FLOPS (its own exact flops, whatever its batch shapes, over its
  fwd + bwd + step) is the median of theirs (for an even count, the mean of the two middle ones).
  Its phase latencies are the window's latencies and its work over them the rates (FLOPS, MFU,
  samples/s, tokens/s), so that iter latency = fwd + bwd + step latency, every rate is the median of the
  per-step rates, and one slow step moves none of them (summed flops over summed times would carry
  all of a hiccup's time; a sum of per-phase medians is no step's and no median's);
* spreads: each latency's median and range (min .. max) over the clean steps: where a slow step shows;
* wall rates: the clean steps' samples (tokens) over the sum of their wall times: what the wall did.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from flops_callbacks.communication.breakdown import CommBreakdown
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.token_layout import Layout, LayoutTensors, layout_tensors
from flops_callbacks.session.vote_times import Vote
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.timing.energy_figures import Reading
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phases import StepPhases

__all__ = [
    "SUMS",
    "StepSeconds",
    "LATENCIES",
    "CleanFigures",
    "CleanStep",
    "Spread",
    "StepWork",
    "Pauses",
    "WindowStep",
    "clean_figures",
    "mean",
]

# the latencies of a clean step
LATENCIES = ("fwd", "bwd", "step", "iter", "data", "wall")


class StepSeconds(NamedTuple):
    """A clean step's seconds: its phases, the wait for data and the wall step."""

    fwd: float
    bwd: float
    step: float
    data: float
    wall: float

    @property
    def iter(self) -> float:
        """fwd + bwd + step (DeepSpeed's iter latency)."""
        return self.fwd + self.bwd + self.step


SUMS = StepSeconds._fields


class StepWork(NamedTuple):
    """What one timed step did per device (over several ranks: their mean): its flops and MACs, samples,
    tokens, and the token positions its attention masks cover and those that are not padding (None:
    unknown)."""

    counts: BatchCounts
    samples: int | float | None
    tokens: int | float | None
    real_tokens: int | float | None = None
    positions: int | float | None = None

    @classmethod
    def combined(cls, work: Sequence[StepWork], how: Any) -> StepWork:
        """Each field of ``work`` combined by ``how`` (a list of values -> one; None if one is None);
        counts field by field, rounded to whole flops."""
        fields: list[Any] = [
            BatchCounts(*(round(how([w.counts[i] for w in work])) for i in range(len(BatchCounts._fields))))
        ]
        for i in range(1, len(cls._fields)):
            values = [w[i] for w in work]
            fields.append(None if any(v is None for v in values) else how(values))
        return cls(*fields)


def _sum(values: list[Any]) -> Any:
    return sum(values)


def mean(values: Sequence[Any]) -> Any:
    """The mean of per-device figures (None when one is unknown): an int when exact, as a count is."""
    if any(v is None for v in values):
        return None
    total = sum(values)
    return total // len(values) if total % len(values) == 0 else total / len(values)


@dataclass
class WindowStep:
    """One step of the window: its job, its phase marks, and what its micro-batches held."""

    kind: Kind | None  # None until its first micro-batch says whether its flops are known
    number: int
    phases: StepPhases
    start_mark: Any = None  # the previous window step's end: where this wall step starts
    end_mark: Any = None
    paused: list[tuple[Any, Any]] = field(default_factory=list)  # in its wall, the run's declared pauses
    fetch: Any = None  # where the framework began fetching its first batch (None: its wait is all before it)
    ended: bool = False  # its end marked (a meta clock's marks are None)
    signatures: list[Signature] = field(default_factory=list)
    # each micro-batch, and how the adapter's step runs it again, where the window's end may count it
    # (a token batch's sequences; a module-timing step's batch of other shapes than the counting step's)
    batches: list[Any] = field(default_factory=list)
    replays: list[Any] = field(default_factory=list)
    samples: int | None = 0  # None when a micro-batch's size could not be found
    tokens: int | None = None
    counts: BatchCounts | None = field(default_factory=BatchCounts.zero)  # None: a micro-batch's are unknown
    each: list[BatchCounts | None] = field(default_factory=list)  # each micro-batch's (None: unknown)
    # each micro-batch's padding and packing: the tensors (read at the window's end, no synchronize in a
    # timed step), then their layout; and its samples as read (a layout's sequences replace them)
    layouts: list[LayoutTensors | None] = field(default_factory=list)
    laid_out: list[Layout | None] = field(default_factory=list)
    each_samples: list[int | None] = field(default_factory=list)
    layout_samples: bool = True  # samples are a layout's sequences (no batch_size_fn of the user's)
    timer: ModuleTimer | None = None  # a module-timing step's marks
    outer: OuterCalls | None = None  # a clean step's outermost module calls (CPU: the hooks' cost)
    comm: CommBreakdown | None = None  # the communication step's split of its time
    votes: tuple[Vote, ...] = ()  # the profiler's votes in its wall, on this rank (session.window_plan)
    energy: Reading | str | None = None  # the energy counter right after its end mark, or why none
    frames: int = 0  # dynamo's compiled frames at its start (a clean step that compiled is left out)

    def add(
        self,
        batch: Any,
        signature: Signature,
        samples: int | None,
        tokens: int | None,
        counts: BatchCounts | None,
        replay: Any = None,
        keep: bool = False,
    ) -> None:
        """A micro-batch of this step (its kind decided): what it holds, its samples, tokens and flops;
        ``replay``: its step again, kept with the batch where it is a token batch or ``keep`` says so."""
        self.signatures.append(signature)
        self.each_samples.append(samples)
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens
        self.each.append(counts)
        self.counts = None if counts is None or self.counts is None else self.counts.plus(counts)
        layout = layout_tensors(batch, decoder_marks=True)  # read where the model is an encoder-decoder
        self.layouts.append(layout)
        held = keep or layout is not None or self.kind == Kind.COUNTING  # the counting step's: the estimate's
        self.batches.append(batch if held else None)
        self.replays.append(replay if held else None)

    def other_shapes(self, counted: Sequence[Signature], signature: Signature) -> bool:
        """Whether this module-timing step's next micro-batch (``signature``) has other shapes than the
        counting step's (``counted``) at its place: its batch is kept, counted at the window's end for the
        module tree it times."""
        place = len(self.signatures)
        return self.kind == Kind.MODULE_TIMING and (place >= len(counted) or counted[place] != signature)

    def read_layouts(self, encoder_decoder: bool = False) -> None:
        """Read each micro-batch's layout (after the window: it waits for the device); a layout's
        sequences are the micro-batch's samples; ``encoder_decoder``: the model is one (its rows pairs)."""
        held = [t if t is None or encoder_decoder else t.without_decoder_marks() for t in self.layouts]
        self.laid_out = [t.read() if t is not None else None for t in held]
        if self.layout_samples and any(self.laid_out):
            read = zip(self.laid_out, self.each_samples, strict=True)
            each = [lo.sequences if lo is not None else n for lo, n in read]
            self.samples = None if any(n is None for n in each) else sum(n or 0 for n in each)

    def fill(self, index: int, counts: BatchCounts) -> None:
        """Micro-batch ``index``'s counts, found after it ran (counted off the clock)."""
        self.each[index] = counts
        known = [c for c in self.each if c is not None]
        total = BatchCounts.zero()
        for c in known:
            total = total.plus(c)
        self.counts = total if len(known) == len(self.each) else None

    def finished(self) -> bool:
        """Whether the device has run this step to its end, so its seconds read without waiting: the
        ``"auto"`` stop reads no other (a synchronize would drain the queue the host keeps ahead of the
        device, and the next clean step would start with the device idle)."""
        return self.ended and self.phases.clock.done(self.end_mark)

    def seconds(self) -> dict[str, float]:
        """Seconds of each latency of this step (data and wall 0 without the previous step's end). Its data
        time is the wait before its first forward and between its micro-batches (from the fetch's start,
        where the framework says it); a pause the run declared (evaluation: ``pause()`` / ``resume()``) is
        no part of any of them, wherever it falls (between two steps, inside a block)."""
        fwd, bwd, opt = self.phases.seconds(self._unpaused)
        first = self.phases.first_mark
        data = wall = 0.0
        if self.start_mark is not None and self.end_mark is not None and first is not None:
            wall = max(self._unpaused(self.start_mark, self.end_mark), 0.0)
            waited = self._unpaused(self.fetch or self.start_mark, first)
            data = max(waited + self.phases.wait_seconds(self._unpaused), 0.0)
        return {"fwd": fwd, "bwd": bwd, "step": opt, "iter": fwd + bwd + opt, "data": data, "wall": wall}

    def _unpaused(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` less the pauses that overlap them (the run's declared ones, the
        profiler's own work: their union, as an event's own work may hold another's)."""
        clock = self.phases.clock
        seconds = clock.seconds(start, end)
        inside = sorted((clock.seconds(start, a), clock.seconds(start, b)) for a, b in self.paused)
        reached = 0.0  # seconds from ``start`` the pauses so far cover up to
        for a, b in inside:
            a, b = max(a, reached), min(b, clock.seconds(start, end))
            if b > a:
                seconds -= b - a
                reached = b
        return seconds

    def work(self, counts: BatchCounts | None = None) -> StepWork:
        """What this step did; ``counts``: its flops when its own are not known (the profile's)."""
        read = [lo for lo in self.laid_out if lo is not None]
        real = sum(lo.real_tokens for lo in read) if read else None
        positions = sum(lo.positions for lo in read) if read else None
        own = counts if counts is not None else self.counts or BatchCounts.zero()
        return StepWork(own, self.samples, self.tokens, real, positions)


@dataclass(frozen=True)
class Spread:
    """A latency over the clean steps: the median, its range, and over how many steps."""

    median: float
    low: float
    high: float
    steps: int


class CleanStep(NamedTuple):
    """One timed step as the job saw it: its work per device and its seconds (each of :data:`SUMS`)."""

    work: StepWork
    seconds: StepSeconds

    def latency(self, name: str) -> float:
        """Seconds of one of :data:`LATENCIES` ("iter": fwd + bwd + step)."""
        return float(getattr(self.seconds, name))

    def rate(self) -> float:
        """Its model flops per second of fwd + bwd + step (seconds' inverse where no flops are known):
        what the median step is the median of."""
        seconds = self.latency("iter")
        return (self.work.counts.model_flops or 1) / seconds if seconds > 0 else math.inf


@dataclass(frozen=True)
class CleanFigures:
    """What the clean steps did, step by step (the ranks' mean work per device, each step's slowest rank's
    times): the median step, the spreads and the sums are made of them."""

    steps: tuple[CleanStep, ...]

    def median_step(self) -> CleanStep:
        """The step of the median FLOPS (module doc): its latencies and rates are the window's; of an even
        count, the mean of the two middle ones (as a median of two values is their mean)."""
        ranked = sorted(self.steps, key=CleanStep.rate)
        middle = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
        if len(middle) == 1:
            return middle[0]
        seconds = StepSeconds(*(sum(pair) / 2 for pair in zip(*(s.seconds for s in middle), strict=True)))
        return CleanStep(StepWork.combined([s.work for s in middle], mean), seconds)

    @property
    def work(self) -> tuple[StepWork, ...]:
        return tuple(s.work for s in self.steps)

    def total(self) -> StepWork:
        """The steps' work summed: what the wall rates divide by the summed wall time."""
        return StepWork.combined(self.work, _sum)

    @property
    def sums(self) -> dict[str, float]:
        """Seconds of each of :data:`SUMS` over the clean steps."""
        return {name: sum(s.latency(name) for s in self.steps) for name in SUMS}

    @property
    def spreads(self) -> dict[str, Spread]:
        """Each of :data:`LATENCIES`: median, min, max over the steps."""
        spreads = {}
        for name in LATENCIES:
            values = [s.latency(name) for s in self.steps]
            spreads[name] = Spread(statistics.median(values), min(values), max(values), len(values))
        return spreads

    @property
    def iters(self) -> tuple[float, ...]:
        """Each step's fwd + bwd + step seconds, in order."""
        return tuple(s.latency("iter") for s in self.steps)

    @property
    def counts(self) -> BatchCounts:
        return self.total().counts

    @property
    def samples(self) -> int | float | None:
        return self.total().samples

    @property
    def tokens(self) -> int | float | None:
        return self.total().tokens

    @property
    def iter_seconds(self) -> float:
        return sum(self.iters)


def clean_figures(
    steps: list[WindowStep], counts: BatchCounts | None = None, each: Sequence[BatchCounts] | None = None
) -> CleanFigures:
    """The figures of ``steps`` (the clean steps, or the one step that stands for them); ``counts``: the
    flops of the one step that stands for them when its own are not known (the profile's); ``each``:
    every step's flops where the shape table's are not theirs (estimated from counted neighbours)."""
    timed = []
    for i, s in enumerate(steps):
        seconds = s.seconds()
        own = each[i] if each is not None else counts
        timed.append(CleanStep(s.work(own), StepSeconds(*(seconds[name] for name in SUMS))))
    return CleanFigures(tuple(timed))


class Pauses:
    """The run's declared pauses inside a window (evaluation): the one open now, and those closed between
    two window steps, which are in the next one's wall (out of its data and wall time)."""

    def __init__(self) -> None:
        self.start: Any = None  # the open pause's clock mark (None: none is open)
        self.waiting: list[tuple[Any, Any]] = []
        self.fetch: Any = None  # where the framework began fetching the next window step's first batch
        self.quiet: Any = None  # the last step's end, or the last pause's: where a late pause starts

    def fetching(self, mark: Any, step: WindowStep | None) -> None:
        """The framework starts fetching the next micro-batch at ``mark``: of ``step`` (between its
        micro-batches), or (None) of the next window step (:attr:`WindowStep.fetch`). What ran since the
        last one (other callbacks, logging) is no wait for data: the step's other time."""
        if step is not None:
            step.phases.fetching(mark)
        else:
            self.fetch = mark

    def begin(self, mark: Any, late: bool = False) -> None:
        """A pause starts at ``mark``; ``late``: it started at the last step's end or pause's (learned
        of when it has ended: an evaluation or a save no event announced), ``mark`` where there is none."""
        self.start = self.quiet if late and self.quiet is not None else mark

    def end(self, mark: Any, step: WindowStep | None) -> None:
        """The open pause ends: in ``step``'s wall, or (None: between two steps) in the next one's."""
        if self.start is not None:
            (step.paused if step is not None else self.waiting).append((self.start, mark))
            self.start = None
            self.quiet = mark

    @contextlib.contextmanager
    def own(self, clock: Any, running: Callable[[], WindowStep | None]) -> Iterator[None]:
        """The profiler's own work in an event, on ``clock`` (None: left in, as with several ranks, whose
        votes are taken out apart): like a declared pause, no part of the step ``running`` at its start nor
        of the one at its end, or (none) of the next one's. A step that ended in it keeps its seconds as
        they were read at its end (its timed part had stopped)."""
        if clock is None:
            yield
            return
        before, start = running(), clock.mark()
        yield
        end, after = clock.mark(), running()
        if before is not None and before.ended:  # from its end on: the "auto" stop read its seconds already
            start = before.end_mark
        elif before is not None and before is not after:
            before.paused.append((start, end))
        (after.paused if after is not None else self.waiting).append((start, end))

    def take(self) -> dict[str, Any]:
        """What a window step that starts now holds: the pauses since the last one ended, and its fetch
        (:class:`WindowStep`'s ``paused`` and ``fetch``)."""
        held = {"paused": self.waiting, "fetch": self.fetch}
        self.waiting, self.start, self.fetch, self.quiet = [], None, None, None
        return held
