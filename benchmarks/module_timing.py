"""Can the module tree's widths be believed? The tree's root forward (one module-timing step's, as the
report chooses it) against a stopwatch, before and after, side by side in one run.

The model the LightningModule wraps is the tree's root here. Three checks, each a ratio:

* root / stopwatch: the user's own ``perf_counter`` around ``self.model(...)`` in ``training_step``,
  median of the clean steps (two clock reads, no hook): the truth for the root. Goal [0.9, 1.1].
* children / no-hook marks (the two Sequential models): the sum of the children's tree widths against
  ``perf_counter`` marks the Sequential's own forward takes between its children on every call (no hook),
  each child's median over the clean steps: a truth that owes nothing to the profiler, taken on the
  training steps themselves (marks taken in a loop after the run read 10-40% apart from them and from
  each other on ops of 5-20 us). Goal [0.9, 1.1].
* runs off / flagged (after only): how many runs' root / stopwatch fell outside [0.9, 1.1], how many of
  those the report flagged ``module latencies in doubt``, and how many it flagged needlessly.
* model's own forward / stopwatch (after only): the report's "the model's own forward" row (its outermost
  module calls, marked on the clean steps) against the same stopwatch. Goal [0.9, 1.1]. The root against
  it (root / own) is the check a user can make from the report alone.
* root / phase: the issue's check. The forward phase is the user's ``training_step`` (Lightning) or
  ``compute_loss`` (HF): the model's call and the loss; the framework's work around them is no phase's.
  Goal [0.9, 1.1].

Models: (a) 24 x (Linear(128,128)+ReLU), batch 32; (b) 100 residual blocks (x + relu(Linear(LayerNorm(x)))),
width 128, batch 32; (c) GPT-2 4 layers x 128, seq 128, batch 8. Median of ``--repeats`` runs.

"Before" is the package as it was at ``--before`` (extracted with ``git archive`` into a temporary
folder), "after" is this checkout's; every run is its own process (a fresh interpreter for each side),
and the two sides alternate so that a busy machine weighs on both alike.

    python benchmarks/module_timing.py [--repeats 3] [--cases mlp,residual,gpt2] [--before REF]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
SIDES = ("before", "after")
BEFORE = "3519c06"  # the package without the hooks' cost taken out: "before"
CASES = {
    "mlp": "24 x (Linear(128,128)+ReLU), batch 32",
    "mlp512": "24 x (Linear(128,128)+ReLU), batch 512",
    "residual": "100 x residual (LayerNorm, Linear(128,128), ReLU), batch 32",
    "gpt2": "GPT-2 4 x 128, seq 128, batch 8",
}


class Marked(nn.Sequential):
    """A Sequential that reads the clock between its children on every forward, no hook (a read costs
    about 50 ns): ``last`` holds the last forward's seconds per child."""

    last: list[float]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        each, mark = [], time.perf_counter()
        for child in self:
            x = child(x)
            now = time.perf_counter()
            each.append(now - mark)
            mark = now
        self.last = each
        return x


