"""A tiny GPT-2 trained by a plain PyTorch loop on synthetic tokens, profiled from step 4 by StepProfiler.

    python examples/plain/train.py                    # CPU, under a minute
    python examples/plain/train.py --accumulate 2     # two micro-batches per optimizer step

The only line the loop gains is ``with prof.step(batch):``. The report is printed at the window's end
and saved, with a JSON of the full profile, in --log-dir; the metrics go to the ``log`` function.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from flops_callbacks import StepProfiler

VOCAB, CONTEXT = 512, 128


def tiny_gpt2() -> GPT2LMHeadModel:
    """GPT-2's architecture at 2 layers x 128 wide, built from a config (nothing downloaded)."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=128, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def synthetic_batches(steps: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=16, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--profile-step", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--log-dir", default="runs/plain")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def log(metrics: dict[str, float], step: int) -> None:
        shown = {
            k: round(v, 4) for k, v in metrics.items() if k.endswith(("latency", "samples_per_sec", "mfu"))
        }
        print(f"step {step}: {shown}")

    prof = StepProfiler(
        model, profile_step=args.profile_step, log=log, log_dir=args.log_dir, log_every_n_steps=5
    )
    for i, batch in enumerate(synthetic_batches(args.max_steps * args.accumulate, args.batch_size)):
        with prof.step(batch):
            loss = model(**batch).loss / args.accumulate
            loss.backward()
            if (i + 1) % args.accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
    prof.close()
    if prof.metrics is not None:
        flops = prof.metrics["flops_profiler/fwd_flops"] + prof.metrics["flops_profiler/bwd_flops"]
        print(f"fwd+bwd flops per optimizer step: {flops:.3e}")


if __name__ == "__main__":
    main()
