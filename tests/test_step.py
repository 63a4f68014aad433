"""StepProfiler: the framework-free step both callbacks drive (phases, micro-batches, metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from flops_callbacks import metrics as names
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.step import BACKWARD, FORWARD, OPTIMIZER_STEP, StepProfiler, leading_batch_size

B, IN, OUT = 5, 6, 2


def run_step(sp: StepProfiler, model: nn.Module, micro_batches: int, parallel: ParallelSizes) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sp.begin(model, parallel)
    for _ in range(micro_batches):
        batch = torch.randn(B, IN)
        sp.add_batch(batch)
        sp.phase(FORWARD)
        loss = model(batch).sum()
        sp.phase(BACKWARD)
        loss.backward()
    sp.phase(OPTIMIZER_STEP)
    opt.step()


def test_a_step_of_two_micro_batches_sums_flops_samples_and_phases() -> None:
    model = nn.Linear(IN, OUT)
    sp = StepProfiler(profile_step=3, tokens_fn=lambda b: b.numel())
    assert sp.due(3) and not sp.due(2)
    run_step(sp, model, micro_batches=2, parallel=ParallelSizes(world_size=4, data_parallel=4))
    r = sp.finish()
    assert not sp.due(3)  # one profile per run
    fwd = 2 * B * IN * OUT
    bwd = 2 * B * IN * OUT + B * OUT  # weight grad + bias grad (input needs no grad)
    m = r.metrics()
    accumulate = IN * OUT + OUT  # the second micro-batch adds its gradients into .grad
    assert (m[names.FWD_FLOPS], m[names.BWD_FLOPS]) == (2 * fwd, 2 * bwd + accumulate)
    assert m[names.FWD_MACS] == 2 * B * IN * OUT
    assert (r.samples, r.tokens, r.micro_batches) == (2 * B, 2 * B * IN, 2)
    assert m[names.ITER_LATENCY] == pytest.approx(
        m[names.FWD_LATENCY] + m[names.BWD_LATENCY] + m[names.STEP_LATENCY], rel=1e-12
    )
    assert min(m[names.FWD_LATENCY], m[names.BWD_LATENCY], m[names.STEP_LATENCY]) > 0
    assert m[names.SAMPLES_PER_SEC] == pytest.approx(2 * B * 4 / m[names.ITER_LATENCY])
    assert m[names.TOKENS_PER_SEC] == pytest.approx(2 * B * IN * 4 / m[names.ITER_LATENCY])
    assert m[names.FLOPS_PER_SEC] == pytest.approx((2 * (fwd + bwd) + accumulate) / m[names.ITER_LATENCY])
    assert m[names.FWD_FLOPS_PER_SEC] == pytest.approx(2 * fwd / m[names.FWD_LATENCY])
    assert set(m) == set(names.ALL)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_tokens_per_sec_is_absent_without_tokens() -> None:
    sp = StepProfiler(profile_step=0)
    run_step(sp, nn.Linear(IN, OUT), 1, ParallelSizes())
    assert names.TOKENS_PER_SEC not in sp.finish().metrics()


def test_publish_prints_the_report_and_writes_report_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sp = StepProfiler(profile_step=4, detailed=False)
    run_step(sp, nn.Linear(IN, OUT), 1, ParallelSizes(world_size=2, data_parallel=1, tensor_parallel=2))
    r = sp.finish()
    text = sp.publish(r, tmp_path)
    assert text in capsys.readouterr().out
    assert "Profile Summary at step 4:" in text
    assert "model parallel size:" in text and "iter latency = fwd + bwd + step latency" in text
    assert (tmp_path / "flops_profile_step4.txt").read_text().strip() == text.strip()
    data = json.loads((tmp_path / "flops_profile_step4.json").read_text())
    assert data["metrics"][names.FWD_FLOPS] == 2 * B * IN * OUT
    assert data["profile"]["modules"][""]["class_name"] == "Linear"


def test_output_file_replaces_printing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sp = StepProfiler(profile_step=0, output_file=tmp_path / "report.txt")
    run_step(sp, nn.Linear(IN, OUT), 1, ParallelSizes())
    sp.publish(sp.finish(), None)
    assert capsys.readouterr().out == ""
    assert "Profile Summary at step 0:" in (tmp_path / "report.txt").read_text()


def test_abort_removes_everything_and_allows_no_result() -> None:
    model = nn.Linear(IN, OUT)
    sp = StepProfiler(profile_step=0)
    sp.begin(model)
    model(torch.randn(B, IN))
    sp.abort()
    assert not sp.active and sp.result is None
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_leading_batch_size_finds_the_first_tensor() -> None:
    assert leading_batch_size({"input_ids": torch.zeros(7, 3), "labels": torch.zeros(7)}) == 7
    assert leading_batch_size([3, (torch.zeros(2, 5),)]) == 2
    with pytest.raises(ValueError, match="batch_size_fn"):
        leading_batch_size({"text": "no tensors"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"profile_step": -1}, "profile_step must be an int >= 0"),
        ({"profile_step": 2.0}, "profile_step must be an int >= 0"),
        ({"profile_step": True}, "profile_step must be an int >= 0"),
        ({"module_depth": -3}, "module_depth must be an int >= -1"),
        ({"top_modules": 0}, "top_modules must be an int >= 1"),
        ({"batch_size_fn": 3}, "batch_size_fn must be a callable"),
        ({"tokens_fn": "n"}, "tokens_fn must be a callable"),
        ({"causal_attention": "some"}, "causal_attention must be one of"),
        ({"detailed": "yes"}, "detailed must be True or False"),
        ({"print_profile": 1}, "print_profile must be True or False"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepProfiler(**kwargs)


def test_phase_names_are_checked() -> None:
    with pytest.raises(ValueError, match="phase must be one of"):
        StepProfiler().phase("warmup")
