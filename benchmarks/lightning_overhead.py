"""Step time of a Lightning run with FlopsProfilerCallback attached vs without, on the steps it does not
profile. Goal: ratio <= 1.01 (the callback does no work outside the profiled step).

Short runs alternate in one process (the order flips every round), so load from other processes hits
all configurations alike: without the callback; with it, profiling step 10; with it attached but
never profiling (profile_step past the run: its hooks alone). A ratio is the median over rounds of
the ratio of two runs' median step times. One torch thread, so a step is work of the main thread and
its CPU time is measured beside wall time (on a shared machine wall time mostly measures the
neighbours). Last, the time spent inside the callback's own hooks on non-profiled steps, measured
directly, which no neighbour disturbs. Model: the GPT of examples/lightning/train.py on CPU.

    python benchmarks/lightning_overhead.py [--repeats 20] [--steps 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lightning"))
from common import print_ratio_table, quiet_trainer, step_timer, window_steps  # noqa: E402
from train import GPT, SyntheticTokens  # noqa: E402

from flops_callbacks import FlopsProfilerCallback  # noqa: E402

STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class HookTimedCallback(FlopsProfilerCallback):
    """The callback, with the wall time of each per-step hook call summed while no profile is on."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.idle_seconds = 0.0
        for name in STEP_HOOKS:
            setattr(self, name, self._timed(getattr(self, name)))

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any) -> None:
            idle = not self.session.window_open
            start = time.perf_counter()
            hook(*args)
            if idle and not self.session.window_open:
                self.idle_seconds += time.perf_counter() - start

        return timed


def run(steps: int, batch_size: int, callback: L.Callback | None, root: str) -> Any:
    """One run; its timer's step times are indexed by global step."""
    L.seed_everything(0, verbose=False)
    timer = step_timer()
    trainer = quiet_trainer(root, steps, [timer, callback] if callback else [timer])
    data = torch.utils.data.DataLoader(SyntheticTokens(batch_size * (steps + 1)), batch_size=batch_size)
    trainer.fit(GPT(), train_dataloaders=data)
    return timer


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=20, help="runs per configuration")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="first steps of every run left out")
    parser.add_argument("--profile-step", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FlopsProfilerCallback: no optimizer step started")

    profile_steps = {"without": None, "profiling": args.profile_step, "never profiling": 10 * args.steps}
    timers: dict[str, list[Any]] = {config: [] for config in profile_steps}
    hook_seconds: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            order = list(profile_steps) if repeat % 2 == 0 else list(reversed(profile_steps))
            for config in order:
                callback = None
                if config == "profiling":
                    callback = HookTimedCallback(
                        profile_step=args.profile_step, clean_steps=0, print_profile=False
                    )
                elif config == "never profiling":
                    callback = FlopsProfilerCallback(profile_step=profile_steps[config])
                timers[config].append(run(args.steps, args.batch_size, callback, root))
                if isinstance(callback, HookTimedCallback):
                    hook_seconds.append(callback.idle_seconds / (args.steps - 1))

    window = window_steps(args.profile_step)  # clean_steps=0: the counting and module-timing steps

    def kept(timer: Any, clock: str) -> list[float]:
        times = timer.step_times(clock)
        return [t for step, t in enumerate(times) if step >= args.warmup and step not in window]

    print(f"torch {torch.__version__}, lightning {L.__version__}, 1 torch thread, batch {args.batch_size}")
    print(f"{args.repeats} runs per configuration x {args.steps} steps, alternating; left out: the first")
    print(
        f"{args.warmup} steps of every run and the counting and module-timing steps (global steps "
        f"{window.start}-{window.stop - 1})"
    )
    print()
    print_ratio_table("callback", timers, kept, {c: "<= 1.01" for c in profile_steps if c != "without"})
    # the step's CPU time is the least inflated by neighbours: the conservative base for a ratio
    base = statistics.median(statistics.median(kept(t, "main-thread CPU")) for t in timers["without"])
    in_hooks = statistics.median(hook_seconds)
    profiled = statistics.median(
        t.step_times("main-thread CPU")[args.profile_step] for t in timers["profiling"]
    )
    print()
    print(f"time inside the callback's hooks per non-profiled step: {in_hooks * 1e6:.1f} us")
    print(f"  = ratio {1 + in_hooks / base:.5f} to a {base * 1e3:.2f} ms step (CPU time)")
    print(f"the profiled step itself (CPU time): {profiled * 1e3:.2f} ms, {profiled / base:.1f}x a step")


if __name__ == "__main__":
    main()