class Residual(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def build(case: str) -> tuple[nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    if case in ("mlp", "mlp512"):
        layers: list[nn.Module] = []
        for _ in range(24):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        batch = 512 if case == "mlp512" else 32
        return Marked(*layers), lambda: {"x": torch.randn(batch, 128)}
    if case == "residual":
        return Marked(*[Residual() for _ in range(100)]), lambda: {"x": torch.randn(32, 128)}
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=1000)
    ids = torch.randint(0, config.vocab_size, (8, 128))
    return transformers.GPT2LMHeadModel(config), lambda: {"input_ids": ids, "labels": ids}


def one_run(case: str) -> dict[str, float]:
    """One Lightning fit with the callback: the root's forward, the forward phase, and their ratio."""
    import lightning as L
    from common import quiet_trainer

    from flops_callbacks import FlopsProfilerCallback

    class Module(L.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model
            self.stopwatch: dict[int, float] = {}  # global step -> the model's forward, no hook of ours
            self.children_marks: dict[int, list[float]] = {}  # global step -> each child's seconds

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            begin = time.perf_counter()
            out = self.model(batch["x"]) if "x" in batch else self.model(**batch)
            self.stopwatch[self.global_step] = time.perf_counter() - begin
            if isinstance(self.model, Marked):
                self.children_marks[self.global_step] = self.model.last
            return out.square().mean() if "x" in batch else out.loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    model, make = build(case)
    steps = 12
    data = [make() for _ in range(steps)]
    ours = FlopsProfilerCallback(profile_step=2, clean_steps=3, print_profile=False, throughput=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(root, steps, [ours])
        lit = Module(model)
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
    return _row(ours.result, "model", model, lit.stopwatch, lit.children_marks)


def _row(
    result: Any, root: str, model: nn.Module, watch: dict[int, float], marks: dict[int, list[float]]
) -> dict[str, float]:
    """The ratios of one run, from its window result, the tree's root name, the stopwatch and the
    Sequential's marks between its children (global step -> seconds per child)."""
    root_fwd = result.profile.modules[root].fwd_latency
    stopwatch = statistics.median(watch[step] for step in result.steps.clean)
    row = {
        "root": root_fwd,
        "phase": result.fwd_latency,
        "ratio": root_fwd / result.fwd_latency,
        "stopwatch": stopwatch,
        "truth": root_fwd / stopwatch,
    }
    own = getattr(result, "model_forward", None)  # the report's row (not in the "before" package)
    if own:
        from flops_callbacks.reporting.window_rows import tree_doubts

        row["own"], row["root_own"] = own / stopwatch, root_fwd / own
        # the report's "in doubt" row, for the forward (a backward's note says nothing of the root's forward)
        row["doubted"] = float(any("forward" in note for note in tree_doubts(result).notes))
    net, prefix = (model.net, f"{root}.net") if isinstance(model, WithLoss) else (model, root)
    if isinstance(net, Marked):  # the children's widths against the marks of the clean steps, no hook
        tree = sum(result.profile.modules[f"{prefix}.{i}".lstrip(".")].fwd_latency for i in range(len(net)))
        clean = [marks[step] for step in result.steps.clean]
        row["children"] = tree / sum(statistics.median(child) for child in zip(*clean, strict=True))
    return row


class WithLoss(nn.Module):
    """The Sequential models with their loss inside, as Hugging Face models hold theirs: what the HF
    Trainer calls."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).square().mean()}


def one_hf_run(case: str) -> dict[str, float]:
    """One HF Trainer run with the callback: the forward phase is ``compute_loss`` (the model's call,
    loss inside), so the root should fill it."""
    import transformers

    from flops_callbacks import HFFlopsCallback

    stopwatch: dict[int, float] = {}  # global step -> the model's call, no hook of ours
    children_marks: dict[int, list[float]] = {}  # global step -> each child's seconds

    class Timed(transformers.Trainer):
        def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, **kw: object):
            begin = time.perf_counter()
            outputs = model(**inputs)
            stopwatch[self.state.global_step] = time.perf_counter() - begin
            if isinstance(model, WithLoss):
                children_marks[self.state.global_step] = model.net.last
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    model, make = build(case)
    model = WithLoss(model) if isinstance(model, Marked) else model
    steps = 12
    data = [make() for _ in range(steps)]
    ours = HFFlopsCallback(profile_step=2, clean_steps=3, print_profile=False, throughput=False)
    with tempfile.TemporaryDirectory() as root:
        args = transformers.TrainingArguments(
            output_dir=root, use_cpu=True, max_steps=steps, per_device_train_batch_size=1,
            learning_rate=1e-4, save_strategy="no", report_to=[], disable_tqdm=True,
            remove_unused_columns=False, logging_steps=1000,
        )  # fmt: skip
        trainer = Timed(model=model, args=args, train_dataset=data, data_collator=lambda items: items[0])
        trainer.add_callback(ours)
        trainer.train()
    return _row(ours.result, "", model, stopwatch, children_marks)


def run_side(case: str, package_root: Path, threads: int, trainer: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    command = [sys.executable, __file__, "--worker", case, "--threads", str(threads), "--trainer", trainer]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{case} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def extract(ref: str, into: Path) -> Path:
    archive = into / "before.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "-o", str(archive), ref, "flops_callbacks"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--before", default=BEFORE, help="git ref of the 'before' package")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each run")
    parser.add_argument(
        "--trainer", choices=("lightning", "hf"), default="lightning", help="the Trainer each run fits with"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        print(json.dumps((one_hf_run if args.trainer == "hf" else one_run)(args.worker)))
        return
    cases = args.cases.split(",")
    rows: dict[str, dict[str, list[dict[str, float]]]] = {c: {"before": [], "after": []} for c in cases}
    with tempfile.TemporaryDirectory() as folder:
        before_root = extract(args.before, Path(folder))
        for _ in range(args.repeats):
            for case in cases:
                rows[case]["before"].append(run_side(case, before_root, args.threads, args.trainer))
                rows[case]["after"].append(run_side(case, REPO, args.threads, args.trainer))
    print(
        f"Root forward (module-timing step) / forward phase (clean steps); median of {args.repeats} "
        f"run(s) each, {args.trainer} Trainer, torch {torch.__version__}, {args.threads} thread(s); "
        f"before = {args.before}\n"
    )
    print(
        "| model | root / stopwatch, before | root / stopwatch, after | children / no-hook marks, before "
        "| children / no-hook marks, after | root / phase, before | root / phase, after "
        "| model's own forward / stopwatch, after | root / model's own forward, after "
        "| after: runs off (root / stopwatch outside [0.9, 1.1]) / of them flagged / others flagged "
        "| after: root / stopwatch / phase ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        cells = [_cell(rows[case][side], key) for key in ("truth", "children", "ratio") for side in SIDES]
        cells += [_cell(rows[case]["after"], key) for key in ("own", "root_own")]
        cells.append(_flagged(rows[case]["after"]))
        after = rows[case]["after"]
        ms = " / ".join(
            f"{statistics.median(r[key] for r in after) * 1e3:.2f}" for key in ("root", "stopwatch", "phase")
        )
        print(f"| {CASES[case]} | {' | '.join(cells)} | {ms} |")


def _flagged(runs: list[dict[str, float]]) -> str:
    """How many runs' roots were off the stopwatch, how many of those the report flagged "in doubt", and
    how many it flagged that were not off."""
    off = [not 0.9 <= r["truth"] <= 1.1 for r in runs]
    doubted = [bool(r.get("doubted")) for r in runs]
    caught = sum(o and d for o, d in zip(off, doubted, strict=True))
    needless = sum(d and not o for o, d in zip(off, doubted, strict=True))
    return f"{sum(off)} / {caught} / {needless}"


def _cell(runs: list[dict[str, float]], key: str) -> str:
    """The median of ``key`` over the runs and, in brackets, each run's."""
    values = [r[key] for r in runs if key in r]
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


if __name__ == "__main__":
    main()
