"""Four real Lightning runs on CPU whose profile files the command line reads: A, A2 (A's configuration
again), B (A with one module, ``slow``, slowed by a sleep) and C (A with twice the batch: other work).
Each takes about a second.

The model is Linear(8, 32) -> Pause -> Pause -> Linear(32, 4), each Pause a Linear(32, 32) + ReLU that
sleeps first, so its own time is known: ``mixer`` sleeps PAUSE in every run, ``slow`` sleeps PAUSE in A
and A2 and PAUSE + SLOWER in B.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from tests.support import lightning_settings, one_thread, window_end

IN, WIDTH, OUT, BATCH = 8, 32, 4, 4
PAUSE, SLOWER = 0.025, 0.15  # seconds
PROFILE_STEP, CLEAN = 1, 6
PEAK = 1e11  # a peak FLOPS given, so that the files hold MFU
# forward flops of a batch by hand: each Linear one addmm (2 x batch x in x out), each ReLU one per element
FWD_FLOPS = 2 * BATCH * IN * WIDTH + 2 * (2 * BATCH * WIDTH * WIDTH + BATCH * WIDTH) + 2 * BATCH * WIDTH * OUT


class Pause(nn.Module):
    """Linear + ReLU after a sleep of ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return F.relu(self.linear(x))


class Net(L.LightningModule):
    def __init__(self, slow: float) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, WIDTH)
        self.mixer = Pause(PAUSE)
        self.slow = Pause(slow)
        self.head = nn.Linear(WIDTH, OUT)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.slow(self.mixer(self.embed(x)))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def profiled_run(root: Path, slow: float, batch: int = BATCH) -> Path:
    """Fit Net for one window and a step past it; the path of the profile file the run wrote."""
    steps = window_end(PROFILE_STEP, CLEAN) + 1
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * BATCH, IN, generator=generator),
        torch.randn(steps * BATCH, OUT, generator=generator),
    )
    callback = FlopsProfilerCallback(
        profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, peak_flops=PEAK, top_modules=2
    )
    trainer = L.Trainer(callbacks=[callback], **lightning_settings(root, steps))
    with one_thread():
        trainer.fit(Net(slow), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=batch))
    path = root / f"flops_profile_step{PROFILE_STEP}.json"
    assert path.is_file()
    return path


def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The profile files of runs A, A2, B and C (A with twice the batch: other work), by name (the
    ``runs`` fixture of tests/conftest.py)."""
    runs = {"A": (PAUSE, BATCH), "A2": (PAUSE, BATCH), "B": (PAUSE + SLOWER, BATCH), "C": (PAUSE, 2 * BATCH)}
    return {name: profiled_run(tmp_path_factory.mktemp(name), *run) for name, run in runs.items()}
