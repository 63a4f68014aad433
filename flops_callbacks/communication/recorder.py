"""``torch.profiler`` over the communication step: started at the step's start, phase marks recorded as
empty ranges in the profiler's own timeline, stopped on every exit path, read once.

Why marks in the trace rather than the phase clock's: the clock's marks (``perf_counter``, CUDA events)
are on another time base than the profiler's; a mark recorded by the profiler is on the events' own.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from flops_callbacks.communication.breakdown import CommBreakdown, breakdown
from flops_callbacks.communication.core_wait import core_wait
from flops_callbacks.communication.events import StepEvents, classify, mark_name, trace_events
from flops_callbacks.timing.collector import collect_counting_garbage, collector_off
from flops_callbacks.user_warning import warn

__all__ = ["CommRecorder"]


class CommRecorder:
    """Records one step on this rank (CPU activity, CUDA's too where the model is on a GPU)."""

    def __init__(self, cuda: bool) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler: Any = torch.profiler.profile(activities=activities, record_shapes=True)
        self.running = False
        self.events: StepEvents | None = None
        self._host = not cuda  # the host's timeline: its thread's wait for a core is read at each mark
        self._collector = contextlib.ExitStack()
        self._collect = False

    def start(self) -> None:
        self.running = True  # a start that fails part way is stopped by stop() all the same
        self._collect = gc.isenabled()  # a user who turned the collector off gets no collection either
        self._collector.enter_context(collector_off())
        self._profiler.start()

    def mark(self, phase: str) -> None:
        """Phase ``phase`` starts now ("": the running phase ends)."""
        if self.running:
            name = mark_name(phase, core_wait() if self._host else None)
            handle = torch.ops.profiler._record_function_enter_new(name, None)
            torch.ops.profiler._record_function_exit._RecordFunction(handle)

    def stop(self, keep: bool = True) -> None:
        """Stop the profiler (idempotent); with ``keep`` its events are classed and kept."""
        if not self.running:
            return
        profiler, self.running, self._profiler = self._profiler, False, None  # never tried twice
        try:
            self._stop(profiler, keep)
        finally:
            self._collector.close()
            if self._collect:
                collect_counting_garbage()  # the trace's objects, before the next step's clock

    def _stop(self, profiler: Any, keep: bool) -> None:
        try:
            profiler.stop()
        except Exception as error:  # a start that failed part way, a torch that changed: the run goes on
            warn(
                f"flops_callbacks: torch.profiler could not be stopped after a communication step "
                f"({type(error).__name__}: {error}); that step has no communication figures.",
            )
            return
        if keep:
            try:
                self.events = classify(trace_events(profiler.profiler.kineto_results))
            except Exception as error:  # torch.profiler's results vary by version: the rest goes on
                warn(
                    f"flops_callbacks: a communication step's trace could not be read "
                    f"({type(error).__name__}: {error}); that step has no communication figures "
                    f"(the median step is chosen among the others).",
                )

    def breakdown(self) -> CommBreakdown | None:
        """The recorded step's split (None: nothing recorded, or no phase in it)."""
        return breakdown(self.events) if self.events is not None else None
