"""The processes of tests/integrations/test_step_profiler.py's shared-group test: a DDP loop on gloo under
``torchrun`` that makes three ``StepProfiler``s in turn, each profiling a window and metering after it.
Every rank writes ``rank{r}.json``: the process groups alive after each profiler closed, and whether each
one published a window and logged ``throughput/*``.

``python group_workers.py DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks import StepProfiler  # noqa: E402
from flops_callbacks.session.window_plan import COMM_MIN  # noqa: E402
from tests.support import end_process, window_end  # noqa: E402

PROFILE_STEP, CLEAN = 1, 1
STEPS = window_end(PROFILE_STEP, CLEAN, comm=True) + 4  # two throughput logs after the window


def main(directory: Path) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    groups, runs = [], []
    for _ in range(3):
        logged: list[int] = []
        prof = StepProfiler(
            model, profile_step=PROFILE_STEP, clean_steps=CLEAN, comm_steps=COMM_MIN, print_profile=False,
            log_every_n_steps=2, log=lambda metrics, step, logged=logged: logged.append(step),
        )  # fmt: skip
        try:
            for _ in range(STEPS):
                with prof.step(torch.ones(8, 16)):
                    model(torch.ones(8, 16)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
        finally:
            prof.close()
        groups.append(len(torch.distributed.distributed_c10d._world.pg_map))
        runs.append({"result": prof.result is not None, "logged": logged})
    (directory / f"rank{rank}.json").write_text(json.dumps({"groups": groups, "runs": runs}))
    end_process()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
