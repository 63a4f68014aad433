"""The thread's wait for a core, read from Linux's schedstat: a thread that shares its core with three
busy processes waits for it about three quarters of the time."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any

import pytest

from flops_callbacks.timing.core_wait import core_wait


def _spin(core: int, ready: Any, seconds: float) -> None:
    os.sched_setaffinity(0, {core})
    ready.put(os.getpid())
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux") or core_wait() is None, reason="Linux schedstat")
def test_a_thread_sharing_its_core_with_three_busy_processes_waits_most_of_the_time() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Queue()
    spinners = [spawn.Process(target=_spin, args=(core, ready, 60.0)) for _ in range(3)]
    for p in spinners:
        p.start()
    try:
        for _ in spinners:  # each pinned to the core and spinning (a loaded machine starts them slowly)
            ready.get(timeout=60)
        os.sched_setaffinity(0, {core})
        waited, start = core_wait(), time.perf_counter()
        end = start + 1.0
        while time.perf_counter() < end:  # busy: ready to run all the time, one of four on the core
            pass
        elapsed, after = time.perf_counter() - start, core_wait()
    finally:
        os.sched_setaffinity(0, before)
        for p in spinners:
            p.kill()
            p.join()
    assert waited is not None and after is not None
    # a fair scheduler runs each of four on the core a quarter of the time: 0.75 s of the second waiting
    assert 0.5 * elapsed < after - waited < elapsed
    later = core_wait()
    assert later is not None and later >= after  # a running count, never falling
