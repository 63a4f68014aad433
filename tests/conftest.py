"""What every test shares: an offline run, and the check that no test leaves a global hook or a mode of
the profiler behind (tests/support.py holds the snapshot and the injected fault)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import torch_state

# no hub, no W&B servers: the tests build models from configs and log offline
for _name, _value in {
    "WANDB_MODE": "offline",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(autouse=True)
def no_global_hook_or_mode_stays() -> Iterator[None]:
    """torch's global module and optimizer hooks and both mode stacks are as the test found them."""
    before = torch_state()
    yield
    assert torch_state() == before, "a global hook or a mode stayed behind"
