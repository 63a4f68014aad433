"""The communication steps in the report, the console summary, the JSON and a Chrome trace: where a
multi-process step's time went (compute, communication hidden under it, exposed, idle), each phase's
share, the collectives' table with the ranks' range, and what the step spends most on beyond compute.
Every figure it prints is the metrics dict's or the figures' own, computed once.
"""

from __future__ import annotations

from typing import Any

from flops_callbacks import metrics as names
from flops_callbacks.communication.breakdown import CollectiveRow, TimeSplit
from flops_callbacks.communication.figures import CommFigures
from flops_callbacks.communication.intervals import subtract
from flops_callbacks.phase_names import STEP_PHASES
from flops_callbacks.step_lists import step_list
from flops_callbacks.units import bytes_to_string, duration_to_string, percent

__all__ = [
    "beyond_compute",
    "comm_console_row",
    "comm_data",
    "comm_from_data",
    "comm_lines",
    "comm_trace",
    "waited_words",
]


def waited_words(split: TimeSplit) -> str:
    """What of the exposed time was compute waiting for a core (a CPU's) and waiting for a slower rank in
    the profiler's votes, where any was."""
    said = []
    if split.core_wait >= 1e-6:  # less than a microsecond: the arithmetic's, not the scheduler's
        said.append(f"{duration_to_string(split.core_wait)} of it compute waiting for a core")
    if split.rank_wait >= 1e-6:
        said.append(f"{duration_to_string(split.rank_wait)} waiting for a slower rank before the step")
    return f" ({'; '.join(said)})" if said else ""


def _split_text(split: TimeSplit) -> str:
    comm, exposed = duration_to_string(split.comm), duration_to_string(split.exposed)
    idle, span = duration_to_string(split.idle), duration_to_string(split.span)
    return f"{comm} comm, {exposed} exposed{waited_words(split)}, {idle} idle of {span}"


def beyond_compute(comm: CommFigures, waiting_for: str = "") -> str:
    """What the step spends beyond compute, the largest first: exposed communication (and the collective
    that took longest, or ``waiting_for``: the slow rank the ranks wait for there), or idle time, or
    neither."""
    step = comm.step
    if step.exposed <= 0 and step.idle <= 0:
        return "compute: no exposed communication, no idle time"
    if step.exposed >= step.idle:
        share = percent(step.exposed, step.span)
        text = f"exposed communication: {duration_to_string(step.exposed)} ({share} of the step)"
        worst = comm.responsible()
        if waiting_for:
            text += f", mostly waiting for {waiting_for}"
        elif worst is not None:
            text += f", mostly {worst.op} ({worst.calls} call(s), {duration_to_string(worst.seconds[1])})"
        return text
    where = "the host's gaps between ops" if not comm.device else "the device waiting for work"
    return f"idle: {duration_to_string(step.idle)} ({percent(step.idle, step.span)} of the step, {where})"


def _steps_words(comm: CommFigures) -> str:
    """Which step the figures come from, and how far the steps were apart: ``"step 6 of 5-7, the median
    by exposed time (the ranks' mean; the steps' 1.20 .. 2.40 ms)"``."""
    if len(comm.steps) == 1:
        return f"step {comm.steps[0]}"
    read = [x for x in comm.step_exposed if x is not None]
    spread = f"; the steps' {min(read) * 1e3:.2f} .. {max(read) * 1e3:.2f} ms" if len(read) > 1 else ""
    return (
        f"step {comm.median_step} of {step_list(comm.steps)}, the median by exposed time "
        f"(the ranks' mean{spread})"
    )


def comm_lines(
    comm: CommFigures | None, metrics: dict[str, float], waiting_for: str = ""
) -> list[tuple[str, str]]:
    """The full report's rows of the median communication step ([] where none ran); ``waiting_for``: the
    slow rank the exposed time waits for, as the summary says it (:func:`beyond_compute`)."""
    if comm is None or names.COMM_LATENCY not in metrics:
        return []
    timeline = "a GPU's kernels" if comm.device else "gloo's work and the host's ops"
    cost = f"{duration_to_string(comm.iter_seconds)} fwd + bwd + step (the slowest rank's)"
    low, high = comm.exposed_range
    lines = [
        (
            "communication from",
            f"{_steps_words(comm)} (torch.profiler on every rank: {timeline}; {cost})",
        ),
        (
            f"communication / exposed (ranks' mean; {low * 1e3:.2f} .. {high * 1e3:.2f} ms) / idle",
            f"{duration_to_string(metrics[names.COMM_LATENCY])} / "
            f"{duration_to_string(metrics[names.EXPOSED_COMM_LATENCY])}{waited_words(comm.step)} / "
            f"{duration_to_string(metrics[names.IDLE_LATENCY])} of {duration_to_string(comm.step.span)}",
        ),
        ("communication overlapped by compute", f"{100 * metrics[names.COMM_OVERLAP]:.1f}%"),
    ]
    lines += [(f"  {p}", _split_text(comm.phases[p])) for p in STEP_PHASES if p in comm.phases]
    for row in comm.collectives:
        size = "? B" if row.nbytes is None else bytes_to_string(row.nbytes)
        bus = (
            "n/a"
            if row.bus_bandwidth is None
            else f"{bytes_to_string(row.bus_bandwidth[0])}/s .. {bytes_to_string(row.bus_bandwidth[1])}/s"
        )
        seconds = f"{duration_to_string(row.seconds[0])} .. {duration_to_string(row.seconds[1])}"
        label = f"  {row.op}: calls, bytes, time and bus bandwidth (ranks' min .. max)"
        lines.append((label, f"{row.calls}, {size}, {seconds}, {bus}"))
    lines.append(("beyond compute, the step spends most on", beyond_compute(comm, waiting_for)))
    return lines


