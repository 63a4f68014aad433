"""Continuous throughput after the profile window: samples, tokens, FLOPS and MFU per logging interval.

Shared by every door, through the step session, on every rank:

    meter.start(result, model, flops)      when the profile window has ended
    meter.begin_micro_batch(batch)         before each later micro-batch's forward
    meter.end_step()                       when its optimizer step has ended
    meter.interval()                       at a logging step: this rank's interval, and a new one
    meter.pause() / meter.resume()         around evaluation
    meter.close()                          at the end of training, or on an exception

and :func:`throughput_metrics` makes the job's ``throughput/*`` of every rank's interval (the session
exchanges them at the logging step, which every rank reaches).

Nothing is counted on these steps: a micro-batch's flops come from the window's table of shape
signatures (:class:`~flops_callbacks.session.shape_flops.ShapeFlops`): counted there, or predicted exactly
from the shapes counted there, so batches of every padded length have their own flops and no step
runs slower. A shape the table can neither give nor predict (a model whose counts are no polynomial
of its shapes, a batch unlike any the window saw) gets no flops: an interval with one logs samples and
tokens per second, not flops, and a warning says so once.

Time is the wall time between logging steps, read after one device synchronize per logging interval
(and one at each pause and resume), every step of the interval included, the slowest rank's; flops are
model flops (fwd + bwd, recompute excluded) per device: the ranks' mean, as
``flops_profiler/flops_per_sec``; samples and tokens are the job's: the ranks' mean times the
data-parallel size (every rank's own batches, summed over the replicas).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from flops_callbacks import metrics as names
from flops_callbacks.session.batch import shape_signature
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import ShapeFlops
from flops_callbacks.timing.clock import clock_for, module_device
from flops_callbacks.user_warning import warn

__all__ = ["Interval", "ThroughputMeter", "throughput_metrics"]


class Interval(NamedTuple):
    """What one rank did between two logging steps: its micro-batches' samples, tokens (None: unknown)
    and model flops (None: a shape's flops unknown), over its seconds."""

    seconds: float
    samples: int
    tokens: int | None
    flops: float | None


def throughput_metrics(
    intervals: Sequence[Interval], data_parallel: int, peak: float | None
) -> dict[str, float]:
    """The job's ``throughput/*`` of every rank's interval (module doc); empty when no step ran."""
    seconds = max(i.seconds for i in intervals)
    if seconds <= 0 or not any(i.samples for i in intervals):
        return {}
    world = len(intervals)
    metrics = {
        names.THROUGHPUT_SAMPLES_PER_SEC: sum(i.samples for i in intervals) / world * data_parallel / seconds
    }
    tokens = [i.tokens for i in intervals]
    if all(t is not None for t in tokens):
        metrics[names.THROUGHPUT_TOKENS_PER_SEC] = (
            sum(t or 0 for t in tokens) / world * data_parallel / seconds
        )
    flops = [i.flops for i in intervals]
    if all(f is not None for f in flops):
        per_device = sum(f or 0.0 for f in flops) / world / seconds
        metrics[names.THROUGHPUT_FLOPS_PER_SEC] = per_device
        if peak is not None:
            metrics[names.THROUGHPUT_MFU] = per_device / peak
    return metrics


class ThroughputMeter:
    """Samples, tokens and known flops per logging interval after the profile window (module doc).

    Args:
        batch_size_fn: samples in a micro-batch.
        tokens_fn: tokens in a micro-batch, or None when unknown (then no tokens_per_sec).
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        tokens_fn: Callable[[Any], int | None] | None = None,
    ) -> None:
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.flops = ShapeFlops()
        self.data_parallel = 1
        self.peak: float | None = None
        self._started = False
        self._samples = 0
        self._flops: float | None = 0.0
        self._tokens: int | None = 0
        self._later = False  # the next micro-batch is not its step's first
        self._warned_unknown = False

    def start(self, result: WindowResult, model: torch.nn.Module, flops: ShapeFlops) -> None:
        """Take the window's flops table and sizes, and start the first interval now."""
        self.flops = flops
        self.data_parallel = result.parallel.data_parallel
        self.peak = result.peak.flops if result.peak is not None else None
        self._clock = clock_for(module_device(model))
        self._started = True
        self._later = False
        self._paused_at: float | None = None
        self._restart(self._now())

    def begin_micro_batch(self, batch: Any) -> None:
        """Add a micro-batch's samples, tokens and flops (None for the interval when they are unknown)."""
        later, self._later = self._later, True
        if not self._started or self._paused_at is not None:
            return
        self._samples += int(self.batch_size_fn(batch))
        if self._tokens is not None:
            tokens = self.tokens_fn(batch) if self.tokens_fn is not None else None
            self._tokens = None if tokens is None else self._tokens + int(tokens)
        counts = self.flops.get(shape_signature(batch), later)
        if counts is None:
            self._flops = None
            if not self._warned_unknown:
                self._warned_unknown = True
                warn(
                    "flops_callbacks: a batch shape the profile window neither counted nor can predict "
                    f"({shape_signature(batch)}): intervals with one log samples and tokens per second, "
                    "not flops.",
                )
        elif self._flops is not None:
            self._flops += counts.model_flops

    def end_step(self) -> None:
        """After an optimizer step: the next micro-batch is a step's first."""
        self._later = False

    def interval(self) -> Interval:
        """This rank's interval since the last call (or the start), and a new interval from now."""
        if not self._started:
            return Interval(0.0, 0, 0, 0.0)
        now = self._now()
        seconds = now - self._start - self._paused
        if self._paused_at is not None:  # asked while paused: count up to the pause only
            seconds -= now - self._paused_at
        done = Interval(seconds, self._samples, self._tokens, self._flops)
        self._restart(now)
        if self._paused_at is not None:
            self._paused_at = now
        return done

    def metrics(self) -> dict[str, float]:
        """This rank's ``throughput/*`` of the interval since the last call, as if it were the job."""
        return throughput_metrics([self.interval()], self.data_parallel, self.peak)

    def pause(self) -> None:
        """Stop the interval's clock (evaluation) until :meth:`resume`."""
        if not self._started:
            return
        if self._paused_at is None:
            self._paused_at = self._now()

    def resume(self) -> None:
        if self._started and self._paused_at is not None:
            self._paused += self._now() - self._paused_at
            self._paused_at = None

    def close(self) -> None:
        """Stop metering."""
        self._started = False
        self._samples, self._flops, self._tokens = 0, 0.0, 0

    def _restart(self, now: float) -> None:
        self._start, self._paused = now, 0.0
        self._samples, self._flops, self._tokens = 0, 0.0, 0

    def _now(self) -> float:
        self._clock.synchronize()  # the device has done the work queued so far
        return time.perf_counter()
