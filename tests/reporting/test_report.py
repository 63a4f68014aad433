"""The text report: DeepSpeed's summary rows first, in its order, words and row format; ours after."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn as nn

from flops_callbacks import FlopsProfiler
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.profile_report import EngineRows, render_profile
from flops_callbacks.units import bytes_to_string, duration_to_string, flops_to_string, number_to_string

B, IN, HID, OUT = 4, 8, 16, 3
FWD = 2 * B * IN * HID + B * HID + 2 * B * HID * OUT  # linear, relu, linear

# DeepSpeed 0.19.8's summary labels for a profile without an engine, in its order
DEEPSPEED_ROWS = [
    "params per GPU",
    "params of model = params per GPU * mp_size",
    "fwd MACs per GPU",
    "fwd flops per GPU",
    "fwd flops of model = fwd flops per GPU * mp_size",
    "fwd latency",
    "fwd FLOPS per GPU = fwd flops per GPU / fwd latency",
]


def profile_of_mlp(backward: bool = False) -> Profile:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    with FlopsProfiler(model) as prof:
        y = model(torch.randn(B, IN))
        if backward:
            y.sum().backward()
    return prof.get_profile()


def rows(text: str) -> list[tuple[str, str]]:
    """The summary's (label, value) rows: label and ': ' padded to 70 columns, two spaces, the value."""
    summary = text.split("Aggregated Profile")[0]
    found = [
        (line[:70].rstrip(), line[72:].rstrip())
        for line in summary.splitlines()
        if re.match(r".{70}  \S", line)
    ]
    return [(label.removesuffix(":"), value) for label, value in found]


def test_deepspeed_rows_come_first_in_its_order_then_ours() -> None:
    text = render_profile(profile_of_mlp(), timing_lines=[("MFU", "n/a")])
    labels = [label for label, _ in rows(text)]
    ours = [
        "device",
        "trainable params per GPU",
        "fwd bytes moved per GPU",
        "activations saved for bwd per GPU (params excluded)",
    ]
    assert labels == [*DEEPSPEED_ROWS, *ours, "MFU"]
    values = dict(rows(text))
    # addmm reads bias, x, weight and writes its output; relu reads and writes 4 x 16; addmm again
    moved = 4 * ((HID + B * IN + IN * HID + B * HID) + 2 * B * HID + (OUT + B * HID + HID * OUT + B * OUT))
    assert values["fwd bytes moved per GPU"] == bytes_to_string(moved) == "1.98 KB"
    saved = 4 * (B * IN + B * HID)  # x (by the first addmm), the ReLU's output (once, for relu and addmm)
    assert values["activations saved for bwd per GPU (params excluded)"] == bytes_to_string(saved)
    assert values["fwd flops per GPU"] == number_to_string(FWD).strip()
    assert values["params of model = params per GPU * mp_size"] == str(IN * HID + HID + HID * OUT + OUT)
    assert values["device"] == "cpu"


def test_a_gpu_profile_has_no_device_row() -> None:
    profile = dataclasses.replace(profile_of_mlp(), device="cuda:0")
    assert "device" not in dict(rows(render_profile(profile)))


def test_run_context_adds_deepspeeds_engine_rows_and_scales_of_model_by_mp_size() -> None:
    run = EngineRows(
        parallel=ParallelSizes(world_size=8, data_parallel=4, tensor_parallel=2),
        batch_size=16,
        fwd_latency=0.002,
        bwd_latency=0.004,
        step_latency=0.001,
        samples_per_second=123.456,
    )
    text = render_profile(profile_of_mlp(backward=True), run=run)
    values = dict(rows(text))
    assert list(values)[:4] == [
        "world size",
        "data parallel size",
        "model parallel size",
        "batch size per GPU",
    ]
    assert [values[k] for k in list(values)[:4]] == ["8", "4", "2", "16"]
    assert values["fwd flops of model = fwd flops per GPU * mp_size"] == number_to_string(2 * FWD).strip()
    assert values["fwd latency"] == duration_to_string(0.002).strip()
    assert values["iter latency"] == duration_to_string(0.007).strip()
    assert values["samples/second"] == "123.46"
    # the backward was measured: DeepSpeed's label up to '=', then what was divided
    bwd = profile_of_mlp(backward=True).bwd_flops
    assert values["bwd FLOPS per GPU = bwd flops per GPU / bwd latency"] == flops_to_string(bwd / 0.004)
    assert values["FLOPS per GPU = fwd+bwd flops per GPU / iter latency"] == flops_to_string(
        (FWD + bwd) / 0.007
    )
    assert values["bwd flops per GPU (measured)"] == number_to_string(bwd).strip()


