"""What reading the energy counter costs, against a training step (docs/energy.md, "What it costs").

* One read of each counter this machine has: RAPL on a two-socket layout (two packages, two DRAM
  domains: four ``energy_uj`` files) in a memory folder (``/dev/shm``, like sysfs), RAPL's real files where
  they are readable, and NVML's total energy where a GPU and nvidia-ml-py are there. Median of many reads.
  A real RAPL file costs a model-specific register read in the kernel on top of a memory file's read.
* A training step of a small model (an MLP, one CPU thread) with StepProfiler: the read's share of it.
  The window reads once per window step (goal: under 1% of a step).
* Reads outside the window: a StepProfiler run whose counter counts its reads; after the window only the
  throughput meter reads, once per logging interval (and around its pauses), and nothing reads with
  ``throughput=False``.

    python benchmarks/energy_cost.py [--reads 2000] [--width 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import flops_callbacks.timing.energy as energy
from flops_callbacks import StepProfiler
from flops_callbacks.timing.energy import RaplEnergy, energy_counter

RANGE_UJ = 262_143_328_850


def fake_tree(root: Path) -> Path:
    """Two packages, each with a DRAM domain, as a two-socket server's powercap folder."""
    for p in range(2):
        package = root / f"intel-rapl:{p}"
        for folder, name in ((package, f"package-{p}"), (package / f"intel-rapl:{p}:0", "dram")):
            folder.mkdir(parents=True)
            (folder / "name").write_text(f"{name}\n")
            (folder / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
            (folder / "energy_uj").write_text("123456789\n")
    return root


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Median seconds of one call, over batches of calls."""
    batches = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(max(calls // 20, 1)):
            fn()
        batches.append((time.perf_counter() - start) / max(calls // 20, 1))
    return statistics.median(batches)


def step_seconds(width: int, batch: int, steps: int = 30) -> float:
    """Median seconds of a plain training step of a 4-layer MLP (no profiler)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[5:])


def reads_in_a_run(
    root: Path, throughput: bool, steps: int = 60, log_every: int = 10
) -> tuple[int, int, int]:
    """(window steps, reads inside the window, reads after it) in a StepProfiler run on the fake tree."""
    reads = {"in": 0, "after": 0}
    original = RaplEnergy.read
    prof: StepProfiler | None = None

    def counted(self: RaplEnergy) -> float:
        reads["in" if prof is None or prof.result is None else "after"] += 1
        return original(self)

    RaplEnergy.read = counted  # type: ignore[method-assign]
    energy.POWERCAP_ROOT = root
    try:
        model = torch.nn.Linear(32, 32)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        prof = StepProfiler(
            model, profile_step=2, clean_steps=5, print_profile=False, throughput=throughput,
            log_every_n_steps=log_every, flops_audit=0,
        )  # fmt: skip
        for _ in range(steps):
            with prof.step({"x": torch.ones(4, 32)}):
                model(torch.ones(4, 32)).sum().backward()
                optimizer.step()
        prof.close()
    finally:
        RaplEnergy.read = original  # type: ignore[method-assign]
    assert prof.result is not None
    window = prof.result.published_at - 2  # from the counting step to the window's last step
    return window, reads["in"], reads["after"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        root = fake_tree(Path(folder) / "powercap")
        counter = energy.rapl_counter(root)
        assert isinstance(counter, RaplEnergy)
        rows.append(("RAPL, 2 packages + 2 DRAM, files in memory", per_call(counter.read, args.reads)))
        real = energy.rapl_counter(Path("/sys/class/powercap"))
        if isinstance(real, RaplEnergy):
            rows.append((f"RAPL, this machine's ({real.source})", per_call(real.read, args.reads)))
        else:
            print(f"this machine's RAPL: {real}")
        if torch.cuda.is_available():
            gpu = energy_counter(torch.device("cuda", 0))
            if isinstance(gpu, str):
                print(f"this machine's GPU: {gpu}")
            else:
                rows.append((f"GPU 0, {gpu.source}", per_call(gpu.read, args.reads)))
        step = step_seconds(args.width, args.batch)
        print(
            f"a training step: 4 x Linear({args.width}), batch {args.batch}, 1 thread: {1e3 * step:.2f} ms\n"
        )
        print("| counter | one read | share of the step |")
        print("| --- | --- | --- |")
        for name, seconds in rows:
            print(f"| {name} | {1e6 * seconds:.1f} us | {100 * seconds / step:.3f}% |")
        print()
        for throughput in (False, True):
            window, inside, after = reads_in_a_run(root, throughput)
            what = f"{window} window steps, {inside} reads in the window, {after} after it"
            print(f"throughput={throughput}: {what} (60 steps, throughput logged every 10)")


if __name__ == "__main__":
    main()
