"""The window on a GPU: MFU against a hand computation, and what each window step costs beside plain steps.

GPT-2 124M built from its config (random weights), bf16 mixed precision, batch ``--batch`` x seq
``--seq``, AdamW, a real ``lightning.Trainer`` on one CUDA device. Per repeat, three runs of the same steps
in turn: plain (a step timer only), profiled (``FlopsProfilerCallback(profile_step=5)`` and the same
timer), and the peer: torch's ``FlopCounterMode`` around the whole of the step our window counts (forward,
backward and optimizer step, entered at its ``on_train_batch_start`` and left at its
``on_train_batch_end``), with the same timer. A step's time is the wall clock from one
``on_train_batch_start`` to the next (the GPU runs ahead of the host between them; a median over many
steps is the GPU's pace).

Printed:

* MFU: the reported ``mfu``; ``6 N T / iter / peak`` by hand (N the parameters, T the tokens of a step,
  iter the reported iter latency); Megatron's ``(6 N + 12 L s d) T`` (attention's matmuls added); the
  measured model flops over each formula.
* the cost of each kind of window step: its time over the plain run's median step; the steps after the
  window over the plain run's same steps (goal <= 1.01); the same step counted by ``FlopCounterMode``
  over the plain median step, and our counting step over it (goal <= 1), with both counts' flops.
* a fake-tensor count of one shape (the off-clock count): its seconds, and its flops against the window's
  real count of the same shape (must be equal).

    python benchmarks/gpu_window.py [--batch 8] [--seq 1024] [--steps 70] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import transformers
from common import flop_counter_step, quiet_trainer, step_timer

from flops_callbacks import FlopsProfilerCallback
from flops_callbacks import metrics as names
from flops_callbacks.counting.fake_count import fake_count
from flops_callbacks.profile import model_flops
from flops_callbacks.session.result import window_metrics

PROFILE_STEP = 5


def build(seq: int, layers: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=seq, n_layer=layers))


def lightning_module(model: Any) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Module()


class Batches(torch.utils.data.Dataset):
    def __init__(self, steps: int, batch: int, seq: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i], "labels": self.items[i]}


def run(
    args: argparse.Namespace, profiled: bool, show: bool = False, peer_at: int | None = None
) -> tuple[list[float], Any, Any]:
    """One run: its step times by global step, our callback (or, with ``peer_at``, the FlopCounterMode
    callback counting that step; None when plain), its model."""
    model = build(args.seq, args.layers)
    timer = step_timer({"wall": time.perf_counter})
    ours = FlopsProfilerCallback(profile_step=PROFILE_STEP, print_profile=show, throughput=False)
    peer = flop_counter_step(peer_at) if peer_at is not None else None
    callbacks = [ours, timer] if profiled else [timer, peer] if peer is not None else [timer]
    data = Batches(args.steps, args.batch, args.seq, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as root:
        accelerator = "gpu" if args.device == "cuda" else "cpu"
        trainer = quiet_trainer(root, args.steps, callbacks, accelerator=accelerator, precision="bf16-mixed")
        trainer.fit(lightning_module(model), torch.utils.data.DataLoader(data, batch_size=None))
    if args.device == "cuda":
        torch.cuda.synchronize()
    return timer.step_times("wall"), (ours if profiled else peer), model


def fake_seconds(model: Any, batch: int, seq: int, device: str) -> tuple[float, int]:
    """Seconds and model flops of one fake count of a (batch, seq) micro-batch, as the off-clock count
    runs it (autocast bf16, as Lightning's precision wraps the training step)."""
    model.to(device)  # Lightning's teardown left it on the CPU
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def step(m: Any, b: dict[str, torch.Tensor]) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(**b).loss
        loss.backward()

    start = time.perf_counter()
    counts = fake_count(model, step, {"input_ids": ids, "labels": ids})
    return time.perf_counter() - start, model_flops(counts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12: 124M)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"transformers {transformers.__version__}; GPT-2 {args.layers} layers, bf16-mixed, "
          f"batch {args.batch} x seq {args.seq}, {args.steps} steps, {args.repeats} repeat(s)\n")  # fmt: skip
    costs: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        plain, _, _ = run(args, profiled=False)
        times, ours, model = run(args, profiled=True, show=repeat == 0)
        result = ours.result
        metrics = window_metrics(result)
        base = statistics.median(plain[2:])
        steps = result.steps
        window = {"counting": [steps.counting], "module timing": list(steps.module_timing),
                  "clean": list(steps.clean)}  # fmt: skip
        last = max(steps.counting, *steps.module_timing, *steps.clean)
        window["check / other window steps"] = [
            s for s in range(steps.counting, last + 1) if all(s not in v for v in window.values())
        ]
        for kind, which in window.items():
            if which:
                costs.setdefault(kind, []).append(statistics.median(times[s] for s in which) / base)
        after = range(last + 2, len(times))
        if after:  # none when --steps leaves no step after the window
            costs.setdefault("after the window (vs the same plain steps)", []).append(
                statistics.median(times[s] for s in after) / statistics.median(plain[s] for s in after)
            )
        counted, peer, _ = run(args, profiled=False, peer_at=steps.counting)
        costs.setdefault("FlopCounterMode counting the same step", []).append(counted[steps.counting] / base)
        costs.setdefault("our counting step / FlopCounterMode's (goal <= 1)", []).append(
            times[steps.counting] / counted[steps.counting]
        )
        ours_flops = result.profile.hardware_flops
        print(f"repeat {repeat + 1}: the counted step's flops, ours (hardware: fwd + bwd + recompute) "
              f"{ours_flops:.4e}, FlopCounterMode's (the optimizer step's too) {peer.flops:.4e}")  # fmt: skip
        if repeat == 0:
            params = sum(p.numel() for p in model.parameters())
            tokens = args.batch * args.seq
            config = model.config
            peak = result.peak.flops if result.peak is not None else float("nan")
            iter_s = metrics[names.ITER_LATENCY]
            measured = model_flops(result.profile)
            hand = 6 * params * tokens
            megatron = (6 * params + 12 * config.n_layer * args.seq * config.n_embd) * tokens
            print(f"peak: {result.peak}")
            print(f"iter {iter_s * 1e3:.2f} ms (plain median step {base * 1e3:.2f} ms), "
                  f"fwd {metrics[names.FWD_LATENCY] * 1e3:.2f}, bwd {metrics[names.BWD_LATENCY] * 1e3:.2f}, "
                  f"step {metrics[names.STEP_LATENCY] * 1e3:.2f} ms")  # fmt: skip
            print(f"mfu reported {metrics.get(names.MFU, float('nan')):.4f}; "
                  f"6NT/iter/peak {hand / iter_s / peak:.4f}; Megatron {megatron / iter_s / peak:.4f}; "
                  f"measured/iter/peak {measured / iter_s / peak:.4f}")  # fmt: skip
            print(f"model flops measured {measured:.4e}; / 6NT {measured / hand:.4f}; "
                  f"/ Megatron {measured / megatron:.4f}; N {params}, T {tokens}")  # fmt: skip
            print(f"flops sources: {result.flops_sources}")
            print(f"communication steps: {steps.communication} (one device: none)")
            print(f"data latency {metrics.get(names.DATA_LATENCY, float('nan')) * 1e3:.3f} ms, wall "
                  f"{metrics.get(names.WALL_LATENCY, float('nan')) * 1e3:.2f} ms; peak memory by phase "
                  f"(bytes): {result.peak_memory}")  # fmt: skip
            for batch, seq in ((args.batch, args.seq), (args.batch, args.seq // 2)):
                seconds, flops = fake_seconds(model, batch, seq, args.device)
                same = f", the window's real count {measured}: equal {flops == measured}"
                print(f"fake count of {batch} x {seq}: {seconds * 1e3:.0f} ms "
                      f"({seconds / base:.1f} plain steps), {flops} model flops"
                      f"{same if seq == args.seq else ''}")  # fmt: skip
    print("\n| window step | time / plain median step (each repeat) |\n|---|---|")
    for kind, ratios in costs.items():
        print(f"| {kind} | {' '.join(f'{r:.3f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
