"""What a fresh process's first profile times that its second does not: on an H100 (torch 2.11) the first
``FlopsProfiler`` profile of a 0.1 s forward reads 0.130 s against the second's 0.104; on a CPU they
agree (tests/integrations/test_deepspeed_api.py allows 1.1x).

Run in a fresh process, per profile: the timed duration, modules first imported inside the timed
forward, whether CUDA was initialized by then, and with ``--calls`` the slowest calls made inside the
forward into torch code outside the model's hot path (a ``sys.setprofile`` hook: their times inflated
alike in both profiles).

    python benchmarks/first_profile.py [--calls]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.sleepy: the test's own model

from flops_callbacks import FlopsProfiler  # noqa: E402
from tests.sleepy import Sleepy  # noqa: E402

SKIPPED = (
    "torch/nn/modules/",
    "flops_callbacks/",
    "tests/sleepy",
    "torch/_tensor",
    "torch/autograd/function",
)


def calls_inside(run: Callable[[], object]) -> list[tuple[float, str]]:
    """The 8 slowest Python calls under ``run()`` into torch, skipping the model's and our own hot path."""
    starts: dict[int, tuple[float, str]] = {}
    spent: list[tuple[float, str]] = []

    def hook(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if "torch" not in code.co_filename or any(s in code.co_filename for s in SKIPPED):
            return
        if event == "call":
            starts[id(frame)] = (
                time.perf_counter(),
                f"{code.co_filename.split('site-packages/')[-1]}:{code.co_name}",
            )
        elif event == "return" and id(frame) in starts:
            start, name = starts.pop(id(frame))
            spent.append((time.perf_counter() - start, name))

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(spent, reverse=True)[:8]


def main() -> None:
    watch = "--calls" in sys.argv  # the slowest calls inside each forward (their times inflated alike)
    model, x = Sleepy(fwd=0.1, bwd=0.0), torch.randn(2, 4)
    for i in range(2):
        prof = FlopsProfiler(model)
        prof.start_profile()
        before, cuda_before = set(sys.modules), torch.cuda.is_initialized()
        with torch.no_grad():
            slowest = calls_inside(lambda: model(x)) if watch else model(x)
        imported, cuda_after = sorted(set(sys.modules) - before), torch.cuda.is_initialized()
        prof.stop_profile()
        seconds = prof.get_total_duration()
        prof.end_profile()
        print(f"profile {i + 1}: {seconds * 1e3:.1f} ms; CUDA initialized {cuda_before} -> {cuda_after}; "
              f"imported in the forward: {imported[:12] or 'nothing'}")  # fmt: skip
        if watch:
            print("  slowest torch calls:", [(f"{t * 1e3:.2f} ms", name) for t, name in slowest])


if __name__ == "__main__":
    main()
