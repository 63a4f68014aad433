"""A tiny GPT-2 trained by an accelerate loop on synthetic tokens, profiled from step 4 by StepProfiler.

    python examples/accelerate/train.py                               # CPU, under a minute
    accelerate launch --num_processes 2 --mixed_precision bf16 examples/accelerate/train.py
    tensorboard --logdir runs/accelerate                              # the flops_profiler/* scalars

``StepProfiler(model, accelerator=accelerator)`` reads the world size, the parallel sizes, the
distributed type and the mixed precision from accelerate's state, logs through ``accelerator.log``
(every tracker: TensorBoard here) and profiles the model inside ``accelerator.prepare``'s wrapper.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from flops_callbacks import StepProfiler

VOCAB, CONTEXT = 512, 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--profile-step", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--project-dir", default="runs/accelerate")
    args = parser.parse_args()

    accelerator = Accelerator(
        log_with="tensorboard", project_dir=args.project_dir, gradient_accumulation_steps=args.accumulate
    )
    accelerator.init_trackers("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (args.max_steps * args.accumulate * args.batch_size, CONTEXT))
    data = torch.utils.data.DataLoader(
        [{"input_ids": x, "labels": x} for x in ids], batch_size=args.batch_size
    )
    model, optimizer, data = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4), data)

    prof = StepProfiler(model, accelerator=accelerator, profile_step=args.profile_step, log_every_n_steps=5)
    for batch in data:
        with prof.step(batch), accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    accelerator.end_training()
    accelerator.print(f"Report and logs in {accelerator.logging_dir}")


if __name__ == "__main__":
    main()
