"""The steps of a profile window and the figures made of its clean steps.

Each window step keeps what it did: its micro-batches' shape signatures, samples, tokens, flops (from
:class:`~flops_callbacks.session.shape_flops.ShapeFlops`), attention masks, phase marks, and the clock
marks of
its wall step (from the previous step's end to its own). The clean steps' figures are:

* latencies: the median over the clean steps, with its range (min .. max) and the number of steps;
* work per step (flops, samples, tokens): the median over the clean steps, each step with its own
  exact flops whatever its batch shapes (:class:`StepWork`); the rates (FLOPS, MFU, samples/s,
  tokens/s) are these medians over the median latencies, so one slow step moves none of them (a sum of
  flops over a sum of times would carry all of a hiccup's time); the range shows the slow step;
* wall rates: the clean steps' samples (tokens) over the sum of their wall times: what the wall did;
* ``median_known``: whether the median iter latency is known within a tolerance, for
  ``clean_steps="auto"``.

Why not ``statistics.quantiles`` or scipy for the interval: the interval needs only two order
statistics and the binomial distribution, a few lines here; the core depends on torch only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from flops_callbacks.session.batch import Signature
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phases import StepPhases

__all__ = [
    "Kind",
    "LATENCIES",
    "CleanFigures",
    "Spread",
    "StepWork",
    "WindowStep",
    "clean_figures",
    "median_known",
]

# what a window step is for


class Kind:
    """The job of a window step (the names the report and JSON say)."""

    COUNTING, MODULE_TIMING, CLEAN = "counting", "module timing", "clean"
    SHAPE_COUNTING = "shape counting"  # counted with no clock: its batch shapes' flops were not known yet
    SKIPPED = "skipped"  # timed, but its batch shapes' flops are unknown (no shape counting left)


# the latencies of a clean step, in the order gathered across ranks
LATENCIES = ("fwd", "bwd", "step", "iter", "data", "wall")
SUMS = ("fwd", "bwd", "step", "data", "wall")
CONFIDENCE = 0.90  # of the median's interval for clean_steps="auto"


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


def _median(values: list[Any]) -> Any:
    middle = statistics.median(values)
    return int(middle) if middle == int(middle) else middle  # a whole median stays an int


@dataclass
class WindowStep:
    """One step of the window: its job, its phase marks, and what its micro-batches held."""

    kind: str | None  # None until its first micro-batch says whether its flops are known
    number: int
    phases: StepPhases
    start_mark: Any = None  # the previous window step's end: where this wall step starts
    end_mark: Any = None
    signatures: list[Signature] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)  # the counting step's, for the Trainer's estimate
    samples: int | None = 0  # None when a micro-batch's size could not be found
    tokens: int | None = None
    counts: BatchCounts | None = field(default_factory=BatchCounts.zero)  # None: a micro-batch's are unknown
    masks: list[torch.Tensor] = field(default_factory=list)  # attention masks (padding)
    timer: ModuleTimer | None = None  # a module-timing step's marks
    outer: OuterCalls | None = None  # a clean step's outermost module calls (CPU: the hooks' cost)

    def seconds(self) -> dict[str, float]:
        """Seconds of each latency of this step (data and wall 0 without the previous step's end)."""
        fwd, bwd, opt = self.phases.seconds()
        clock = self.phases.clock
        first = self.phases.first_mark
        known = self.start_mark is not None and self.end_mark is not None and first is not None
        wall = clock.seconds(self.start_mark, self.end_mark) if known else 0.0
        data = clock.seconds(self.start_mark, first) if known else 0.0
        return {"fwd": fwd, "bwd": bwd, "step": opt, "iter": fwd + bwd + opt, "data": data, "wall": wall}

    def work(self, counts: BatchCounts | None = None) -> StepWork:
        """What this step did; ``counts``: its flops when its own are not known (the profile's)."""
        real = sum(int(m.sum()) for m in self.masks) if self.masks else None
        positions = sum(m.numel() for m in self.masks) if self.masks else None
        own = counts if counts is not None else self.counts or BatchCounts.zero()
        return StepWork(own, self.samples, self.tokens, real, positions)


@dataclass(frozen=True)
class Spread:
    """A latency over the clean steps: the median, its range, and over how many steps."""

    median: float
    low: float
    high: float
    steps: int


@dataclass(frozen=True)
class CleanFigures:
    """What the clean steps did: each step's work, the sums and spreads of their times (the slowest rank's
    times, the ranks' mean work per device)."""

    work: tuple[StepWork, ...]  # each step's, in order (over several ranks: step by step, their mean)
    sums: dict[str, float]  # seconds of each of SUMS over the clean steps
    spreads: dict[str, Spread]  # each of LATENCIES
    iters: tuple[float, ...] = ()  # each step's fwd + bwd + step seconds, in order (this rank's)

    def total(self) -> StepWork:
        """The steps' work summed: what the wall rates divide by the summed wall time."""
        return StepWork.combined(self.work, _sum)

    def median(self) -> StepWork:
        """The median step's work, field by field: what the rates divide by the median latencies."""
        return StepWork.combined(self.work, _median)

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
    def real_tokens(self) -> int | float | None:
        return self.total().real_tokens

    @property
    def positions(self) -> int | float | None:
        return self.total().positions

    @property
    def iter_seconds(self) -> float:
        return self.sums["fwd"] + self.sums["bwd"] + self.sums["step"]

    def gathered(self) -> tuple[float, ...]:
        """The times as one row of floats, to compare ranks (:func:`from_gathered`)."""
        row = [self.sums[name] for name in SUMS]
        for name in LATENCIES:
            s = self.spreads[name]
            row += [s.median, s.low, s.high]
        return tuple(row)

    @staticmethod
    def phase_medians(row: tuple[float, ...]) -> tuple[float, float, float]:
        """The (fwd, bwd, step) medians of a :meth:`gathered` row: their sum is that rank's iter latency."""
        at = len(SUMS)
        return row[at], row[at + 3], row[at + 6]

    def from_gathered(self, row: tuple[float, ...]) -> CleanFigures:
        """These figures with another rank's times (the work stays this one's)."""
        sums = dict(zip(SUMS, row[: len(SUMS)], strict=True))
        rest = row[len(SUMS) :]
        steps = next(iter(self.spreads.values())).steps
        spreads = {
            name: Spread(rest[3 * i], rest[3 * i + 1], rest[3 * i + 2], steps)
            for i, name in enumerate(LATENCIES)
        }
        return replace(self, sums=sums, spreads=spreads)


def clean_figures(steps: list[WindowStep], counts: BatchCounts | None = None) -> CleanFigures:
    """The figures of ``steps`` (the clean steps, or the one step that stands for them); ``counts``: the
    flops of the one step that stands for them when its own are not known (the profile's)."""
    per_step = [s.seconds() for s in steps]
    spreads = {}
    for name in LATENCIES:
        values = [t[name] for t in per_step]
        spreads[name] = Spread(statistics.median(values), min(values), max(values), len(values))
    return CleanFigures(
        work=tuple(s.work(counts) for s in steps),
        sums={name: sum(t[name] for t in per_step) for name in SUMS},
        spreads=spreads,
        iters=tuple(t["iter"] for t in per_step),
    )


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The distribution-free interval for the median from order statistics: ``(x_(k), x_(n+1-k))`` with
    the largest ``k`` such that ``P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2``; it holds the
    true median with probability at least ``confidence`` whatever the distribution. None when ``n`` is
    too small for any such interval (below 5 steps at 90%)."""
    n = len(values)
    k = 0
    while k + 1 <= n // 2 and _binomial_cdf(k, n) <= (1 - confidence) / 2:
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def median_known(values: list[float], tolerance: float = 0.03) -> bool:
    """Whether the median of ``values`` is known within +-``tolerance`` (its interval lies inside)."""
    interval = median_interval(values)
    if interval is None:
        return False
    median = statistics.median(values)
    return interval[0] >= median * (1 - tolerance) and interval[1] <= median * (1 + tolerance)
