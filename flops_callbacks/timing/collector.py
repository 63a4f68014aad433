"""The garbage collector around timed work: what a counting step or pass left is collected before modules
are timed, outside every clock, and no collection runs while they are timed (a pause would land in
whichever module was running: 283 ms were seen in one module of an 18-ms forward)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["COLLECTED", "collect_counting_garbage", "collector_off"]

# The generations collected: the young ones, which hold a counting step's garbage. Not a full collection:
# on the Lightning example's heap one took 185-243 ms to find 40 objects, and the step after it ran its
# forward 1.14-1.33x slower (benchmarks/collection_cost.py: caches and free lists emptied), the very step
# that times the modules; a generation-1 collection costs neither.
COLLECTED = 1


def collect_counting_garbage() -> None:
    """Collect what a counting step or pass left (the young generations)."""
    gc.collect(COLLECTED)


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No collection inside; the collector as it was after (a user who turned it off keeps it off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
