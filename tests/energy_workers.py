"""The processes of tests/integrations/test_energy_ranks.py: a plain DDP loop (gloo) under ``torchrun``
with ``StepProfiler`` (no communication steps), each rank on a host of its own (its own fake RAPL tree
and host name), its forward adding ``rank + 1`` joules to its counter.

``python -m torch.distributed.run --nproc-per-node=2 energy_workers.py DIR``

Each rank writes ``rank{N}.json``: the window's clean steps, its metrics and every rank's energy spans.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch

import flops_callbacks.timing.energy as energy
from flops_callbacks import StepProfiler
from tests.fake_rapl import Burner, FakeRapl

STEPS, PROFILE_STEP, CLEAN = 16, 2, 4


def main(directory: Path) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    socket.gethostname = lambda: f"host{rank}"  # type: ignore[assignment]  # a host of its own
    rapl = FakeRapl(directory / f"powercap{rank}")
    energy.POWERCAP_ROOT = rapl.root
    model = torch.nn.parallel.DistributedDataParallel(Burner(rapl, float(rank + 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, comm_steps=0
    )
    torch.manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(4, 16)
        with prof.step({"x": x}):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    result = prof.result
    assert result is not None
    seen = {
        "clean": list(result.steps.clean),
        "metrics": result.metrics(),
        "energy": [s._asdict() for s in result.energy],
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
