"""The communication step's recorder on a real step in this process: torch.profiler started and stopped,
the phases found by their marks, a collective found by its launch (a one-rank gloo group on the CPU; an
NCCL one on a GPU, skipped without one)."""

from __future__ import annotations

import gc
import tempfile
from typing import Any

import pytest
import torch

from flops_callbacks.communication.recorder import CommRecorder
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP


def one_rank_group(backend: str) -> None:
    with tempfile.NamedTemporaryFile() as f:
        torch.distributed.init_process_group(backend, init_method=f"file://{f.name}", rank=0, world_size=1)


def recorded_step(device: str) -> CommRecorder:
    """One step of a small model whose gradients are all-reduced by hand, recorded with its phases."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64, device=device)
    recorder = CommRecorder(cuda=device == "cuda")
    recorder.start()
    try:
        recorder.mark(FORWARD)
        loss = model(x).square().mean()
        recorder.mark(BACKWARD)
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
        torch.distributed.all_reduce(flat)
        recorder.mark(OPTIMIZER_STEP)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        recorder.mark("")
    finally:
        recorder.stop()
    assert not torch.autograd._profiler_enabled()  # nothing of the profiler is left running
    return recorder


def test_a_cpu_step_is_split_by_its_marks_and_its_all_reduce_found() -> None:
    one_rank_group("gloo")
    try:
        split = recorded_step("cpu").breakdown()
    finally:
        torch.distributed.destroy_process_group()
    assert split is not None and not split.device
    assert set(split.phases) == {FORWARD, BACKWARD, OPTIMIZER_STEP}
    assert split.step.compute > 0 and split.step.span >= split.step.compute
    (row,) = split.collectives
    params = 2 * (64 * 64 + 64)
    assert (row.op, row.calls, row.nbytes) == ("all_reduce", 1, params * 4)
    assert split.phases[BACKWARD].comm > 0 and split.phases[FORWARD].comm == 0


def test_a_cpu_recorder_reads_the_threads_wait_into_each_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([0.25, 0.5, 1.0, 2.0])  # seconds, as schedstat would count them
    monkeypatch.setattr("flops_callbacks.communication.recorder.core_wait", lambda: next(readings))
    one_rank_group("gloo")
    try:
        recorder = recorded_step("cpu")
    finally:
        torch.distributed.destroy_process_group()
    assert recorder.events is not None
    assert [phase for phase, _ in recorder.events.marks] == [FORWARD, BACKWARD, OPTIMIZER_STEP, ""]
    assert recorder.events.waits == (0.25, 0.5, 1.0, 2.0)
    split = recorder.breakdown()
    # the all-reduce ran alone (the thread waited on it): nothing overlapped, so nothing moves
    assert split is not None and split.step.core_wait == 0.0


def test_a_gpu_recorder_puts_no_wait_for_a_core_in_its_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    from flops_callbacks.communication import events as comm_events

    waited: list[float | None] = []

    def name(phase: str, read: float | None = None) -> str:
        waited.append(read)
        return comm_events.mark_name(phase, read)

    monkeypatch.setattr("flops_callbacks.communication.recorder.mark_name", name)
    recorder = CommRecorder(cuda=True)  # its marks only: a CUDA profiler is not started without a GPU
    recorder.running = True
    try:
        recorder.mark(FORWARD)
    finally:
        recorder.running = False
    assert waited == [None]  # a GPU's timeline: the host thread's wait for a core is not the step's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: NCCL kernels on a GPU's timeline")
def test_a_gpu_step_reads_the_kernels_timeline_and_the_nccl_all_reduce() -> None:
    one_rank_group("nccl")
    try:
        split = recorded_step("cuda").breakdown()
    finally:
        torch.distributed.destroy_process_group()
    assert split is not None and split.device
    assert split.step.compute > 0
    ops = {row.op for row in split.collectives}
    assert ops <= {"all_reduce"}  # NCCL may run a one-rank all-reduce as a copy: no kernel of its own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: DDP's copies as kernels")
def test_ddp_copies_on_a_gpu_are_communication_by_the_ops_that_launched_them() -> None:
    """DDP's bucket copies are kernels on the compute stream. torch's own pairing of kernels with the
    ops that launched them (``FunctionEvent.kernels``) says which ran under a staging range; the classed
    compute is every other kernel that is not NCCL's (one stream here: no two compute kernels overlap)."""
    from torch.nn.parallel import DistributedDataParallel

    from flops_callbacks.communication.events import STAGING, classify, collective_op, trace_events
    from flops_callbacks.communication.intervals import subtract, total

    one_rank_group("nccl")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        ddp = DistributedDataParallel(model.cuda(), device_ids=[0])
        x = torch.randn(32, 256, device="cuda")
        ddp(x).square().mean().backward()  # the first step builds the buckets
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            ddp(x).square().mean().backward()
            torch.cuda.synchronize()
        events = classify(trace_events(prof.profiler.kineto_results))
    finally:
        torch.distributed.destroy_process_group()

    def under(op: Any) -> list[float]:
        """The microseconds of each kernel torch pairs with ``op`` or an op inside it."""
        return [k.duration for k in op.kernels] + [us for child in op.cpu_children for us in under(child)]

    staged = [us for op in prof.events() if op.name in STAGING for us in under(op)]
    assert staged, "DDP ran no staging copy on the GPU"
    kernels = [e for e in trace_events(prof.profiler.kineto_results) if e.device and not e.annotation]
    others = sum(k.end - k.start for k in kernels if collective_op(k.name) is None)
    assert events.device
    # as many kernels left out of compute as torch pairs with staging ranges, and their time: the trace's
    # kernel times come in steps of 0.25 us (an H100's), the paired kernels' to the nanosecond
    apart = [k for k in kernels if collective_op(k.name) is None and subtract([k.interval], events.compute)]
    assert len(apart) == len(staged)
    assert total(events.compute) == pytest.approx(others - sum(staged), abs=0.25 * len(staged))
    assert total(events.comm) >= max(staged)


