"""The kernel clock: each kernel's device time given to the host span that launched it (by the launch's
correlation id), marks as user annotations of a real ``torch.profiler`` session, and nothing left running."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from flops_callbacks.module_tree import ancestors
from flops_callbacks.timing.kernel_clock import (
    MARK_PREFIX,
    KernelClock,
    KernelTrace,
    kernel_clock_unavailable,
)
from flops_callbacks.timing.module_timer import ModuleTimer

MAIN, AUTOGRAD = 100, 200  # two host threads


def mark(number: int, ts: float, tid: int = MAIN) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": f"{MARK_PREFIX}{number}",
        "pid": 1,
        "tid": tid,
        "ts": ts,
    }


def launch(correlation: int, ts: float, tid: int = MAIN) -> dict[str, Any]:
    args = {"correlation": correlation}
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "args": args,
    }


def kernel(correlation: int, us: float, name: str = "gemm", cat: str = "kernel") -> dict[str, Any]:
    # the device's own timeline: its start says nothing of which host span launched it
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": 1e6,
        "dur": us,
        "args": {"correlation": correlation},
    }


def trace() -> KernelTrace:
    """Marks 0..1 (main thread) hold launches 1, 2; marks 2..3 (autograd's thread) hold launch 3, while
    the main thread launches 4 at the same time; 5 is a graph launch (two kernels), 6 an NCCL kernel."""
    return KernelTrace(
        [
            mark(0, 10.0),
            launch(1, 11.0),
            kernel(1, 5.0),
            launch(2, 12.0),
            kernel(2, 7.0, "memcpy HtoD", "gpu_memcpy"),
            mark(1, 20.0),
            mark(2, 30.0, AUTOGRAD),
            launch(3, 31.0, AUTOGRAD),
            kernel(3, 11.0),
            launch(4, 32.0),
            kernel(4, 13.0),
            launch(5, 33.0, AUTOGRAD),
            kernel(5, 2.0),
            kernel(5, 3.0),
            launch(6, 34.0, AUTOGRAD),
            kernel(6, 100.0, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            mark(3, 40.0, AUTOGRAD),
            launch(7, 50.0),  # launched after every mark: nobody's
            kernel(7, 17.0),
        ]
    )


def test_a_span_gets_the_device_time_of_what_its_thread_launched_in_it() -> None:
    t = trace()
    assert t.seconds(0, 1) == pytest.approx((5 + 7) * 1e-6)  # a kernel and a copy
    # the autograd thread's span: its kernel and its graph's two, not the main thread's, not NCCL's
    assert t.seconds(2, 3) == pytest.approx((11 + 2 + 3) * 1e-6)
    assert t.seconds(2, 3, any_thread=True) == pytest.approx((11 + 13 + 2 + 3) * 1e-6)
    assert t.seconds(1, 2) == pytest.approx(0.0)  # marks on two threads: every thread's, none between
    assert t.seconds(0, 3) == pytest.approx((5 + 7 + 11 + 13 + 2 + 3) * 1e-6)
    assert t.communication == pytest.approx(100e-6)
    assert t.device_seconds == pytest.approx((5 + 7 + 11 + 13 + 5 + 17) * 1e-6)
    assert t.seconds(0, 99) == 0.0  # a mark the trace lacks reads nothing


def test_a_kernel_whose_launch_the_trace_lacks_is_nobodys() -> None:
    t = KernelTrace([mark(0, 0.0), kernel(1, 5.0), mark(1, 10.0)])
    assert t.seconds(0, 1) == 0.0 and t.device_seconds == pytest.approx(5e-6)


def test_the_clock_marks_into_a_real_profiler_and_stops_it() -> None:
    clock = KernelClock(torch.device("cpu"))  # a CPU's trace: marks and ops, no launches
    clock.begin()
    assert kernel_clock_unavailable() is not None  # one profiler at a time: another clock would not start
    clock.phase("forward")
    torch.randn(64, 64) @ torch.randn(64, 64)
    inner = clock.mark(), clock.mark()
    clock.phase("backward")
    clock.phase("")
    clock.end()
    assert kernel_clock_unavailable() is None  # nothing left running
    assert set(clock.trace.marks) == {0, 1, 2, 3, 4}  # every mark found in the trace, in order
    times = [clock.trace.marks[n][1] for n in range(5)]
    assert times == sorted(times)
    assert clock.seconds(*inner) == 0.0
    assert clock.phase_seconds() == {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0}


def test_a_dropped_trace_reads_nothing_and_marks_outside_a_session_are_numbers_only() -> None:
    clock = KernelClock(torch.device("cpu"))
    assert clock.mark() == 0 and not clock.running
    clock.begin()
    clock.mark()
    clock.end(keep=False)
    assert clock.trace.marks == {} and kernel_clock_unavailable() is None


# --- real traces of an H200 (benchmarks/module_kernels.py --record): the CPU reads what the GPU did ------

TRACES = Path(__file__).parent / "kernel_traces"
RECORDED = ("gpu_bound", "launch_bound", "checkpointed", "ddp")


def recorded(name: str) -> tuple[dict[str, Any], KernelClock, ModuleTimer]:
    """A recorded module-timing step: its state, a clock reading its trace, and a timer of the same model
    (built on the meta device from the recorded config) holding the step's marks."""
    state = json.loads((TRACES / f"{name}.state.json").read_text())
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(state["config"]))
    clock = KernelClock(torch.device("cpu"))
    clock._trace = KernelTrace.read(TRACES / f"{name}.json.gz")
    clock._phases = [(phase, mark) for phase, mark in state["phases"]]
    timer = ModuleTimer(model, clock)
    timer._fwd_spans = [tuple(span) for span in state["fwd_spans"]]
    # a node's owners (the modules open around its call); a trace recorded before they were kept holds
    # its module's name, whose owners were its name's ancestors (no recorded model shares a module)
    owners = lambda found: tuple(found) if isinstance(found, list) else (*ancestors(found), found)  # noqa: E731
    # with the calls started at its start (a trace recorded before they were kept: those at its end)
    began = lambda span: span[4] if len(span) > 4 else span[3]  # noqa: E731
    # and whether the modules never called above its owners hold it (a trace recorded before: all did)
    above = lambda span: span[5] if len(span) > 5 else True  # noqa: E731
    timer._node_spans = [(owners(s[0]), *s[1:4], began(s), above(s)) for s in state["node_spans"]]
    timer._origin = state["origin"]
    return state, clock, timer


