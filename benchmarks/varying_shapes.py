"""Runs with a new padded length on most steps, side by side in one process, HF Trainer and Lightning:

1. off-window cost: the median step time after the profile window with the callback (throughput/*
   logged at every logging step) over the same run without it. Goal: <= 1.01.
2. truth of the window's figures: its reported wall step, data wait and compute (fwd + bwd + step)
   latencies vs an outside timer (a callback of the user's, after ours) on the same clean steps,
   with a collator that sleeps ``--data-sleep`` seconds per batch.

Rounds alternate the configurations (the order flips every round), so load from other processes hits
them alike; a ratio is the median over rounds of the ratio of two runs' median step times. Model: a
tiny GPT-2 from a config; batches of token sequences of random lengths, padded to the longest.

    python benchmarks/varying_shapes.py [--rounds 5] [--steps 40] [--data-sleep 0.02]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from common import RandomLengths, pad_to_longest, quiet_trainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from flops_callbacks import FlopsProfilerCallback, HFFlopsCallback
from flops_callbacks import metrics as names

PROFILE_STEP, CLEAN, BATCH, VOCAB = 2, 5, 8, 512


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=0)
    return GPT2LMHeadModel(config)


def sequences(size: int) -> RandomLengths:
    """``size`` sequences of 16 .. 128 tokens."""
    return RandomLengths(size, VOCAB, 16, 129)


class Collator:
    """Pads to the longest sequence of the batch (a new length on most steps), after ``sleep`` seconds."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        return pad_to_longest(samples)


class Marks:
    """Outside clock marks per global step: start of the step, end of the step (a user's callback)."""

    def __init__(self) -> None:
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def step_times(self, after: int) -> list[float]:
        """Wall time of each step after ``after``: from the previous step's end to this one's."""
        return [self.end[s] - self.end[s - 1] for s in sorted(self.end) if s > after and s - 1 in self.end]


