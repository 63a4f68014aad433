"""The thread's wait for a core, read from Linux's schedstat: a thread that shares its core with three
busy processes waits for it about three quarters of the time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flops_callbacks.communication.core_wait import core_wait

# a bare interpreter pinned to one core: says so, then spins (no test module to import: a loaded
# machine starts it in a moment)
SPIN = "import os; os.sched_setaffinity(0, {%d}); print(flush=True)\nwhile True: pass"


@pytest.mark.skipif(not sys.platform.startswith("linux") or core_wait() is None, reason="Linux schedstat")
def test_a_thread_sharing_its_core_with_three_busy_processes_waits_most_of_the_time() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN % core], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        for p in spinners:  # each pinned to the core and about to spin
            assert p.stdout is not None and p.stdout.readline() == "\n"
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
            p.wait()
    assert waited is not None and after is not None
    # a fair scheduler runs each of four on the core a quarter of the time: 0.75 s of the second waiting
    assert 0.5 * elapsed < after - waited < elapsed
    later = core_wait()
    assert later is not None and later >= after  # a running count, never falling
