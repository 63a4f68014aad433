"""Can the module tree's widths be believed? The root's forward (module-timing step) over the forward
phase (median of the clean steps), before and after, side by side in one run.

The model the LightningModule wraps is the tree's root here: its forward is one module call inside the
forward phase, which adds only the loss and Lightning's own call to it, so a true tree reads a little
under 1. Models: (a) 24 x (Linear(128,128)+ReLU), batch 32; (b) 100 residual blocks
(x + relu(Linear(LayerNorm(x)))), width 128, batch 32; (c) GPT-2 4 layers x 128, seq 128, batch 8.
Goal: each within [0.9, 1.1], median of ``--repeats`` runs.

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
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
BEFORE = "3519c06"  # the last commit before the per-module timing remedies (issue 19)
CASES = {
    "mlp": "24 x (Linear(128,128)+ReLU), batch 32",
    "residual": "100 x residual (LayerNorm, Linear(128,128), ReLU), batch 32",
    "gpt2": "GPT-2 4 x 128, seq 128, batch 8",
}


class Residual(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def build(case: str) -> tuple[nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    if case == "mlp":
        layers: list[nn.Module] = []
        for _ in range(24):
            layers += [nn.Linear(128, 128), nn.ReLU()]
        return nn.Sequential(*layers), lambda: {"x": torch.randn(32, 128)}
    if case == "residual":
        return nn.Sequential(*[Residual() for _ in range(100)]), lambda: {"x": torch.randn(32, 128)}
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=1000)
    ids = torch.randint(0, config.vocab_size, (8, 128))
    return transformers.GPT2LMHeadModel(config), lambda: {"input_ids": ids, "labels": ids}


def one_run(case: str) -> dict[str, float]:
    """One Lightning fit with the callback: the root's forward, the forward phase, and their ratio."""
    import lightning as L

    from flops_callbacks import FlopsProfilerCallback

    class Module(L.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if "x" in batch:
                return self.model(batch["x"]).square().mean()
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    model, make = build(case)
    steps = 8
    data = [make() for _ in range(steps)]
    ours = FlopsProfilerCallback(profile_step=2, clean_steps=3, print_profile=False, throughput=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            callbacks=[ours],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(Module(model), torch.utils.data.DataLoader(data, batch_size=None))
    result = ours.result
    root_fwd = result.profile.modules["model"].fwd_latency
    return {"root": root_fwd, "phase": result.fwd_latency, "ratio": root_fwd / result.fwd_latency}


def run_side(case: str, package_root: Path, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    command = [sys.executable, __file__, "--worker", case, "--threads", str(threads)]
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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        print(json.dumps(one_run(args.worker)))
        return
    cases = args.cases.split(",")
    rows: dict[str, dict[str, list[dict[str, float]]]] = {c: {"before": [], "after": []} for c in cases}
    with tempfile.TemporaryDirectory() as folder:
        before_root = extract(args.before, Path(folder))
        for _ in range(args.repeats):
            for case in cases:
                rows[case]["before"].append(run_side(case, before_root, args.threads))
                rows[case]["after"].append(run_side(case, REPO, args.threads))
    print(
        f"Root forward (module-timing step) / forward phase (clean steps); median of {args.repeats} "
        f"run(s) each, torch {torch.__version__}, {args.threads} thread(s); before = {args.before}\n"
    )
    print("| model | before: ratio (runs) | after: ratio (runs) | after: root / phase ms |")
    print("|---|---:|---:|---:|")
    for case in cases:
        cells = []
        for side in ("before", "after"):
            ratios = [r["ratio"] for r in rows[case][side]]
            runs = ", ".join(f"{r:.2f}" for r in ratios)
            cells.append(f"{statistics.median(ratios):.2f} ({runs})")
        after = rows[case]["after"]
        ms = f"{statistics.median(r['root'] for r in after) * 1e3:.2f} / "
        ms += f"{statistics.median(r['phase'] for r in after) * 1e3:.2f}"
        print(f"| {CASES[case]} | {cells[0]} | {cells[1]} | {ms} |")


if __name__ == "__main__":
    main()
