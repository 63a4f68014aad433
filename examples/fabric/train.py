"""A tiny GPT-2 trained by a Lightning Fabric loop on synthetic tokens, profiled from step 4 by StepProfiler.

    python examples/fabric/train.py                                   # CPU, under a minute
    python examples/fabric/train.py --accelerator cuda --devices 2 --strategy ddp --precision bf16-mixed
    tensorboard --logdir runs/fabric                                  # the flops_profiler/* scalars

``StepProfiler(model, fabric=fabric)`` reads the world size and the compute dtype from Fabric's strategy
and precision, logs through ``fabric.log_dict`` and profiles the model inside ``fabric.setup``'s wrapper.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from transformers import GPT2Config, GPT2LMHeadModel

from flops_callbacks import StepProfiler

VOCAB, CONTEXT = 512, 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--profile-step", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--root-dir", default="runs/fabric")
    args = parser.parse_args()

    logger = TensorBoardLogger(args.root_dir, name="gpt2")
    fabric = Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        loggers=logger,
    )
    fabric.launch()
    fabric.seed_everything(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    ids = torch.randint(0, VOCAB, (args.max_steps, args.batch_size, CONTEXT))

    prof = StepProfiler(model, fabric=fabric, profile_step=args.profile_step, log_every_n_steps=5)
    for step_ids in ids:
        batch = {"input_ids": step_ids.to(fabric.device), "labels": step_ids.to(fabric.device)}
        with prof.step(batch):
            loss = model(**batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    fabric.logger.finalize("success")
    fabric.print(f"Report and logs in {logger.log_dir}; view them with: tensorboard --logdir {args.root_dir}")


if __name__ == "__main__":
    main()