def python_calls(name: str, thread: Any) -> list[tuple[str, float, float]]:
    """Python's module calls on ``thread`` (the profiler's own record, no hook): (class_index, begin, end)."""
    with gzip.open(TRACES / f"{name}.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    return [
        (e["name"][len("nn.Module: ") :], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "python_function"
        and str(e["name"]).startswith("nn.Module: ")
        and (e.get("pid"), e.get("tid")) == thread
    ]


@pytest.mark.parametrize("name", RECORDED)
def test_each_modules_forward_is_the_kernels_its_python_calls_launched(name: str) -> None:
    """The marks' attribution against the one Python's tracer gives (each ``nn.Module: Class_i`` call's
    span on the host, hook-free): every module's forward kernel time within 1% (0.5 us)."""
    state, clock, timer = recorded(name)
    times = timer.times()
    assert times.fwd == pytest.approx(state["times"]["fwd"], abs=1e-9)  # as the GPU computed it
    assert times.bwd == pytest.approx(state["times"]["bwd"], abs=1e-9)
    # Python numbers each class's instances in the order their first call came: the marks' call order
    order: dict[str, list[str]] = {}
    for span in sorted((s for s in state["fwd_spans"] if not s[5]), key=lambda s: s[1]):
        cls = type(timer._modules[span[0]]).__name__
        if span[0] not in order.setdefault(cls, []):
            order[cls].append(span[0])
    main = clock.trace.marks[state["phases"][0][1]][0]
    reference: dict[str, float] = {}
    for call, begin, end in python_calls(name, main):
        cls, index = call.rsplit("_", 1)
        if cls not in order:  # a wrapper the timer does not time (DDP's)
            continue
        module = order[cls][int(index)]
        reference[module] = reference.get(module, 0.0) + clock.trace.launched(begin, end, main)
    compared = [m for m in times.fwd if m in reference and m]
    assert len(compared) >= 10
    for module in compared:
        assert times.fwd[module] == pytest.approx(reference[module], rel=0.01, abs=5e-7), module
    assert times.fwd[""] == pytest.approx(reference[""], rel=0.01)


@pytest.mark.parametrize("name", RECORDED)
def test_the_backward_tree_holds_most_of_the_backward_phases_kernels_and_no_more(name: str) -> None:
    """The backward's nodes given to modules: at most the phase's kernels (what no node launched, autograd's
    own sums and DDP's bucket copies, is nobody's), at least 90% of them."""
    state, clock, timer = recorded(name)
    phase = clock.phase_seconds()
    assert phase == pytest.approx(state["phase_seconds"], abs=1e-9)
    root = timer.times().bwd[""]
    assert 0.9 * phase["backward"] <= root <= phase["backward"] + 1e-9
    # every kernel of the step launched in one of its phases (none before the forward, none after the step)
    assert sum(phase.values()) == pytest.approx(clock.trace.device_seconds, rel=1e-6)


def test_a_checkpointed_blocks_recompute_is_its_forward_run_again() -> None:
    _, _, timer = recorded("checkpointed")
    times = timer.times()
    blocks = [name for name in times.fwd if name.count(".") == 2 and name.startswith("transformer.h.")]
    assert blocks and all(times.recompute.get(b, 0.0) > 0 for b in blocks)
    forward, again = sum(times.fwd[b] for b in blocks), sum(times.recompute[b] for b in blocks)
    assert 0.8 * forward <= again <= 1.25 * forward  # the same kernels (dropout's mask kept, not redrawn)


def test_the_idle_share_follows_from_the_recorded_kernels_and_latencies() -> None:
    """On a recorded step (its host slowed by the profiler's Python tracer: every shape waits for it), the
    device's idle share of fwd + bwd is 1 - kernels / latency; the 2 x 32 model's kernels fill under 2%
    of its phases, the 8 x 1024 model's over 20%."""
    shares = {}
    for name in ("gpu_bound", "launch_bound"):
        state, clock, _ = recorded(name)
        busy, latency = clock.phase_seconds(), state["latency"]
        shares[name] = (busy["forward"] + busy["backward"]) / (latency["forward"] + latency["backward"])
    assert shares["launch_bound"] < 0.02 < 0.2 < shares["gpu_bound"]
