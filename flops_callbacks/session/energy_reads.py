"""Where the session reads the device's energy counter, and what that comes to: the window's clean steps
(this rank's span, the job's of every rank's, the ``flops_profiler/`` energy metrics) and the throughput
meter's intervals after the window (``throughput/power``, ``throughput/tokens_per_joule``).

The window's counter (:func:`~flops_callbacks.timing.energy.energy_counter`) is made at the window's first
step, read right after each window step's end mark and stopped at the window's end: a clean step's energy
runs from the previous window step's end to its own, the steps of its wall latency. The meter reads a
counter of its own once per logging interval and around its pauses (a RAPL counter also at the first
step end :data:`KEEP_UP_S` after its last read, so that no wrap falls between two reads), only where
reading it is cheap and needs nothing running between reads (RAPL; NVML's total energy), never sampled
power (a thread for the whole run). The counter is read on the host, without waiting for the device: in
a steady loop the host runs ahead of the device by about the same at both ends of a span.

Reading it is the profiler's own work: a failure leaves the window (or the meter) without energy, says
why in one line, and nothing else changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.session.window_steps import WindowStep
from flops_callbacks.timing.clock import module_device
from flops_callbacks.timing.energy import EnergyCounter, NvmlEnergy, RaplEnergy, energy_counter, read_failure
from flops_callbacks.timing.energy_figures import (
    EnergySpan,
    Reading,
    energy_figures,
    job_spans,
    read,
    span_over,
)
from flops_callbacks.user_warning import warn

__all__ = [
    "KEEP_UP_S",
    "IntervalEnergy",
    "WindowEnergy",
    "energy_metrics",
    "job_energy",
    "rank_energy",
    "throughput_energy",
]

# seconds between two reads of a RAPL counter while the meter runs, at most (plus a step): a counter's
# range lasts minutes (262 kJ on Intel: 22 minutes at 200 W; ranges of a quarter of that exist) and an
# interval may last longer, losing a wrap; two reads over half a range apart read as a reset
KEEP_UP_S = 5.0


class WindowEnergy:
    """The energy counter over one window (module doc): started at its first step, read at each step's end,
    stopped at its end; holds nothing between windows (and pickles without a counter)."""

    def __init__(self) -> None:
        self.counter: EnergyCounter | None = None
        self.why = ""  # why this window has no counter ("" while it has one)
        self.running = False

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def start(self, model: torch.nn.Module) -> None:
        """A window step starts: the first one makes the counter of ``model``'s device (or says why none)."""
        if self.running:
            return
        self.running = True
        try:
            found = energy_counter(module_device(model))
            if not isinstance(found, str):
                found.start()
        except Exception as error:  # the profiler's own work: no energy, the window goes on
            found = f"finding the energy counter failed ({type(error).__name__}: {error})"
        if isinstance(found, str):
            self.why = found
        else:
            self.counter = found

    def read(self, step: WindowStep) -> None:
        """A window step ended: the counter now, kept on the step (or why there is none)."""
        counter = self.counter
        if counter is None:
            step.energy = self.why or "the energy counter was not started"
            return
        try:
            step.energy = read(counter)
        except Exception as error:  # the profiler's own work: no energy, the window goes on
            self.why = step.energy = read_failure(counter, error)
            self.counter = None
            counter.stop()

    def stop(self) -> None:
        """The window ended (or was dropped): stop what the counter runs; nothing is read until the next."""
        counter, self.counter, self.running, self.why = self.counter, None, False, ""
        if counter is not None:
            counter.stop()


def rank_energy(steps: Sequence[WindowStep], clean: Sequence[WindowStep]) -> EnergySpan | str:
    """This rank's span over ``clean`` (each from the window step before it to its end), or why none.

    Args:
        steps: the window's steps, in order.
        clean: the clean steps the latencies use.
    """
    if not clean:
        return "no clean step ran"
    place = {id(s): i for i, s in enumerate(steps)}
    pairs: list[tuple[Reading, Reading]] = []
    for step in clean:
        i = place[id(step)]
        before = steps[i - 1].energy if i > 0 else None
        for reading in (before, step.energy):
            if isinstance(reading, str):
                return reading
        if not isinstance(before, Reading) or not isinstance(step.energy, Reading):
            return f"step {step.number} has no reading of the energy counter at its start or end"
        pairs.append((before, step.energy))
    try:
        span = span_over(pairs)
    except ValueError as error:
        return str(error)
    if span.joules <= 0:  # no step does no work: the counter did not update (too coarse, or not live)
        return (
            f"the energy counter did not move over the clean steps ({span.seconds:.3g} s; it updates "
            f"about every {span.resolution:g} s)"
        )
    return span


def job_energy(ranks: Sequence[EnergySpan | str]) -> tuple[tuple[EnergySpan, ...], str]:
    """Every rank's span, by rank, or why the job has none (a rank without: its sum would be partial).

    Args:
        ranks: each rank's span or why it has none, by rank.
    """
    for rank, found in enumerate(ranks):
        if isinstance(found, str):
            why = found or "the energy counter was not read"
            return (), why if len(ranks) == 1 else f"rank {rank}: {why}"
    return tuple(s for s in ranks if not isinstance(s, str)), ""


