"""Clocks: CPU wall time, CUDA events (GPU only), and contiguous phases."""

import time

import pytest
import torch

from flops_callbacks.clock import CpuClock, CudaClock, NullClock, PhaseTimer, SyncClock, clock_for


def test_clock_for_picks_the_device_clock() -> None:
    assert isinstance(clock_for("cpu"), CpuClock)
    assert isinstance(clock_for("meta"), NullClock)
    assert isinstance(clock_for("cuda:0"), CudaClock)
    assert isinstance(clock_for("xpu"), SyncClock)


def test_phase_timer_switches_on_one_mark_so_phases_add_up() -> None:
    timer = PhaseTimer(CpuClock())
    start = time.perf_counter()
    timer.start("a")
    time.sleep(0.01)
    timer.switch("a", "b")
    time.sleep(0.02)
    timer.switch("b", "a")  # a phase that runs twice sums its spans
    time.sleep(0.01)
    timer.stop("a")
    wall = time.perf_counter() - start
    assert timer.seconds("a") >= 0.02 and timer.seconds("b") >= 0.02
    assert timer.seconds("a") + timer.seconds("b") <= wall
    assert timer.seconds("never") == 0.0
    assert timer.stop("never") is None


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
