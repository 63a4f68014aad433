"""The result of a profiled generation: plain data the metrics, the report, the JSON and the picture read.

Work comes from the counting run (each step's flops, MACs and bytes, op by op, and the module trees of
the prefill and of the middle decode step, whose cache is at mid-length), seconds from the timed runs
(:class:`~flops_callbacks.generation.run.RunTimes`). The metrics dict is computed here once, with
the names of :mod:`flops_callbacks.metrics`; the report prints what it holds. Why not the training
window's result: a generation has no backward, no optimizer step and no micro-batches, and its figures
are per phase, the decode's per token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from flops_callbacks import metrics as names
from flops_callbacks.generation.module_times import MODULE_TIMING_SOURCE
from flops_callbacks.generation.run import RunTimes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.profile import Profile
from flops_callbacks.roofline import Roofline, module_rooflines, roofline
from flops_callbacks.timing.energy_figures import EnergySpan, span_over

__all__ = ["GenerationResult", "PhaseWork", "CountedStep", "quantile"]


@dataclass(frozen=True)
class CountedStep:
    """One model step of the counting run: the model's flops, MACs and bytes moved."""

    flops: int
    macs: int
    bytes: int

    @classmethod
    def of(cls, profile: Profile) -> CountedStep:
        return cls(profile.fwd_flops, profile.fwd_macs, profile.fwd_bytes)


@dataclass(frozen=True)
class PhaseWork:
    """A phase's work: the prefill's, or the decode's per token (the mean over its steps)."""

    flops: float
    macs: float
    bytes: float
    steps: int


def _mean(steps: Sequence[CountedStep], per_step: bool) -> PhaseWork | None:
    """The steps' work summed (a chunked prefill), or their mean per step (the decode); None of none."""
    if not steps:
        return None
    n = len(steps) if per_step else 1
    flops, macs, moved = (sum(getattr(s, key) for s in steps) / n for key in ("flops", "macs", "bytes"))
    return PhaseWork(flops, macs, moved, len(steps))


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linearly interpolated between the nearest ranks (numpy's
    default); nan of nothing."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# each phase's (flops, bytes, seconds) and the (MFU, MBU) they give
_RATES = (
    (names.PREFILL_FLOPS, names.PREFILL_BYTES, names.PREFILL_LATENCY, names.PREFILL_MFU, names.PREFILL_MBU),
    (
        names.DECODE_FLOPS_PER_TOKEN,
        names.DECODE_BYTES_PER_TOKEN,
        names.DECODE_LATENCY_PER_TOKEN,
        names.DECODE_MFU,
        names.DECODE_MBU,
    ),
)


