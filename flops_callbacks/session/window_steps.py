"""The steps of a profile window and the figures made of its clean steps.

Each window step keeps what it did: its micro-batches' shape signatures, samples, tokens, flops (from
:class:`~flops_callbacks.session.shape_flops.ShapeFlops`), attention masks, phase marks, and the clock
marks of
its wall step (from the previous step's end to its own). The clean steps' figures are:

* rates (FLOPS, MFU, samples/s, tokens/s): the sum of the clean steps' flops (samples, tokens) over
  the sum of their times, so that steps of every shape weigh by their work, not by their number;
* latencies: the median over the clean steps, with its range (min .. max) and the number of steps;
* ``median_known``: whether the median iter latency is known within a tolerance, for
  ``clean_steps="auto"``.

Why not ``statistics.quantiles`` or scipy for the interval: the interval needs only two order
statistics and the binomial distribution, a few lines here; the core depends on torch only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

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
    LEAD_IN = "lead-in"  # a re-profile window's first: its end is where the first clean step's wall starts


# the latencies of a clean step, in the order gathered across ranks
LATENCIES = ("fwd", "bwd", "step", "iter", "data", "wall")
SUMS = ("fwd", "bwd", "step", "data", "wall")
CONFIDENCE = 0.90  # of the median's interval for clean_steps="auto"


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

    def add(
        self,
        batch: Any,
        signature: Signature,
        samples: int | None,
        tokens: int | None,
        counts: BatchCounts | None,
    ) -> None:
        """A micro-batch of this step (its kind decided): what it holds, its samples, tokens and flops."""
        self.signatures.append(signature)
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens
        self.counts = None if counts is None or self.counts is None else self.counts.plus(counts)
        if self.kind == Kind.CLEAN:
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                self.masks.append(mask)  # read after the window: no synchronize in a timed step
        if self.kind == Kind.COUNTING:
            self.batches.append(batch)

    def seconds(self) -> dict[str, float]:
        """Seconds of each latency of this step (data and wall 0 without the previous step's end)."""
        fwd, bwd, opt = self.phases.seconds()
        clock = self.phases.clock
        first = self.phases.first_mark
        known = self.start_mark is not None and self.end_mark is not None and first is not None
        wall = clock.seconds(self.start_mark, self.end_mark) if known else 0.0
        data = clock.seconds(self.start_mark, first) if known else 0.0
        return {"fwd": fwd, "bwd": bwd, "step": opt, "iter": fwd + bwd + opt, "data": data, "wall": wall}


@dataclass(frozen=True)
class Spread:
    """A latency over the clean steps: the median, its range, and over how many steps."""

    median: float
    low: float
    high: float
    steps: int


@dataclass(frozen=True)
class CleanFigures:
    """What the clean steps did, summed (for rates) and spread (for latencies): the slowest rank's times,
    the ranks' mean work per device."""

    counts: BatchCounts
    # per device: over several ranks, their mean (an int when exact)
    samples: int | float | None
    tokens: int | float | None
    real_tokens: int | float | None  # token positions that are not padding (attention masks), when known
    positions: int | float | None  # token positions the attention masks cover
    sums: dict[str, float]  # seconds of each of SUMS over the clean steps
    spreads: dict[str, Spread]  # each of LATENCIES
    iters: tuple[float, ...] = ()  # each step's fwd + bwd + step seconds, in order (this rank's)

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


def clean_figures(steps: list[WindowStep], counts: BatchCounts) -> CleanFigures:
    """The figures of ``steps`` (the clean steps, or the one step that stands for them) whose flops sum
    to ``counts``."""
    per_step = [s.seconds() for s in steps]
    spreads = {}
    for name in LATENCIES:
        values = [t[name] for t in per_step]
        spreads[name] = Spread(statistics.median(values), min(values), max(values), len(values))
    masks = [m for s in steps for m in s.masks]
    real = sum(int(m.sum()) for m in masks) if masks else None
    positions = sum(m.numel() for m in masks) if masks else None
    tokens = [s.tokens for s in steps]
    return CleanFigures(
        counts=counts,
        samples=None if any(s.samples is None for s in steps) else sum(s.samples or 0 for s in steps),
        tokens=None if any(t is None for t in tokens) else sum(t or 0 for t in tokens),
        real_tokens=real,
        positions=positions,
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