def energy_metrics(
    spans: Sequence[EnergySpan], tokens_per_step: float | None, samples_per_step: float | None
) -> dict[str, float]:
    """The window's energy metrics of every rank's span (empty without spans).

    Args:
        spans: every rank's span over its clean steps.
        tokens_per_step: the job's tokens in one clean step (every replica's), None when not counted.
        samples_per_step: the job's samples in one clean step, None when not counted.
    """
    if not spans:
        return {}
    figures = energy_figures(spans, tokens_per_step, samples_per_step)
    metrics = {names.ENERGY_PER_STEP: figures.joules_per_step, names.POWER: figures.watts}
    if figures.joules_per_sample is not None:
        metrics[names.ENERGY_PER_SAMPLE] = figures.joules_per_sample
    if figures.joules_per_token is not None:
        metrics[names.ENERGY_PER_TOKEN] = figures.joules_per_token
    if figures.tokens_per_joule is not None:
        metrics[names.TOKENS_PER_JOULE] = figures.tokens_per_joule
    return metrics


class IntervalEnergy:
    """The throughput meter's counter (module doc): its joules and seconds over each interval, the meter's
    pauses left out. A failed read ends it, said once.

    Args:
        counter: a counter that needs nothing running between reads.
    """

    def __init__(self, counter: RaplEnergy | NvmlEnergy) -> None:
        self.counter: RaplEnergy | NvmlEnergy | None = counter
        self._from: Reading | None = None  # the last read while the interval runs (None: paused)
        self._pairs: list[tuple[Reading, Reading]] = []
        self._unknown = False  # the interval's joules lost a span (a pause learned of late)
        self._read_at = time.monotonic()

    @classmethod
    def of(cls, device: torch.device) -> IntervalEnergy | None:
        """The meter's counter of ``device`` where one is cheap to read, else None (said by the window)."""
        try:
            found = energy_counter(device)
        except Exception:  # the window said why it has none
            return None
        return cls(found) if isinstance(found, (RaplEnergy, NvmlEnergy)) else None

    def _read(self) -> Reading | None:
        counter = self.counter
        if counter is None:
            return None
        self._read_at = time.monotonic()
        try:
            return read(counter)
        except Exception as error:  # the profiler's own work: throughput/* goes on without energy
            warn(f"flops_callbacks: {read_failure(counter, error)}; throughput/* goes on without energy.")
            self.counter, self._from, self._pairs = None, None, []
            return None

    def keep_up(self) -> None:
        """A step ended: a RAPL counter is read if its last read is :data:`KEEP_UP_S` old (its total takes
        in a wrap only between two reads less than half a range apart; NVML's does not wrap)."""
        if isinstance(self.counter, RaplEnergy) and time.monotonic() - self._read_at > KEEP_UP_S:
            self._read()

    def restart(self) -> None:
        """An interval starts now."""
        self._pairs, self._from, self._unknown = [], self._read(), False

    def pause(self, late: bool = False) -> None:
        """The meter's clock stops: the energy until now is the interval's; ``late``: it stopped earlier,
        at a point no read was taken: the interval has no figure (its joules cannot be told apart)."""
        if late and self._from is not None:
            self._unknown = True
        elif self._from is not None and (now := self._read()) is not None:
            self._pairs.append((self._from, now))
        self._from = None

    def resume(self) -> None:
        if self.counter is not None and self._from is None:
            self._from = self._read()

    def take(self) -> EnergySpan | None:
        """The interval's span (None: none read), and a new interval from now."""
        running = self._from is not None
        self.pause()
        pairs, unknown = self._pairs, self._unknown
        self._pairs, self._from, self._unknown = [], None, False
        if running:
            self._from = pairs[-1][1] if pairs else self._read()
        if not pairs or unknown:
            return None
        try:
            return span_over(pairs)
        except ValueError:  # a counter that went back (a driver reset): no figure for this interval
            return None


def throughput_energy(
    spans: Sequence[EnergySpan | None], tokens: float | None, seconds: float
) -> dict[str, float]:
    """The job's ``throughput/`` energy metrics of every rank's interval span, where every rank has one and
    each counter's spans :data:`~flops_callbacks.timing.energy_figures.LONG_ENOUGH_RESOLUTIONS` of its
    resolution (else none: a figure off by more than 5%). Tokens per joule are the tokens over the power
    over the interval's ``seconds`` (the ranks' intervals start apart, the first after the window: a
    shared counter's one span is not the seconds the tokens took).

    Args:
        spans: each rank's span over the interval (None: none).
        tokens: the job's tokens in the interval (every replica's), None when not counted.
        seconds: the interval's seconds, the ones its rates divide by (the slowest rank's).
    """
    if not spans or any(s is None for s in spans):
        return {}
    counted = job_spans([s for s in spans if s is not None])
    if not all(s.long_enough and s.seconds > 0 for s in counted):
        return {}
    if sum(s.joules for s in counted) <= 0:  # a counter that did not move over 20 of its resolutions
        return {}
    watts = sum(s.joules / s.seconds for s in counted)
    metrics = {names.THROUGHPUT_POWER: watts}
    if tokens is not None and seconds > 0:
        metrics[names.THROUGHPUT_TOKENS_PER_JOULE] = tokens / (watts * seconds)
    return metrics