def comm_console_row(comm: CommFigures) -> str:
    """The console summary's row of the median communication step: its split, and which step it is."""
    step = comm.step
    overlap = f"{step.overlapped / step.comm:.0%} overlapped" if step.comm else "none"
    return (
        f"{duration_to_string(step.comm)} ({overlap}), exposed {duration_to_string(step.exposed)}"
        f"{waited_words(step)}, "
        f"idle {duration_to_string(step.idle)} of {duration_to_string(step.span)} "
        f"(step {comm.median_step}, the median of {step_list(comm.steps)})"
    )


def comm_data(comm: CommFigures | None, waiting_for: str = "") -> dict[str, Any] | None:
    """The communication step as JSON-ready data (seconds, bytes, bytes/s); its verdict as
    :func:`comm_lines` says it."""
    if comm is None:
        return None

    def split(s: TimeSplit) -> dict[str, float | None]:
        return {
            "span": s.span, "compute": s.compute, "comm": s.comm, "overlapped": s.overlapped,
            "exposed": s.exposed, "idle": s.idle, "overlap": s.overlap, "core_wait": s.core_wait,
            "rank_wait": s.rank_wait,
        }  # fmt: skip

    return {
        "steps": list(comm.steps),
        "median_step": comm.median_step,
        "step_exposed": list(comm.step_exposed),
        "world": comm.world,
        "device_timeline": comm.device,
        "iter_seconds": comm.iter_seconds,
        "exposed_range": list(comm.exposed_range),
        "whole_step": split(comm.step),
        "phases": {phase: split(s) for phase, s in comm.phases.items()},
        "collectives": [
            {
                "op": row.op,
                "calls": row.calls,
                "bytes": row.nbytes,
                "seconds": list(row.seconds),
                "bus_bandwidth": None if row.bus_bandwidth is None else list(row.bus_bandwidth),
            }
            for row in comm.collectives
        ],
        "verdict": beyond_compute(comm, waiting_for),
    }


def comm_from_data(data: dict[str, Any]) -> CommFigures:
    """The figures :func:`comm_data` wrote, read back from a profile file (the rank's timeline stays in
    its ``.comm.trace.json``)."""

    def split(s: dict[str, Any]) -> TimeSplit:
        return TimeSplit(
            s["span"],
            s["compute"],
            s["comm"],
            s["overlapped"],
            s.get("core_wait", 0.0),
            s.get("rank_wait", 0.0),
        )

    rows = [
        CollectiveRow(
            row["op"],
            row["calls"],
            row["bytes"],
            tuple(row["seconds"]),
            None if row["bus_bandwidth"] is None else tuple(row["bus_bandwidth"]),
        )
        for row in data["collectives"]
    ]
    return CommFigures(
        steps=tuple(data["steps"]),
        median_step=data["median_step"],
        step_exposed=tuple(data.get("step_exposed", ())),  # not in files of before it
        world=data["world"],
        step=split(data["whole_step"]),
        phases={phase: split(s) for phase, s in data["phases"].items()},
        collectives=rows,
        exposed_range=tuple(data["exposed_range"]),
        device=data["device_timeline"],
        iter_seconds=data["iter_seconds"],
    )


def comm_trace(comm: CommFigures) -> dict[str, Any]:
    """This rank's communication step as trace-event JSON: one track each for compute, communication
    and exposed communication (their merged intervals), and the phases (times in microseconds). A CPU's
    wait for a core has no place in time: it is in the figures, not on the tracks."""
    events = comm.timeline
    if events is None:
        return {"traceEvents": []}
    origin = events.marks[0][1] if events.marks else 0.0
    pairs = zip(events.marks, events.marks[1:], strict=False)
    tracks = {
        "phases": [(name, start, end) for (name, start), (_, end) in pairs if name],
        "compute": [("compute", a, b) for a, b in events.compute],
        "communication": [("communication", a, b) for a, b in events.comm],
        "exposed communication": [("exposed", a, b) for a, b in subtract(events.comm, events.compute)],
    }
    process = {"name": f"flops_callbacks communication step {comm.median_step}"}
    trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": process}]
    for tid, (track, spans) in enumerate(tracks.items(), start=1):
        trace.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}})
        trace += [
            {
                "name": name,
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": round(a - origin, 3),
                "dur": round(b - a, 3),
            }
            for name, a, b in spans
        ]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
