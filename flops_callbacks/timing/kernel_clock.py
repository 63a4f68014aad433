"""A GPU's module times from its own kernels: a clock whose marks are host points in a ``torch.profiler``
trace, and whose seconds between two marks are the device time of the kernels launched between them.

CUDA events recorded at the module hooks time the device's timeline between two host moments: as soon as
the host is the bottleneck, every hook's host time becomes device idle time inside the span, and a module
reads up to 1.5x its kernels. Here each kernel (copy, memset) is given to the host span that launched it,
read from the device's activity records (CUPTI, through ``torch.profiler``): the launch call on the host and
the kernel on the device share a correlation id. A module's figure is then its kernels' time, whatever the
hooks cost the host; the gap to its phase is the device's idle time. Communication kernels (NCCL's) are
left out: they run on their own stream, and the communication step accounts for them.

Why not torch's own tree of the trace (``prof.events()``, each op's ``device_time_total``): it gives a
kernel to the op that launched it, and a module is no op; building it costs seconds on a large step. Why
not the communication room's reader of the same profiler's events
(:func:`flops_callbacks.communication.events.trace_events`): it lies a layer above, and it keeps no
launch call's time. One trace format (the Chrome trace ``export_chrome_trace`` writes) serves the live
step and the real GPU traces the tests read on a CPU.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import torch

from flops_callbacks.phase_names import STEP_PHASES
from flops_callbacks.user_warning import warn

__all__ = ["KernelClock", "KernelTrace", "kernel_clock_unavailable", "MARK_PREFIX"]

MARK_PREFIX = "flops_callbacks#"  # a mark's user annotation: this, then its number
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the host calls that queue device work
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
COMMUNICATION = ("nccl",)  # kernel names (lower case) of communication, left out


@dataclass(frozen=True)
class _Launches:
    """The launches of one host thread (or of all), in time order, with the running sum of their device
    seconds: the device time launched between two host times is one subtraction."""

    times: list[float]
    cumulative: list[float]  # device seconds of launches [0, i)

    @classmethod
    def of(cls, launches: Iterable[tuple[float, float]]) -> _Launches:
        ordered = sorted(launches)
        cumulative = [0.0]
        for _, seconds in ordered:
            cumulative.append(cumulative[-1] + seconds)
        return cls([t for t, _ in ordered], cumulative)

    def between(self, start: float, end: float) -> float:
        first, last = bisect.bisect_left(self.times, start), bisect.bisect_left(self.times, end)
        return self.cumulative[last] - self.cumulative[first] if last > first else 0.0


class KernelTrace:
    """A trace's marks and launches: where each mark lies on the host (thread, microseconds) and how much
    device time each host thread launched when (module doc)."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.marks: dict[int, tuple[Any, float]] = {}
        launches: dict[int, tuple[Any, float]] = {}  # correlation -> (thread, host time)
        device: dict[int, float] = {}  # correlation -> device seconds (a graph launch: several kernels)
        self.communication = 0.0  # device seconds of communication kernels, left out
        for e in events:
            cat, args = e.get("cat"), e.get("args") or {}
            if cat == "user_annotation" and str(e.get("name", "")).startswith(MARK_PREFIX):
                self.marks[int(e["name"][len(MARK_PREFIX) :])] = (
                    (e.get("pid"), e.get("tid")),
                    float(e["ts"]),
                )
            elif cat in LAUNCHES and "correlation" in args:
                launches[int(args["correlation"])] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
            elif cat in DEVICE_WORK and "correlation" in args:
                seconds = float(e.get("dur", 0.0)) / 1e6
                if any(word in str(e.get("name", "")).lower() for word in COMMUNICATION):
                    self.communication += seconds
                else:
                    correlation = int(args["correlation"])
                    device[correlation] = device.get(correlation, 0.0) + seconds
        by_thread: dict[Any, list[tuple[float, float]]] = {}
        for correlation, seconds in device.items():
            if correlation in launches:
                thread, at = launches[correlation]
                by_thread.setdefault(thread, []).append((at, seconds))
        self.device_seconds = sum(device.values())  # every kernel's, launched where it was or not
        self._threads = {thread: _Launches.of(each) for thread, each in by_thread.items()}
        self._all = _Launches.of(pair for each in by_thread.values() for pair in each)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> KernelTrace:
        """The trace of a Chrome trace file (``.json`` or ``.json.gz``) as ``torch.profiler`` exports it.

        Args:
            path: the file.
        """
        opener: Any = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as f:
            return cls(json.load(f)["traceEvents"])

    def seconds(self, start: int, end: int, any_thread: bool = False) -> float:
        """Device seconds of the work launched between two marks: by the marks' thread where both lie on
        one (a module's calls, its backward nodes), else (or with ``any_thread``) by every thread (a
        phase: its backward launches from autograd's thread).

        Args:
            start: the first mark.
            end: the second mark.
            any_thread: count every thread's launches.
        """
        if start not in self.marks or end not in self.marks:
            return 0.0
        (thread, begin), (end_thread, finish) = self.marks[start], self.marks[end]
        return self.launched(begin, finish, None if any_thread or thread != end_thread else thread)

    def launched(self, begin: float, end: float, thread: Any = None) -> float:
        """Device seconds of the work launched between two host times (the trace's microseconds), by
        ``thread`` (a (pid, tid) pair), or by every thread.

        Args:
            begin: the first host time.
            end: the second host time.
            thread: the launching thread, or None for all.
        """
        launches = self._all if thread is None else self._threads.get(thread)
        return launches.between(begin, end) if launches is not None else 0.0


