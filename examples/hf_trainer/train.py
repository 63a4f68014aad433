"""A tiny GPT-2 (built from a config) trained by transformers.Trainer on synthetic tokens, profiled at
step 10 by HFFlopsCallback.

    python examples/hf_trainer/train.py                                 # CPU, under a minute
    python examples/hf_trainer/train.py --device auto --bf16 --activation-checkpointing
    torchrun --nproc-per-node 2 examples/hf_trainer/train.py --device auto   # data parallel
    tensorboard --logdir runs/hf_trainer                                # train/flops_profiler/* scalars

The report is printed at the profiled step and saved, with a JSON of the full profile, in the output
directory; the metrics go through the Trainer's own logging to TensorBoard.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from flops_callbacks import HFFlopsCallback

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 512, 128, 128, 4, 2


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences; the model shifts the labels itself (causal LM)."""

    def __init__(self, sequences: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (sequences, CONTEXT), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index], "labels": self.data[index]}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "auto"], help="auto: GPU if any")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute reported apart")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--profile-step", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per device and micro-batch")
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    args = parser.parse_args()

    set_seed(0)
    # transformers 5 renamed gradient_checkpointing (4.46, the floor, knows only that name)
    new_name = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if new_name else "gradient_checkpointing"
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        **{checkpointing: args.activation_checkpointing},
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=3e-4,
        logging_steps=5,
        save_strategy="no",
        report_to=["tensorboard"],
        disable_tqdm=True,
    )
    sequences = args.batch_size * args.gradient_accumulation_steps * (args.max_steps + 1)
    profiler = HFFlopsCallback(profile_step=args.profile_step, top_modules=3)
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training_args,
        train_dataset=SyntheticTokens(sequences),
        callbacks=[profiler],
    )
    trainer.train()
    if trainer.is_world_process_zero() and profiler.result is not None:
        logs = f"{args.output_dir}/runs"
        print(f"Report and JSON in {args.output_dir}; view the logs with: tensorboard --logdir {logs}")


if __name__ == "__main__":
    main()
