"""What collecting the counting step's garbage costs the steps after it: a full collection against one of
the young generations (what the session does: ``flops_callbacks/timing/collector.py``), side by side.

A plain training loop of the Lightning example's GPT (batch 8 x 128 tokens): in each cycle, 6 steps, one
step counted by the real counting engine, the collection, then 4 steps whose forwards are timed against the
median of the cycle's first 6. The first step after the collection is the one that times the modules in a
profile window. Each cell: the median over ``--cycles`` cycles of that ratio; and how long the collection
took. Variants alternate cycle by cycle, so a busy machine weighs on each alike.

    python benchmarks/collection_cost.py [--cycles 12]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "lightning"))

import train  # noqa: E402  (the Lightning example's model)

from flops_callbacks.counting.engine import CountingEngine  # noqa: E402

VARIANTS = {"none": None, "full (generation 2)": 2, "young (generation 1)": 1}
AFTER = 4  # steps timed after the collection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = train.GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, train.VOCAB, (8, train.CONTEXT))
    y = torch.randint(0, train.VOCAB, (8, train.CONTEXT))

    def step(tracer: CountingEngine | None = None) -> float:
        """One training step; the seconds of its forward."""
        if tracer is not None:
            tracer.start()
        begin = time.perf_counter()
        logits = model(x)
        seconds = time.perf_counter() - begin
        F.cross_entropy(logits.view(-1, train.VOCAB), y.reshape(-1)).backward()
        if tracer is not None:
            tracer.stop()
        optimizer.step()
        optimizer.zero_grad()
        return seconds

    for _ in range(10):
        step()
    ratios: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    pauses: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.cycles):
        for name, generation in VARIANTS.items():
            before = statistics.median(step() for _ in range(6))
            tracer = CountingEngine(model)
            step(tracer)
            tracer.profile()
            del tracer
            begin = time.perf_counter()
            if generation is not None:
                gc.collect(generation)
            pauses[name].append(time.perf_counter() - begin)
            ratios[name].append([step() / before for _ in range(AFTER)])
    print(
        f"Forward after a counted step and a collection / the 6 before it; median of {args.cycles} cycles, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n"
    )
    print("| collection | its duration | " + " | ".join(f"step +{i + 1}" for i in range(AFTER)) + " |")
    print("|---|---:|" + "---:|" * AFTER)
    for name in VARIANTS:
        cells = [f"{statistics.median(r[i] for r in ratios[name]):.2f}" for i in range(AFTER)]
        print(f"| {name} | {statistics.median(pauses[name]) * 1e3:.1f} ms | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
