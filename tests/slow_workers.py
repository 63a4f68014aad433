"""The processes of tests/integrations/test_slow_rank_runs.py: a data-parallel MLP on gloo (CPU) with one rank
made slow by a known sleep, whose windows name it.

``python slow_workers.py KIND DIR SLOW_RANK [SLEEP_MS]`` (``SLOW_RANK`` -1: no rank sleeps)

* ``loop``: DDP in a loop of one's own with ``StepProfiler`` (under ``torchrun``);
* ``lightning``: Lightning's ``ddp`` strategy (its own launcher starts the second process);
* ``hf``: the HF Trainer's DDP (under ``torchrun``); ``hf-accumulating``: with 2 micro-batches a step,
  each sleeping half the step's sleep.

Two windows: the first (with its communication steps) while the slow rank sleeps in its model's forward,
the second (a re-profile window: clean steps only, ``profile_every``) once it sleeps in its batches'
collate function instead. Each rank writes ``rank{N}.json``: each window's metrics and slow-rank figures
(as the profile file holds them) and its report rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks.session.window_plan import MODULE_TIMING_STEPS  # noqa: E402
from tests.comm_workers import Pairs, Regressor  # noqa: E402
from tests.support import end_process  # noqa: E402

# 9 communication steps: a median of 9 exposed times per rank (gloo's scatter on a shared CPU; "auto" may
# stop at 3 where the ranks' means agree)
PROFILE_STEP, CLEAN, COMM, BATCH, WIDTH = 1, 8, 9, 32, 128
EVERY = 1 + MODULE_TIMING_STEPS + COMM + 1 + CLEAN + 1  # the second window starts after the first ended
STEPS = PROFILE_STEP + EVERY + 1 + CLEAN + 2  # its lead-in and clean steps, and two more
TIMEOUT = timedelta(seconds=120)
OPTIONS: dict[str, Any] = dict(
    profile_step=PROFILE_STEP, clean_steps=CLEAN, comm_steps=COMM, profile_every=EVERY, print_profile=False
)


class Sleeper:
    """Where the slow rank sleeps: in the forward until the first window's result, then in the data."""

    def __init__(self, slow: int, seconds: float) -> None:
        self.slow, self.seconds, self.where = slow, seconds, "forward"

    def __call__(self, where: str) -> None:
        dist = torch.distributed
        if where == self.where and dist.is_initialized() and dist.get_rank() == self.slow:
            time.sleep(self.seconds)


class Slowed(Regressor):
    def __init__(self, sleeper: Sleeper) -> None:
        super().__init__(WIDTH)
        self.sleeper = sleeper

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.sleeper("forward")
        return super().forward(x, y)


class Collate:
    def __init__(self, sleeper: Sleeper) -> None:
        self.sleeper = sleeper

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.sleeper("data")
        return torch.utils.data.default_collate(items)


class Windows:
    """Each window's result as it is published (the adapter's ``result`` changes at its end)."""

    def __init__(self, sleeper: Sleeper) -> None:
        self.sleeper, self.results = sleeper, []

    def see(self, result: Any) -> None:
        if result is not None and (not self.results or result is not self.results[-1]):
            self.results.append(result)
            self.sleeper.where = "data"


def save(directory: Path, rank: int, windows: Windows) -> None:
    from flops_callbacks.reporting.profile_file import json_data
    from flops_callbacks.reporting.window_rows import timing_lines

    seen = [
        {
            "metrics": r.metrics(),
            "slow_rank": json_data(r).get("slow_rank"),
            "rows": [list(row) for row in timing_lines(r, r.metrics())],
        }
        for r in windows.results
    ]
    (directory / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "windows": seen}))


def loop(directory: Path, sleeper: Sleeper) -> None:
    from flops_callbacks import StepProfiler

    torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    model = nn.parallel.DistributedDataParallel(Slowed(sleeper))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Pairs(WIDTH), batch_size=BATCH, collate_fn=Collate(sleeper))
    prof = StepProfiler(model, log_dir=directory, **OPTIONS)
    windows = Windows(sleeper)
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        with prof.step(batch):
            model(**batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
        windows.see(prof.result)
    prof.close()
    save(directory, torch.distributed.get_rank(), windows)


def lightning(directory: Path, sleeper: Sleeper) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from flops_callbacks import FlopsProfilerCallback

    callback = FlopsProfilerCallback(**OPTIONS)
    windows = Windows(sleeper)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Slowed(sleeper)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch)["loss"]

        def on_train_batch_end(self, *args: Any) -> None:
            windows.see(callback.result)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT), max_steps=STEPS,
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Pairs(WIDTH), batch_size=BATCH, collate_fn=Collate(sleeper))
    trainer.fit(Module(), loader)
    save(directory, trainer.global_rank, windows)


def hf(directory: Path, sleeper: Sleeper, accumulation: int = 1) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from flops_callbacks.integrations.hf import HFFlopsCallback

    callback = HFFlopsCallback(**OPTIONS)
    windows = Windows(sleeper)

    class Watch(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            windows.see(callback.result)

    args = TrainingArguments(
        output_dir=str(directory / "out"), use_cpu=True, ddp_backend="gloo",
        ddp_timeout=int(TIMEOUT.total_seconds()), per_device_train_batch_size=BATCH, max_steps=STEPS,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    trainer = Trainer(
        model=Slowed(sleeper), args=args, train_dataset=Pairs(WIDTH), data_collator=Collate(sleeper),
        callbacks=[callback, Watch()],
    )  # fmt: skip
    trainer.train()
    save(directory, int(os.environ.get("RANK", 0)), windows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    kind, out, slow = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    seconds = (float(sys.argv[4]) if len(sys.argv) > 4 else 20.0) / 1e3
    if kind == "hf-accumulating":  # 2 micro-batches a step, each sleeping half the step's sleep
        hf(out, Sleeper(slow, seconds / 2), accumulation=2)
    else:
        {"loop": loop, "lightning": lightning, "hf": hf}[kind](out, Sleeper(slow, seconds))
    end_process()
