"""What every test shares: an offline run, and the check that no test leaves a global hook or a mode of
the profiler behind (tests/support.py holds the snapshot and the injected fault), nor accelerate's state."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flops_callbacks.module_tree import dynamo_compiled_anything
from tests.support import one_thread, torch_state

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


@pytest.fixture(autouse=True)
def nothing_compiled_stays() -> Iterator[None]:
    """A test that compiled leaves dynamo as it found it: whether anything was compiled in the process
    changes what the window measures (module_tree.dynamo_compiled_anything), so no test may depend on
    which tests ran before it."""
    yield
    if dynamo_compiled_anything():
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()


@pytest.fixture(autouse=True)
def no_accelerator_state_stays() -> Iterator[None]:
    """accelerate keeps one process-wide state, which the HF Trainer and an ``Accelerator`` set once
    and a later ``Accelerator`` of other settings refuses: each test starts without it."""
    yield
    if "accelerate.state" in sys.modules:
        sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(name="one_thread")
def one_thread_fixture() -> Iterator[None]:
    """torch on one thread for a test that compares step times (tests.support.one_thread)."""
    with one_thread():
        yield


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four real Lightning runs' profile files, by name (tests/saved_runs.py), for the readers of saved
    profiles: the JSON file's tests, the picture's diff and the command line."""
    from tests.saved_runs import saved_runs

    return saved_runs(tmp_path_factory)