def test_detailed_false_keeps_the_aggregated_profile() -> None:
    text = render_profile(profile_of_mlp(), detailed=False, top_modules=2)
    assert "Aggregated Profile per GPU" in text and "Detailed Profile" not in text
    assert "Top 2 modules in terms of params, MACs or fwd latency at different model depths:" in text
    assert "    MACs        - {'Linear': '" in text


def test_module_lines_read_like_print_model_with_numbers_then_the_modules_settings() -> None:
    profile = profile_of_mlp()
    profile.modules["0"].extra_repr = "in_features=8, out_features=16, bias=True"
    text = render_profile(profile).split("Detailed Profile per GPU")[1]
    first = next(line for line in text.splitlines() if line.startswith("  (0): Linear("))
    macs = B * IN * HID
    share = round(100 * macs / profile.fwd_macs, 2)
    assert first.startswith(f"  (0): Linear({IN * HID + HID} = ")
    assert f", {macs} MACs = {share:g}% MACs, " in first
    assert first.endswith(", in_features=8, out_features=16, bias=True)")
    assert "  (1): ReLU(0 = 0% Params, 0 MACs = 0% MACs" in text


def test_the_coverage_says_the_work_outside_the_models_modules_by_where_it_ran() -> None:
    """A loss outside the model and SGD's update in the profile: the loss's forward and the update are
    outside the backward (they were said as "fwd"), the loss's backward inside it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlopsProfiler(model) as prof:
        loss = model(torch.randn(B, IN)).pow(2).sum()  # pow: B x OUT flops; sum: one per element
        loss.backward()
        optimizer.step()  # p.add_(grad, alpha=-lr): one elementwise op, one flop per parameter
    outside = prof.get_profile().outside_model
    params = IN * HID + HID + HID * OUT + OUT
    assert outside.fwd_flops == B * OUT + B * OUT + params
    line = next(x for x in render_profile(prof.get_profile()).splitlines() if x.startswith("Outside"))
    assert line == (
        f"Outside the model's modules (not in the model totals): {number_to_string(outside.fwd_flops)}flops "
        f"outside the backward (the loss, the optimizer step), {number_to_string(outside.bwd_flops)}flops in "
        "it (the loss's backward)."
    )


def test_a_functional_run_only_in_a_recompute_shows_its_recompute_flops() -> None:
    """A checkpointed function of two Linears: the recompute's work of a functional is on its line (it
    read ``0 flops x0``, the recompute left out)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(IN, HID), nn.Linear(HID, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda y: self.l2(torch.relu(self.l1(y))), x, use_reentrant=False)

    torch.manual_seed(0)
    model = Checkpointed()
    with FlopsProfiler(model) as prof:
        model(torch.randn(B, IN, requires_grad=True)).sum().backward()
    l1 = prof.get_profile().modules["l1"]
    (recomputed,) = [(name, c) for name, c in l1.functionals.items() if c.recompute_flops]
    assert recomputed[1].recompute_flops == 2 * B * IN * HID  # the recompute's matmul
    text = render_profile(prof.get_profile(), detailed=True)
    said = [line.strip() for line in text.splitlines() if line.strip().startswith("functionals: ")]
    assert said and not any(" 0 flops x0" in line for line in said), said
    zero, matmul = number_to_string(0), number_to_string(2 * B * IN * HID)
    rec = f"{recomputed[0]} {zero}fwd/{zero}bwd/{matmul}rec x0"
    assert any(rec in line for line in said), said
