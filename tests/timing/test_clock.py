"""Clocks: CPU wall time, CUDA events (GPU only)."""

import pytest
import torch

from flops_callbacks.timing.clock import CpuClock, CudaClock, NullClock, SyncClock, clock_for


def test_clock_for_picks_the_device_clock() -> None:
    assert isinstance(clock_for("cpu"), CpuClock)
    assert isinstance(clock_for("meta"), NullClock)
    assert isinstance(clock_for("cuda:0"), CudaClock)
    assert isinstance(clock_for("xpu"), SyncClock)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_queued_work_without_blocking() -> None:
    clock = CudaClock(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = clock.mark()
    for _ in range(10):
        a = a @ a / 64
    end = clock.mark()
    seconds = clock.seconds(start, end)  # waits for the queued matmuls
    assert end.query()
    assert 0 < seconds < 10


HOST_CLOCKS = [CpuClock(), NullClock(), SyncClock(torch.device("cpu"))]


@pytest.mark.parametrize("clock", HOST_CLOCKS, ids=lambda c: type(c).__name__)
def test_a_host_clocks_marks_are_done_when_taken(clock: object) -> None:
    assert clock.done(clock.mark())  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_mark_behind_queued_work_is_not_done_until_the_device_reaches_it() -> None:
    clock = CudaClock(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # about 0.1 s of the GPU's cycles, queued
    mark = clock.mark()
    assert not clock.done(mark)  # the host did not wait for it
    torch.cuda.synchronize()
    assert clock.done(mark)
