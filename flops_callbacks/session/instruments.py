"""The instruments of the window's steps, started and stopped as one unit: the counting engine (the
counting step's, kept for its profile; a check's or shape-counting step's, with no clock), the module
timer (on a CUDA device, on the clock of its kernels: :mod:`flops_callbacks.timing.kernel_clock`), the
clean steps' marks of the model's outermost calls (what the timer's hooks cost, in place), and
each communication step's ``torch.profiler`` (:mod:`flops_callbacks.communication.recorder`). One object
owns what runs inside a micro-batch and its teardown on every exit path: the session stops it in one call.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flops_callbacks.communication.recorder import CommRecorder
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.module_tree import dynamo_compiled_anything, dynamo_frames, has_compiled
from flops_callbacks.options import Options
from flops_callbacks.phase_names import BACKWARD, FORWARD
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.energy_reads import WindowEnergy
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import WindowStep
from flops_callbacks.timing.clock import Clock, CpuClock, CudaClock, NullClock, module_device
from flops_callbacks.timing.hook_probe import stop_probes
from flops_callbacks.timing.kernel_clock import KernelClock, kernel_clock_unavailable
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.user_warning import warn

__all__ = ["Instruments", "totals"]

COUNTERS = (Kind.CHECK, Kind.SHAPE_COUNTING)  # steps counted with an engine of their own (no clock)


def totals(engine: CountingEngine) -> BatchCounts:
    """The model's counts an engine has seen so far."""
    return BatchCounts.of(engine.totals()[0])


