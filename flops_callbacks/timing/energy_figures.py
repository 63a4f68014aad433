"""What readings of an energy counter come to: the joules and seconds between reads (a span), and what
spans come to per step, token and sample, the job's with each GPU and each host counted once.

A reading is stale by up to the counter's resolution (:mod:`.energy`: NVML's total energy moves about
every 100 ms, RAPL's every millisecond), so a span read in ``brackets`` separate runs of reads over
``seconds`` is off by at most ``brackets x resolution / seconds`` of its energy at a steady power;
:data:`LONG_ENOUGH_RESOLUTIONS` resolutions per run keep that within 5%. Why spans of runs and not two
readings: the clean steps of a window may be broken by a step that counts a new batch shape, whose
energy is no clean step's; consecutive steps' spans join at their shared reading, so a run of them is
one bracket.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = [
    "CounterName",
    "EnergyFigures",
    "EnergySpan",
    "LONG_ENOUGH_RESOLUTIONS",
    "Reading",
    "energy_figures",
    "job_spans",
    "read",
    "span_over",
]

# A run of reads spanning this many resolutions is off by at most 1/20 = 5% of its energy.
LONG_ENOUGH_RESOLUTIONS = 20


class _Counter(Protocol):
    scope: str
    source: str
    resolution: float

    def read(self) -> float: ...


class CounterName(NamedTuple):
    """Which counter: the hardware it measures, what it is in words, its resolution in seconds
    (:class:`~flops_callbacks.timing.energy.EnergyCounter`'s)."""

    scope: str
    source: str
    resolution: float


class Reading(NamedTuple):
    """A counter read: its joules from its origin, ``time.perf_counter()`` right after, and which."""

    joules: float
    at: float
    counter: CounterName


def read(counter: _Counter) -> Reading:
    """``counter`` read now (its errors raise)."""
    joules = counter.read()
    return Reading(
        joules, time.perf_counter(), CounterName(counter.scope, counter.source, counter.resolution)
    )


class EnergySpan(NamedTuple):
    """One counter's joules over some seconds: a rank's clean steps, a generation's phase.

    ``scope`` names the hardware (a GPU's UUID, "RAPL on <host>"): ranks that share it read the same
    joules. ``steps``: the steps the seconds hold; ``brackets``: the separate runs of reads (each run's two
    ends stale by up to one ``resolution``, in seconds).
    """

    scope: str
    source: str
    resolution: float
    joules: float
    seconds: float
    steps: int = 1
    brackets: int = 1

    @property
    def error(self) -> float:
        """The most its joules may be off at a steady power, as a fraction (1: not known at all)."""
        return min(self.brackets * self.resolution / self.seconds, 1.0) if self.seconds > 0 else 1.0

    @property
    def long_enough(self) -> bool:
        """Whether each run spans :data:`LONG_ENOUGH_RESOLUTIONS` resolutions on average (within 5%)."""
        return self.seconds >= LONG_ENOUGH_RESOLUTIONS * self.brackets * self.resolution

    def note(self, what: str) -> str:
        """One line saying that ``what`` (e.g. "energy of the clean steps") spans too few of the counter's
        resolutions to be within 5%, or "" when it spans enough."""
        if self.long_enough:
            return ""
        runs = f" in {self.brackets} runs" if self.brackets > 1 else ""
        return (
            f"{what}: {self.seconds:.3g} s{runs}, under {LONG_ENOUGH_RESOLUTIONS}x the counter's "
            f"{self.resolution:g} s resolution per run: off by up to {100 * self.error:.0f}%"
        )


def span_over(pairs: Sequence[tuple[Reading, Reading]]) -> EnergySpan:
    """The span of the steps whose (start, end) readings are ``pairs``, in order: a step whose start is
    the previous one's end continues its run. ValueError for no pair, readings of two counters, or a
    counter that went back.

    Args:
        pairs: each step's reading at its start and at its end.
    """
    if not pairs:
        raise ValueError("an energy span needs at least one step")
    counter = pairs[0][0].counter
    if any(r.counter != counter for pair in pairs for r in pair):
        raise ValueError(f"an energy span's readings come from more than one counter ({counter.scope}, ...)")
    joules = seconds = 0.0
    brackets = 0
    previous: Reading | None = None
    for start, end in pairs:
        if end.joules < start.joules:
            raise ValueError(f"the energy counter went back ({start.joules} J, then {end.joules} J)")
        joules += end.joules - start.joules
        seconds += end.at - start.at
        brackets += start != previous
        previous = end
    return EnergySpan(*counter, joules, seconds, len(pairs), brackets)


def job_spans(spans: Sequence[EnergySpan]) -> list[EnergySpan]:
    """Each scope's first span: ranks that share a GPU, or a host's RAPL, read one counter."""
    seen: dict[str, EnergySpan] = {}
    for span in spans:
        seen.setdefault(span.scope, span)
    return list(seen.values())


@dataclass(frozen=True)
class EnergyFigures:
    """What spans come to, every scope once: joules per step (each scope's over its own steps, summed),
    the mean power (each scope's, summed), per token and per sample where those are known (None else),
    the most the joules may be off (the worst scope's), and the counters summed."""

    joules_per_step: float
    watts: float
    joules_per_token: float | None
    joules_per_sample: float | None
    tokens_per_joule: float | None
    error: float
    counters: int


def energy_figures(
    spans: Sequence[EnergySpan],
    tokens_per_step: float | None = None,
    samples_per_step: float | None = None,
) -> EnergyFigures:
    """The figures of every rank's span over the same steps (module doc); ValueError for none, or a span
    of no time or no step.

    Args:
        spans: each rank's span (ranks sharing a scope: its first).
        tokens_per_step: the job's tokens in one step (every replica's), None when not counted.
        samples_per_step: the job's samples in one step, None when not counted.
    """
    counted = job_spans(spans)
    if not counted or any(s.seconds <= 0 or s.steps <= 0 for s in counted):
        raise ValueError(f"energy figures need spans of time and steps (got {counted})")
    per_step = sum(s.joules / s.steps for s in counted)
    return EnergyFigures(
        joules_per_step=per_step,
        watts=sum(s.joules / s.seconds for s in counted),
        joules_per_token=per_step / tokens_per_step if tokens_per_step and per_step > 0 else None,
        joules_per_sample=per_step / samples_per_step if samples_per_step and per_step > 0 else None,
        tokens_per_joule=tokens_per_step / per_step if tokens_per_step and per_step > 0 else None,
        error=max(s.error for s in counted),
        counters=len(counted),
    )
