"""Counting new batch shapes off the clock: what a fake count costs, and what it spares a window.

1. cost of a fake count per shape: GPT-2 124M and a Llama of about 125M (both from configs, nothing
   downloaded), one micro-batch of ``--batch`` x ``--length`` tokens: the fake count (forward, loss and
   backward under fake tensors, counted by the engine) against a real training step of the same batch,
   and whether the two counts are equal.
2. the grouped-length HF Trainer run (``train_sampling_strategy="group_by_length"``, lengths 16..256
   padded to the longest, a tiny GPT-2, ``profile_step=10``, 60 steps): the window's length in steps,
   its kinds and its wall time, with fake counts and with them turned off (the adapter gives no step
   function: every new shape counted on a training step of its own).

    python benchmarks/off_clock.py [--batch 4] [--length 256] [--repeats 3]
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

import torch
import transformers
from common import RandomLengths, pad_to_longest
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import flops_callbacks.integrations.hf as hf_adapter
from flops_callbacks import HFFlopsCallback
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.fake_count import fake_count

PROFILE_STEP, STEPS, VOCAB = 10, 60, 101


def gpt2_124m() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config())


def llama_125m() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lm_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def fake_count_cost(name: str, model: torch.nn.Module, batch: int, length: int, repeats: int) -> str:
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.ones_like(ids)
    mask[0, length // 2 :] = 0  # padded, as a grouped batch is
    data = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    model.train()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    fake_seconds, real_seconds = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        faked = fake_count(model, lm_step, data)
        fake_seconds.append(time.perf_counter() - start)
        tracer = CountingEngine(model)
        start = time.perf_counter()
        tracer.start()
        try:
            lm_step(model, data)
        finally:
            tracer.stop()
        real_seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        counted = tracer.totals()[0]
        start = time.perf_counter()
        lm_step(model, data)
        model.zero_grad(set_to_none=True)
        real_seconds[-1] = time.perf_counter() - start  # the plain step, unprofiled
    flops = faked.fwd_flops + faked.bwd_flops
    equal = (
        "equal" if (faked.fwd_flops, faked.bwd_flops) == (counted.fwd_flops, counted.bwd_flops) else "DIFFER"
    )
    return (
        f"| {name} ({params:.0f}M params), {batch}x{length} | {flops / 1e9:.1f} | "
        f"{statistics.median(fake_seconds):.2f} | {statistics.median(real_seconds):.2f} | {equal} |"
    )


class Marks(TrainerCallback):
    """Outside clock marks: each step's start and end."""

    def __init__(self) -> None:
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start[state.global_step] = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end[state.global_step - 1] = time.perf_counter()


def grouped_run(root: Path, off_clock: bool) -> str:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=str(root), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        train_sampling_strategy="group_by_length",
    )  # fmt: skip
    callback, marks = HFFlopsCallback(profile_step=PROFILE_STEP, print_profile=False), Marks()
    lengths = RandomLengths(600, VOCAB, 16, 257)  # 16 .. 256 tokens
    trainer = Trainer(
        GPT2LMHeadModel(config), args, train_dataset=lengths, data_collator=pad_to_longest,
        callbacks=[callback, marks],
    )  # fmt: skip
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no loss lines
    replay = hf_adapter._replay
    if not off_clock:
        hf_adapter._replay = lambda *a: "turned off for the benchmark"  # type: ignore[assignment]
    try:
        trainer.train()
    finally:
        hf_adapter._replay = replay
    result = callback.session.result
    if result is None:
        return f"| {'on' if off_clock else 'off'} | no window ended in {STEPS} steps | | | | | |"
    s = result.steps
    last = max((*s.clean, *s.skipped, *s.shape_counting, *s.module_timing, s.counting))
    seconds = marks.end[last] - marks.start[PROFILE_STEP]
    counts = len(s.shape_counting) - (1 if result.flops_sources and result.flops_sources.check_step else 0)
    return (
        f"| {'on' if off_clock else 'off'} | {last - PROFILE_STEP + 1} | {len(s.clean)} | {counts} | "
        f"{len(s.skipped)} | {bool(result.flops_sources and result.flops_sources.checked)} | {seconds:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print("| model, batch | fwd + bwd GFLOPs | fake count (s) | real step, unprofiled (s) | fake = real |")
    print("|---|---:|---:|---:|---|")
    for name, build in (("GPT-2 124M", gpt2_124m), ("Llama", llama_125m)):
        torch.manual_seed(0)
        print(fake_count_cost(name, build(), options.batch, options.length, options.repeats), flush=True)
    print()
    print(
        "| counts off the clock | window steps | clean | shape counts | skipped | checked | window wall (s) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as root:
        for on in (False, True):
            print(grouped_run(Path(root) / str(on), on), flush=True)


if __name__ == "__main__":
    main()