def kernel_clock_unavailable() -> str | None:
    """Why no kernel clock can run here (another profiler runs: one at a time), or None."""
    if torch.autograd.profiler._is_profiler_enabled:
        return "another torch.profiler is running (one at a time)"
    return None


class KernelClock:
    """A module-timing step's clock on a CUDA device (module doc): :meth:`begin` starts ``torch.profiler``,
    each mark is a user annotation, :meth:`end` stops it; seconds are read from the trace once, after.
    :meth:`phase` marks where each phase starts, for the device's busy time per phase.

    Args:
        device: the CUDA device timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._numbers = count()
        self._profiler: Any = None
        self._pending: Any = None  # the stopped profiler, its trace not read yet
        self._export = False
        self._trace: KernelTrace | None = None
        self._phases: list[tuple[str, int]] = []  # (phase starting, or "" for none; its mark)

    def begin(self, with_stack: bool = False, export: bool = False) -> None:
        """Start recording the device's activity (a CUDA device synchronizes first: work queued before is
        none of the step's).

        Args:
            with_stack: record Python's calls too (each module call as ``nn.Module: Class_i``, hook-free:
                what ``benchmarks/module_kernels.py`` checks the marks against).
            export: the trace is read by :meth:`export`, at once after :meth:`end`, not by :meth:`end`.
        """
        self._export = export
        from torch.profiler import ProfilerActivity, profile

        self.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        self._profiler = profile(activities=activities, with_stack=with_stack)
        self._profiler.start()

    def export(self, path: str | os.PathLike[str]) -> None:
        """Write the step's trace to ``path`` (Chrome's format; gzip where it ends in ``.gz``) and read it
        from there (torch.profiler saves a trace once), for the tests.

        Args:
            path: the file.
        """
        profiler, self._pending = self._pending, None
        assert profiler is not None and self._trace is None, "one export, before any figure is read"
        profiler.export_chrome_trace(str(path))
        self._trace = KernelTrace.read(path)

    def end(self, keep: bool = True) -> None:
        """Stop recording (the device synchronized: every kernel launched is in the trace); with ``keep``
        its trace is read when a figure is first asked for.

        Args:
            keep: whether the trace is kept (False: an exception, a dropped window).
        """
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        try:
            self.synchronize()
            with warnings.catch_warnings():  # torch's note on its cycles says nothing of ours to the user
                warnings.filterwarnings("ignore", message="Profiler clears events")
                profiler.stop()
        except Exception as error:  # a start that failed part way, a torch that changed: the run goes on
            warn(f"flops_callbacks: torch.profiler could not be stopped after a module-timing step ({error})")
            return
        self._pending = profiler if keep else None
        if keep and not self._export:
            # read now: the device's activity records live in CUPTI's buffers, which the next profiler
            # session reuses (an H200's earlier steps read back with every kernel at time 0)
            _ = self.trace

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def mark(self) -> int:
        number = next(self._numbers)
        if self._profiler is not None:
            with torch.profiler.record_function(f"{MARK_PREFIX}{number}"):
                pass
        return number

    def phase(self, name: str) -> None:
        """``name`` starts on the host now ("": none runs).

        Args:
            name: the phase starting, or "".
        """
        if self._profiler is not None:
            self._phases.append((name, self.mark()))

    @property
    def trace(self) -> KernelTrace:
        """The step's trace (read once, from the profiler's own export)."""
        if self._trace is None:
            profiler, self._pending = self._pending, None
            if profiler is None:
                self._trace = KernelTrace(())
            else:
                try:
                    with tempfile.TemporaryDirectory() as folder:
                        path = Path(folder) / "trace.json"
                        profiler.export_chrome_trace(str(path))
                        self._trace = KernelTrace.read(path)
                except Exception as error:  # torch.profiler's export varies by version: the rest goes on
                    warn(
                        f"flops_callbacks: a module-timing step's kernels could not be read "
                        f"({type(error).__name__}: {error})"
                    )
                    self._trace = KernelTrace(())
        return self._trace

    def seconds(self, start: int, end: int) -> float:
        return self.trace.seconds(start, end)

    def phase_seconds(self) -> dict[str, float]:
        """Device seconds launched in each phase of the step (every thread's: a backward's kernels launch
        from autograd's), by phase name."""
        busy: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        for (name, start), (_, end) in zip(self._phases, self._phases[1:], strict=False):
            if name in busy:
                busy[name] += self.trace.seconds(start, end, any_thread=True)
        return busy

    def synchronize(self) -> None:
        if self.device.type == "cuda":  # a CPU's "kernels" are its ops, none launched: the tests' traces
            torch.cuda.synchronize(self.device)

    def done(self, mark: int) -> bool:
        return self._profiler is None
