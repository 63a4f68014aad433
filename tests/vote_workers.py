"""The processes of tests/integrations/test_vote_cost.py: a DDP run (gloo) under ``torchrun`` whose
profiler's votes between the ranks are made slow by a known sleep on every rank, so that the exchange
itself, not a wait for a slower rank, takes it.

``python -m torch.distributed.run --nproc-per-node=2 vote_workers.py KIND DIR SLEEP_MS``

* ``loop``: a plain loop with ``StepProfiler``, one micro-batch a step (two votes in each clean step);
* ``hf``: the HF Trainer with two micro-batches a step (three votes; its backward runs on to the next
  micro-batch: no pause between them).

Each rank writes ``rank{N}.json``: its metrics, the clean steps and (``loop``) the loop's own time of each
step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flops_callbacks import HFFlopsCallback, StepProfiler
from flops_callbacks.session.ranks import Ranks

STEPS, PROFILE_STEP, CLEAN = 14, 1, 3
WINDOW: dict[str, Any] = dict(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, comm_steps=0)


def slowed(sleep: float) -> None:
    """Every vote of the profiler's sleeps ``sleep`` seconds on this rank before it gathers the wishes."""
    gather = Ranks.gather

    def slow(self: Ranks, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        time.sleep(sleep)
        return gather(self, mine)

    Ranks.gather = slow  # type: ignore[method-assign]


def loop() -> tuple[Any, list[float]]:
    """A plain DDP loop: the profile and the loop's own seconds of each step."""
    torch.distributed.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = StepProfiler(model, **WINDOW)
    marks = []
    for _ in range(STEPS):
        marks.append(time.perf_counter())
        x = torch.randn(4, 16)
        with prof.step({"x": x}):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    marks.append(time.perf_counter())
    prof.close()
    return prof.result, [end - start for start, end in zip(marks, marks[1:], strict=False)]


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(16, generator=g), "labels": torch.randn(16, generator=g)}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.linear(x) - labels).pow(2).mean()}


def hf(directory: Path) -> tuple[Any, list[float]]:
    """The HF Trainer's DDP, two micro-batches a step: the profile."""
    from transformers import Trainer, TrainingArguments

    callback = HFFlopsCallback(**WINDOW, throughput=False)
    args = TrainingArguments(
        output_dir=str(directory / "out"), use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=STEPS, logging_steps=100, save_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    Trainer(model=Regressor(), args=args, train_dataset=Pairs(), callbacks=[callback]).train()
    return callback.result, []


def main(kind: str, directory: Path, sleep: float) -> None:
    slowed(sleep)
    torch.manual_seed(0)
    result, steps = loop() if kind == "loop" else hf(directory)
    assert result is not None
    seen = {"clean": list(result.steps.clean), "metrics": result.metrics(), "loop": steps}
    (directory / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]) / 1000)
