"""The processes of tests/integrations/test_step_profiler.py's two-rank fault: a DDP loop on gloo under
``torchrun`` with ``StepProfiler`` and ``prof.close()`` in a ``finally``, rank 1 raising its own error in a
window step. Rank 1 writes ``rank1.json`` (the seconds from its raise to ``close()``'s return) and lets its
error end the process; rank 0 waits in the step's all-reduce until torchrun ends it.

``python raised_workers.py DIR``
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks import StepProfiler  # noqa: E402
from tests.support import comm_steps  # noqa: E402

PROFILE_STEP = 2
RAISES_AT = comm_steps(PROFILE_STEP)[0]  # a communication step: every rank's window is open


def main(directory: Path) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = StepProfiler(model, profile_step=PROFILE_STEP, clean_steps=3, print_profile=False)
    raised = 0.0
    try:
        for step in range(20):
            with prof.step(torch.ones(8, 16)):
                if rank == 1 and step == RAISES_AT:
                    raised = time.perf_counter()
                    raise ValueError("rank 1's own error")
                model(torch.ones(8, 16)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        prof.close()
        if raised:
            closed = {"close_seconds": time.perf_counter() - raised}
            (directory / f"rank{rank}.json").write_text(json.dumps(closed))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
