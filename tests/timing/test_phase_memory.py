"""Peak memory allocated per phase on a clean step: exact on CUDA (a phase that allocates a known
temporary shows it, the others do not), n/a elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from flops_callbacks.options import Options
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.profile_file import json_data
from flops_callbacks.reporting.publish import publish
from flops_callbacks.reporting.window_rows import report_text
from flops_callbacks.session.step_session import StepSession
from tests.support import Sink, run, window_end

MIB = 2**20
FWD_TEMP, BWD_TEMP = 256 * MIB, 512 * MIB  # bytes of a temporary each pass allocates and frees


class BigGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        temp = torch.ones(BWD_TEMP // 4, device=grad.device)  # fp32
        return grad + temp[:1].sum() * 0


class Temporaries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temp = torch.ones(FWD_TEMP // 4, device=x.device)
        return BigGradient.apply(self.linear(x) + temp[:1].sum() * 0)


def window(device: str, tmp_path: Path) -> StepSession:
    model = Temporaries().to(device)
    session = StepSession(
        Options(profile_step=0, clean_steps=2, print_profile=False), "test", publish=publish
    )
    session.train_start(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    run(
        session,
        model,
        optimizer,
        range(0, window_end(0, 2)),
        Sink(tmp_path),
        torch.randn(4, 8, device=device),
    )
    return session


def test_off_cuda_the_peak_memory_is_said_to_be_na(tmp_path: Path) -> None:
    result = window("cpu", tmp_path).result
    assert result is not None and result.peak_memory is None
    assert json_data(result)["peak_memory_allocated"] is None
    text = report_text(result, Options(), detailed=False)
    assert (
        "peak memory allocated fwd / bwd / step (clean steps):" in text and "n/a on cpu (CUDA only)" in text
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: no other device keeps a peak counter")
def test_on_cuda_each_phase_shows_the_temporary_it_allocated_and_no_other(tmp_path: Path) -> None:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    result = window("cuda", tmp_path).result
    assert result is not None and result.peak_memory is not None
    peaks = result.peak_memory
    assert set(peaks) == {FORWARD, BACKWARD, OPTIMIZER_STEP}
    assert peaks[FORWARD] >= base + FWD_TEMP
    assert peaks[FORWARD] < base + FWD_TEMP + 64 * MIB  # the forward never saw the backward's temporary
    assert peaks[BACKWARD] >= base + BWD_TEMP
    assert peaks[OPTIMIZER_STEP] < base + 64 * MIB  # SGD on a 8 x 8 Linear: nothing big
    assert json_data(result)["peak_memory_allocated"] == peaks