def test_a_trace_that_cannot_be_read_is_said_and_the_step_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(events: object) -> None:
        raise KeyError("a field this torch does not have")

    monkeypatch.setattr("flops_callbacks.communication.recorder.classify", broken)
    recorder = CommRecorder(cuda=False)
    recorder.start()
    recorder.mark(FORWARD)
    torch.ones(3).sum()
    with pytest.warns(UserWarning, match="a communication step's trace could not be read"):
        recorder.stop()
    assert recorder.breakdown() is None and not torch.autograd._profiler_enabled()


def test_the_instruments_drop_stops_a_running_recorder() -> None:
    from flops_callbacks.options import Options
    from flops_callbacks.session.instruments import Instruments
    from flops_callbacks.session.window_plan import Kind
    from flops_callbacks.session.window_steps import WindowStep
    from flops_callbacks.timing.clock import CpuClock
    from flops_callbacks.timing.phases import StepPhases

    instruments = Instruments(Options())
    step = WindowStep(Kind.COMMUNICATION, 5, StepPhases(CpuClock()))
    instruments.for_step(step, torch.nn.Linear(4, 4), None)  # the communication step started
    assert torch.autograd._profiler_enabled() and not gc.isenabled()
    instruments.drop()  # an exception, a dropped window, the run's end
    assert instruments.recorder is None and not torch.autograd._profiler_enabled() and gc.isenabled()


def test_a_start_that_fails_part_way_is_stopped_and_a_stop_that_fails_warns() -> None:
    recorder = CommRecorder(cuda=False)
    real = recorder._profiler

    class HalfStarted:
        def start(self) -> None:
            real.start()
            raise RuntimeError("kineto started, then failed")

        def stop(self) -> None:
            real.stop()

    recorder._profiler = HalfStarted()
    with pytest.raises(RuntimeError, match="then failed"):
        recorder.start()
    assert torch.autograd._profiler_enabled() and not gc.isenabled()
    recorder.stop(keep=False)  # what the instruments' drop does on that exit path
    assert not torch.autograd._profiler_enabled() and gc.isenabled()  # the collector on again

    class Unstoppable:
        def start(self) -> None:
            pass

        def stop(self) -> None:
            raise RuntimeError("no such profiler")

    broken = CommRecorder(cuda=False)
    broken._profiler = Unstoppable()
    broken.start()
    with pytest.warns(UserWarning, match=r"could not be stopped .*RuntimeError: no such profiler"):
        broken.stop()
    assert broken.breakdown() is None and not broken.running and gc.isenabled()
    broken.stop()  # never tried twice
    gc.disable()  # a user who runs with the collector off keeps it off
    try:
        off = CommRecorder(cuda=False)
        off.start()
        off.stop()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_three_communication_steps_each_get_a_split_and_the_profiler_stops_after_each() -> None:
    from flops_callbacks.options import Options
    from flops_callbacks.session.instruments import Instruments
    from flops_callbacks.session.window_plan import COMM_MIN, Kind
    from flops_callbacks.session.window_steps import WindowStep
    from flops_callbacks.timing.clock import CpuClock
    from flops_callbacks.timing.phases import StepPhases

    instruments = Instruments(Options())
    model = torch.nn.Linear(4, 4)
    steps = [WindowStep(Kind.COMMUNICATION, 5 + i, StepPhases(CpuClock())) for i in range(COMM_MIN)]
    enabled = gc.isenabled()
    for step in steps:
        instruments.for_step(step, model, None)  # each step its own profiler, from the step's start
        recorder = instruments.recorder
        assert recorder is not None and recorder.running and torch.autograd._profiler_enabled()
        assert not gc.isenabled()  # no collection pauses a rank in the recorded step
        recorder.mark(FORWARD)
        torch.ones(64, 64).matmul(torch.ones(64, 64))
        recorder.mark("")
        instruments.step_ended(step)
        assert instruments.recorder is None and not torch.autograd._profiler_enabled()
        assert gc.isenabled() == enabled
    assert all(s.comm is not None and s.comm.step.compute > 0 for s in steps)
