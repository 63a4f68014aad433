"""StepProfiler's joules per step against the device's counter read by the loop itself around the same
clean steps: the truth check of docs/energy.md.

A plain training loop (an MLP; bf16 on a GPU) runs under ``StepProfiler``. As the last line of each
step's block, the loop synchronizes the device and reads the counter through a counter of its own (on a
GPU, NVML's total energy; on a CPU, RAPL), just before the profiler's own read at the block's end. Over
the window's clean steps, each step taken from the end of the step before it, it prints:

* joules per step from the profiler (``flops_profiler/energy_per_step``) beside the loop's, and their
  ratio (goal: within [0.95, 1.05]);
* the profiler's mean power (``flops_profiler/power``) beside the device's power limits (goal: above 0,
  at most the enforced limit; NVML only);
* the clean steps' seconds against the counter's resolution: the bound on both figures' error.

Exit status 0 when the goals hold, 1 when one does not, and 2 when the device has no counter to read (the
line says why: no GPU, nvidia-ml-py missing, no RAPL files or root-only ones). On a fake RAPL tree that a
thread advances at 30 W, the CPU path meets the goal (``tests/test_benchmarks.py``).

    python benchmarks/energy_truth.py --device cuda [--width 8192 --layers 4 --batch 32768 --clean 60]
    python benchmarks/energy_truth.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.timing.energy import NvmlEnergy, energy_counter
from flops_callbacks.timing.energy_figures import Reading, read

GOAL = (0.95, 1.05)


def power_limits(device: torch.device) -> tuple[float, float] | None:
    """The GPU's power limit constraints and enforced limit, watts: (min, enforced); None off NVML."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index or 0
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
        except pynvml.NVMLError:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        low, _ = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        return low / 1000, pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
    except Exception as error:  # a benchmark: say it and go on
        print(f"power limits not read ({type(error).__name__}: {error})")
        return None


def model_for(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The loop under StepProfiler; the profiler's result and the loop's reads, by step."""
    device = torch.device(args.device)
    hand = energy_counter(device)
    if isinstance(hand, str):
        return {"no_counter": hand}
    model = model_for(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device, dtype=next(model.parameters()).dtype)
    prof = StepProfiler(model, profile_step=args.profile_step, clean_steps=args.clean, print_profile=False)
    hand.start()
    ends: dict[int, Reading] = {}
    started = time.perf_counter()
    try:
        for _ in range(args.steps):
            with prof.step({"x": x}):
                model(x).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                ends[prof.global_step] = read(hand)
            if prof.result is not None:  # the window ended: its clean steps' reads are in
                break
    finally:
        prof.close()
        hand.stop()
    return {"result": prof.result, "ends": ends, "counter": hand, "seconds": time.perf_counter() - started}


def report(args: argparse.Namespace, found: dict[str, Any]) -> int:
    if "no_counter" in found:
        print(f"energy_truth: {found['no_counter']}")
        return 2
    result, ends, counter = found["result"], found["ends"], found["counter"]
    if result is None:
        print("energy_truth: the window did not end (raise --steps)")
        return 1
    metrics = result.metrics()
    if names.ENERGY_PER_STEP not in metrics:
        print(f"energy_truth: the profiler has no energy figure: {result.no_energy_reason}")
        return 1
    clean = result.steps.clean
    joules = sum(ends[n].joules - ends[n - 1].joules for n in clean)
    seconds = sum(ends[n].at - ends[n - 1].at for n in clean)
    loop = joules / len(clean)
    profiler = metrics[names.ENERGY_PER_STEP]
    ratio = profiler / loop if loop > 0 else float("nan")
    (span,) = result.energy
    power = metrics[names.POWER]
    limits = power_limits(torch.device(args.device))
    print(f"device: {args.device}, counter: {counter.source} ({counter.scope}), every {counter.resolution} s")
    print(f"model: {args.layers} x Linear({args.width}), batch {args.batch}; run {found['seconds']:.1f} s")
    runs = f"{span.seconds:.3f} s in {span.brackets} run(s)"
    print(f"clean steps: {len(clean)} ({clean[0]}-{clean[-1]}), {runs}: error bound {100 * span.error:.1f}%")
    print("| figure | profiler | loop's own read | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| joules per step | {profiler:.4g} | {loop:.4g} | {ratio:.4f} |")
    print(f"| mean power (W) | {power:.4g} | {joules / seconds:.4g} | {power / (joules / seconds):.4f} |")
    ok = GOAL[0] <= ratio <= GOAL[1]
    if limits is not None:
        low, enforced = limits
        within = 0 < power <= enforced * 1.02  # NVML's limit holds over its averaging window, not every read
        print(f"power limits: min {low:.0f} W, enforced {enforced:.0f} W; mean power {power:.0f} W: "
              f"{'within' if within else 'OUTSIDE'}")  # fmt: skip
        ok = ok and within
    print(f"goal: ratio within {GOAL}: {'met' if GOAL[0] <= ratio <= GOAL[1] else 'MISSED'}")
    if isinstance(counter, NvmlEnergy) and not span.long_enough:
        print("note: the clean steps span under 20 of NVML's resolutions: raise --clean or --batch")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="default: 8192 on a GPU, 256 on a CPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="default: 32768 on a GPU, 64 on a CPU")
    parser.add_argument("--clean", type=int, default=60, help="clean steps of the window (an H200: 5 s)")
    parser.add_argument("--profile-step", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120, help="the most steps the loop runs")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.width = args.width or (8192 if gpu else 256)
    args.batch = args.batch or (32768 if gpu else 64)  # a GPU step of ~100 ms: 20 of them span 2 s
    if gpu and not torch.cuda.is_available():
        print("energy_truth: --device cuda, but torch sees no CUDA device")
        return 2
    return report(args, run(args))


if __name__ == "__main__":
    sys.exit(main())
