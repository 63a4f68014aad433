"""Continuous throughput after the profile window: samples, tokens, FLOPS and MFU per logging interval.

Shared by both callbacks; an adapter calls, on the logging rank:

    meter.start(result, model, flops)      when the profile window has ended
    meter.begin_micro_batch(batch)         before each later micro-batch's forward
    meter.end_step()                       when its optimizer step has ended
    metrics = meter.metrics()              at a logging step
    meter.pause() / meter.resume()         around evaluation
    meter.close()                          at the end of training, or on an exception

Nothing is counted on these steps: a micro-batch's flops come from the window's table of shape
signatures (:class:`~flops_callbacks.session.shape_flops.ShapeFlops`): counted there, or predicted exactly
from the shapes counted there, so batches of every padded length have their own flops and no step
runs slower. A shape the table can neither give nor predict (a model whose counts are no polynomial
of its shapes, a batch unlike any the window saw) gets no flops: an interval with one logs samples and
tokens per second, not flops, and a warning says so once.

Time is the wall time between logging steps, read after one device synchronize per logging interval
(and one at each pause and resume), every step of the interval included; flops are model flops
(fwd + bwd, recompute excluded), per device, as ``flops_profiler/flops_per_sec``; samples and tokens
count all data-parallel replicas, assuming every replica's batches are as this rank's (as
``flops_profiler/samples_per_sec`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.session.batch import shape_signature
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import ShapeFlops
from flops_callbacks.timing.clock import clock_for, module_device
from flops_callbacks.user_warning import warn

__all__ = ["ThroughputMeter"]


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
        self._started = False
        self._samples = 0
        self._flops: float | None = 0.0
        self._tokens: int | None = 0
        self._later = False  # the next micro-batch is not its step's first
        self._warned_unknown = False

    def start(self, result: WindowResult, model: torch.nn.Module, flops: ShapeFlops) -> None:
        """Take the window's flops table and sizes, and start the first interval now."""
        self.flops = flops
        self._data_parallel = result.parallel.data_parallel
        self._peak = result.peak.flops if result.peak is not None else None
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

    def metrics(self) -> dict[str, float]:
        """The ``throughput/*`` metrics of the interval since the last call (or the start), and a new
        interval from now. Empty when the interval had no step."""
        if not self._started:
            return {}
        now = self._now()
        seconds = now - self._start - self._paused
        if self._paused_at is not None:  # asked while paused: count up to the pause only
            seconds -= now - self._paused_at
        samples, tokens, flops = self._samples, self._tokens, self._flops
        self._restart(now)
        if self._paused_at is not None:
            self._paused_at = now
        if seconds <= 0 or samples == 0:
            return {}
        dp = self._data_parallel
        metrics = {names.THROUGHPUT_SAMPLES_PER_SEC: samples * dp / seconds}
        if tokens is not None:
            metrics[names.THROUGHPUT_TOKENS_PER_SEC] = tokens * dp / seconds
        if flops is not None:
            metrics[names.THROUGHPUT_FLOPS_PER_SEC] = flops / seconds
            if self._peak is not None:
                metrics[names.THROUGHPUT_MFU] = flops / seconds / self._peak
        return metrics

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
