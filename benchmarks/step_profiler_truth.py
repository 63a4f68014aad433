"""StepProfiler's window against the loop's own clock: a plain, a Fabric and an accelerate loop, written
as the README shows, and a plain loop that computes the loss itself from the logits (``F.cross_entropy``:
its forward is the forward's, its backward the backward's), each also marking ``time.perf_counter()``
where the phases are defined to start and end: before the forward (the block's first line), before the
backward call (``loss.backward()`` / ``fabric.backward(loss)`` / ``accelerator.backward(loss)``), before
``optimizer.step()``, and after ``zero_grad`` (the block's last line).

The four loops run side by side in one process, one step of each in turn, so a load that comes and goes
on a shared machine falls on all of them alike. Two comparisons per loop, each window figure divided by the
loop's own:

* **outside**: the medians of the loop's marks on the steps the window does not touch (from step 2 on),
  samples/s as their samples over their summed iter time. Goal: fwd / bwd / step within [0.85, 1.15],
  iter and samples/s within [0.9, 1.1].
* **same steps**: the loop's marks on the window's own clean steps (their median): where the phase
  boundaries fall, with no drift of the machine's load between the window and the other steps. Goal
  for the loss outside the model: fwd and bwd within [0.95, 1.05]. In the plain loop the window's backward
  starts about 0.25 ms after the loop's mark (at autograd's first node, after ``loss.backward()``'s own
  Python) and its step about 0.15 ms after it (at torch's optimizer pre-hook).

Model: GPT-2 4 x 128 (vocabulary 8192, so that AdamW's step takes milliseconds), seq 128, AdamW, CPU,
one torch thread. With ``--device cuda`` the loops run on the GPU and their marks are CUDA events.

    python benchmarks/step_profiler_truth.py [--steps 45] [--profile-step 5] [--batch-size 4] [--loops ...]
    python benchmarks/step_profiler_truth.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names

VOCAB, CONTEXT = 8192, 128
OWN_LOSS = "plain, own loss"
DOORS = ("plain", OWN_LOSS, "fabric", "accelerate")
KEYS = (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY, names.ITER_LATENCY)

# one step's marks: (fwd, bwd, step, iter) seconds
Marks = tuple[float, float, float, float]


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=128, n_layer=4, n_head=4)
    return GPT2LMHeadModel(config)


class Clock:
    """The loop's own marks: ``perf_counter`` on a CPU, CUDA events on a GPU (read at the loop's end)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a


def loop(
    door: str, steps: int, profile_step: int, batch_size: int, root: str, out: dict, device: str
) -> Iterator[None]:
    """One loop, a step per ``next``; at its end ``out`` holds the profiler and the loop's marks by step."""
    model: Any = gpt2().to(device)
    clock = Clock(device)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=3e-4)
    extra: dict[str, Any] = {}
    fabric: Any = None
    accelerator: Any = None
    if door == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator=device, devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        extra = {"fabric": fabric}
    elif door == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device == "cpu", project_dir=root)
        model, optimizer = accelerator.prepare(model, optimizer)
        extra = {"accelerator": accelerator}
    prof = StepProfiler(model, profile_step=profile_step, print_profile=False, **extra)
    generator = torch.Generator().manual_seed(0)
    stamps: dict[int, tuple[Any, Any, Any, Any]] = {}
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator).to(device)
        batch = {"input_ids": ids, "labels": ids}
        with prof.step(batch):
            t0 = clock.mark()
            if door == OWN_LOSS:
                logits = model(input_ids=ids).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            else:
                loss = model(**batch).loss
            t1 = clock.mark()
            if fabric is not None:
                fabric.backward(loss)
            elif accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            t2 = clock.mark()
            optimizer.step()
            optimizer.zero_grad()
            t3 = clock.mark()
        stamps[step] = (t0, t1, t2, t3)
        yield
    prof.close()
    if clock.cuda:
        torch.cuda.synchronize()
    marks: dict[int, Marks] = {
        step: (clock.seconds(a, b), clock.seconds(b, c), clock.seconds(c, d), clock.seconds(a, d))
        for step, (a, b, c, d) in stamps.items()
    }
    out.update(prof=prof, marks=marks)


def medians(marks: list[Marks]) -> list[float]:
    return [statistics.median(m[i] for m in marks) for i in range(4)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--profile-step", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--loops", nargs="+", choices=DOORS, default=DOORS, help="which loops to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    runs: dict[str, dict] = {door: {} for door in args.loops}
    with tempfile.TemporaryDirectory() as root:
        sizes = (args.steps, args.profile_step, args.batch_size, root)
        loops = [loop(d, *sizes, runs[d], args.device) for d in args.loops]
        for _ in range(args.steps + 1):  # one step of each loop in turn; the last next() closes them
            for each in loops:
                next(each, None)
    print("| loop | fwd | bwd | step | iter | samples/s | same steps: fwd | bwd | step | iter "
          "| window fwd / bwd / step ms | clean steps |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for door in args.loops:
        prof, marks = runs[door]["prof"], runs[door]["marks"]
        metrics, result = prof.metrics, prof.result
        assert metrics is not None and result is not None, f"{door}: no window"
        window = range(result.steps.counting, result.published_at + 1)
        outside = [m for s, m in marks.items() if s not in window and s >= 2]
        same = [marks[s] for s in result.steps.clean]
        reported = [metrics[key] for key in KEYS]
        rate = args.batch_size * len(outside) / sum(m[3] for m in outside)
        ratios = [r / t for r, t in zip(reported, medians(outside), strict=True)]
        ratios.append(metrics[names.SAMPLES_PER_SEC] / rate)
        ratios += [r / t for r, t in zip(reported, medians(same), strict=True)]
        cells = " | ".join(f"{r:.3f}" for r in ratios)
        ms = " / ".join(f"{1e3 * r:.1f}" for r in reported[:3])
        print(f"| {door} | {cells} | {ms} | {len(result.steps.clean)} |")


if __name__ == "__main__":
    main()
