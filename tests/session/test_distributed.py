"""What a profile needs from the other ranks: without a process group, only this rank's latencies (the
two-process gathers run in the DDP tests of test_lightning.py and test_hf.py)."""

from __future__ import annotations

import torch

from flops_callbacks.session.distributed import gather_latencies


def test_a_single_process_gathers_its_own_latencies() -> None:
    assert not torch.distributed.is_initialized()
    assert gather_latencies((0.1, 0.2, 0.05), torch.device("cpu")) == [(0.1, 0.2, 0.05)]
