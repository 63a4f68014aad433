"""The step session below both callbacks: the profile window, then the continuous throughput meter.

A profile is a short window of steps, each doing one job on its own clock, laid out by
:mod:`.window_plan`: the counting step counts every op (its times feed no figure), the module-timing steps
mark module calls only, the check counts a known shape again, the clean steps mark the phases. Each
batch's flops come from :class:`~flops_callbacks.session.shape_flops.ShapeFlops`, or off the clock
(:mod:`.off_clock`), a token batch's model work from its sequences (:mod:`.sequence_flops`);
:mod:`.builder` builds the figures; after the window, :mod:`flops_callbacks.session.meter` logs
``throughput/*`` with the same tables. Adapters map their framework's events onto it (:mod:`.adapter_api`).

With several processes, every decision that shapes the window is agreed by all ranks in lock step
(:mod:`.window_plan`; the only collectives are :mod:`.ranks`'); ``throughput/*`` is summed after it.

Instruments run only inside a micro-batch of a window step. Every event runs as the profiler's own work
(:mod:`flops_callbacks.guard`): a failure is said, the window dropped, and the run goes on unprofiled;
the user's functions and loggers are called through the guard, so their exceptions pass unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flops_callbacks.guard import F, Guard, guarded_event
from flops_callbacks.options import Options
from flops_callbacks.peaks import given_bandwidth, given_peak
from flops_callbacks.phase_names import FORWARD
from flops_callbacks.session.adapter_api import Publish, Sink, TrainingContext
from flops_callbacks.session.batch import BatchReader, Signature, shape_signature
from flops_callbacks.session.builder import build_result
from flops_callbacks.session.instruments import Instruments
from flops_callbacks.session.job_meter import JobMeter
from flops_callbacks.session.meter import ThroughputMeter
from flops_callbacks.session.off_clock import OffClock, Replay
from flops_callbacks.session.rank_part import RankRow, local_part
from flops_callbacks.session.ranks import RankFailure, Ranks
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.run_plan import RunPlan, unwritable_destinations
from flops_callbacks.session.sequence_flops import SequenceFlops
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_plan import FAILED, Decision, Kind, WindowPlan, Wish
from flops_callbacks.session.window_steps import Pauses, WindowStep
from flops_callbacks.timing.clock import clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage
from flops_callbacks.timing.phase_memory import phase_memory_for
from flops_callbacks.timing.phases import StepPhases
from flops_callbacks.user_warning import warn

__all__ = ["StepSession"]

DROPPED = "the profile window is dropped and nothing of the profiler stays; this run goes on unprofiled"


def _own_work(what: str, abandon: bool = True) -> Callable[[F], F]:
    """An event of the session as the profiler's own work (``abandon``: a failure drops the window)."""
    return guarded_event(what, DROPPED if abandon else "training goes on", "_abandon" if abandon else None)


class _Read(NamedTuple):
    """A window micro-batch as read: its shapes, whether it is a later one of its step, its counts."""

    signature: Signature
    later: bool
    counts: BatchCounts | None