@dataclass(frozen=True)
class GenerationResult:
    """A generation's work (counting run) and seconds (timed runs), and what it ran on."""

    device: str
    compute_dtype: str | None
    batch_size: int | None  # sequences generated at once
    prompt_tokens: int | None  # positions per sequence in the prompt, padding included
    padding_tokens: int | None  # padding positions of the prompt, all sequences
    work: tuple[CountedStep, ...]  # the counting run's steps: the prefill's, then each decode step
    prefill: Profile | None  # the module tree of the prefill (its first chunk's when chunked)
    decode: Profile | None  # the module tree of the middle decode step
    decode_shown: int | None  # which decode step that is (0: the first after the prefill)
    runs: tuple[RunTimes, ...]
    warm_up: int
    kv_cache_bytes: int | None  # at the end of the counting run
    peak: Peak | None
    no_peak_reason: str
    bandwidth: Bandwidth | None
    no_bandwidth_reason: str
    prefill_steps: int = 1  # the counting run's steps before its first token (prefill chunks)
    mode: str = "eval"
    counting_failure: str = ""  # what stopped counting ("": nothing did)
    module_latencies: str = ""  # where the trees' module latencies come from
    no_energy_reason: str = ""  # why the timed runs read no energy counter ("": they did, or none ran)

    # --- work ----------------------------------------------------------------------------------------

    @property
    def prefill_work(self) -> PhaseWork | None:
        return _mean(self.work[: self.prefill_steps], per_step=False)

    @property
    def decode_work(self) -> PhaseWork | None:
        """The decode per token: its steps' mean (the cache at mid-length: attention grows linearly)."""
        return _mean(self.work[self.prefill_steps :], per_step=True)

    # --- seconds -------------------------------------------------------------------------------------

    @property
    def prefill_latency(self) -> float | None:
        spans = [sum(run.steps[: run.prefill_steps]) for run in self.runs if run.prefill_steps]
        return statistics.median(spans) if spans else None

    @property
    def token_gaps(self) -> list[float]:
        return [gap for run in self.runs for gap in run.token_gaps]

    @property
    def decode_forwards(self) -> list[float]:
        return [span for run in self.runs for span in run.steps[run.prefill_steps :]]

    @property
    def new_tokens(self) -> int:
        """Tokens per sequence of each timed run (the first run's; every run has its own in ``runs``)."""
        return self.runs[0].tokens if self.runs else len(self.work)

    # --- energy --------------------------------------------------------------------------------------

    def energy(self) -> dict[str, EnergySpan]:
        """The energy counter over the timed runs: "run" (start to end), "prefill" (start to the first
        token) and "decode" (first token to end), each over every run; empty where a run read none, or
        where the counter did not move (:attr:`no_energy`)."""
        spans = self._spans
        return spans if spans and spans["run"].joules > 0 and spans["run"].seconds > 0 else {}

    @cached_property
    def _spans(self) -> dict[str, EnergySpan]:
        readings = [run.energy for run in self.runs]
        if not readings or any(len(r) != 3 for r in readings):
            return {}
        try:
            return {
                phase: span_over([(r[a], r[b]) for r in readings])
                for phase, a, b in (("run", 0, 2), ("prefill", 0, 1), ("decode", 1, 2))
            }
        except ValueError:  # a counter that went back (a driver reset)
            return {}

    @property
    def no_energy(self) -> str:
        """Why the generation has no energy figure ("": it has them)."""
        if self.energy():
            return ""
        whole = self._spans.get("run")
        if whole is not None:  # read, and still: no run does no work, the counter did not update
            return (
                f"the energy counter did not move over the timed runs ({whole.seconds:.3g} s; it updates "
                f"about every {whole.resolution:g} s)"
            )
        return self.no_energy_reason or "no timed run read the counter"

    def _energy_metrics(self) -> dict[str, float]:
        spans, runs = self.energy(), self.runs
        if not spans:
            return {}
        whole, prefill, decode = spans["run"], spans["prefill"], spans["decode"]
        m = {names.GENERATION_POWER: whole.joules / whole.seconds}
        tokens = sum(self.batch_size * run.tokens for run in runs) if self.batch_size is not None else 0
        if tokens > 0 and whole.joules > 0:
            m[names.GENERATION_ENERGY_PER_TOKEN] = whole.joules / tokens
            m[names.GENERATION_TOKENS_PER_JOULE] = tokens / whole.joules
        if prefill.long_enough:
            m[names.PREFILL_ENERGY] = prefill.joules / len(runs)
        decode_steps = sum(run.tokens - 1 for run in runs)
        if decode.long_enough and decode_steps > 0:
            m[names.DECODE_ENERGY_PER_TOKEN] = decode.joules / decode_steps
        return m

    # --- figures -------------------------------------------------------------------------------------

    @cached_property
    def _metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        prefill, decode, runs = self.prefill_work, self.decode_work, self.runs
        if prefill is not None:
            m[names.PREFILL_FLOPS], m[names.PREFILL_BYTES] = float(prefill.flops), float(prefill.bytes)
        if decode is not None:
            m[names.DECODE_FLOPS_PER_TOKEN], m[names.DECODE_BYTES_PER_TOKEN] = decode.flops, decode.bytes
        prefill_latency, gaps, forwards = self.prefill_latency, self.token_gaps, self.decode_forwards
        if prefill_latency is not None:
            m[names.PREFILL_LATENCY] = prefill_latency
        if runs:
            m[names.TIME_TO_FIRST_TOKEN] = statistics.median(run.first_token for run in runs)
        if gaps:
            m[names.DECODE_LATENCY_PER_TOKEN] = statistics.median(gaps)
            m[names.DECODE_LATENCY_P90] = quantile(gaps, 0.9)
        if forwards:
            m[names.DECODE_FORWARD_LATENCY] = statistics.median(forwards)
        if runs:  # the median run (of an even count, the two middle ones): one slow run weighs nothing
            ordered = sorted(runs, key=lambda run: run.total)
            middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]
            total = sum(run.total for run in middle)
            m[names.GENERATION_LATENCY] = total / len(middle)
            if self.batch_size is not None and total > 0:
                m[names.GENERATION_TOKENS_PER_SEC] = self.batch_size * sum(r.tokens for r in middle) / total
        if self.kv_cache_bytes is not None:
            m[names.KV_CACHE_BYTES] = float(self.kv_cache_bytes)
        m.update(self._energy_metrics())
        for flops, moved, seconds, mfu, mbu in _RATES:
            if seconds not in m or not m[seconds] > 0:
                continue
            if self.peak is not None and flops in m:
                m[mfu] = m[flops] / m[seconds] / self.peak.flops
            if self.bandwidth is not None and moved in m:
                m[mbu] = m[moved] / m[seconds] / self.bandwidth.bytes_per_sec
        return m

    def metrics(self) -> dict[str, float]:
        """The ``generation/`` metrics (:mod:`flops_callbacks.metrics`), computed once."""
        return dict(self._metrics)

    def module_rooflines(self, phase: str) -> dict[str, dict[str, Roofline]]:
        """Each module of a phase's tree ("prefill" or "decode") against the roofs, where both peaks are
        known and the module latencies are the module-timing run's (none on the counting run's)."""
        tree = self.prefill if phase == "prefill" else self.decode
        if tree is None or self.peak is None or self.bandwidth is None:
            return {}
        if self.module_latencies != MODULE_TIMING_SOURCE:
            return {}
        return module_rooflines(tree, self.peak.flops, self.bandwidth.bytes_per_sec)

    def rooflines(self) -> dict[str, Roofline]:
        """Each phase against the two roofs ("prefill"; "decode", per token) where both peaks are known."""
        if self.peak is None or self.bandwidth is None:
            return {}
        m = self._metrics
        found: dict[str, Roofline] = {}
        for phase, work, seconds in (
            ("prefill", self.prefill_work, m.get(names.PREFILL_LATENCY)),
            ("decode", self.decode_work, m.get(names.DECODE_LATENCY_PER_TOKEN)),
        ):
            if work is None or seconds is None:
                continue
            roof = roofline(
                round(work.flops), round(work.bytes), seconds, self.peak.flops, self.bandwidth.bytes_per_sec
            )
            if roof is not None:
                found[phase] = roof
        return found
