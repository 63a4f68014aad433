"""Continuous throughput after the profile window: samples, tokens, FLOPS and MFU per logging interval.

Shared by both callbacks; an adapter calls, on the logging rank:

    meter.start(result, model, signatures)     when the profile window has ended
    meter.begin_micro_batch(batch, model)      before each later micro-batch's forward
    meter.end_micro_batch()                    after its backward
    meter.end_step()                           when its optimizer step has ended
    metrics = meter.metrics()                  at a logging step
    meter.pause() / meter.resume()             around evaluation
    meter.close()                              at the end of training, or on an exception

Flops are not counted on these steps: a micro-batch whose shape signature (the shapes and dtypes of
its tensors) was seen before does the work measured for it then. The counting step gives the flops
of its signature (when all its micro-batches share one). A micro-batch with a new signature is
measured once, exactly, by the counting engine (:class:`~flops_callbacks.tracer.Tracer`, with no
clock) on its own forward and backward: nothing is scaled or guessed, so attention's quadratic cost in
the sequence length and any padding are what they are. That step runs slower (it counts), so it is
left out of the interval: its time, samples and flops. At most ``max_signatures`` signatures are
measured (dynamic padding can make a new one every batch); an interval with a micro-batch beyond them
logs samples and tokens, not flops.

Time is the wall time between logging steps, read after one device synchronize per logging interval
(and one at each pause and resume); flops are model flops (fwd + bwd, recompute excluded), per device,
as ``flops_profiler/flops_per_sec``; samples and tokens count all data-parallel replicas, assuming
every replica's batches are as this rank's (as ``flops_profiler/samples_per_sec`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.batch import Signature, shape_signature
from flops_callbacks.clock import NullClock, clock_for, module_device
from flops_callbacks.options import CausalAttention
from flops_callbacks.result import WindowResult
from flops_callbacks.tracer import Tracer
from flops_callbacks.user_warning import warn


class ThroughputMeter:
    """Samples, tokens and measured flops per logging interval after the profile window (module doc).

    Args:
        batch_size_fn: samples in a micro-batch.
        tokens_fn: tokens in a micro-batch, or None when unknown (then no tokens_per_sec).
        causal_attention: as the profile counted attention ("full" or "half").
        max_signatures: how many shape signatures are measured at most.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        tokens_fn: Callable[[Any], int | None] | None = None,
        causal_attention: CausalAttention = "full",
        max_signatures: int = 16,
    ) -> None:
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.causal_attention = causal_attention
        self.max_signatures = max_signatures
        # model flops (fwd + bwd) of one micro-batch, per signature
        self.flops_per_micro_batch: dict[Signature, float] = {}
        self._started = False
        self._measuring: tuple[Signature, Tracer] | None = None
        self._warned_unmeasured = False
        self._evaluating = False

    @property
    def started(self) -> bool:
        return self._started

    def start(self, result: WindowResult, model: torch.nn.Module, observed: list[Signature]) -> None:
        """Take the counting step's flops (``observed``: its micro-batches' signatures) and sizes, and
        start the first interval now."""
        if observed and len(set(observed)) == 1:
            self.flops_per_micro_batch[observed[0]] = result.profile.model_flops / len(observed)
        self._data_parallel = result.parallel.data_parallel
        self._peak = result.peak.flops if result.peak is not None else None
        self._clock = clock_for(module_device(model))
        self._started = True
        self._paused_at: float | None = None
        self._evaluating = False
        self._restart(self._now())

    def begin_micro_batch(self, batch: Any, model: torch.nn.Module) -> None:
        """Count a micro-batch's samples, tokens and known flops; measure it if its signature is new."""
        if not self._started or self._paused_at is not None:
            return
        signature = shape_signature(batch)
        flops = self.flops_per_micro_batch.get(signature)
        if flops is None and len(self.flops_per_micro_batch) < self.max_signatures:
            self.pause()  # the counting step is slower: not part of the interval
            tracer = Tracer(model, causal_attention=self.causal_attention, clock=NullClock())
            tracer.start()
            self._measuring = (signature, tracer)
            return
        self._samples += int(self.batch_size_fn(batch))
        if self._tokens is not None:
            tokens = self.tokens_fn(batch) if self.tokens_fn is not None else None
            self._tokens = None if tokens is None else self._tokens + int(tokens)
        if flops is None:
            self._flops = None
            if not self._warned_unmeasured:
                self._warned_unmeasured = True
                warn(
                    f"flops_callbacks: more than {self.max_signatures} batch shapes; intervals with a new "
                    "one log samples and tokens per second, not flops.",
                )
        elif self._flops is not None:
            self._flops += flops

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: keep its measured flops if it was measured."""
        if self._measuring is None:
            return
        signature, tracer = self._measuring
        self._measuring = None
        tracer.stop()
        self.flops_per_micro_batch[signature] = float(tracer.profile().model_flops)

    def end_step(self) -> None:
        """After an optimizer step: a step that measured a new signature ends its pause here."""
        self.end_micro_batch()  # an optimizer step that ended without its micro-batch's end event
        if self._paused_at is not None and not self._evaluating:
            self.resume()

    def metrics(self) -> dict[str, float]:
        """The ``throughput/*`` metrics of the interval since the last call (or the start), and a new
        interval from now. Empty when the interval had no counted step."""
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

    def pause(self, evaluating: bool = False) -> None:
        """Stop the interval's clock (evaluation, a measuring step) until :meth:`resume`; an evaluation's
        pause outlasts the end of a step, a measuring step's does not."""
        if not self._started:
            return
        self._evaluating = self._evaluating or evaluating
        if self._paused_at is None:
            self._paused_at = self._now()

    def resume(self) -> None:
        self._evaluating = False
        if self._started and self._paused_at is not None:
            self._paused += self._now() - self._paused_at
            self._paused_at = None

    def close(self) -> None:
        """Stop a measurement in progress (the tracer removes its hooks and modes) and stop metering."""
        measuring, self._measuring = self._measuring, None
        if measuring is not None:
            measuring[1].stop()
        self._started = False

    def _restart(self, now: float) -> None:
        self._start, self._paused = now, 0.0
        self._samples, self._flops = 0, 0.0
        self._tokens: int | None = 0

    def _now(self) -> float:
        self._clock.synchronize()  # the device has done the work queued so far
        return time.perf_counter()