class StepSession:
    """The profile window and the throughput meter of one callback (module doc).

    ``owner`` names the callback in messages; ``tokens_fn`` defaults to the options' (an adapter may
    pass a smarter default, e.g. the HF Trainer's ``input_ids``). Pickles (``ddp_spawn``): it holds no
    lambda, and its process group is made again at the run's start.
    """

    def __init__(
        self,
        options: Options,
        owner: str,
        tokens_fn: Callable[[Any], int | None] | None = None,
        publish: Publish | None = None,
    ) -> None:
        self.options, self.owner = options, owner
        self.publish = publish  # None: the result is kept (``self.result``), not published
        self.guard = Guard(owner)
        self.batches = BatchReader(options, owner, self.guard, tokens_fn)
        self.given_peak = given_peak(options.peak_flops)
        self.given_bandwidth = given_bandwidth(options.peak_bandwidth)
        meter = ThroughputMeter(
            self.batches.samples_or_zero, self.batches.tokens, options.flops_audit, options.causal_attention
        )
        self.meter = meter if options.throughput else None
        self.ranks = Ranks()
        self.job_meter = JobMeter(self.meter, self.ranks, self.guard)
        self.plan = WindowPlan(options, self.ranks)
        self.result: WindowResult | None = None
        self.flops = ShapeFlops()  # flops per micro-batch shape: counted in the window, read after it
        self.off_clock = OffClock(options.causal_attention)
        self.sequences = SequenceFlops()  # the model's work on real tokens: each sequence alone
        meter.off_clock, meter.sequences = self.off_clock, self.sequences
        meter.layout_samples = options.batch_size_fn is None
        self._steps: list[WindowStep] = []  # the window's steps so far (this rank's record of them)
        self._step: WindowStep | None = None  # the window step in progress
        self._pauses = Pauses()  # declared pauses inside the window (evaluation)
        self.instruments = Instruments(options)
        self.plan.own_work = self.instruments.take_own  # what made this rank late at a vote
        self._model: torch.nn.Module | None = None
        self._context = TrainingContext()
        self._window_ran = False  # this run's window ended (published or dropped): no other starts
        self._resumed_past = self._unreachable = False  # said at train start: past profile_step, past the end
        self._abandoned = False  # the profiler's own work failed in this run: it goes on unprofiled
        self._logging_rank = True
        self._unwritable: dict[str, str] = {}  # "output_file" / "log_dir" -> why, said at train start
        self._log_dir: str | Path | None = None  # where the window's files went
        self.enabled = True

    def disable(self) -> None:
        """Profile nothing and meter nothing (a DeepSpeed config with ``enabled: false``)."""
        self.close()
        self.enabled, self.meter, self.job_meter.meter = False, None, None

    def _abandon(self) -> None:
        """The profiler's own work failed: drop what runs. Every rank drops an open window at its next vote
        and stops metering at the next exchange (this rank joins them with nothing)."""
        self._abandoned = True
        self.plan.failed = FAILED if self.plan.open else 0
        self.job_meter.fail()
        self.close(meter=False)

    # --- the run -------------------------------------------------------------------------------------

    @property
    def window_open(self) -> bool:
        """Between the counting step's start and the window's end (this rank's instruments)."""
        return bool(self._steps)

    @property
    def _expected(self) -> bool:  # a window was expected, and no warning at train start said otherwise
        return self.enabled and not (self._resumed_past or self._unreachable or self._abandoned)

    def own(self) -> Any:
        """The profiler's own work in an event, out of the steps' times (one process: ``Pauses.own``)."""
        clock = self.plan.clock if self._steps and not self.ranks.several else None
        return self._pauses.own(clock, lambda: self._step)

    @property
    def wants_batches(self) -> bool:
        """Whether the micro-batches of the next step matter (a window step, or the meter runs)."""
        return self._step is not None or self.job_meter.running or self.plan.open

    @_own_work("checking the run at its start")
    def train_start(
        self,
        global_step: int,
        *,
        max_steps: int | None = None,
        profiled_before: bool = False,
        profiled_step: int | None = None,  # the step profiled before, where known (its files' name)
        is_logging_rank: bool = True,
        steps_per_batch: int = 1,
        log_dir: str | Path | None = None,
    ) -> None:
        """A run starts (on every rank): forget an earlier run's window, make the ranks' process group,
        and warn now (on the logging rank) if no profile can run in this one, or only a cut-short one.
        ``steps_per_batch``: global steps each optimizer step takes (Lightning's manual optimization with
        several optimizers). ``log_dir``: where the files go, checked now rather than at the window's end."""
        self.close()
        self.guard.forget()
        self.plan.new_run(global_step, max_steps, steps_per_batch)
        self.result, self.flops = None, ShapeFlops()
        self.off_clock.forget()
        self.sequences.forget()
        self._window_ran = self._abandoned = self.batches.said_no_size = False
        self._logging_rank, self._unwritable = is_logging_rank, {}
        plan = RunPlan.of(self.options, global_step, max_steps, steps_per_batch)
        self._resumed_past, self._unreachable = plan.resumed_past, plan.unreachable
        self.job_meter.unwindowed = plan.resumed_past and self.options.profile_every is None
        if not self.enabled:
            return
        with self.guard.own_work("making the profiler's process group", DROPPED, self._abandon):
            self.ranks.setup()
        if not is_logging_rank:
            return
        self._unwritable = unwritable_destinations(self.owner, self.options.output_file, log_dir)
        plan = RunPlan.of(self.options, global_step, max_steps, steps_per_batch, self.plan.comm_steps)
        plan.warn(self.owner, profiled_before, profiled_step)  # the ranks are known now: with comm steps

    @_own_work("ending the run")
    def train_end(self, global_step: int, sink: Sink) -> None:
        """The run ended (on every rank): publish a window it cut short, or say that none ran."""
        self.instruments.stop(self.flops, self._step)  # a counted micro-batch's counts: the table
        self._steps, self._step = [s for s in self._steps if s is not self._step], None  # cut: no step
        self._after_window(sink)
        if self.plan.open:
            self._finish(global_step, sink)
        elif self.result is None and self._expected and sink.is_logging_rank:
            warn(f"{self.owner}: no optimizer step started at profile_step={self.options.profile_step} or "
                 f"after (training ended at global step {global_step}): no profile ran.")  # fmt: skip
        self.job_meter.close()  # after the window's end, which starts it: it holds the model
        self.off_clock.drop(ended=True)  # its trial holds a batch and the trainer

    def _after_window(self, sink: Sink) -> None:
        """The profiler's own counting since the window, written into its files (logging rank)."""
        after = self.meter.after if self.meter is not None else None
        if after is None or not after.counts or self.result is None or self.publish is None:
            return
        self.result.after = after
        if sink.is_logging_rank:
            with self.guard.own_work("writing the counting after the window", "its files do not say it"):
                skip, log_dir = set(self._unwritable), self._log_dir
                self.publish(self.result, self.options, log_dir, sink, self.guard, skip, True)  # files only

    @_own_work("cleaning up", abandon=False)
    def close(self, meter: bool = True, raised: bool = False, goes_on: bool = False) -> None:
        """Stop what runs, drop this rank's window: no hook, mode or tag of the profiler remains (any times).
        ``raised``: a step raised, the loop may go on (``goes_on``: that step; ``WindowPlan.raised``)."""
        if raised:
            self.plan.raised(goes_on)
        try:
            self.instruments.stop()
        finally:
            self._steps, self._step, self._model, self._pauses = [], None, None, Pauses()
            self._context = TrainingContext()
            self.instruments.drop()
            self.off_clock.drop(ended=meter and not raised)  # the metering ends: nothing to fake-count
            if raised:  # the loop goes on: metering too (a window dropped for it resumes it)
                self.job_meter.step_raised()
            elif meter:
                self.job_meter.close()

    # --- steps ---------------------------------------------------------------------------------------

    def step_start(
        self,
        global_step: int,
        model: torch.nn.Module,
        context: Callable[[], TrainingContext] | None = None,
        runs: torch.nn.Module | None = None,
    ) -> None:
        """An optimizer step starts (before its first micro-batch). ``runs``: what the framework calls,
        when it is a wrapper of ``model`` (the HF Trainer's compiled model): a compile is seen there."""
        if (owed := self.plan.owed_vote()) is not None and owed.drop:
            self._drop(owed)
        if not self.plan.open:
            late = self._window_ran or self._resumed_past or not self.enabled
            if (late or global_step < self.options.profile_step) and not self.plan.due(global_step):
                self.job_meter.start_unwindowed(model, context, self.given_peak)  # once, if resumed past it
                return  # no window starts: the first at profile_step, then one each profile_every steps
            if any(torch.nn.parameter.is_lazy(p) for p in model.parameters()):
                return  # the first forward makes the parameters the window counts: it starts after it
            self.plan.failed = FAILED if self._abandoned else 0  # failed before the window: votes to drop it
        with self.own():
            kind = self.plan.start_step()  # on every rank alike: the window's steps are the same everywhere
            if not self.plan.failed:
                self._begin_step(kind, global_step, model, context, runs)

    @_own_work("starting a step")
    def _begin_step(
        self,
        kind: Kind | None,
        global_step: int,
        model: torch.nn.Module,
        context: Callable[[], TrainingContext] | None,
        runs: torch.nn.Module | None,
    ) -> None:
        if not self._steps:
            self._context = context() if context is not None else TrainingContext()
            self._model = model
            self.job_meter.pause()  # in a re-profile window (module doc); resumed at its end
        device = module_device(model)
        clock = self.plan.clock = self._steps[0].phases.clock if self._steps else clock_for(device)
        start_mark = self._steps[-1].end_mark if self._steps else None
        phases = StepPhases(clock, phase_memory_for(device) if kind is None else None)  # peaks: clean steps
        step = WindowStep(kind, global_step, phases, start_mark, **self._pauses.take())
        self._steps.append(step)
        self._step = step
        self.instruments.for_step(step, model, runs)

    def micro_batch_start(self, batch: Any, replay: Replay | str | None = None) -> None:
        """Before a micro-batch's forward: its samples, tokens and flops; the step's kind, agreed by every
        rank while its batches decide it; and this step's instrument. ``replay``: how the adapter's step
        runs this micro-batch again (for a count off the clock), or why it cannot."""
        if not self.plan.open:
            with self.guard.own_work("reading the batch", DROPPED, self._abandon):
                return self.job_meter.micro_batch_start(batch, replay)
        with self.own():
            read = self._read_batch(batch) if self._step is not None else None
            if (decides := self.plan.batch_decides) or self.plan.lines_up():  # lines_up: comm step's start
                if read is not None and read.later:  # the vote lies between the phases (the HF Trainer's)
                    self.stop_timing()
                decision = self.plan.vote(self._wish(read, replay))
                if decision.drop:
                    return self._drop(decision)
                if decides:
                    self.plan.batch_kind(decision)
            if read is not None and self._step is not None:
                self._begin_micro_batch(batch, read, replay)

    def _wish(self, read: _Read | None, replay: Replay | str | None) -> Wish:
        """This rank's wish for the step's kind (:class:`~flops_callbacks.session.window_plan.Wish`)."""
        if read is None:
            return Wish(drop=self.plan.failed)
        unknown, content = read.counts is None, self.flops.content
        model = self._model if unknown and not self.plan.checked and self.plan.kind is None else None
        fake = self.off_clock.usable(replay, model)  # model: tried first, on an untimed check or shape count
        return Wish(self.plan.failed, unknown and not fake, not unknown or fake, content is not None)

    @_own_work("reading the batch")
    def _read_batch(self, batch: Any) -> _Read:
        step = self._step
        assert step is not None
        signature, later = shape_signature(batch), bool(step.signatures)
        return _Read(signature, later, self.flops.get(signature, later))

    @_own_work("reading the batch")
    def _begin_micro_batch(self, batch: Any, read: _Read, replay: Replay | str | None) -> None:
        step, kind, model = self._step, self.plan.kind, self._model
        assert step is not None
        if step.kind != kind and kind in (Kind.CHECK, Kind.SHAPE_COUNTING) and model is not None:
            self.instruments.shape_counting(model)
        step.kind = kind
        counts = read.counts
        if model is not None and kind is not None:
            where = (step, read.signature, read.later)
            counts = self.off_clock.micro_batch(model, self.flops, kind, *where, counts, replay)
        samples, tokens = self.batches.samples(batch, say_unknown=True), self.batches.tokens(batch)
        step.layout_samples = self.options.batch_size_fn is None
        keep = step.other_shapes(self._steps[0].signatures, read.signature)
        step.add(batch, read.signature, samples, tokens, counts, replay, keep=keep)
        self.instruments.start(step, read.signature, read.later)
        step.phases.start(FORWARD)

    @_own_work("marking a phase")
    def phase(self, name: str) -> None:
        """The framework reached the start of phase ``name``; ``FORWARD`` while the forward runs: the user's
        code starts here, and the framework's work since the micro-batch started is no phase's."""
        step = self._step
        if step is None or (name == FORWARD and step.phases.restart(FORWARD)):
            return
        self.instruments.phase(step, name)
        step.phases.start(name)

    @_own_work("marking a phase")
    def phase_end(self) -> None:
        """The running phase ended, not saying what follows (:mod:`flops_callbacks.timing.phases`)."""
        if self._step is not None:
            self._step.phases.end()
        self.instruments.phase_end()

    @_own_work("ending a micro-batch")
    def micro_batch_end(self, pause: bool = True) -> None:
        """After a micro-batch: its instrument stops; with ``pause`` its phase clock (validation may come)."""
        step = self._step
        if step is None:
            self.job_meter.micro_batch_end()
            return
        self.instruments.stop(self.flops, self._step)
        if self._counting_failed():
            return
        if pause:
            step.phases.stop()
        if step.kind == Kind.COUNTING:
            self.off_clock.hold_trial(self.flops, self._model)

    @_own_work("marking a fetch")
    def fetching(self) -> None:
        """The framework starts fetching the next micro-batch: the wait for data starts here."""
        if self.plan.open and self._steps:
            self._pauses.fetching(self.plan.clock.mark(), self._step)

    @_own_work("marking a phase")
    def stop_timing(self) -> None:
        """The step's timed part ended (before bookkeeping the framework does after it)."""
        if self._step is not None:
            self._step.phases.stop()

    def step_end(self, global_step: int, sink: Sink, logs: bool = False) -> None:
        """The optimizer step ended (on every rank); ``logs`` says whether this is a logging step."""
        if not self.plan.open:
            with self.guard.own_work("ending a step", DROPPED, self._abandon):
                self.job_meter.step_end(global_step, sink, logs, self.plan.starts_at(global_step))
            return
        with self.own():
            done, comm = (self._end_window_step() if self._step is not None else None) or (False, None)
            decision = self.plan.vote(Wish(drop=self.plan.failed, done=done, comm=comm), ended=True)
        if decision.drop:
            self._drop(decision)
        elif decision.done or self.plan.capped():
            self._finish(global_step, sink)

    @_own_work("ending a step")
    def _end_window_step(self) -> tuple[bool, tuple[float, float] | None]:
        """This rank's window step ended: whether it has its clean steps, and its (exposed, span)."""
        step = self._step
        assert step is not None
        self.instruments.stop(self.flops, self._step)
        if self._counting_failed():
            return False, None
        step.phases.stop()
        self.instruments.step_ended(step)  # a trace read now is this step's time, not the next one's
        step.end_mark, step.ended = step.phases.clock.mark(), True
        self._pauses.quiet = step.end_mark
        self._step = None
        if step.kind == Kind.COUNTING:
            collect_counting_garbage()  # now, outside every clock
        clean = [s for s in self._steps if s.kind == Kind.CLEAN]
        iters = lambda: [s.seconds()["iter"] for s in clean if s.finished()]  # noqa: E731
        done = self.plan.wants_iters(len(clean)) and self.plan.done_here(iters)
        return done, (step.comm.step.exposed, step.comm.step.span) if step.comm is not None else None

    # --- the window's end ------------------------------------------------------------------------------

    def _drop(self, decision: Decision) -> None:
        """Every rank agreed to drop the window: said once, by the logging rank, unless this rank's own
        failure was said already. No other window starts in this run, unless a step raised in a re-profile
        window: metering goes on, the next window starts on the grid."""
        again = self.plan.drop(decision.raised and self.job_meter.running and not self._abandoned)
        self._window_ran = True
        went_on = f"the re-profile window is dropped; throughput/* goes on; the next starts at step {again}"
        if self._logging_rank and not self._abandoned:
            how = went_on if again is not None else f"{DROPPED} on every rank"
            warn(f"{self.owner}: {decision.why}; {how}. Training goes on.")
        if again is not None:
            self.close(meter=False)
            return self.job_meter.resume()
        self._abandoned = True
        self.close()

    def _counting_failed(self) -> bool:
        """Whether a formula failed while counting (said here, and the window dropped)."""
        failure = self.instruments.failure()
        if failure is None:
            return False
        what, error = failure
        self.guard.fail(what, error, DROPPED)
        self._abandon()
        return True

    def _finish(self, global_step: int, sink: Sink) -> None:
        """The window's agreed end (every rank): exchange each rank's figures, build the job's result,
        publish it on the logging rank, and start (or resume) the throughput meter on every rank."""
        steps, self._steps, self._step = self._steps, [], None
        engine = self.instruments.drop()
        model, self._model = self._model, None
        reprofile, base, marks = self.plan.reprofile, self.result, self.plan.marks
        self.plan.reset()
        self.plan.ended(steps[-1].number if steps else global_step)  # agreed: the steps are every rank's
        self._window_ran = True
        local = None
        if model is not None:
            with self.guard.own_work("counting the window's new shapes", DROPPED, self._abandon):
                self.off_clock.finish(model, self.flops)  # before the exchange: no step's time
                self.sequences.window_end(steps, model, self.off_clock)
            with self.guard.own_work("building the profile", DROPPED, self._abandon):
                count = lambda step: self.off_clock.profile(model, step.replays)  # noqa: E731
                local = local_part(steps, self.flops, engine, base if reprofile else None, count, marks)
        mine: RankRow | str = local.row() if local is not None else "failed" if self._abandoned else "empty"
        try:
            rows = self.ranks.exchange(mine)
        except RankFailure as failure:
            return self._drop(Decision.dropped(f"exchanging every rank's figures failed ({failure})"))
        if any(row == "failed" for row in rows):
            return self._drop(Decision.dropped(f"rank {rows.index('failed')}'s profile failed"))
        if local is None or model is None or any(isinstance(row, str) for row in rows):
            return self.job_meter.resume() if reprofile else None  # no micro-batch: nothing to say
        with self.guard.own_work("asking the log dir", "the files in the log dir are not written"):
            log_dir = self._log_dir = sink.log_dir()  # on every rank: Lightning's log_dir is a collective
        built = None
        with self.guard.own_work("building the profile", "no profile is published"):
            peaks, apart = (self.given_peak, self.given_bandwidth), self.sequences.why_not
            context, self._context = self._context, TrainingContext()  # it may hold the trainer: not kept
            built = build_result(local, steps, rows, model, context, self.flops, global_step, peaks, apart)
        self.result = built or self.result  # a failed re-profile keeps the last result to build on
        if built is not None and sink.is_logging_rank and self.publish is not None:
            self.publish(built, self.options, log_dir, sink, self.guard, set(self._unwritable), False)
        self.job_meter.start(self.result, model, self.flops, again=reprofile)

    # --- throughput ----------------------------------------------------------------------------------

    def log_throughput(self, global_step: int, sink: Sink) -> None:
        """Log the job's ``throughput/*`` since the last call (a logging event, which every rank reaches)."""
        self.job_meter.log(global_step, sink)

    @_own_work("pausing throughput")
    def pause_throughput(self, late: bool = False) -> None:
        """Evaluation starts: its time is not training throughput, nor a window step's; ``late``: it
        started at the last step's end (or pause's end): learned of when it ended, resumed right after."""
        self.job_meter.pause(late)
        if self.plan.open and self._steps:
            self._pauses.begin(self.plan.clock.mark(), late)

    @_own_work("resuming throughput")
    def resume_throughput(self) -> None:
        if self.plan.open:  # in this window step's wall, or in the next one's
            self._pauses.end(self.plan.clock.mark(), self._step)
        else:  # a re-profile window's time is not metered: resumed at its end
            self.job_meter.resume()
