"""The DeepSpeed-compatible API says where its latencies come from: ``FlopsProfiler`` in the caller's
loop from the counting pass (and says so), ``get_model_profile`` from clean passes after it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
import torch.nn as nn

from flops_callbacks import FlopsProfiler, get_model_profile

# seconds the inner module sleeps on each call: warm-up, counting, module-timing, clean
SLEEPS = (0.0, 0.3, 0.1, 0.05)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEPS[min(self.calls, len(SLEEPS) - 1)])
        self.calls += 1
        return self.linear(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def rows(text: str) -> dict[str, str]:
    """The report's summary rows, label -> value."""
    found = {}
    for line in text.splitlines():
        label, colon, value = line.partition(": ")
        if colon and value.strip():
            found[label.strip()] = value.strip()
    return found


def seconds(value: str) -> float:
    number, unit = value.split()
    return float(number) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def test_flops_profiler_in_a_plain_loop_says_its_latencies_are_the_counting_passs() -> None:
    model, x = Outer(), torch.randn(2, 4)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    text = prof.print_model_profile(output_file="")
    prof.end_profile()
    source = rows(text)["latencies from"]
    assert source.startswith("the counting pass (instrumented")
    assert "StepProfiler (any loop) or the Lightning / HF callbacks" in source


def test_get_model_profile_times_the_model_on_a_clean_pass_and_modules_on_a_marks_only_pass(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.txt"
    get_model_profile(Outer(), args=[torch.randn(2, 4)], warm_up=1, output_file=out)
    text = out.read_text()
    found = rows(text)
    assert found["latencies from"].startswith("a clean pass after the counting pass")
    # a sleep is never shorter; far from the counting pass's 0.3 s and the module pass's 0.1 s
    assert SLEEPS[3] <= seconds(found["fwd latency"]) < 0.08
    lines = text.splitlines()
    inner = lines[next(i for i, line in enumerate(lines) if line.strip() == "(inner): Inner(") + 1]
    latency = re.search(r"MACs, ([\d.]+ \w+) = [\d.]+% latency", inner)
    assert latency is not None, inner
    assert SLEEPS[2] <= seconds(latency[1]) < 0.2  # the module pass's sleep, not 0.3 s nor 0.05 s


def test_get_model_profile_with_backward_leaves_no_gradient_of_its_own() -> None:
    """None of its passes' gradients stays (the caller's own: tests/integrations/test_deepspeed_api.py)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), torch.randn(3, 4)
    get_model_profile(model, args=[x], warm_up=0, backward=True, print_profile=False)
    assert all(param.grad is None for param in model.parameters())
