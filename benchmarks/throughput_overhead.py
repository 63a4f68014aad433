"""Cost of continuous throughput: Lightning step time after the profiled step with FlopsProfilerCallback
logging ``throughput/*`` at every logging step, vs without the callback, vs Lightning's ThroughputMonitor
(given the same flops per batch by hand, as it requires). Goal: ratio to without <= 1.01.

Short runs alternate in one process (the order flips every round), so load from other processes hits
all configurations alike. A ratio is the median over rounds of the ratio of two runs' median step
times, on wall time and on the main thread's CPU time (one torch thread: a step is main-thread work,
and on a shared machine its CPU time is the least disturbed by neighbours). Last, the time spent inside
each callback's own hooks per step, measured directly. Every configuration has the same CSV logger and
logs the example's loss every ``--log-every`` steps. Model: the GPT of examples/lightning/train.py.

    python benchmarks/throughput_overhead.py [--repeats 10] [--steps 60] [--log-every 10]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lightning"))
from common import print_ratio_table, quiet_trainer, step_timer, window_steps  # noqa: E402
from train import GPT, SyntheticTokens, count_tokens  # noqa: E402

from flops_callbacks import FlopsProfilerCallback  # noqa: E402

HOOKS = ("on_train_batch_start", "on_train_batch_end")


def time_hooks(callback: L.Callback, after_step: int) -> dict[str, list[float]]:
    """Wrap the callback's per-step hooks; returns {hook: [seconds of each call after ``after_step``]}."""
    spent: dict[str, list[float]] = {name: [] for name in HOOKS}

    def timed(name: str, hook: Any) -> Any:
        def wrapper(trainer, *args: Any) -> None:
            start = time.perf_counter()
            hook(trainer, *args)
            if trainer.global_step > after_step:
                spent[name].append(time.perf_counter() - start)

        return wrapper

    for name in HOOKS:
        setattr(callback, name, timed(name, getattr(callback, name)))
    return spent


def run(config: str, args: argparse.Namespace, root: str, flops_per_batch: float) -> tuple[Any, float]:
    """One run; its step times, and the seconds per step spent in the measured callback's hooks."""
    L.seed_everything(0, verbose=False)
    timer, module = step_timer(), GPT()
    callbacks: list[L.Callback] = [timer]
    spent: dict[str, list[float]] = {}
    if config == "flops_callbacks throughput":
        callback = FlopsProfilerCallback(  # clean_steps=0: the window is the counting and module-timing steps
            profile_step=args.profile_step, clean_steps=0, print_profile=False, tokens_fn=count_tokens
        )
        spent = time_hooks(callback, window_steps(args.profile_step).stop)
        callbacks.append(callback)
    elif config == "Lightning ThroughputMonitor":
        module.flops_per_batch = flops_per_batch  # ThroughputMonitor needs the flops by hand
        callback = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], length_fn=count_tokens)
        spent = time_hooks(callback, window_steps(args.profile_step).stop)
        callbacks.append(callback)
    trainer = quiet_trainer(
        root,
        args.steps,
        callbacks,
        logger=CSVLogger(root, name=config.replace(" ", "_")),
        log_every_n_steps=args.log_every,
    )
    data = torch.utils.data.DataLoader(
        SyntheticTokens(args.batch_size * (args.steps + 1)), batch_size=args.batch_size
    )
    trainer.fit(module, train_dataloaders=data)
    # per step, logging steps included: every call's time over the steps timed
    steps = len(spent.get("on_train_batch_start", ()))
    return timer, sum(map(sum, spent.values())) / steps if steps else 0.0


def measured_flops_per_batch(args: argparse.Namespace, root: str) -> float:
    """Model flops of one batch, from a profiled run (what ThroughputMonitor is then given)."""
    callback = FlopsProfilerCallback(profile_step=1, clean_steps=0, print_profile=False)
    steps = window_steps(1).stop  # the whole window, which publishes as the run ends
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(root, steps, [callback])
    data = torch.utils.data.DataLoader(
        SyntheticTokens(args.batch_size * (steps + 1)), batch_size=args.batch_size
    )
    trainer.fit(GPT(), train_dataloaders=data)
    return float(callback.result.profile.model_flops)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=10, help="runs per configuration")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--profile-step", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="steps after the profiled one left out")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" per run

    configs = ("without", "flops_callbacks throughput", "Lightning ThroughputMonitor")
    timers: dict[str, list[Any]] = {config: [] for config in configs}
    in_hooks: dict[str, list[float]] = {config: [] for config in configs}
    with tempfile.TemporaryDirectory() as root:
        flops_per_batch = measured_flops_per_batch(args, root)
        for repeat in range(args.repeats):
            for config in configs if repeat % 2 == 0 else reversed(configs):
                timer, seconds = run(config, args, root, flops_per_batch)
                timers[config].append(timer)
                in_hooks[config].append(seconds)

    first = window_steps(args.profile_step).stop + args.warmup  # after the profile window and a warm-up

    def kept(timer: Any, clock: str) -> list[float]:
        return timer.step_times(clock)[first:]

    print(f"torch {torch.__version__}, lightning {L.__version__}, 1 torch thread, batch {args.batch_size}, "
          f"log every {args.log_every} steps")  # fmt: skip
    timed = (
        f"steps {first}-{args.steps - 1} (after the profiled step {args.profile_step} and {args.warmup} more)"
    )
    print(f"{args.repeats} runs per configuration x {args.steps} steps, alternating; timed: {timed}")
    print()
    print_ratio_table("configuration", timers, kept, {"flops_callbacks throughput": "<= 1.01"})
    base = statistics.median(statistics.median(kept(t, "main-thread CPU")) for t in timers["without"])
    print()
    for config in configs[1:]:
        seconds = statistics.median(in_hooks[config])
        print(f"inside {config}'s per-step hooks: {seconds * 1e6:.1f} us per step = ratio "
              f"{1 + seconds / base:.5f} to a {base * 1e3:.2f} ms step (CPU time)")  # fmt: skip


if __name__ == "__main__":
    main()
