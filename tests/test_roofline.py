"""The roofline verdict per module: by hand on plain numbers, then through a real profile window with the
peaks given by the environment (a large matmul is compute-bound, a large elementwise op memory-bound)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from flops_callbacks.options import Options
from flops_callbacks.reporting.profile_file import json_data
from flops_callbacks.reporting.publish import publish
from flops_callbacks.reporting.window_rows import report_text
from flops_callbacks.roofline import COMPUTE, MEMORY, roofline
from flops_callbacks.session.step_session import StepSession
from tests.support import Sink, run, window_end

N, F32 = 256, 4
PEAK_FLOPS, PEAK_BANDWIDTH = 1e11, 1e10  # ridge at 10 flops per byte


def test_the_larger_term_is_the_limiter_and_the_fraction_is_bound_over_latency() -> None:
    # 1e9 flops at 1e12 FLOPS: 1 ms; 1e6 bytes at 1e12 B/s: 1 us; measured 4 ms
    r = roofline(10**9, 10**6, 4e-3, 1e12, 1e12)
    assert r is not None
    assert (r.limiter, r.intensity, r.bound_seconds) == (COMPUTE, 1000.0, pytest.approx(1e-3))
    assert r.roofline_fraction == pytest.approx(0.25) and r.flops_per_sec == pytest.approx(2.5e11)
    assert r.verdict() == "compute-bound at 25% of the roofline" and not r.overhead_bound
    # 1e6 flops, 1e9 bytes: 1 us vs 1 ms: memory; at 0.05 of the roofline: overhead-bound
    r = roofline(10**6, 10**9, 20e-3, 1e12, 1e12)
    assert r is not None and r.limiter == MEMORY and r.roofline_fraction == pytest.approx(0.05)
    assert r.overhead_bound and r.verdict() == "overhead-bound at 5% of the roofline (memory roof)"
    # at or above the roof (a fused kernel moves fewer bytes than its ops' operands): whole percents
    r = roofline(10**9, 10**6, 0.98e-3, 1e12, 1e12)
    assert r is not None and r.verdict() == "compute-bound at 102% of the roofline"
    r = roofline(10**9, 10**6, 1e-2 / 0.97, 1e12, 1e12)
    assert r is not None and r.verdict() == "overhead-bound at 9.7% of the roofline (compute roof)"
    # equal terms: not compute (the flops term must be the larger); no latency or no work: no verdict
    tie = roofline(10**6, 10**6, 1.0, 1e12, 1e12)
    assert tie is not None and tie.limiter == MEMORY
    assert roofline(10**6, 10**6, 0.0, 1e12, 1e12) is None and roofline(0, 0, 1.0, 1e12, 1e12) is None


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class MatmulThenScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matmul = nn.Linear(N, N, bias=False)
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.matmul(x))


def test_a_large_matmul_is_compute_bound_and_a_large_elementwise_op_memory_bound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLOPS_CALLBACKS_PEAK_FLOPS", str(PEAK_FLOPS))
    monkeypatch.setenv("FLOPS_CALLBACKS_PEAK_BANDWIDTH", str(PEAK_BANDWIDTH))
    torch.manual_seed(0)
    model = MatmulThenScale()
    session = StepSession(
        Options(profile_step=0, clean_steps=1, print_profile=False), "test", publish=publish
    )
    session.train_start(0)
    sink = Sink(tmp_path)
    x = torch.randn(N, N)
    run(session, model, torch.optim.SGD(model.parameters(), lr=0.0), range(0, window_end(0, 1)), sink, x)
    result = session.result
    assert result is not None and result.bandwidth is not None
    assert (
        result.bandwidth.bytes_per_sec == PEAK_BANDWIDTH and "environment variable" in result.bandwidth.source
    )
    rooflines = result.rooflines()
    profile = result.profile

    # matmul: mm(x, weight.t()) reads two N x N and writes one; 2 N^3 flops; intensity N / 6
    matmul = rooflines["matmul"]["fwd"]
    assert (matmul.flops, matmul.bytes) == (2 * N**3, 3 * N * N * F32)
    assert matmul.intensity == pytest.approx(N / 6)  # 42.7 flops/B, above the ridge at 10
    assert matmul.limiter == COMPUTE
    assert matmul.bound_seconds == pytest.approx(2 * N**3 / PEAK_FLOPS)
    assert matmul.seconds == profile.modules["matmul"].fwd_latency > 0  # the module-timing step's
    assert matmul.roofline_fraction == pytest.approx(matmul.bound_seconds / matmul.seconds)
    # its backward: the weight gradient only (x needs none), mm(grad.t(), x): the same shapes
    assert rooflines["matmul"]["bwd"].limiter == COMPUTE
    assert rooflines["matmul"]["bwd"].bytes == 3 * N * N * F32

    # scale: x * 2 reads N x N and writes N x N, one flop per element: 1/8 flop per byte
    scale = rooflines["scale"]["fwd"]
    assert (scale.flops, scale.bytes, scale.limiter) == (N * N, 2 * N * N * F32, MEMORY)
    assert scale.intensity == pytest.approx(1 / 8)
    assert scale.bound_seconds == pytest.approx(2 * N * N * F32 / PEAK_BANDWIDTH)
    assert rooflines["scale"]["bwd"].limiter == MEMORY  # grad * 2: the same op

    # the JSON's module entries carry them; the report names each verdict
    data = json.loads(json.dumps(json_data(result)))
    entry = data["profile"]["modules"]["matmul"]
    assert (entry["fwd_bytes"], entry["roofline"]["fwd"]["limiter"]) == (3 * N * N * F32, "compute")
    assert entry["roofline"]["fwd"]["roofline_fraction"] == pytest.approx(matmul.roofline_fraction)
    assert data["profile"]["modules"]["scale"]["roofline"]["bwd"]["limiter"] == "memory"
    assert data["bandwidth"] == {"bytes_per_sec": PEAK_BANDWIDTH, "source": result.bandwidth.source}
    text = report_text(result, session.options, detailed=False)
    section = text.split("Roofline per GPU")[1].split("Aggregated Profile")[0]
    assert "ridge at 10 flops/B" in section
    assert "matmul (Linear), " in section and matmul.verdict() in section
    assert "scale (Scale), " in section and scale.verdict() in section
    written = json.loads((tmp_path / "flops_profile_step0.json").read_text())
    assert written["profile"]["modules"]["scale"]["roofline"]["fwd"]["limiter"] == "memory"


def test_without_a_peak_bandwidth_the_report_says_why_and_no_module_has_a_roofline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLOPS_CALLBACKS_PEAK_FLOPS", str(PEAK_FLOPS))
    monkeypatch.delenv("FLOPS_CALLBACKS_PEAK_BANDWIDTH", raising=False)
    model = MatmulThenScale()
    session = StepSession(
        Options(profile_step=0, clean_steps=1, print_profile=False), "test", publish=publish
    )
    session.train_start(0)
    run(
        session,
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        range(0, window_end(0, 1)),
        Sink(tmp_path),
        torch.randn(4, N),
    )
    result = session.result
    assert result is not None and result.rooflines() == {}
    text = report_text(result, session.options, detailed=False)
    assert "Roofline per GPU" not in text
    assert "n/a: no peak bandwidth for a cpu device: pass peak_bandwidth= or set" in text
    assert "roofline" not in json_data(result)["profile"]["modules"]["matmul"]
