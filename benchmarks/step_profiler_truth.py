"""StepProfiler's window against the loop's own clock: a plain, a Fabric and an accelerate loop, written
as the README shows, each also marking ``time.perf_counter()`` before the forward, the backward, the
optimizer step and after ``zero_grad``. The window's median fwd / bwd / step latency, iter latency and
samples/s are divided by the medians of the loop's marks on the steps outside the window. Goal: fwd /
bwd / step within [0.85, 1.15], iter and samples/s within [0.9, 1.1]. Model: a tiny GPT-2 from a
config (examples/plain/train.py), CPU.

    python benchmarks/step_profiler_truth.py [--steps 30] [--profile-step 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "plain"))
from train import synthetic_batches, tiny_gpt2  # noqa: E402

from flops_callbacks import StepProfiler  # noqa: E402
from flops_callbacks import metrics as names  # noqa: E402


def loop(
    door: str, steps: int, profile_step: int, batch_size: int, root: str
) -> tuple[dict[str, float], list]:
    """One run; the window's metrics and the loop's own marks per step (global step, 4 marks)."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=3e-4)
    backward: Any = lambda loss: loss.backward()  # noqa: E731
    extra: dict[str, Any] = {}
    if door == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        backward, extra = fabric.backward, {"fabric": fabric}
    elif door == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, project_dir=root)
        model, optimizer = accelerator.prepare(model, optimizer)
        backward, extra = accelerator.backward, {"accelerator": accelerator}
    prof = StepProfiler(model, profile_step=profile_step, print_profile=False, **extra)
    marks = []
    for step, batch in enumerate(synthetic_batches(steps, batch_size)):
        with prof.step(batch):
            t0 = time.perf_counter()
            loss = model(**batch).loss
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            t3 = time.perf_counter()
        marks.append((step, t0, t1, t2, t3))
    prof.close()
    assert prof.metrics is not None and prof.result is not None
    window = {prof.result.step, *range(prof.result.step, prof.result.published_at + 1)}
    return prof.metrics, [m for m in marks if m[0] not in window and m[0] >= 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-step", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| loop | fwd | bwd | step | iter | samples/s | window iter ms | loop iter ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for door in ("plain", "fabric", "accelerate"):
        import tempfile

        with tempfile.TemporaryDirectory() as root:
            metrics, marks = loop(door, args.steps, args.profile_step, args.batch_size, root)
        fwd = statistics.median(m[2] - m[1] for m in marks)  # t1 - t0
        bwd = statistics.median(m[3] - m[2] for m in marks)
        step = statistics.median(m[4] - m[3] for m in marks)
        iters = statistics.median(m[4] - m[1] for m in marks)
        ratios = [
            metrics[names.FWD_LATENCY] / fwd,
            metrics[names.BWD_LATENCY] / bwd,
            metrics[names.STEP_LATENCY] / step,
            metrics[names.ITER_LATENCY] / iters,
            metrics[names.SAMPLES_PER_SEC] / (args.batch_size / iters),
        ]
        cells = " | ".join(f"{r:.3f}" for r in ratios)
        print(f"| {door} | {cells} | {1e3 * metrics[names.ITER_LATENCY]:.1f} | {1e3 * iters:.1f} |")


if __name__ == "__main__":
    main()
