"""The processes of tests/integrations/test_comm.py: a data-parallel MLP on gloo whose communication
step the tests read (2 processes on CPU).

``python comm_workers.py KIND DIR [WIDTH] [BUCKET_MB]``

* ``loop``: DDP in a loop of one's own with ``StepProfiler`` (under ``torchrun``);
* ``slow_start``: ``loop``, rank 1's communication profiler 30 ms slower to start (the profiler's own
  work before the ranks line up, as a trace's start on a busy host);
* ``fsdp2``: ``fully_shard`` on each layer and the root, in a ``StepProfiler`` loop (under ``torchrun``);
* ``lightning``: Lightning's ``ddp`` strategy (its own launcher starts the second process);
* ``hf``: the HF Trainer's DDP (under ``torchrun``).

Each rank writes ``rank{N}.json``: the window's steps, the metrics, the communication figures and the
bytes of the model's gradients (what the all-reduces carry).
"""

from __future__ import annotations

import dataclasses
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
from flops_callbacks.session.window_plan import COMM_MAX, COMM_MIN  # noqa: E402
from tests.support import end_process, window_end  # noqa: E402

PROFILE_STEP, CLEAN, BATCH = 1, 2, 32
# comm_steps="auto": 3 communication steps, or up to 25 where they disagree (as on a loaded CPU)
STEPS = window_end(PROFILE_STEP, CLEAN, comm=True) + COMM_MAX - COMM_MIN + 1
TIMEOUT = timedelta(seconds=120)
SLOW_START = 0.03  # seconds rank 1's communication profiler takes longer to start (slow_start)


class Regressor(nn.Module):
    """An MLP of ``depth`` square layers with its loss: what every framework here can call."""

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.layers(x), y)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, width: int, size: int = 4096) -> None:
        self.width, self.size = width, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(self.width, generator=g), "y": torch.randn(self.width, generator=g)}


def save(directory: Path, rank: int, result: Any, model: nn.Module) -> None:
    from flops_callbacks.communication.report import comm_data
    from flops_callbacks.communication.slow_rank_report import slow_rank_data

    comm = result.comm if result is not None else None
    seen = {
        "rank": rank,
        "steps": dataclasses.asdict(result.steps) if result is not None else None,
        "metrics": result.metrics() if result is not None else None,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "comm": comm_data(comm),  # as the JSON file holds it
        "slow_rank": slow_rank_data(result.slow_rank) if result is not None else None,
        "profiler_left": torch.autograd._profiler_enabled(),
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(seen))


def loop(kind: str, directory: Path, width: int, bucket_mb: float) -> None:
    from flops_callbacks import StepProfiler

    torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
    rank = torch.distributed.get_rank()
    if kind == "slow_start" and rank == 1:
        from flops_callbacks.communication.recorder import CommRecorder

        start = CommRecorder.start

        def slow_start(self: CommRecorder) -> None:
            time.sleep(SLOW_START)
            start(self)

        CommRecorder.start = slow_start  # type: ignore[method-assign]
    model: Any = Regressor(width)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Pairs(width), batch_size=BATCH)
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, log_dir=directory
    )
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        with prof.step(batch):
            model(**batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    inner = model.module if hasattr(model, "module") else model
    save(directory, rank, prof.result, inner if kind != "fsdp2" else Regressor(width))


def lightning(directory: Path, width: int) -> None:
    import lightning as L

    from flops_callbacks import FlopsProfilerCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Regressor(width)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    from lightning.pytorch.strategies import DDPStrategy

    callback = FlopsProfilerCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
    module = Module()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT), max_steps=STEPS,
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=directory,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(Pairs(width), batch_size=BATCH))
    save(directory, trainer.global_rank, callback.result, module.model)


def hf(directory: Path, width: int) -> None:
    from transformers import Trainer, TrainingArguments

    from flops_callbacks.integrations.hf import HFFlopsCallback

    callback = HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
    args = TrainingArguments(
        output_dir=str(directory / "out"), use_cpu=True, ddp_backend="gloo",
        ddp_timeout=int(TIMEOUT.total_seconds()), per_device_train_batch_size=BATCH, max_steps=STEPS,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = Regressor(width)
    trainer = Trainer(model=model, args=args, train_dataset=Pairs(width), callbacks=[callback])
    trainer.train()
    save(directory, int(os.environ.get("RANK", 0)), callback.result, model)


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    bucket = float(sys.argv[4]) if len(sys.argv) > 4 else 25.0
    if kind in ("loop", "fsdp2", "slow_start"):
        loop(kind, out, width, bucket)
    elif kind == "lightning":
        lightning(out, width)
    else:
        hf(out, width)
    end_process()