class LightningMarks(Marks, L.Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start[trainer.global_step] = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.end[trainer.global_step - 1] = time.perf_counter()


class HFMarks(Marks, TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start[state.global_step] = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end[state.global_step - 1] = time.perf_counter()


class LitGPT2(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def run_lightning(root: Path, steps: int, sleep: float, profiled: bool) -> tuple[Marks, Any]:
    marks = LightningMarks()
    callback = (
        FlopsProfilerCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
        if profiled
        else None
    )
    callbacks = ([callback] if callback else []) + [marks]
    logger = L.pytorch.loggers.CSVLogger(root)
    trainer = quiet_trainer(root, steps, callbacks, logger=logger, log_every_n_steps=5)
    data = torch.utils.data.DataLoader(sequences(steps * BATCH), batch_size=BATCH, collate_fn=Collator(sleep))
    trainer.fit(LitGPT2(), data)
    if callback:
        LAST_SESSION[0] = callback.session
    return marks, callback.result if callback else None


def run_hf(root: Path, steps: int, sleep: float, profiled: bool) -> tuple[Marks, Any]:
    marks = HFMarks()
    callback = (
        HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
        if profiled
        else None
    )
    args = TrainingArguments(
        output_dir=str(root), use_cpu=True, max_steps=steps, per_device_train_batch_size=BATCH,
        logging_steps=5,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, remove_unused_columns=False,
    )  # fmt: skip
    callbacks: list[Any] = ([callback] if callback else []) + [marks]
    trainer = Trainer(
        model=gpt2(), args=args, train_dataset=sequences(steps * BATCH), data_collator=Collator(sleep),
        callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    if callback:
        LAST_SESSION[0] = callback.session
    return marks, callback.result if callback else None


RUNNERS = {"HF Trainer": run_hf, "Lightning": run_lightning}
LAST_SESSION: list[Any] = [None]  # the last profiled run's session: its tables, its meter


def off_window(rounds: int, steps: int) -> None:
    print(
        f"\n## Off-window step time, with / without the callback "
        f"(new padded length on most steps, {rounds} rounds)\n"
    )
    print(
        "| framework | window ends at step | median step without | median step with "
        "| ratio (median over rounds) |"
    )
    print("|---|---:|---:|---:|---:|")
    for framework, runner in RUNNERS.items():
        ratios, with_times, without_times, end = [], [], [], 0
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            medians = {}
            for profiled in order:
                with tempfile.TemporaryDirectory() as root:
                    marks, result = runner(Path(root), steps, 0.0, profiled)
                if result is not None:
                    end = result.published_at
                medians[profiled] = marks
            after = end + 1  # the first interval after the window
            times = {p: statistics.median(m.step_times(after)) for p, m in medians.items()}
            ratios.append(times[True] / times[False])
            with_times.append(times[True])
            without_times.append(times[False])
        print(
            f"| {framework} | {end} | {1e3 * statistics.median(without_times):.2f} ms | "
            f"{1e3 * statistics.median(with_times):.2f} ms | {statistics.median(ratios):.3f} |"
        )


def meter_cost(steps: int) -> None:
    """The meter's own work per micro-batch after the window (its signature, the table's flops, the
    batch's layout and its sequences' model flops), timed directly on 200 batches of new padded lengths
    after 200 more (the lengths' predictions memoized, as in a run), with the run's own session and
    tables, beside a step's time: the least noisy figure."""
    print("\n## The meter's own time per micro-batch after the window (new padded lengths)\n")
    print("| framework | meter per micro-batch | median step | share of a step |")
    print("|---|---:|---:|---:|")
    collate = Collator(0.0)
    data = sequences(400 * BATCH)
    batches = [collate([data[i * BATCH + j] for j in range(BATCH)]) for i in range(400)]
    for framework, runner in RUNNERS.items():
        with tempfile.TemporaryDirectory() as root:
            marks, result = runner(Path(root), steps, 0.0, True)
        step = statistics.median(marks.step_times(result.published_at + 1))
        session = LAST_SESSION[0]
        meter = session.meter
        meter.audit = 0  # no audit: its count is its own figure (AUDIT_COST), not the meter's per batch
        meter.start(result, gpt2(), session.flops)
        for batch in batches[:200]:
            meter.micro_batch_start(batch)
            meter.step_end()
        start = time.perf_counter()
        for batch in batches[200:]:
            meter.micro_batch_start(batch)
            meter.step_end()
        meter.interval()  # its layouts read, as at a logging step
        each = (time.perf_counter() - start) / 200
        print(f"| {framework} | {each * 1e6:.1f} us | {step * 1e3:.2f} ms | {each / step:.5f} |")


def truth(sleep: float, steps: int) -> None:
    print(
        f"\n## The window's figures vs an outside timer on the same clean steps "
        f"(collator sleeps {sleep * 1e3:.0f} ms)\n"
    )
    print("| framework | clean steps | figure | reported | outside timer | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for framework, runner in RUNNERS.items():
        with tempfile.TemporaryDirectory() as root:
            marks, result = runner(Path(root), steps, sleep, True)
        m, clean = result.metrics(), result.steps.clean
        outside = {
            "wall step": statistics.median(marks.end[s] - marks.end[s - 1] for s in clean),
            "data wait": statistics.median(marks.start[s] - marks.end[s - 1] for s in clean),
            "fwd + bwd + step": statistics.median(marks.end[s] - marks.start[s] for s in clean),
        }
        reported = {
            "wall step": m[names.WALL_LATENCY],
            "data wait": m[names.DATA_LATENCY],
            "fwd + bwd + step": m[names.ITER_LATENCY],
        }
        for figure, value in reported.items():
            print(
                f"| {framework} | {len(clean)} | {figure} | {value * 1e3:.2f} ms "
                f"| {outside[figure] * 1e3:.2f} ms | "
                f"{value / outside[figure]:.3f} |"
            )
        print(
            f"| {framework} | {len(clean)} | samples/s compute / wall | {m[names.SAMPLES_PER_SEC]:.1f} / "
            f"{m[names.WALL_SAMPLES_PER_SEC]:.1f} | | |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--data-sleep", type=float, default=0.02)
    parser.add_argument("--only-meter", action="store_true", help="only the meter's own time per micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, lightning {L.__version__}")
    if not args.only_meter:
        off_window(args.rounds, args.steps)
    meter_cost(args.steps)
    if not args.only_meter:
        truth(args.data_sleep, args.steps)


if __name__ == "__main__":
    main()
