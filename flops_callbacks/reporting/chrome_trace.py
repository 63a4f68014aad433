"""Module spans as a Chrome trace: one complete event per module call, one track per phase.

The trace-event JSON (``{"traceEvents": [...]}``, times in microseconds) is what ``torch.profiler``'s
``export_chrome_trace`` writes and what Perfetto and chrome://tracing open, so the module timeline of a
profiled step is read with the tools people already use for op timelines. Why not record the modules
with ``torch.profiler`` itself (``record_function``): it traces every op and kernel too, which costs
far more than the module timing it would show, and its files grow to hundreds of megabytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flops_callbacks.phase_names import MODULE_PASSES
from flops_callbacks.timing.spans import ModuleSpan

__all__ = ["chrome_trace"]

_PID = 1  # one process holds the tracks; its name says what they are


def chrome_trace(
    spans: Sequence[ModuleSpan], *, process_name: str = "flops_callbacks modules"
) -> dict[str, Any]:
    """Trace-event JSON data: a complete ("X") event per span, on the track of its phase.

    Args:
        spans: the module calls to draw.
        process_name: the name of the process that holds the tracks.
    """
    tracks = {phase: tid for tid, phase in enumerate(MODULE_PASSES, start=1)}
    used = [phase for phase in MODULE_PASSES if any(span.phase == phase for span in spans)]
    meta: list[dict[str, Any]] = [_meta("process_name", 0, name=process_name)]
    for phase in used:
        meta.append(_meta("thread_name", tracks[phase], name=phase))
        meta.append(_meta("thread_sort_index", tracks[phase], sort_index=tracks[phase]))
    calls: list[dict[str, Any]] = [
        {
            "name": span.name or "(model)",
            "cat": span.phase,
            "ph": "X",
            "pid": _PID,
            "tid": tracks[span.phase],
            "ts": _microseconds(span.start),
            "dur": _microseconds(span.duration),
            "args": {"module": span.name, "depth": span.depth},
        }
        for span in spans
    ]
    # outer calls before the calls they enclose, so that viewers nest them without re-sorting
    calls.sort(key=lambda event: (event["tid"], event["ts"], -event["dur"], event["args"]["depth"]))
    return {"traceEvents": meta + calls, "displayTimeUnit": "ms"}


def _meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def _microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # nanosecond resolution, without float noise like 1500.0000000000002
