"""StepProfiler's cost outside its window against the Lightning callback's: the same tiny GPT-2 (a
config, examples/plain/train.py) in a plain loop without a profiler, with StepProfiler whose window
has ended (the meter runs: its work per micro-batch and its optimizer step hook), and the callback
session's own events driven as the Lightning callback drives them after its window. Goal: StepProfiler
/ callback <= 1.01 (both do the same session work; StepProfiler adds one global hook per block).
Rounds alternate the order; each cell is the median over rounds of the median step time.

    python benchmarks/step_profiler_overhead.py [--rounds 5] [--steps 20]
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
from common import window_steps  # noqa: E402  (beside this script)
from train import synthetic_batches, tiny_gpt2  # noqa: E402

from flops_callbacks import StepProfiler  # noqa: E402
from flops_callbacks.integrations.callback_base import build_session  # noqa: E402
from flops_callbacks.integrations.loop_adapters import plain_adapter  # noqa: E402

WINDOW = {"profile_step": 0, "clean_steps": 3, "print_profile": False}
# the window ends (publishes) at this global step; the step after it is the first one timed
END = window_steps(WINDOW["profile_step"], WINDOW["clean_steps"]).stop


def timed_steps(kind: str, steps: int, batch_size: int) -> list[float]:
    """Step times after a window that ended (``none``: no profiler at all)."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = synthetic_batches(steps + END + 1, batch_size)
    times: list[float] = []
    prof = StepProfiler(model, log_every_n_steps=10**9, **WINDOW) if kind == "StepProfiler" else None
    session: Any = build_session("callback", dict(WINDOW)) if kind == "callback" else None
    sink = plain_adapter(model, None, None).sink
    if session is not None:
        session.train_start(0)
    for step, batch in enumerate(batches):
        start = time.perf_counter()
        if prof is not None:
            with prof.step(batch):
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        elif session is not None:  # the callback's events, as on_train_batch_start / _end call them
            session.step_start(step, model)
            session.micro_batch_start(batch)
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            session.micro_batch_end(pause=True)
            session.step_end(step + 1, sink, logs=False)
        else:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    if prof is not None:
        assert prof.result is not None and prof.result.published_at == END
        prof.close()
    if session is not None:
        assert session.result is not None and session.result.published_at == END
        session.train_end(len(batches), sink)
    return times[END + 1 :]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    kinds = ["none", "callback", "StepProfiler"]
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            medians[kind].append(statistics.median(timed_steps(kind, args.steps, args.batch_size)))
    ratio = statistics.median(
        s / c for s, c in zip(medians["StepProfiler"], medians["callback"], strict=True)
    )
    bare = statistics.median(s / n for s, n in zip(medians["StepProfiler"], medians["none"], strict=True))
    for kind in kinds:
        print(f"{kind:>13}: median step {1e3 * statistics.median(medians[kind]):.2f} ms")
    print(f"StepProfiler / callback outside the window: {ratio:.4f} (goal <= 1.01)")
    print(f"StepProfiler / no profiler outside the window: {bare:.4f}")


if __name__ == "__main__":
    main()
