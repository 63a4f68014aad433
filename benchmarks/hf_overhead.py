"""Cost of HFFlopsCallback on the steps it does not profile: transformers.Trainer step time with and
without the callback, side by side in one run. Goal: ratio <= 1.01 (no work outside the profiled step).

    python benchmarks/hf_overhead.py [--steps 600] [--threads 1]

One Trainer (a tiny GPT-2 on CPU) first runs the profiled step once. Then, in one training run, the
callback is attached for one step in three and detached for the other two, in an order that rotates
every three steps, so that both arms see the same model, optimizer and machine load, step by step.
The two steps without the callback also give the noise floor (their ratio, for identical setups);
ratios are medians over cycles of the ratio within each cycle.
A step is timed from ``on_step_begin`` to ``on_step_end`` by a callback that runs before the
profiler's handlers; the first steps (warm-up) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
from common import window_steps
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from flops_callbacks import HFFlopsCallback

VOCAB, CONTEXT, BATCH, PROFILE_STEP, WARMUP = 256, 64, 8, 5, 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.ids = torch.randint(0, VOCAB, (size, CONTEXT), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Alternator(TrainerCallback):
    """Times every step; while ``alternating``, attaches ``profiler`` to the Trainer one step in three."""

    ARMS = ("with", "without", "control")

    def __init__(self, profiler: HFFlopsCallback) -> None:
        self.profiler = profiler
        self.trainer: Trainer | None = None
        self.alternating = False
        self.step_seconds: dict[int, float] = {}  # every step, by the global step it started at
        self.cycles: dict[int, dict[str, float]] = {}  # while alternating: cycle -> arm -> seconds
        self._start = 0.0

    def arm(self, step: int) -> str:
        return self.ARMS[(step // 3 + step) % 3]  # each arm once per three steps, order rotating

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step, seconds = state.global_step - 1, time.perf_counter() - self._start
        self.step_seconds[step] = seconds
        if not self.alternating:
            return
        if step >= WARMUP:
            self.cycles.setdefault(step // 3, {})[self.arm(step)] = seconds
        # A new list, not an edit of the one the Trainer is iterating over right now.
        handler = self.trainer.callback_handler
        others = [c for c in handler.callbacks if c is not self.profiler]
        handler.callbacks = others + [self.profiler] if self.arm(step + 1) == "with" else others


def make_trainer(output_dir: str, callback: TrainerCallback) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        log_level="error",
    )
    model = GPT2LMHeadModel(config)
    return Trainer(model=model, args=args, train_dataset=Tokens(BATCH * 64), callbacks=[callback])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of the compared run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less noise)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)

    profiler = HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=0, print_profile=False)
    alternator = Alternator(profiler)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = alternator.trainer = make_trainer(tmp, alternator)
        # the profiled step, once, with the callback attached throughout its whole window
        trainer.args.max_steps = window_steps(PROFILE_STEP).stop
        trainer.add_callback(profiler)
        trainer.train()
        profiled_step = alternator.step_seconds[PROFILE_STEP]
        trainer.remove_callback(profiler)
        # the compared run: a callback attached one step in three whose window never comes (a callback
        # used for another train() would profile that run too), so it only waits on its events
        warnings.filterwarnings("ignore", message=".*is never reached")
        profiler = alternator.profiler = HFFlopsCallback(profile_step=10**9, print_profile=False)
        alternator.alternating = True
        trainer.args.max_steps = options.steps
        if alternator.arm(0) == "with":
            trainer.add_callback(profiler)
        trainer.train()

    cycles = [cycle for cycle in alternator.cycles.values() if len(cycle) == len(Alternator.ARMS)]
    with_callback, without, control = (statistics.median(c[arm] for c in cycles) for arm in Alternator.ARMS)
    # paired: the three steps of a cycle ran back to back, under the same load
    ratio = statistics.median(c["with"] / c["without"] for c in cycles)
    noise = statistics.median(c["control"] / c["without"] for c in cycles)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, CPU, {threads} thread(s); GPT-2, batch {BATCH} x {CONTEXT} tokens")
    print(f"{len(cycles)} cycles of three back-to-back steps: with, without, control (order rotating)")
    print(f"median step time without the callback: {without * 1e3:8.3f} ms")
    print(f"median step time with the callback:    {with_callback * 1e3:8.3f} ms")
    print(f"median step time control (without):    {control * 1e3:8.3f} ms")
    print(f"ratio with / without (median of pairs): {ratio:8.4f}   (goal <= 1.01)")
    print(f"noise floor, control / without:         {noise:8.4f}   (both without the callback)")
    print(f"the profiled step itself (once):        {profiled_step * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