class Instruments:
    """What runs on the window's steps (module doc); one per session."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.engine: CountingEngine | None = None  # the counting step's: its profile at the window's end
        self.shape_engine: CountingEngine | None = None  # a check's or shape-counting step's (no clock)
        self.timer: ModuleTimer | None = None
        self.outer: OuterCalls | None = None  # a clean step's outermost calls, while marked
        self.outermost: list[torch.nn.Module] = []  # the modules whose calls they are
        self.mark_outer = False  # whether clean steps mark them (a CPU clock, nothing compiled)
        self._counting: tuple[Signature, bool, BatchCounts] | None = None  # (signature, later, before)
        self.recorder: CommRecorder | None = None  # a communication step's, from its start to its end
        self.energy = WindowEnergy()  # the device's energy counter, read at each window step's end
        self.kernels: KernelClock | None = None  # a CUDA module-timing step's, from its start to its end
        self._own = 0.0  # seconds the communication profiler's start and stop took, since take_own()

    def for_step(self, step: WindowStep, model: torch.nn.Module, runs: torch.nn.Module | None) -> None:
        """A window step starts: the counting step's engine, or a module-timing step's timer."""
        self.energy.start(model)  # at the window's first step: its device's counter
        step.frames = dynamo_frames()
        if step.kind == Kind.COUNTING:
            compiled = None if runs is None else has_compiled(runs.modules())
            causal = self.options.causal_attention
            self.engine = CountingEngine(model, causal_attention=causal, compiled=compiled)
            # the clean steps mark the outermost module calls (what the module timer's hooks cost, in
            # place) where a CPU clock times them and no hook can change what dynamo compiles
            self.mark_outer = (
                isinstance(step.phases.clock, CpuClock)
                and not self.engine.compiled
                and not dynamo_compiled_anything()
            )
        elif step.kind == Kind.MODULE_TIMING:
            self.timer = step.timer = ModuleTimer(model, self._module_clock(step.phases.clock))
        elif step.kind == Kind.COMMUNICATION:  # the ranks line up after its start-up (WindowPlan.lines_up)
            start = time.perf_counter()
            if self.recorder is not None:  # a step that never ended: nothing of it is read
                self.recorder.stop(keep=False)
            self.recorder = CommRecorder(module_device(model).type == "cuda")
            self.recorder.start()
            self._own += time.perf_counter() - start

    def _module_clock(self, clock: Clock) -> Clock:
        """The module timer's clock: on a CUDA device its kernels' (started now), unless another profiler
        runs; elsewhere the phases'."""
        if not isinstance(clock, CudaClock):
            return clock
        why = kernel_clock_unavailable()
        if why is not None:
            warn(f"module latencies from CUDA events at the module hooks, not the kernels: {why}")
            return clock
        if self.kernels is not None:  # a step that never ended: nothing of it is read
            self.kernels.end(keep=False)
        kernels = KernelClock(clock.device)
        try:
            kernels.begin()
        except Exception as error:  # a torch built without CUPTI, a profiler that changed: events instead
            kernels.end(keep=False)
            warn(f"module latencies from CUDA events at the hooks (torch.profiler did not start: {error})")
            return clock
        self.kernels = kernels
        return kernels

    def shape_counting(self, model: torch.nn.Module) -> None:
        """The step became a check or a shape-counting one: an engine of its own, with no clock."""
        causal = self.options.causal_attention
        self.shape_engine = CountingEngine(model, causal_attention=causal, clock=NullClock())

    def start(self, step: WindowStep, signature: Signature, later: bool) -> None:
        """A micro-batch of ``step`` starts: its kind's instrument."""
        engine = self.shape_engine if step.kind in COUNTERS else None
        if step.kind == Kind.COUNTING:
            engine = self.engine
        if engine is not None:
            self._counting = (signature, later, totals(engine))
            engine.start()
        elif step.kind == Kind.MODULE_TIMING and self.timer is not None:
            self.timer.start()
        elif step.kind == Kind.CLEAN and self.outermost:
            self.outer = step.outer = step.outer or OuterCalls(self.outermost, step.phases.clock)
            self.outer.start()
        elif self.recorder is not None:
            self.recorder.mark(FORWARD)
        if self.kernels is not None:
            self.kernels.phase(FORWARD)

    def phase(self, step: WindowStep, name: str) -> None:
        """A phase starts: the timer walks to the backward's hooks (nobody's time), the outer calls stop."""
        if name == BACKWARD and self.timer is not None and self.timer.running:
            step.phases.stop()  # the walk is nobody's time, not the forward's
            self.timer.arm()
        elif name != BACKWARD and self.timer is not None:
            self.timer.release()
        if self.outer is not None:  # the outer calls are the forward's: no hook past it
            self.outer.stop()
        if self.recorder is not None:
            self.recorder.mark(name)
        if self.kernels is not None:
            self.kernels.phase(name)

    def phase_end(self) -> None:
        if self.outer is not None:  # what follows may be a forward (a GAN's second model): marked again
            self.outer.start()

    def stop(self, flops: ShapeFlops | None = None, step: WindowStep | None = None) -> None:
        """Stop what runs; with ``flops`` a counted micro-batch's counts go in the table (not after an
        exception)."""
        try:
            for engine in (self.engine, self.shape_engine):
                if engine is not None and engine.running:
                    engine.stop()
                    if flops is not None:
                        self._record(engine, flops, step)
        finally:
            if self.recorder is not None:
                self.recorder.mark("")  # the micro-batch ended: its phase too (the profiler runs on)
            if self.kernels is not None:
                self.kernels.phase("")
            if self.timer is not None:
                self.timer.stop()
            if self.outer is not None:
                self.outer.stop()
                self.outer = None

    def _record(self, engine: CountingEngine, flops: ShapeFlops, step: WindowStep | None) -> None:
        counting, self._counting = self._counting, None
        if counting is not None:
            signature, later, before = counting
            flops.record(signature, totals(engine).minus(before), later, step.number if step else None)

    def failure(self) -> tuple[str, BaseException] | None:
        """A formula's failure while counting, taken (once)."""
        engine = next((e for e in (self.engine, self.shape_engine) if e is not None and e.failure), None)
        if engine is None or engine.failure is None:
            return None
        failure, engine.failure = engine.failure, None
        return failure

    def step_ended(self, step: WindowStep) -> None:
        """A window step ended: a module-timing step names the outermost modules clean steps mark; the
        communication step's profiler stops and its split is read."""
        self.energy.read(step)  # right after its end mark
        if step.kind == Kind.CLEAN and dynamo_frames() > step.frames:
            # compiled code met a shape it had not compiled (the steps before ran eagerly): the compile's
            # seconds are in its time; left out ("auto" times another, an int clean_steps one fewer)
            step.kind = Kind.COMPILED
        if step.kind == Kind.MODULE_TIMING and self.mark_outer and self.timer is not None:
            self.outermost = self.timer.outermost()
        recorder, self.shape_engine, self.timer, self.recorder = self.recorder, None, None, None
        kernels, self.kernels = self.kernels, None
        if kernels is not None:
            kernels.end()  # its trace is read at the window's end
        if recorder is not None:
            start = time.perf_counter()
            recorder.stop()
            step.comm = recorder.breakdown()
            self._own += time.perf_counter() - start

    def take_own(self) -> float:
        """The seconds the communication profiler's start and stop took since the last call: the profiler's
        own work that makes a rank reach the next vote later (:class:`~.vote_times.Vote`'s ``own``)."""
        own, self._own = self._own, 0.0
        return own

    def drop(self) -> Any:
        """Forget every instrument (stopped already); returns the counting step's engine."""
        self.energy.stop()
        stop_probes()  # the window's end measures the hooks' cost: a Ctrl-C there leaves none on
        engine, recorder, kernels = self.engine, self.recorder, self.kernels
        self.engine = self.shape_engine = self.timer = self.outer = self.recorder = self.kernels = None
        if recorder is not None:
            recorder.stop(keep=False)  # an exception or a dropped window: nothing of it is read
        if kernels is not None:
            kernels.end(keep=False)
        self.outermost, self._counting, self._own = [], None, 0.0
        return engine
