"""The helpers the benchmark scripts share: the profile window's steps as the run plan lays them out, the
clocks a step is timed on, a Lightning callback that times steps, a quiet Lightning Trainer, and token
sequences of random lengths padded to the longest of their batch.

One module beside the scripts (``python benchmarks/x.py`` puts this folder on ``sys.path``), so that a
script reads as its measurement alone. Lightning and the package are imported inside the helpers that
need them: a plain loop's script needs no Lightning, and module_timing.py's run of an older package
needs no module that package lacks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "CLOCKS",
    "flop_counter_step",
    "RandomLengths",
    "pad_to_longest",
    "print_ratio_table",
    "quiet_trainer",
    "step_timer",
    "window_steps",
]

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "main-thread CPU": time.thread_time}


def flop_counter_step(step: int) -> Any:
    """A Lightning callback that counts global step ``step`` whole (forward, backward and optimizer step)
    under torch's ``FlopCounterMode``, as a Lightning user writes it: the peer of our counting step. Its
    ``flops`` once counted.

    Args:
        step: the global step to count.
    """
    import lightning as L
    from torch.utils.flop_counter import FlopCounterMode

    class FlopCounterStep(L.Callback):
        def __init__(self) -> None:
            self.mode: FlopCounterMode | None = None
            self.flops: int | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == step:
                self.mode = FlopCounterMode(display=False)
                self.mode.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.flops, self.mode = self.mode.get_total_flops(), None

    return FlopCounterStep()


def window_steps(profile_step: int, clean_steps: int = 0) -> range:
    """The global steps of a window counted at ``profile_step``, in a run from step 0 with one global step
    per optimizer step: no table may count a window step as unprofiled, and a run meant to finish its
    window must run all of it, whatever the window's layout becomes.

    Args:
        profile_step: the window's counting step.
        clean_steps: the window's clean steps.

    Returns:
        The window's steps; ``.stop`` is the first step after it (the one at which the window has ended,
        and the ``max_steps`` of a run that ends with it).
    """
    from flops_callbacks.options import Options
    from flops_callbacks.session.run_plan import RunPlan

    plan = RunPlan.of(Options(profile_step=profile_step, clean_steps=clean_steps), 0, None, 1)
    return range(plan.first, plan.last + 1)


def step_timer(clocks: dict[str, Callable[[], float]] = CLOCKS) -> Any:
    """A Lightning callback that reads ``clocks`` at every ``on_train_batch_start`` and at the run's end;
    its ``step_times(clock)`` are the seconds from one mark to the next (the whole step, data loading and
    the other callbacks' hooks included), indexed by global step.

    Args:
        clocks: the clocks to read, by name.
    """
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.marks: list[dict[str, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.marks.append({name: clock() for name, clock in clocks.items()})

        def on_train_end(self, trainer, pl_module) -> None:
            self.marks.append({name: clock() for name, clock in clocks.items()})

        def step_times(self, clock: str) -> list[float]:
            return [b[clock] - a[clock] for a, b in zip(self.marks, self.marks[1:], strict=False)]

    return StepTimer()


def quiet_trainer(root: str | Path, max_steps: int, callbacks: list, **settings: Any) -> Any:
    """A Lightning Trainer on one CPU device with no logger, checkpoint, progress bar or model summary.

    Args:
        root: its ``default_root_dir``.
        max_steps: the steps it runs.
        callbacks: its callbacks, in the order they run.
        **settings: other ``Trainer`` arguments, or these overridden (``logger=``, ``accelerator=``).
    """
    import lightning as L

    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **settings}, max_steps=max_steps, callbacks=callbacks, default_root_dir=root)


def print_ratio_table(
    column: str, timers: dict[str, list[Any]], kept: Callable[[Any, str], list[float]], goals: dict[str, str]
) -> None:
    """Print, per clock and configuration, the median step and its ratio to the ``"without"`` runs' (the
    median over rounds of each round's ratio).

    Args:
        column: the configurations' column heading.
        timers: each configuration's step timers, one a round, in the order of the rows.
        kept: the step times of a timer on a clock that the table counts.
        goals: the goal cell of a configuration that has one.
    """
    print(f"| clock | {column} | median step (ms) | ratio to without (median over rounds) | goal |")
    print("|---|---|---:|---:|---|")
    for clock in CLOCKS:
        medians = {c: [statistics.median(kept(t, clock)) for t in runs] for c, runs in timers.items()}
        for config, values in medians.items():
            ratio = statistics.median(a / b for a, b in zip(values, medians["without"], strict=True))
            goal = goals.get(config, "")
            print(f"| {clock} | {config} | {statistics.median(values) * 1e3:.2f} | {ratio:.4f} | {goal} |")


class RandomLengths:
    """``size`` sequences of token ids below ``vocab``, each of a length drawn from ``low .. high - 1``
    (seed 0), as ``{"input_ids": ...}`` items of a map-style dataset."""

    def __init__(self, size: int, vocab: int, low: int, high: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(low, high, (size,), generator=g)
        self.items = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.items[i]}


def pad_to_longest(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch padded to its longest sequence: input_ids, attention_mask, and labels with -100 on padding."""
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])], mask[row, : len(s["input_ids"])] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
