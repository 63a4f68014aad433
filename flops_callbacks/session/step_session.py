"""The step session below both callbacks: the profile window, then the continuous throughput meter.

A profile is a short window of steps, each doing one job on its own clock: the counting step counts every
op (:class:`~flops_callbacks.counting.engine.Tracer`; its times feed no figure), the
``MODULE_TIMING_STEPS`` module-timing steps mark module calls only (the tree is the median one's:
:class:`~flops_callbacks.timing.module_timer.ModuleTimer`), the clean steps mark the phases at the
framework's events, each step's end and the model's outermost calls (:mod:`.outer_calls`). Each
batch's flops come from :class:`~flops_callbacks.session.shape_flops.ShapeFlops`; what it cannot vouch
for (``needs_count``: a new shape, the content check) is a shape-counting step (counted, not timed), at
most ``MAX_SHAPE_COUNTS`` times. :mod:`.builder` builds the figures from :mod:`.window_steps`; after the
window, :mod:`flops_callbacks.session.meter` logs ``throughput/*`` with the same table.

An adapter maps its framework's events onto this object (:mod:`flops_callbacks.session.adapter_api`):

    train_start(global_step, max_steps=..)   at the start of a run (warnings come here, not at the end)
    step_start(global_step, model, context)  at the start of each optimizer step
    micro_batch_start(batch)                 before each micro-batch's forward
    phase(BACKWARD / OPTIMIZER_STEP / FORWARD), phase_end()   at the events between phases (FORWARD in
                                             a running forward: the user's code starts; stop_timing(): ends)
    micro_batch_end(pause=..)                after each micro-batch
    step_end(global_step, outlet, logs=..)   when the optimizer step has ended
    train_end(global_step, outlet)           at the end of the run
    close()                                  on an exception: nothing of the profiler remains

Instruments run only inside a micro-batch of a window step. Every event runs as the profiler's own work
(:mod:`flops_callbacks.guard`): a failure is said, the window dropped, and the run goes on unprofiled;
the user's functions and loggers are called through the guard, so their exceptions pass unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from flops_callbacks.counting.engine import Tracer
from flops_callbacks.guard import F, Guard, guarded_event
from flops_callbacks.module_tree import dynamo_compiled_anything, has_compiled
from flops_callbacks.options import Options
from flops_callbacks.peaks import given_bandwidth, given_peak
from flops_callbacks.session import run_plan
from flops_callbacks.session.adapter_api import Outlet, Publish, TrainingContext
from flops_callbacks.session.batch import BatchReader, shape_signature
from flops_callbacks.session.builder import build_result
from flops_callbacks.session.meter import ThroughputMeter
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_steps import Kind, WindowStep, median_known
from flops_callbacks.timing.clock import CpuClock, NullClock, clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phase_memory import phase_memory_for
from flops_callbacks.timing.phases import BACKWARD, FORWARD, OPTIMIZER_STEP, StepPhases
from flops_callbacks.user_warning import warn

DROPPED = "the profile window is dropped and nothing of the profiler stays; this run goes on unprofiled"


def _own_work(what: str, abandon: bool = True) -> Callable[[F], F]:
    """An event of the session, run as the profiler's own work (with ``abandon``, a failure drops the
    window for the rest of the run)."""
    return guarded_event(what, DROPPED if abandon else "training goes on", "_abandon" if abandon else None)


MAX_SHAPE_COUNTS = 8  # shape-counting steps a window may add

__all__ = ["BACKWARD", "FORWARD", "OPTIMIZER_STEP", "Outlet", "TrainingContext", "StepSession"]


class StepSession:
    """The profile window and the throughput meter of one callback (module doc).

    ``owner`` names the callback in messages; ``tokens_fn`` defaults to the options' (an adapter may
    pass a smarter default, e.g. the HF Trainer's ``input_ids``).
    """

    def __init__(
        self,
        options: Options,
        owner: str,
        tokens_fn: Callable[[Any], int | None] | None = None,
        publish: Publish | None = None,
    ) -> None:
        self.options = options
        self.owner = owner
        self.publish = publish  # None: the result is kept (``self.result``), not published
        self.guard = Guard(owner)
        self.batches = BatchReader(options, owner, self.guard, tokens_fn)
        self.given_peak = given_peak(options.peak_flops)
        self.given_bandwidth = given_bandwidth(options.peak_bandwidth)
        samples = lambda batch: self.batches.samples(batch) or 0  # noqa: E731
        meter = ThroughputMeter(samples, self.batches.tokens, options.flops_audit, options.causal_attention)
        self.meter = meter if options.throughput else None
        self.result: WindowResult | None = None
        self.flops = ShapeFlops()  # flops per micro-batch shape: counted in the window, read after it
        self._steps: list[WindowStep] = []  # the window's steps so far
        self._step: WindowStep | None = None  # the window step in progress
        self._counter: Tracer | None = None  # a shape-counting step's engine (no clock)
        self._counting: tuple[Any, bool, BatchCounts] | None = None  # (signature, later, counts before)
        self._model: torch.nn.Module | None = None
        self._context = TrainingContext()
        self._tracer: Tracer | None = None
        self._timer: ModuleTimer | None = None
        self._outer: OuterCalls | None = None  # a clean step's outermost calls, while marked
        self._mark_outer = False  # whether clean steps mark them (a CPU clock, nothing compiled)
        self._outermost: list[torch.nn.Module] = []  # the modules whose calls they are
        self._metering = False  # the meter's events are routed (after the window, on the logging rank)
        self._resumed_past = False
        self._unreachable = False  # said at train start: profile_step is past the run's last step
        self._abandoned = False  # the profiler's own work failed in this run: it goes on unprofiled
        self._unwritable: dict[str, str] = {}  # "output_file" / "log_dir" -> why, said at train start
        self.enabled = True

    def disable(self) -> None:
        """Profile nothing and meter nothing (a DeepSpeed config with ``enabled: false``)."""
        self.close()
        self.enabled, self.meter = False, None

    def _abandon(self) -> None:
        """The profiler's own work failed: drop the window and stop metering for the rest of the run."""
        self._abandoned = True
        self.close()

    # --- the run -------------------------------------------------------------------------------------

    @property
    def window_open(self) -> bool:
        """Between the counting step's start and the window's end."""
        return bool(self._steps)

    @property
    def wants_batches(self) -> bool:
        """Whether the micro-batches of the next step matter (a window step, or the meter runs)."""
        return self._step is not None or self._metering

    @_own_work("checking the run at its start")
    def train_start(
        self,
        global_step: int,
        *,
        max_steps: int | None = None,
        profiled_before: bool = False,
        is_logging_rank: bool = True,
        steps_per_batch: int = 1,
        log_dir: str | Path | None = None,
    ) -> None:
        """A run starts: forget an earlier run's window, and warn now (on the logging rank) if no
        profile can run in this one, or only a cut-short one. ``steps_per_batch``: global steps each
        optimizer step of the window takes (Lightning's manual optimization with several optimizers).
        ``log_dir``: where the window's files will go, checked now so that an unwritable one is said
        before the run rather than at the window's end."""
        self.close()
        self.guard.forget()
        self.result = None
        self.flops = ShapeFlops()
        self._metering = False
        self._abandoned = False
        self.batches.said_no_size = False
        self._unwritable = {}
        plan = run_plan.RunPlan.of(self.options, global_step, max_steps, steps_per_batch)
        self._resumed_past, self._unreachable = plan.resumed_past, plan.unreachable
        if not self.enabled or not is_logging_rank:
            return
        self._unwritable = run_plan.unwritable_destinations(self.owner, self.options.output_file, log_dir)
        plan.warn(self.owner, profiled_before)

    @_own_work("ending the run")
    def train_end(self, global_step: int, outlet: Outlet) -> None:
        """The run ended: publish a window it cut short, or say that none ran."""
        self._stop_instruments()
        self._step = None
        if self._metering and self.meter is not None:
            self.meter.close()
        self._metering = False
        if self._steps:
            self._finish(global_step, outlet)
        elif self.result is None and self._should_have_run() and outlet.is_logging_rank:
            warn(
                f"{self.owner}: no optimizer step started at or after "
                f"profile_step={self.options.profile_step} (training ended at global step {global_step}): "
                "no profile ran.",
            )

    def _should_have_run(self) -> bool:
        """A window was expected and no warning at train start said otherwise (a run shorter than
        its announced length, an iterable dataset that ran out)."""
        return self.enabled and not (self._resumed_past or self._unreachable or self._abandoned)

    @_own_work("cleaning up", abandon=False)
    def close(self) -> None:
        """Stop everything that runs and drop the window (an exception ended the run): no hook, mode
        or tag of the profiler remains. Safe to call at any time, any number of times."""
        try:
            self._stop_instruments(record=False)
        finally:
            self._steps, self._step, self._model, self._counter, self._counting = [], None, None, None, None
            self._tracer = self._timer = None
            self._outermost = []
            if self.meter is not None:
                self.meter.close()
            self._metering = False

    # --- steps ---------------------------------------------------------------------------------------

    @_own_work("starting a step")
    def step_start(
        self,
        global_step: int,
        model: torch.nn.Module,
        context: Callable[[], TrainingContext] | None = None,
        runs: torch.nn.Module | None = None,
    ) -> None:
        """An optimizer step starts (before its first micro-batch). ``runs``: what the framework calls,
        when it is a wrapper of ``model`` (the HF Trainer's compiled model): a compile is seen there."""
        if self._metering and self.meter is not None:
            self._model = model
            return
        if not self._steps:
            late = self.result is not None or self._resumed_past or not self.enabled or self._abandoned
            if late or global_step < self.options.profile_step:
                return
            self._context = context() if context is not None else TrainingContext()
            self._model = model
        n = len(self._steps)
        kind = (
            Kind.COUNTING if n == 0 else Kind.MODULE_TIMING if n <= run_plan.MODULE_TIMING_STEPS else None
        )  # None: its first batch decides
        device = module_device(model)
        clock = self._steps[0].phases.clock if self._steps else clock_for(device)
        start_mark = self._steps[-1].end_mark if self._steps else None
        memory = phase_memory_for(device) if kind is None else None  # peaks on clean steps only
        step = WindowStep(kind, global_step, StepPhases(clock, memory), start_mark=start_mark)
        self._steps.append(step)
        self._step = step
        if kind == Kind.COUNTING:
            compiled = None if runs is None else has_compiled(runs.modules())
            self._tracer = Tracer(model, causal_attention=self.options.causal_attention, compiled=compiled)
            # the clean steps mark the outermost module calls (what the module timer's hooks cost, in
            # place) where a CPU clock times them and no hook can change what dynamo compiles
            self._mark_outer = (
                isinstance(clock, CpuClock) and not self._tracer.compiled and not dynamo_compiled_anything()
            )
        elif kind == Kind.MODULE_TIMING:
            self._timer = step.timer = ModuleTimer(model, step.phases.clock)

    @_own_work("reading the batch")
    def micro_batch_start(self, batch: Any) -> None:
        """Before a micro-batch's forward: its samples, tokens and flops, and this step's instrument."""
        step = self._step
        if step is None:
            if self._metering and self.meter is not None and self._model is not None:
                self.meter.begin_micro_batch(batch)
            return
        signature, later = shape_signature(batch), bool(step.signatures)
        step.signatures.append(signature)
        samples = self.batches.samples(batch, say_unknown=True)
        step.samples = None if samples is None or step.samples is None else step.samples + samples
        tokens = self.batches.tokens(batch)
        if tokens is not None:
            step.tokens = (step.tokens or 0) + tokens
        counts = self.flops.get(signature, later)
        last = len(self._steps) > 1 and self._steps[-2].kind in (Kind.COUNTING, Kind.SHAPE_COUNTING)
        count = self.flops.needs_count(signature, later, step.kind is None, last)  # issue 32: table's say
        shape_counts = sum(s.kind == Kind.SHAPE_COUNTING for s in self._steps)
        if step.kind in (None, Kind.CLEAN) and count and (counts is None or shape_counts < MAX_SHAPE_COUNTS):
            step.kind = Kind.SHAPE_COUNTING if shape_counts < MAX_SHAPE_COUNTS else Kind.SKIPPED
            if step.kind == Kind.SHAPE_COUNTING and self._model is not None:
                self._counter = Tracer(
                    self._model, causal_attention=self.options.causal_attention, clock=NullClock()
                )
        elif step.kind is None:
            step.kind = Kind.CLEAN
        step.counts = None if counts is None or step.counts is None else step.counts.plus(counts)
        if step.kind == Kind.CLEAN:
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                step.masks.append(mask)  # read after the window: no synchronize in a timed step
        if step.kind == Kind.COUNTING:
            step.batches.append(batch)
        engine = {Kind.COUNTING: self._tracer, Kind.SHAPE_COUNTING: self._counter}.get(step.kind)
        if engine is not None:
            self._counting = (signature, later, _totals(engine))
            engine.start()
        elif step.kind == Kind.MODULE_TIMING and self._timer is not None:
            self._timer.start()
        elif step.kind == Kind.CLEAN and self._outermost:
            self._outer = step.outer = step.outer or OuterCalls(self._outermost, step.phases.clock)
            self._outer.start()
        step.phases.start(FORWARD)

    @_own_work("marking a phase")
    def phase(self, name: str) -> None:
        """The framework reached the start of phase ``name``; ``FORWARD`` while the forward runs: the user's
        code starts here, and the framework's work since the micro-batch started is no phase's."""
        step = self._step
        if step is None or (name == FORWARD and step.phases.restart(FORWARD)):
            return
        if name == BACKWARD and self._timer is not None and self._timer.running:
            step.phases.stop()  # the walk is nobody's time, not the forward's
            self._timer.arm()
        elif name != BACKWARD and self._timer is not None:
            self._timer.release()
        if self._outer is not None:  # the outer calls are the forward's: no hook past it
            self._outer.stop()
        step.phases.start(name)

    @_own_work("marking a phase")
    def phase_end(self) -> None:
        """The framework says the running phase ended, not what comes next
        (:mod:`flops_callbacks.timing.phases`)."""
        if self._step is not None:
            self._step.phases.end()
        if self._outer is not None:  # what follows may be a forward (a GAN's second model): marked again
            self._outer.start()

    @_own_work("ending a micro-batch")
    def micro_batch_end(self, pause: bool = True) -> None:
        """After a micro-batch: its instrument stops; with ``pause`` the phase clock stops too (what runs
        until the next micro-batch, such as a validation run, is not part of the step)."""
        step = self._step
        if step is None:
            if self._metering and self.meter is not None:
                self.meter.end_micro_batch()  # issue 32: an audited micro-batch's count ends here
            return
        self._stop_instruments()
        if self._counting_failed():
            return
        if pause:
            step.phases.stop()

    def _record_counted(self) -> None:
        """A counted micro-batch ended: its counts (the engine's totals since its start) go in the table."""
        counting, self._counting = self._counting, None
        counting_step = self._step is not None and self._step.kind == Kind.COUNTING
        engine = self._tracer if counting_step else self._counter
        if counting is None or engine is None:
            return
        signature, later, before = counting
        step = self._step.number if self._step is not None else None
        self.flops.record(signature, _totals(engine).minus(before), later, step)

    @_own_work("marking a phase")
    def stop_timing(self) -> None:
        """The step's timed part ended (before bookkeeping the framework does after it)."""
        if self._step is not None:
            self._step.phases.stop()

    @_own_work("ending a step")
    def step_end(self, global_step: int, outlet: Outlet, logs: bool = False) -> None:
        """The optimizer step ended; ``logs`` says whether this is a logging step of the run."""
        step = self._step
        if step is None:
            if self._metering and self.meter is not None:
                self.meter.end_step()
                if logs:
                    self.log_throughput(global_step, outlet)
            return
        self._stop_instruments()
        if self._counting_failed():
            return
        step.phases.stop()
        step.end_mark = step.phases.clock.mark()
        if step.kind == Kind.MODULE_TIMING and self._mark_outer and self._timer is not None:
            self._outermost = self._timer.outermost()
        self._counter = self._timer = None
        self._step = None
        if step.kind == Kind.COUNTING:
            collect_counting_garbage()  # now, outside every clock
        if self._window_done():
            self._finish(global_step, outlet)

    def _window_done(self) -> bool:
        """Whether the window has its clean steps (or has grown as long as it may)."""
        wanted = self.options.clean_steps
        clean = [s for s in self._steps if s.kind == Kind.CLEAN]
        most = run_plan.CLEAN_MAX if wanted == "auto" else wanted
        if len(self._steps) < run_plan.BEFORE_CLEAN:
            return False
        if len(clean) >= most or len(self._steps) - run_plan.BEFORE_CLEAN >= most + 2 * MAX_SHAPE_COUNTS:
            return True
        if wanted != "auto" or len(clean) < run_plan.CLEAN_MIN:
            return False
        return median_known([s.seconds()["iter"] for s in clean])  # reads the clock: a synchronize

    # --- throughput ----------------------------------------------------------------------------------

    @_own_work("logging throughput")
    def log_throughput(self, global_step: int, outlet: Outlet) -> None:
        """Log the ``throughput/*`` metrics of the interval since the last call (a logging event)."""
        if self._metering and self.meter is not None:
            metrics = self.meter.metrics()
            if metrics:
                self.guard.user(outlet.log_metrics, metrics, global_step)

    @_own_work("pausing throughput")
    def pause_throughput(self) -> None:
        """Evaluation starts: its time is not training throughput."""
        if self.meter is not None:
            self.meter.pause()

    @_own_work("resuming throughput")
    def resume_throughput(self) -> None:
        if self.meter is not None:
            self.meter.resume()

    # --- the window's end ----------------------------------------------------------------------------

    def _stop_instruments(self, record: bool = True) -> None:
        """Stop what runs; ``record`` keeps a counted micro-batch's counts (not after an exception)."""
        try:
            for engine in (self._tracer, self._counter):
                if engine is not None and engine.running:
                    engine.stop()
                    if record:
                        self._record_counted()
        finally:
            if self._timer is not None:
                self._timer.stop()
            if self._outer is not None:
                self._outer.stop()
                self._outer = None

    def _counting_failed(self) -> bool:
        """Whether a formula failed while counting (said here, and the window dropped)."""
        engine = next((e for e in (self._tracer, self._counter) if e is not None and e.failure), None)
        if engine is None or engine.failure is None:
            return False
        (what, error), engine.failure = engine.failure, None
        self.guard.fail(what, error, DROPPED)
        self._abandon()
        return True

    def _finish(self, global_step: int, outlet: Outlet) -> None:
        """Build the result from the window's steps, publish it, and start the throughput meter."""
        steps, self._steps, self._step = self._steps, [], None
        tracer, self._tracer, self._timer, self._counter, self._outermost = self._tracer, None, None, None, []
        model, self._model = self._model, None
        if tracer is None or model is None or not steps[0].signatures:
            return
        peaks = (self.given_peak, self.given_bandwidth)
        self.result = build_result(
            steps, tracer, model, self._context, self.flops, global_step, peaks=peaks, guard=self.guard
        )
        log_dir = outlet.log_dir()  # on every rank: Lightning's log_dir is a collective
        if not outlet.is_logging_rank:
            return
        if self.publish is not None:
            self.publish(self.result, self.options, log_dir, outlet, self.guard, set(self._unwritable))
        if self.meter is not None:
            self.meter.start(self.result, model, self.flops)
            self._metering = True


def _totals(engine: Tracer) -> BatchCounts:
    """The model's counts an engine has seen so far."""
    return BatchCounts.of(engine.totals()[0])
