"""A profiled step's events, classed: communication, compute, the host's waits, the collectives' calls.

Communication is what moves data between ranks: NCCL kernels on a GPU; gloo's work on its worker
threads (``gloo:all_reduce``, ...), on a CPU or carrying a GPU's tensors through the host; and the
copies that only fill or drain a collective's buffer (DDP's reducer, FSDP2's copy-in and copy-out:
:data:`STAGING`), which would not run without the collective. Compute is every other device kernel on
a GPU; on a CPU, the outermost ops of the threads that are not gloo's, less the time they spend
waiting on a collective (a wait nested in an op is not compute: counting it as compute would hide
exposed time) and less the staging copies. On a GPU a staging copy is a kernel or a memcpy: it is
known by the host op that launched it (the kernel's correlation id), when that op runs inside a
staging range or a collective's launch, or on a gloo thread. A ``record_function`` range that the
profiler also draws on a stream (DDP's forward, ProcessGroupNCCL's ``nccl:all_reduce``) is neither: it
spans kernels and the idle time between them.

A collective's op and size come from its launch (``c10d::allreduce_``, ``c10d::_allgather_base_``,
...) paired in order with the work that carried it: gloo runs a reduce-scatter as an all-reduce, so
the work's own name can say the wrong op.

Why not HTA or torch's own helpers: HTA reads trace files into pandas frames after the run (and is
not a dependency of the core, which needs torch only); ``torch.profiler`` classes no event as
communication. So the classing is written here over :class:`TraceEvent`, plain tuples that tests write
by hand; :func:`trace_events` is the one place that reads ``torch.profiler``'s results.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from flops_callbacks.communication.intervals import Interval, merge, subtract

__all__ = [
    "MARK",
    "mark_name",
    "Call",
    "StepEvents",
    "TraceEvent",
    "classify",
    "collective_op",
    "trace_events",
]

MARK = "flops_callbacks/phase:"  # the prefix of the phase marks the communication step records
WAITED = "@"  # in a mark's name, before the training thread's wait for a core then (nanoseconds)
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}  # fmt: skip
# a c10d launch's name (less "c10d::" and a trailing "_") -> the collective
LAUNCHES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather", "allgather": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv", "recv_any_source": "recv",
    "barrier": "barrier",
}  # fmt: skip
_NCCL_OPS = re.compile(r"(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|AllToAll)")


class TraceEvent(NamedTuple):
    """One profiler event: times in microseconds; ``thread`` a host thread (or a device's stream)."""

    name: str
    start: float
    end: float
    thread: int = 0
    device: bool = False  # a kernel, copy or set on an accelerator
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    annotation: bool = False  # a user's record_function range (a span, not work)
    op_id: int = 0  # a host op's correlation id (0: none)
    launched_by: int = 0  # a kernel's: the host op that launched it (0: unknown)

    @property
    def interval(self) -> Interval:
        return (self.start, self.end)

    def nbytes(self) -> int | None:
        """Bytes of its largest tensor argument (a collective's whole buffer, as nccl-tests sizes it:
        an all-gather's output, a reduce-scatter's input), None if none is known."""
        sizes = []
        for shape, dtype in zip(self.shapes, self.dtypes, strict=False):
            if dtype in DTYPE_BYTES:  # a 0-dim tensor (a loss, a count) is one element
                n = 1
                for d in shape:
                    n *= d
                sizes.append(n * DTYPE_BYTES[dtype])
        return max(sizes) if sizes else None


class Call(NamedTuple):
    """One collective call: its op, bytes (None: unknown), the seconds its work took and when (its work's
    start and end, seconds on the trace's clock: works of one op may run at once, on gloo's threads)."""

    op: str
    nbytes: int | None
    seconds: float
    work: tuple[float, float] | None = None


def collective_op(name: str) -> str | None:
    """The collective a launch, a gloo work or an NCCL kernel carries (None: not communication)."""
    if name.startswith("c10d::"):
        return LAUNCHES.get(name[len("c10d::") :].rstrip("_"))
    if name.startswith("gloo:"):
        op = name[len("gloo:") :]
        return "all_reduce" if op == "sparse_all_reduce" else op
    if "nccl" in name.lower():
        found = _NCCL_OPS.search(name)
        if found is None:
            return "nccl"
        return re.sub(r"(?<!^)([A-Z])", r"_\1", found.group(1)).lower()
    return None


# Host work that only fills or drains a collective's buffer: DDP's reducer copying a ready gradient into
# its bucket (divided by the world size) and the reduced bucket back to the gradients, FSDP2's copies
# into and out of its all-gather buffer and of the gradients into its reduce-scatter buffer (its own op
# over aten::_chunk_cat). Compute would run without the collective; these would not.
STAGING = (
    "torch::distributed::reducer::mul_out",
    "torch.distributed.ddp.reducer::copy_bucket_to_grad",
    "fsdp::all_gather_copy_in",
    "fsdp::split_with_sizes_copy",
    "fsdp::chunk_cat",
)


def _is_wait(name: str) -> bool:
    """The host blocked on a collective (c10d::wait, wait_tensor, FSDP's waits)."""
    return "wait" in name.lower()


def _staging_kernels(
    host: Sequence[TraceEvent], kernels: Sequence[TraceEvent], gloo_threads: set[int]
) -> list[TraceEvent]:
    """The kernels and copies a collective's buffers need: those launched by a host op that starts
    inside a :data:`STAGING` range or a collective's launch (``c10d::...``: gloo's copy of a GPU's
    tensors to the host, a tensor list's copies) of its own thread, or by an op on a gloo thread (the
    copy back)."""
    ranges: dict[int, list[Interval]] = {}
    for e in host:
        if e.name in STAGING or collective_op(e.name) is not None:
            ranges.setdefault(e.thread, []).append(e.interval)
    merged = {thread: merge(intervals) for thread, intervals in ranges.items()}
    inside = set()
    for e in host:
        if not e.op_id:  # not an op (a runtime call, a range): no kernel names it
            continue
        if e.thread in gloo_threads:
            inside.add(e.op_id)
            continue
        spans = merged.get(e.thread, [])
        i = bisect.bisect_right(spans, (e.start, math.inf)) - 1
        if i >= 0 and e.start < spans[i][1]:
            inside.add(e.op_id)
    return [k for k in kernels if k.launched_by in inside]


def mark_name(phase: str, waited: float | None = None) -> str:
    """The name of the mark that ``phase`` starts now ("": the running phase ends), with ``waited``, the
    seconds the marking thread has waited for a core (:mod:`.core_wait`), where read: in the name, so
    that each reading stays with its mark whatever the trace's order."""
    return MARK + phase + ("" if waited is None else f"{WAITED}{round(waited * 1e9)}")


class StepEvents(NamedTuple):
    """A step's events classed: intervals of communication, compute and phase marks, and its calls."""

    comm: list[Interval]
    compute: list[Interval]
    marks: list[tuple[str, float]]  # (phase, time), in order; "" closes the running phase
    calls: list[Call]
    device: bool  # an accelerator's kernels were recorded (their timeline is the one classed)
    waits: tuple[float | None, ...] = ()  # at each mark, the marking thread's wait for a core (seconds)


def _outermost(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    """The events not nested in another of the same thread."""
    out: list[TraceEvent] = []
    ends: dict[int, float] = {}
    for e in sorted(events, key=lambda e: (e.start, -e.end)):
        if e.start >= ends.get(e.thread, float("-inf")):
            out.append(e)
            ends[e.thread] = e.end
    return out


def _calls(launches: list[TraceEvent], works: list[TraceEvent], sizes: list[TraceEvent]) -> list[Call]:
    """Each collective's op, bytes and time: the i-th launch with the i-th work (both in start order)
    when their counts agree, else each work by its own name and shapes."""
    launches = sorted(launches, key=lambda e: e.start)
    works = sorted(works, key=lambda e: e.start)
    if len(launches) != len(works):
        return [Call(collective_op(w.name) or "unknown", w.nbytes(), *_seconds(w)) for w in works]
    calls = []
    for launch, work in zip(launches, works, strict=True):
        nbytes = launch.nbytes()
        if nbytes is None:  # a tensor list: its record_param_comms, else the work's own tensors
            inside = [s for s in sizes if s.thread == launch.thread and launch.start <= s.start <= launch.end]
            nbytes = next((s.nbytes() for s in inside if s.nbytes()), None) or work.nbytes()
        calls.append(Call(collective_op(launch.name) or "unknown", nbytes, *_seconds(work)))
    return calls


def _seconds(work: TraceEvent) -> tuple[float, tuple[float, float]]:
    """A work's seconds and its (start, end) in seconds (the trace's microseconds)."""
    return (work.end - work.start) / 1e6, (work.start / 1e6, work.end / 1e6)


def classify(events: Iterable[TraceEvent]) -> StepEvents:
    """The communication, compute, marks and calls of one step's ``events`` (module doc)."""
    events = list(events)
    marks: list[tuple[str, float]] = []
    readings: list[float | None] = []  # the thread's wait for a core at each mark
    for e in sorted((e for e in events if e.name.startswith(MARK)), key=lambda e: e.start):
        phase, _, waited = e.name[len(MARK) :].partition(WAITED)
        marks.append((phase, e.start))
        readings.append(int(waited) / 1e9 if waited.isdigit() else None)
    host = [e for e in events if not e.device and not e.name.startswith(MARK)]
    # a range drawn on a stream is no kernel: flagged as a user's, or named as a host range is
    ranges = {e.name for e in host if e.annotation}
    kernels = [e for e in events if e.device and not e.annotation and e.name not in ranges]
    gloo = [e for e in host if e.name.startswith("gloo:")]
    gloo_threads = {e.thread for e in gloo}
    launches = [e for e in host if e.name.startswith("c10d::") and collective_op(e.name) is not None]
    sizes = [e for e in host if e.name == "record_param_comms"]
    if marks:  # the step's own calls: not the ranks' vote before it, nor what follows its end
        launches = [e for e in launches if marks[0][1] <= e.start <= marks[-1][1]]
    gloo_works = [w for w in gloo if not marks or marks[0][1] <= w.start <= marks[-1][1]]
    if kernels:
        nccl = [
            k for k in kernels if collective_op(k.name) is not None and (not marks or k.start >= marks[0][1])
        ]
        # NCCL's kernels; gloo's host work where gloo carries the GPU's tensors (not both: the launches
        # pair with one kind of work)
        works = nccl or gloo_works
        staged = set(_staging_kernels(host, kernels, gloo_threads))
        comm = merge([w.interval for w in works] + [k.interval for k in staged])
        compute = merge(k.interval for k in kernels if collective_op(k.name) is None and k not in staged)
    else:
        works = gloo_works
        mine = [e for e in host if e.thread not in gloo_threads and not e.annotation]
        waits = [e.interval for e in mine if _is_wait(e.name) or e.name.startswith("c10d::")]
        staging = [e.interval for e in mine if e.name in STAGING]
        busy = [e.interval for e in _outermost(mine) if not e.name.startswith("c10d::")]
        comm = merge([w.interval for w in works] + waits + staging)
        compute = subtract(busy, waits + staging)
    return StepEvents(comm, compute, marks, _calls(launches, works, sizes), bool(kernels), tuple(readings))


def trace_events(results: Any) -> list[TraceEvent]:
    """The events of ``torch.profiler``'s kineto results (``profile.profiler.kineto_results``)."""
    out = []
    for e in results.events():
        device = str(e.device_type()) != "DeviceType.CPU"
        start = e.start_ns() / 1e3
        shapes = tuple(tuple(s) for s in e.shapes()) if not device else ()
        out.append(
            TraceEvent(
                e.name(),
                start,
                start + e.duration_ns() / 1e3,
                e.device_resource_id() if device else e.start_thread_id(),
                device,
                shapes,
                tuple(e.dtypes()) if not device else (),
                bool(e.is_user_annotation()),
                # a host op's id, which its kernels link to; a runtime call (cudaLaunchKernel) is
                # itself linked, and its own id is CUPTI's, another count (torch pairs them the same)
                e.correlation_id() if not device and e.linked_correlation_id() == 0 else 0,
                e.linked_correlation_id() if device else 0,
            )
        )
    return out
