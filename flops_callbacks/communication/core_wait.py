"""How long this thread has waited for a core: Linux's run delay (``/proc/thread-self/schedstat``).

On a CPU an op's profiler interval holds the time its thread was ready but not running, and where
gloo's threads hold the cores (a rank per core, as a 2-core machine runs two ranks) that wait is the
communication's: compute did not run then. The profiler cannot see it; the scheduler counts it, to
the nanosecond at each switch (its second field; the first, time on a core, lags by up to a tick).
Why not ``time.thread_time``: it gives time on a core, not time waiting for one, and lags the same way.
"""

from __future__ import annotations

__all__ = ["core_wait"]

_PATH = "/proc/thread-self/schedstat"


def core_wait() -> float | None:
    """Seconds this thread has waited for a core since it started (None: no schedstat here, or a kernel
    that keeps none: its line reads all zeros, though this thread has run)."""
    try:
        with open(_PATH) as file:
            on_core, waited = (int(field) for field in file.read().split()[:2])
    except (OSError, ValueError):
        return None
    return waited / 1e9 if on_core > 0 else None
