"""Truth of the reported times: our latencies against a hand timer on the same boundaries, in one run.

A real ``lightning.Trainer`` and a real ``transformers.Trainer`` train each model with two callbacks:
ours (a window at ``--profile-step``) and a hand timer that marks the same framework boundaries on
every step. "True" is the hand timer's median twice: over the steps outside the window (steps the
profiler does not touch), and over the window's own clean steps (the same steps the profile's latencies
are the median of, marked by the loop as it ran them: on a launch-bound GPU step the truth of other steps
drifts, 23 -> 35 ms between two runs on an H100); "reported" is what our profile reports. The ratio
reported / true is printed for iter, fwd, bwd and step latency and samples/s, as the median over
``--repeats`` runs; the same steps' goal is iter within [0.97, 1.03] and each phase within [0.95, 1.05].

Boundaries (as the callbacks document them): Lightning: forward = the user's training_step (marked in
it), backward on_before_backward -> on_before_optimizer_step, step -> on_train_batch_end. HF Trainer:
forward = compute_loss (a Trainer subclass marks it), backward -> on_pre_optimizer_step, step ->
on_optimizer_step. The framework's work between them (Lightning's closure and zero_grad, the HF
Trainer's model.train()) is in neither side's phases.

Models: (a) 24 x (Linear(128,128)+ReLU), batch 32; (b) GPT-2 4 layers x 128, seq 128, batch 8;
(c) GPT-2 124M, seq 128, batch 2. Goal on CPU: iter within [0.97, 1.03] and each phase within
[0.9, 1.1] for every case and both frameworks.

    python benchmarks/timing_truth.py [--repeats 3] [--cases mlp,gpt2-small,gpt2-124m] [--threads 1]
    python benchmarks/timing_truth.py --device cuda --bf16      # on a GPU: CUDA events on both sides
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import transformers
from common import quiet_trainer
from torch import nn

from flops_callbacks import FlopsProfilerCallback, HFFlopsCallback

PHASES = ("iter", "fwd", "bwd", "step", "samples/s")


class Marks:
    """Hand marks on the device's clock: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.steps: list[dict[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.steps[-1][name] = event
        else:
            self.steps[-1][name] = time.perf_counter()

    def begin(self) -> None:
        self.steps.append({})  # a new step: its marks follow

    def phases(self, keep: Callable[[int], bool]) -> dict[str, float]:
        """Median (fwd, bwd, step) seconds over the steps whose index ``keep`` accepts."""
        if self.cuda:
            torch.cuda.synchronize()

        def seconds(a: Any, b: Any) -> float:
            return a.elapsed_time(b) / 1000 if self.cuda else b - a

        names = {"fwd", "fwd_end", "bwd", "opt", "end"}
        rows = [
            (seconds(s["fwd"], s["fwd_end"]), seconds(s["bwd"], s["opt"]), seconds(s["opt"], s["end"]))
            for i, s in enumerate(self.steps)
            if keep(i) and names <= set(s)
        ]
        fwd, bwd, opt = (statistics.median(r[k] for r in rows) for k in range(3))
        return {"fwd": fwd, "bwd": bwd, "step": opt}


# --- models -------------------------------------------------------------------------------------------


def mlp() -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]], int]:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers), lambda i: {"x": torch.randn(32, 128)}, 32


def gpt2(layers: int, width: int, heads: int, batch: int) -> Callable[[], Any]:
    def build() -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]], int]:
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=128)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
        return model, lambda i: {"input_ids": ids, "labels": ids}, batch

    return build


CASES = {
    "mlp": ("24 x (Linear(128,128)+ReLU), batch 32", mlp),
    "gpt2-small": ("GPT-2 4 x 128, seq 128, batch 8", gpt2(4, 128, 4, 8)),
    "gpt2-124m": ("GPT-2 124M, seq 128, batch 2", gpt2(12, 768, 12, 2)),
}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "x" in batch:
        return model(batch["x"]).square().mean()
    return model(**batch).loss


# --- Lightning ----------------------------------------------------------------------------------------


