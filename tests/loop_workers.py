"""The processes of the training-loop runs in tests/integrations/test_ranks.py: a tiny GPT-2 trained by a
loop of one's own with ``StepProfiler``, each rank reading sequences of its own lengths (rank 0 16
tokens, rank 1 44: tests/rank_workers.py's ``constant`` data, padded to the batch's longest).

``python loop_workers.py LOOP DIR``

* ``plain``: DDP on gloo, launched by ``torchrun``; metrics through ``log=``, kept in ``rank0.json``;
* ``accelerate``: launched by ``accelerate launch``; metrics through ``accelerator.log`` to TensorBoard;
* ``accelerate-no-cpu``: the same without ``Accelerator(cpu=True)``: accelerate runs each process alone
  (no gradient sync) while its launcher made a process group of the two;
* ``fabric``: ``Fabric(strategy="ddp", devices=2)`` starts the second process itself; metrics through
  ``fabric.log_dict`` to TensorBoard.

Each rank writes ``rank{N}.json`` as tests/rank_workers.py's ``save`` does, plus what ``log`` received.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks import StepProfiler  # noqa: E402
from flops_callbacks.session.window_plan import COMM_MIN  # noqa: E402
from tests.rank_workers import (  # noqa: E402
    BATCH,
    PROFILE_STEP,
    TIMEOUT,
    PadToLongest,
    Sequences,
    gpt2,
    rank,
    save,
)
from tests.support import end_process, window_end  # noqa: E402

CLEAN = 3
LOOP_END = window_end(
    PROFILE_STEP, CLEAN, comm=True
)  # counting, module timing, communication, the check, 3 clean
LOOP_STEPS = LOOP_END + 1
LOOP_LOG_EVERY = LOOP_STEPS  # throughput/* at the step after the window


def train(loop: str, directory: Path) -> None:
    collator = PadToLongest("constant")
    loader = torch.utils.data.DataLoader(Sequences("constant"), batch_size=BATCH, collate_fn=collator)
    logged: list[tuple[int, dict[str, float]]] = []
    options: dict[str, Any] = dict(
        profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, peak_flops=1e12,
        comm_steps=COMM_MIN, log=lambda metrics, step: logged.append((step, metrics)),
        log_every_n_steps=LOOP_LOG_EVERY,
    )  # fmt: skip
    model: Any = gpt2()
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward: Any = None
    finish: Any = None
    if loop == "plain":
        torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
        model = torch.nn.parallel.DistributedDataParallel(model)
        prof = StepProfiler(model, **options)
    elif loop.startswith("accelerate"):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        accelerator = Accelerator(
            cpu=loop == "accelerate", log_with="tensorboard", project_dir=directory,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=TIMEOUT)],
        )  # fmt: skip
        accelerator.init_trackers("run")
        model, optimizer = accelerator.prepare(model, optimizer)
        backward, finish = accelerator.backward, accelerator.end_training
        prof = StepProfiler(model, accelerator=accelerator, **options)
    else:
        from lightning.fabric import Fabric
        from lightning.fabric.loggers import TensorBoardLogger
        from lightning.fabric.strategies import DDPStrategy

        logger = TensorBoardLogger(directory, name="run", version=0)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT), loggers=logger)
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        backward, finish = fabric.backward, lambda: logger.finalize("success")
        prof = StepProfiler(model, fabric=fabric, **options)
    ends: list[float] = []
    for step, batch in enumerate(loader):
        if step == LOOP_STEPS:
            break
        with prof.step(batch):
            loss = model(**batch).loss
            if backward is None:
                loss.backward()
            else:
                backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        ends.append(time.perf_counter())
    prof.close()
    if finish is not None:
        finish()
    save(directory, prof, collator, prof.global_step, ends, [])
    seen = directory / f"rank{rank()}.logged.json"
    seen.write_text(json.dumps(logged))
    end_process()


if __name__ == "__main__":
    train(sys.argv[1], Path(sys.argv[2]))
