"""The processes of tests/integrations/test_vote_cost.py: a plain DDP loop (gloo) under ``torchrun`` with
``StepProfiler`` whose votes between the ranks are made slow by a known sleep on every rank, so that the
exchange itself, not a wait for a slower rank, takes it.

``python -m torch.distributed.run --nproc-per-node=2 vote_workers.py DIR SLEEP_MS``

Each rank writes ``rank{N}.json``: its metrics, the clean steps and the loop's own time of each step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from flops_callbacks import StepProfiler
from flops_callbacks.session.ranks import Ranks

STEPS, PROFILE_STEP, CLEAN = 14, 1, 3


def slowed(sleep: float) -> None:
    """Every vote of the profiler's sleeps ``sleep`` seconds on this rank before it gathers the wishes."""
    gather = Ranks.gather

    def slow(self: Ranks, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        time.sleep(sleep)
        return gather(self, mine)

    Ranks.gather = slow  # type: ignore[method-assign]


def main(directory: Path, sleep: float) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    slowed(sleep)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, comm_steps=0
    )
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
    result = prof.result
    assert result is not None
    seen = {
        "clean": list(result.steps.clean),
        "metrics": result.metrics(),
        "loop": [end - start for start, end in zip(marks, marks[1:], strict=False)],
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) / 1000)