class Module(L.LightningModule):
    def __init__(self, model: nn.Module, marks: Marks) -> None:
        super().__init__()
        self.model, self.marks = model, marks

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.marks.mark("fwd")
        loss = loss_of(self.model, batch)
        self.marks.mark("fwd_end")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class LightningHand(L.Callback):
    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.marks.begin()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.marks.mark("bwd")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.marks.mark("opt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.marks.mark("end")


class Batches(torch.utils.data.Dataset):
    def __init__(self, make: Callable[[int], dict[str, torch.Tensor]], steps: int) -> None:
        self.items = [make(i) for i in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def run_lightning(build: Callable[[], Any], args: argparse.Namespace) -> tuple[Any, Marks]:
    model, make, _ = build()
    marks = Marks(args.device)
    ours = FlopsProfilerCallback(profile_step=args.profile_step, print_profile=False, throughput=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(
            root,
            args.steps,
            [ours, LightningHand(marks)],
            accelerator="gpu" if args.device.startswith("cuda") else "cpu",
            precision="bf16-mixed" if args.bf16 else "32-true",
        )
        loader = torch.utils.data.DataLoader(Batches(make, args.steps), batch_size=None)
        trainer.fit(Module(model, marks), loader)
    return ours.result, marks


# --- HF Trainer ---------------------------------------------------------------------------------------


class HandTrainer(transformers.Trainer):
    """Marks the start of each training_step (a new step's marks) and compute_loss (the forward)."""

    marks: Marks

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.marks.begin()
        return super().training_step(*args, **kwargs)

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        self.marks.mark("fwd")
        loss = loss_of(model, inputs)
        self.marks.mark("fwd_end")
        self.marks.mark("bwd")
        return loss


class HFHand(transformers.TrainerCallback):
    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.marks.mark("opt")

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.marks.mark("end")


def run_hf(build: Callable[[], Any], args: argparse.Namespace) -> tuple[Any, Marks]:
    model, make, _ = build()
    marks = Marks(args.device)
    ours = HFFlopsCallback(profile_step=args.profile_step, print_profile=False, throughput=False)
    with tempfile.TemporaryDirectory() as root:
        training = transformers.TrainingArguments(
            output_dir=root,
            max_steps=args.steps,
            per_device_train_batch_size=1,
            learning_rate=1e-4,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=not args.device.startswith("cuda"),
            bf16=args.bf16,
            dataloader_num_workers=0,
            remove_unused_columns=False,
        )
        trainer = HandTrainer(
            model=model,
            args=training,
            train_dataset=Batches(make, args.steps),
            data_collator=lambda items: items[0],
            callbacks=[ours, HFHand(marks)],
        )
        trainer.marks = marks
        trainer.train()
    return ours.result, marks


def outside_window(result: Any) -> Callable[[int], bool]:
    """Step indices (0-based, = global step at the step's start) the profile window did not touch;
    the first two steps are warm-up."""
    first = result.steps.counting
    last = max((first, *result.steps.module_timing, *result.steps.clean))
    return lambda i: i >= 2 and not first <= i <= last


def ratios(result: Any, true: dict[str, float], samples: int) -> dict[str, float]:
    true_iter = true["fwd"] + true["bwd"] + true["step"]
    return {
        "iter": result.iter_latency / true_iter,
        "fwd": result.fwd_latency / true["fwd"],
        "bwd": result.bwd_latency / true["bwd"],
        "step": result.step_latency / true["step"],
        "samples/s": (result.samples / result.iter_latency) / (samples / true_iter),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--frameworks", default="lightning,hf")
    parser.add_argument("--profile-step", type=int, default=6)
    # 30: steps after the window (3 module-timing steps, up to 20 clean ones) count as outside it too, not
    # only steps 2-5 (early AdamW steps read the step phase 0.67-0.84x of the later ones)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: least noise)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    runners = {"lightning": run_lightning, "hf": run_hf}
    where = f"{args.device}{' bf16' if args.bf16 else ''}"
    if args.device == "cpu":
        where += f", {args.threads} thread(s)"
    goal = "goal: iter in [0.97, 1.03]; phases in [0.9, 1.1] (outside), [0.95, 1.05] (the same steps)"
    print(f"reported / true, median of {args.repeats} runs ({where}); {goal}\n")
    print("| model | framework | truth | " + " | ".join(PHASES) + " | true iter |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 1))
    for case in args.cases.split(","):
        title, build = CASES[case]
        samples = build()[2]
        for framework in args.frameworks.split(","):
            rows: dict[str, list[dict[str, float]]] = {"outside": [], "same steps": []}
            trues: dict[str, list[float]] = {"outside": [], "same steps": []}
            for _ in range(args.repeats):
                result, marks = runners[framework](build, args)
                clean = set(result.steps.clean)
                # outside: the steps the window does not touch; the same steps: the window's clean ones,
                # marked by the loop as it ran them (no drift of a launch-bound step between two sets)
                for truth, keep in (("outside", outside_window(result)), ("same steps", clean.__contains__)):
                    true = marks.phases(keep)
                    rows[truth].append(ratios(result, true, samples))
                    trues[truth].append(true["fwd"] + true["bwd"] + true["step"])
            for truth, each in rows.items():
                median = {k: statistics.median(r[k] for r in each) for k in PHASES}
                cells = " | ".join(f"{median[k]:.3f}" for k in PHASES)
                true_iter = statistics.median(trues[truth]) * 1000
                print(f"| {title} | {framework} | {truth} | {cells} | {true_iter:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
