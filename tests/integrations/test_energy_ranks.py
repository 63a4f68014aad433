"""The job's energy across ranks: a real 2-process DDP loop on CPU (gloo) under ``torchrun``
(tests/energy_workers.py), each rank on a host of its own whose fake RAPL counter its forwards advance by
1.1 J (rank 0) and 2.2 J (rank 1) a step; the job's joules per step are their sum, on every rank."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flops_callbacks import metrics as names
from tests.energy_workers import CLEAN
from tests.support import run_bounded

WORKER = Path(__file__).parents[1] / "energy_workers.py"
ROOT = Path(__file__).parents[2]


def test_two_ranks_on_two_hosts_sum_their_counters_and_every_rank_holds_the_jobs_figures(
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(WORKER), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = run_bounded(command, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-16000:]  # every rank's traceback, the one that failed first
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # one window, the job's figures on every rank
    spans = ranks[0]["energy"]
    assert [(s["scope"], s["steps"]) for s in spans] == [("RAPL on host0", CLEAN), ("RAPL on host1", CLEAN)]
    assert [s["joules"] / s["steps"] for s in spans] == [pytest.approx(1.1), pytest.approx(2.2)]
    metrics = ranks[0]["metrics"]
    assert metrics[names.ENERGY_PER_STEP] == pytest.approx(3.3, rel=1e-9)
    assert metrics[names.ENERGY_PER_SAMPLE] == pytest.approx(3.3 / 8, rel=1e-9)  # 4 samples x 2 replicas
    assert metrics[names.POWER] == pytest.approx(sum(s["joules"] / s["seconds"] for s in spans), rel=1e-12)
