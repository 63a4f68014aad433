"""A small GPT trained with Lightning on synthetic tokens, profiled at step 10 by FlopsProfilerCallback.

    python examples/lightning/train.py                       # CPU, under a minute; MFU of the measured peak
    python examples/lightning/train.py --report full         # DeepSpeed's layout on the console
    python examples/lightning/train.py --max-steps 40 --clean-steps 20   # a steadier profile, for a gate
    python examples/lightning/train.py --accelerator gpu --devices 2 --strategy ddp --precision bf16-mixed
    tensorboard --logdir runs/lightning                      # the flops_profiler/* scalars

At the window's end the console gets a summary; the full report is saved, with a JSON of the full
profile, a picture and a trace, in the TensorBoard log directory.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from flops_callbacks import FlopsProfilerCallback

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 512, 128, 128, 4, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences; the target is the input shifted by one."""

    def __init__(self, sequences: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (sequences, CONTEXT + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.data[index]
        return sequence[:-1], sequence[1:]


def count_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    return batch[0].numel()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu, auto, ...")
    parser.add_argument("--devices", default="1", help="number of devices, or 'auto'")
    parser.add_argument("--strategy", default="auto", help="auto, ddp, fsdp, deepspeed, ...")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--profile-step", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per device and micro-batch")
    parser.add_argument("--default-root-dir", default="runs/lightning")
    parser.add_argument("--report", default="summary", choices=["summary", "full"], help="console report")
    parser.add_argument(
        "--clean-steps",
        default="auto",
        help="steps timed clean: 'auto' (5 to 20, until the median iter latency is known within +-3%%; "
        "fewer where the run ends first) or a number",
    )
    parser.add_argument(
        "--peak-flops", default=None,
        help="MFU's peak per device: a number, 'measure' (the device's matmul rate, measured; the default "
        "on cpu) or 'datasheet' (the peak table's; the default elsewhere)",
    )  # fmt: skip
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    devices = args.devices if args.devices == "auto" else int(args.devices)
    sequences = args.batch_size * args.accumulate_grad_batches * (args.max_steps + 1)
    data = torch.utils.data.DataLoader(SyntheticTokens(sequences), batch_size=args.batch_size, shuffle=True)
    peak = args.peak_flops or ("measure" if args.accelerator == "cpu" else "datasheet")
    profiler = FlopsProfilerCallback(
        profile_step=args.profile_step,
        clean_steps=args.clean_steps if args.clean_steps == "auto" else int(args.clean_steps),
        top_modules=3,
        tokens_fn=count_tokens,
        report=args.report,
        peak_flops=None if peak == "datasheet" else "measure" if peak == "measure" else float(peak),
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=args.strategy,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate_grad_batches,
        max_steps=args.max_steps,
        default_root_dir=args.default_root_dir,
        logger=TensorBoardLogger(args.default_root_dir, name="gpt"),
        callbacks=[profiler],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,  # its FLOPs column needs example_input_array; the profile has them
    )
    trainer.fit(GPT(), train_dataloaders=data)
    if trainer.is_global_zero and profiler.result is not None:
        log_dir = trainer.logger.log_dir
        print(f"Report and logs in {log_dir}; view them with: tensorboard --logdir {args.default_root_dir}")


if __name__ == "__main__":
    main()
