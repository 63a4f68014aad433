"""Continuous throughput after the profile window: samples, tokens, FLOPS and MFU per logging interval.

The job meter (:mod:`.job_meter`) drives it on every rank, with the session's event names:

    meter.start(result, model, flops)      when the profile window has ended
    meter.micro_batch_start(batch)         before each later micro-batch's forward
    meter.step_end()                       when its optimizer step has ended
    metrics = meter.metrics()              at a logging step
    meter.pause() / meter.resume()         around evaluation
    meter.close()                          at the end of training, or on an exception

and :func:`throughput_metrics` makes the job's ``throughput/*`` of every rank's interval (the session
exchanges them at the logging step, which every rank reaches).

A micro-batch's flops come from the window's table of shape signatures
(:class:`~flops_callbacks.session.shape_flops.ShapeFlops`): counted there, or predicted exactly inside
the range the shapes counted there verified (outside it, where one polynomial fits every counted shape),
so batches of every padded length have their own flops and no step runs slower. A token batch's samples
and model flops are its sequences' (:mod:`.sequence_flops`), read when its layout reaches the host. One
step in a while is *audited* (``flops_audit``): counted, its time and work left out of its interval (as
evaluation is), and compared with the table; a mismatch (work that depends on the content, a mode the
model switched to, a drift of MoE routing) is said once with its ratio, and from then on that shape
reads the count and the others the table times its ratio. ``"auto"`` audits as rarely as keeps the
counting within ``AUDIT_COST`` of the run's time: the window's counting step against its clean steps
tells what the first count costs, each audit's own time the next one's place. A shape the table can
neither give nor predict (a model whose counts are no polynomial of its shapes, a batch size the window
never saw) is counted under fake tensors with the interval's clock paused (:mod:`.off_clock`; its
seconds logged as ``throughput/profiler_seconds``), where that runs; else it is counted for real when
it comes, in its interval, unless audits are off: then it gets no flops, an interval with one logs
samples and tokens per second, not flops, and a warning says so once.

A run resumed past its window meters with no window's table: its first step is audited, its count the
table's first shape (:meth:`ThroughputMeter.start_unwindowed`).

Time is the wall time between logging steps, read after one device synchronize per logging interval
(and one at each pause and resume), every step of the interval included, the slowest rank's; flops are
model flops (fwd + bwd, recompute excluded) per device: the ranks' mean, as
``flops_profiler/flops_per_sec``; samples and tokens are the job's: the ranks' mean times the
data-parallel size (every rank's own batches, summed over the replicas). Audits fall on the same steps on
every rank (the window's agreed figures set their rhythm). Where the device's energy counter is cheap to
read (RAPL; NVML's total energy), it is read at each interval's ends and around its pauses: the job's
power and tokens per joule (:mod:`.energy_reads`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch

from flops_callbacks import metrics as names
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.options import CausalAttention
from flops_callbacks.session.batch import Signature, shape_signature
from flops_callbacks.session.energy_reads import IntervalEnergy, throughput_energy
from flops_callbacks.session.off_clock import OffClock, Replay
from flops_callbacks.session.result import AfterWindow, WindowResult
from flops_callbacks.session.sequence_flops import LaidOut, SequenceFlops
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.token_layout import HeldLayout, layout_tensors
from flops_callbacks.timing.clock import NullClock, SyncClock, clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage
from flops_callbacks.timing.energy_figures import EnergySpan
from flops_callbacks.user_warning import warn

__all__ = ["AUDIT_COST", "LoggingInterval", "ThroughputMeter", "audit_every", "throughput_metrics"]

AUDIT_COST = 0.01  # flops_audit="auto": the audits' share of the run's time, at most
MIN_AUDIT_EVERY = 10  # steps between audits, at the least (a count that costs nothing is still an event)
# "auto" audits every n steps with n sharing no factor with 2 .. 8 (210 = 2 x 3 x 5 x 7): work that repeats
# every few steps (a GAN's generator every other step, a penalty every 4th) is met on every step of its
# cycle by the next few audits, where an even n would land on the same step of it every time
_PERIODS = 210


def audit_every(audit: int | Literal["auto"], step_seconds: float, count_seconds: float | None) -> int | None:
    """Steps between audits (None: never): ``audit`` itself, or for "auto" as many as make a counted
    step's extra time (``count_seconds`` less ``step_seconds``) ``AUDIT_COST`` of theirs, off the beat of
    a short cycle (:data:`_PERIODS`)."""
    if audit != "auto":
        return audit or None
    if step_seconds <= 0 or count_seconds is None:
        return None  # no clean step timed: nothing to weigh the cost against
    extra = max(count_seconds - step_seconds, 0.0)
    every = max(math.ceil(extra / (AUDIT_COST * step_seconds)), MIN_AUDIT_EVERY)
    while math.gcd(every, _PERIODS) != 1:
        every += 1
    return every


class LoggingInterval(NamedTuple):
    """What one rank did between two logging steps: its micro-batches' samples, tokens (None: unknown)
    and model flops (None: a shape's flops unknown), over its seconds; and the seconds the profiler's own
    counts took in it, out of its clock; the energy counter over it (None: none cheap to read)."""

    seconds: float
    samples: int
    tokens: int | None
    flops: float | None
    own_seconds: float = 0.0
    energy: EnergySpan | None = None


def throughput_metrics(
    intervals: Sequence[LoggingInterval], data_parallel: int, peak: float | None
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
    job_tokens = None
    if all(t is not None for t in tokens):
        job_tokens = sum(t or 0 for t in tokens) / world * data_parallel
        metrics[names.THROUGHPUT_TOKENS_PER_SEC] = job_tokens / seconds
    flops = [i.flops for i in intervals]
    if all(f is not None for f in flops):
        per_device = sum(f or 0.0 for f in flops) / world / seconds
        metrics[names.THROUGHPUT_FLOPS_PER_SEC] = per_device
        if peak is not None:
            metrics[names.THROUGHPUT_MFU] = per_device / peak
    metrics[names.THROUGHPUT_PROFILER_SECONDS] = max(i.own_seconds for i in intervals)
    metrics.update(throughput_energy([i.energy for i in intervals], job_tokens, seconds))
    return metrics


class _Pending(NamedTuple):
    """A token micro-batch whose layout is on its way to the host: its flops as run (None: unknown),
    whether its samples are its sequences, and what a count of one of its sequences needs."""

    held: HeldLayout
    run: float | None
    samples: bool
    batch: Any
    signature: Signature
    replay: Replay | str | None


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
        audit: int | Literal["auto"] = "auto",
        causal_attention: CausalAttention = "full",
    ) -> None:
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.audit, self.causal_attention = audit, causal_attention
        self.every: int | None = None  # steps between audits (None: never)
        self._until: int | None = None  # steps until the next audit
        self._scheduled = False  # the step counted now is an audit (not a shape's count on arrival)
        self._before_audit = False  # paused since the step before an audit ended: its wait is no interval's
        self._audit_start = 0.0  # when the audit now counted started (its whole time sets the next's place)
        self._step_seconds = 0.0  # the window's step: what an audit's time is weighed against
        self._engine: CountingEngine | None = None  # the audited step's engine
        self._counting: tuple[Signature, bool, BatchCounts] | None = None  # the micro-batch counted now
        self._said_mismatch = False
        self._unknown: list[bool] = []  # micro-batches of the counted step whose flops await its count
        self.flops = ShapeFlops()
        self.data_parallel = 1
        self.peak: float | None = None
        self._started = False
        self._samples = 0
        self._flops: float | None = 0.0
        self._tokens: int | None = 0
        self._later = False  # the next micro-batch is not its step's first
        self._warned_unknown = False
        self.off_clock: OffClock | None = None  # the session's fake counts (None: none)
        self.sequences: SequenceFlops | None = None  # the model's work on real tokens (None: as run)
        self.layout_samples = True  # a token batch's samples are its sequences (no user batch_size_fn)
        self._pending: list[_Pending] = []  # token micro-batches whose layout is not read yet
        self._own = 0.0  # the profiler's own counting in this interval, seconds (out of its clock)
        self.after = AfterWindow()  # the profiler's own work since the window, for the report
        self.energy: IntervalEnergy | None = None  # the energy counter over each interval, where cheap
        self._model: torch.nn.Module | None = None  # while metering: what audits and fake counts count
        # a shape the table cannot give is counted as it comes (unless flops_audit=0)
        self._arrivals = False
        # a run with no window: the peak for the dtype its first count's matmuls produced (read then)
        self._peak_of: Callable[[torch.dtype | None], float | None] | None = None

    def start(self, result: WindowResult, model: torch.nn.Module, flops: ShapeFlops) -> None:
        """Take the window's flops table and sizes, and start the first interval now."""
        self.peak = result.peak.flops if result.peak is not None else None
        # a window with no clean step timed its counting step instead: nothing to weigh a count against
        step = result.iter_latency if result.steps.clean else 0.0
        self.every = audit_every(self.audit, step, result.counting_iter)
        self._begin(model, flops, result.parallel.data_parallel, step)

    def start_unwindowed(
        self,
        model: torch.nn.Module,
        data_parallel: int,
        peak_of: Callable[[torch.dtype | None], float | None],
    ) -> None:
        """Meter a run with no window of its own (resumed past ``profile_step``) from its next step, which
        is audited: its count is the table's first shape (out of its interval, as any audit), and the
        dtype its matmuls produced reads the peak (``peak_of``). Then audits every ``flops_audit`` steps
        (``"auto"``: none, no clean step weighs their cost), and a shape the table cannot give is counted
        when it comes, in its interval. ``flops_audit=0`` counts nothing: samples and tokens only."""
        self.peak, self._peak_of = None, peak_of
        self.every = self.audit if isinstance(self.audit, int) and self.audit > 0 else None
        self._begin(model, ShapeFlops(), data_parallel, 0.0)
        if self.audit != 0:
            self._until, self._arrivals = 1, True
        else:
            self._warned_unknown = True  # no flops: said at the run's start

    def _begin(
        self, model: torch.nn.Module, flops: ShapeFlops, data_parallel: int, step_seconds: float
    ) -> None:
        self.flops = flops
        self.data_parallel = data_parallel
        self._clock = clock_for(module_device(model))
        self._model = model
        self._until = self.every
        self._arrivals = self.audit != 0  # a shape the table cannot give is counted as it comes
        self._step_seconds = step_seconds  # what an audited step's time is weighed against
        self.energy = IntervalEnergy.of(module_device(model))  # None where no counter is cheap to read
        self._started = True
        self._later = False
        self._paused_at: float | None = None
        self._ended: Any = None  # the clock's mark at the last step's end (None: none since the start)
        self.after = AfterWindow()
        self._restart(self._now())
        if self.energy is not None:
            self.energy.restart()

    def micro_batch_start(self, batch: Any, replay: Replay | str | None = None) -> None:
        """Add a micro-batch's samples, tokens and flops (None for the interval when they are unknown);
        ``replay``: its step again, for a fake count of a shape the table cannot give."""
        later, self._later = self._later, True
        if not self._started:
            return
        self._settle(wait=False)
        signature = shape_signature(batch)
        if self._engine is None and self.flops.current(signature, later) is None:
            self._count_off_clock(signature, later, replay)
        if not later and (self._paused_at is None or self._before_audit):
            self._before_audit = False
            self._audit_due(self.flops.current(signature, later) is None)
        if self._engine is not None:  # an audited step: counted
            self._counting = (signature, later, _totals(self._engine))
            self._engine.start()
        if self._paused_at is not None:
            return
        sequences = self.sequences
        layout = layout_tensors(batch, sequences.encoder_decoder) if sequences is not None else None
        by_layout = layout is not None and self.layout_samples
        if not by_layout:
            self._samples += int(self.batch_size_fn(batch))
        if self._tokens is not None:
            tokens = self.tokens_fn(batch) if self.tokens_fn is not None else None
            self._tokens = None if tokens is None else self._tokens + int(tokens)
        counts = self.flops.current(signature, later)
        if layout is not None:  # its samples and model work read when its layout reaches the host
            run = counts if self._engine is None else None
            self._pending.append(_Pending(layout.to_host(), run, by_layout, batch, signature, replay))
            if counts is not None:
                return
        if counts is None and self._engine is not None:
            self._unknown.append(later)  # counted now: its flops are added at its end
        elif counts is None:
            self._flops = None
            if not self._warned_unknown:
                self._warned_unknown = True
                warn(
                    "flops_callbacks: a batch shape the profile window neither counted nor can predict "
                    f"({shape_signature(batch)}): intervals with one log samples and tokens per second, "
                    "not flops.",
                )
        elif self._flops is not None:
            self._flops += counts

    def _count_off_clock(self, signature: Signature, later: bool, replay: Replay | str | None) -> None:
        """A shape the table cannot give, counted under fake tensors with the interval's clock paused;
        kept as an audited count (its shape reads it from now on)."""
        off_clock, model = self.off_clock, self._model
        if off_clock is None or model is None or not isinstance(replay, Replay):
            return
        if not off_clock.hopeful(replay):
            return
        with self._own_work():  # a first fake count's trial too (off_clock)
            counts = off_clock.count(model, replay, later) if off_clock.usable(replay, model) else None
        if counts is not None:
            self.flops.audit(signature, later, counts)

    @contextlib.contextmanager
    def _own_work(self) -> Iterator[None]:
        """The profiler's own counting: out of the interval's clock, its seconds kept apart."""
        running, start = self._paused_at is None, time.perf_counter()
        self.pause()
        try:
            yield
        finally:
            if running:
                self.resume()
            seconds = time.perf_counter() - start
            self._own += seconds
            self.after = self.after.plus(seconds)

    def _settle(self, wait: bool) -> None:
        """The token micro-batches whose layouts reached the host (all of them with ``wait``): their
        samples (their sequences) and model work (their sequences' own, :mod:`.sequence_flops`; a length
        the table cannot give is counted, out of the clock)."""
        while self._pending and (wait or self._pending[0].held.ready()):
            p = self._pending.pop(0)
            layout = p.held.read()
            if p.samples:
                self._samples += layout.sequences
            if p.run is None or self._flops is None:
                continue
            model = p.run
            sequences = self.sequences
            if sequences is not None and not layout.plain:
                item = LaidOut(layout, p.batch, p.signature, p.replay)
                alone = sequences.model_flops(item, beyond=True)
                off_clock = self.off_clock
                if alone is None and not sequences.why_not and off_clock and off_clock.hopeful(p.replay):
                    with self._own_work():  # (none where no count can run: no pause, no synchronization)
                        sequences.settle(self._model, off_clock, [item], beyond=True)
                    alone = sequences.model_flops(item, beyond=True)
                if alone is not None:
                    model = alone * self.flops.correction
            self._flops += model

    def _audit_due(self, unknown: bool) -> None:
        """At a step's first micro-batch: start an audit when one is due (out of the interval, as an
        evaluation is), or count a shape the table cannot give yet (outside the verified range: rare,
        as each count widens it), in the interval."""
        if self._model is None:
            return
        if self._until is not None:
            self._until -= 1
        # (a shape's count on arrival keeps the rhythm every rank shares)
        self._scheduled = self._until is not None and self._until <= 0
        if not self._scheduled and not (unknown and self._arrivals):
            return
        if self._scheduled:
            self.pause()  # the audited step's time and work are no interval's
            self._audit_start = time.perf_counter()
        self._engine = CountingEngine(self._model, causal_attention=self.causal_attention, clock=NullClock())

    def micro_batch_end(self) -> None:
        """After a micro-batch: an audited one's count is compared with the table (a mismatch said once)."""
        engine, counting, self._counting = self._engine, self._counting, None
        if engine is None or counting is None or not engine.running:
            return
        engine.stop()
        if engine.failure is not None:
            what, error = engine.failure
            self._until = self.every = None
            self._arrivals = False
            warn(f"flops_callbacks: counting an audited step failed ({what}: {error!r}); no more audits.")
            return
        signature, later, before = counting
        counts = _totals(engine).minus(before)
        if self._peak_of is not None:  # no window read the peak: the dtype the first count's matmuls produced
            self.peak, self._peak_of = self._peak_of(engine.matmul_dtype()), None
        if self._unknown and self._flops is not None:
            self._unknown.pop()
            self._flops += counts.model_flops
        ratio = self.flops.audit(signature, later, counts)
        if ratio is not None and not self._said_mismatch:
            self._said_mismatch = True
            warn(
                f"flops_callbacks: a step counted after the window did {ratio:.4f}x the flops the shape "
                f"table gave for its shapes ({[shape for shape, _ in signature]}): the model's flops depend "
                "on more than the shapes (the batch's content, a mode it keeps); throughput/* follows the "
                "counted value from now on.",
            )

    def step_end(self) -> None:
        """After an optimizer step: the next micro-batch is a step's first; an audit ends here."""
        self._later = False
        # where a pause learned of late starts (a SyncClock's mark synchronizes: the host's time there)
        self._ended = time.perf_counter() if isinstance(self._clock, SyncClock) else self._clock.mark()
        if self.energy is not None:
            self.energy.keep_up()
        if self._engine is not None:
            self._stop_audit()
            collect_counting_garbage()
            if self._scheduled:  # what this audit cost sets the next one's place
                spent = time.perf_counter() - self._audit_start
                every = audit_every(self.audit, self._step_seconds, spent) if self.every is not None else None
                self._until = self.every = every
            self._unknown = []
            self.resume()
        if (
            self._until is not None
            and self._until <= 1
            and self._model is not None
            and self._paused_at is None
        ):
            self.pause()  # the next step is audited: its wait for its batch is no interval's, as its time
            self._before_audit = True

    def step_raised(self) -> None:
        """The step raised and the loop goes on: an audit of it stops (its clock resumes, its count is no
        interval's); the next micro-batch is a step's first."""
        self._later = False
        if self._engine is not None:
            self._stop_audit()
            self._unknown = []
            self.resume()

    def _stop_audit(self) -> None:
        engine, self._engine, self._counting = self._engine, None, None
        if engine is not None and engine.running:
            engine.stop()

    def interval(self) -> LoggingInterval:
        """This rank's interval since the last call (or the start), and a new interval from now."""
        if not self._started:
            return LoggingInterval(0.0, 0, 0, 0.0)
        self._settle(wait=True)
        now = self._now()
        seconds = now - self._start - self._paused
        if self._paused_at is not None:  # asked while paused: count up to the pause only
            seconds -= now - self._paused_at
        energy = self.energy.take() if self.energy is not None else None
        done = LoggingInterval(seconds, self._samples, self._tokens, self._flops, self._own, energy)
        self._restart(now)
        if self._paused_at is not None:
            self._paused_at = now
        return done

    def metrics(self) -> dict[str, float]:
        """This rank's ``throughput/*`` of the interval since the last call, as if it were the job."""
        return throughput_metrics([self.interval()], self.data_parallel, self.peak)

    def pause(self, late: bool = False) -> None:
        """Stop the interval's clock (evaluation) until :meth:`resume`; ``late``: from the last step's end
        (or the interval's start, or the last resume, if later), for a pause learned of when it has ended
        (an evaluation or a save no event announced). The energy counter was not read there: that
        interval has no energy figure."""
        if not self._started or self._paused_at is not None:
            return
        now = self._paused_at = self._now()
        if late:  # with no step ended since the start (the window's last step's end), from the start
            ended, clock = self._ended, self._clock
            ago = clock.seconds(ended, clock.mark()) if ended is not None else math.inf
            self._paused_at = max(now - ago, self._counting_since)
        if self.energy is not None:
            self.energy.pause(late)

    def resume(self) -> None:
        if self._before_audit:  # an evaluation between a step and the audited one: its wait stays out
            return
        if self._started and self._paused_at is not None:
            now = self._counting_since = self._now()
            self._paused += now - self._paused_at
            self._paused_at = None
            if self.energy is not None:
                self.energy.resume()

    def close(self) -> None:
        """Stop metering (an audit in progress stops: nothing of it remains)."""
        self._stop_audit()
        self._started, self.energy, self._model = False, None, None  # the model is the user's to free
        self._peak_of = None
        self._before_audit = False
        self._samples, self._flops, self._tokens, self._pending, self._own = 0, 0.0, 0, [], 0.0

    def _restart(self, now: float) -> None:
        self._start = self._counting_since = now  # counting since: the interval's start, or its last resume
        self._paused = 0.0
        self._samples, self._flops, self._tokens, self._own = 0, 0.0, 0, 0.0

    def _now(self) -> float:
        self._clock.synchronize()  # the device has done the work queued so far
        return time.perf_counter()


def _totals(engine: CountingEngine) -> BatchCounts:
    """The model's counts an engine has seen so far."""
    return BatchCounts.of(engine.totals()[0])
