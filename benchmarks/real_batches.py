"""Batches as users feed them, on the HF Trainer with ``HFFlopsCallback(profile_step=5)`` and its defaults:
dynamic padding (a tiny GPT-2 on sequences of 16 .. 128 tokens, batches of 8 padded to their longest),
padding-free packing (a tiny Llama, ``DataCollatorWithFlattening``: four sequences of 165 .. 204 tokens in
a row) and an encoder-decoder under ``DataCollatorForSeq2Seq`` (a tiny T5: inputs of 16 .. 128 tokens,
labels of 4 .. 48, batches of 8, each padded to its longest: labels with -100).

1. After the window: the 15 steps after the window's last one (the first included), their wall time with
   the callback over the same steps without it, in pairs run one after the other (the order flips every
   pair); the median over pairs. Goal: <= 1.05. Beside it, the profiler's own counting after the window
   (``after_window`` in the JSON: how many counts, their seconds).
2. Model and hardware flops of the median clean step against torch's ``FlopCounterMode`` (SDPA's math
   backend): the model's over its sequences counted alone (an encoder-decoder's: each row's encoder and
   decoder cut to their own tokens; goal: within [0.995, 1.025]), the hardware's
   over the batch as run (2 x our MACs: equal); samples per step (the packed run: four a row).

    python benchmarks/real_batches.py [--pairs 3] [--after 15] [--runs NAME ...]
"""

from __future__ import annotations

import argparse
import json
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
from tokenizers import Tokenizer, models
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from flops_callbacks import HFFlopsCallback

VOCAB = 512


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=0)
    return GPT2LMHeadModel(config)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def seq2seq_collator() -> DataCollatorForSeq2Seq:
    """transformers' collator for an encoder-decoder, with a word-level tokenizer built in memory (pad 0)."""
    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]")
    return DataCollatorForSeq2Seq(tokenizer, model=t5(), label_pad_token_id=-100)


class Translations(torch.utils.data.Dataset):
    """Inputs of 16 .. 128 tokens, labels of 4 .. 48 (seed 0)."""

    def __init__(self, size: int) -> None:
        self.inputs = RandomLengths(size, VOCAB, 16, 129).items
        self.labels = RandomLengths(size + 1, VOCAB, 4, 49).items  # (another size: other lengths)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.inputs[i].tolist(), "labels": self.labels[i].tolist()}


class Packed(torch.utils.data.Dataset):
    """Sequences of 165 .. 204 tokens with their labels (seed 0)."""

    def __init__(self, size: int) -> None:
        self.items = RandomLengths(size, VOCAB, 165, 205).items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.items[i].tolist()
        return {"input_ids": ids, "labels": ids}


class Recorded:
    """A collator that keeps every batch it made (batch ``i``: global step ``i``'s)."""

    def __init__(self, collate: Any) -> None:
        self.collate, self.batches = collate, []

    def __call__(self, samples: list[Any]) -> dict[str, torch.Tensor]:
        batch = self.collate(samples)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


class Ends(TrainerCallback):
    """When each global step ended (after the profiler's callback: its work is the step's)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.at[state.global_step - 1] = time.perf_counter()


RUNS = {
    "dynamic padding (GPT-2, batch 8)": (gpt2, lambda n: RandomLengths(n, VOCAB, 16, 129), pad_to_longest, 8),
    "packed rows (Llama, 4 a row)": (llama, Packed, DataCollatorWithFlattening(), 4),
    "encoder-decoder (T5, batch 8)": (t5, Translations, seq2seq_collator(), 8),
}


def run(
    name: str, root: Path, steps: int, profiled: bool, **options: Any
) -> tuple[Ends, Any, Recorded, Path]:
    make, data, collate, batch = RUNS[name]
    ends, collator = Ends(), Recorded(collate)
    callback = HFFlopsCallback(profile_step=5, print_profile=False, **options) if profiled else None
    args = TrainingArguments(
        output_dir=str(root), use_cpu=True, max_steps=steps, per_device_train_batch_size=batch,
        logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        remove_unused_columns=False,
    )  # fmt: skip
    callbacks: list[Any] = [callback, ends] if callback else [ends]
    trainer = Trainer(
        model=make(), args=args, train_dataset=data(steps * batch), data_collator=collator,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    return ends, callback.result if callback else None, collator, root


def after_window(name: str, pairs: int, after: int, steps: int) -> None:
    ratios, owns = [], []
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        ends: dict[bool, Ends] = {}
        end = own = None
        for profiled in order:
            with tempfile.TemporaryDirectory() as root:
                ends[profiled], result, _, out = run(name, Path(root), steps, profiled)
                if result is not None:
                    end = result.published_at
                    saved = json.loads(next(out.rglob(f"flops_profile_step{result.step}.json")).read_text())
                    own = saved["after_window"]
        assert end is not None and end + after < steps, (end, steps)
        span = {p: ends[p].at[end + after] - ends[p].at[end] for p in ends}  # steps end+1 .. end+after
        ratios.append(span[True] / span[False])
        owns.append(own)
        print(f"| {name} | {pair + 1} | {end} | {span[False]:.2f} s | {span[True]:.2f} s | "
              f"{ratios[-1]:.3f} | {own} |")  # fmt: skip
    print(f"| {name} | median | | | | **{statistics.median(ratios):.3f}** | |")


def dense(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


def sequences(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The batch's sequences, each alone: a padded row's real tokens (an encoder-decoder's decoder cut to
    its labels not -100), or a packed row's runs."""
    if "decoder_input_ids" in batch:
        encoder, labels = (
            batch["attention_mask"].sum(dim=1).tolist(),
            (batch["labels"] != -100).sum(dim=1).tolist(),
        )
        pairs = zip(encoder, labels, strict=True)
        decoder = ("labels", "decoder_input_ids")
        return [
            {k: v[r : r + 1, : (d if k in decoder else n)] for k, v in batch.items()}
            for r, (n, d) in enumerate(pairs)
        ]
    if "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        return [{k: v[r : r + 1, :n] for k, v in batch.items()} for r, n in enumerate(lengths)]
    ids = batch["input_ids"]
    starts = (batch["position_ids"][0] == 0).nonzero().view(-1).tolist() + [ids.shape[1]]
    runs = zip(starts, starts[1:], strict=False)
    return [{k: v[:, a:b] for k, v in batch.items() if k != "position_ids"} for a, b in runs]


def flops_truth(name: str, steps: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        _, result, collator, _ = run(name, Path(root), steps, True, clean_steps=5)  # odd: one median step
    make = RUNS[name][0]
    figures = result.figures()
    median = figures.median_step()
    at = next(s for s, f in zip(result.steps.clean, figures.steps, strict=True) if f == median)
    batch = collator.batches[at]
    counts = median.work.counts
    alone = sum(dense(make(), s) for s in sequences(batch))
    run_dense = dense(make(), batch)
    hardware = 2 * (counts.fwd_macs + counts.bwd_macs) / run_dense
    print(f"| {name} | {at} | {median.work.samples} | {counts.model_flops / alone:.4f} | "
          f"{hardware:.4f} | {run_dense / alone:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--after", type=int, default=15)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", nargs="*", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}\n")
    print(f"## The {args.after} steps after the window, with / without the callback\n")
    print("| run | pair | window's last step | without | with | ratio | after_window |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.runs:
        after_window(name, args.pairs, args.after, args.steps)
    print("\n## Model and hardware flops of the median clean step against FlopCounterMode\n")
    print("| run | step | samples | model / sequences alone | 2 x MACs / as run | as run / alone |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.runs:
        flops_truth(name, 40)


if __name__ == "__main__":
    main()
