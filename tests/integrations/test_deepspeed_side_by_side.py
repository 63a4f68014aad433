"""Side by side with installed DeepSpeed (skipped without it; CI installs it with DS_BUILD_OPS=0):
the same strings, the same summary labels, the same engine rows, from the same calls."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

ds = pytest.importorskip("deepspeed.profiling.flops_profiler")

import flops_callbacks  # noqa: E402

MAGNITUDES = [0, 4e-7, 0.0123, 0.5, 1, 999, 1000, 1340, 123456.789, 1e9, 1e12, 2.5e15, -3.0]
HELPERS = ["number_to_string", "flops_to_string", "macs_to_string", "bytes_to_string", "duration_to_string"]


@pytest.mark.parametrize("helper", [*HELPERS, "params_to_string"])
@pytest.mark.parametrize("units", [None, "T", "G", "M", "K", "m", "u"])
@pytest.mark.parametrize("precision", [0, 2, 3])
def test_every_to_string_helper_writes_deepspeeds_string(
    helper: str, units: str | None, precision: int
) -> None:
    ours, theirs = getattr(flops_callbacks, helper), getattr(ds, helper)
    for value in MAGNITUDES:
        assert ours(value, units=units, precision=precision) == theirs(
            value, units=units, precision=precision
        )


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_get_model_profile_returns_deepspeeds_strings() -> None:
    for shape in [(1, 64), (4, 64), (3000, 64)]:  # hundreds, thousands, millions of flops
        ours = flops_callbacks.get_model_profile(mlp(), input_shape=shape, print_profile=False)
        theirs = ds.get_model_profile(mlp(), input_shape=shape, print_profile=False)
        assert ours == theirs  # a linear + relu model: both count 2 x MACs + one flop per relu output


def summary_labels(text: str) -> list[str]:
    summary = text.split("Aggregated Profile")[0]
    return [line[:70].rstrip() for line in summary.splitlines() if re.match(r".{70}  \S", line)]


def run_profile(profiler_class: Any, engine: Any = None) -> str:
    model = mlp()
    prof = profiler_class(model, ds_engine=engine)
    out = io.StringIO()
    with redirect_stdout(out):
        prof.start_profile()
        model(torch.randn(4, 64))
        prof.stop_profile()
        prof.print_model_profile(profile_step=1, detailed=True)
        prof.end_profile()
    return out.getvalue()


def engine(wall_clock: bool) -> SimpleNamespace:
    elapsed = {"fwd": 2.0, "bwd": 5.0, "step": 1.0}  # milliseconds, as DeepSpeed's timers
    return SimpleNamespace(
        world_size=8,
        dp_world_size=None,
        seq_dp_world_size=4,
        mp_world_size=2,
        has_moe_layers=False,
        train_micro_batch_size_per_gpu=lambda: 3,
        wall_clock_breakdown=lambda: wall_clock,
        timers=lambda name: SimpleNamespace(elapsed=lambda reset=True: elapsed[name]),
    )


@pytest.mark.parametrize("make_engine", [None, lambda: engine(False), lambda: engine(True)])
def test_summary_rows_carry_deepspeeds_labels_in_its_order_then_ours(make_engine: Any) -> None:
    ours = summary_labels(run_profile(flops_callbacks.FlopsProfiler, make_engine and make_engine()))
    theirs = summary_labels(run_profile(ds.FlopsProfiler, make_engine and make_engine()))
    assert ours[: len(theirs)] == theirs
    assert ours[len(theirs)] == "device:"  # ours follow, the device first (not a GPU here)


def test_engine_rows_have_deepspeeds_values() -> None:
    def values(text: str) -> dict[str, str]:
        summary = text.split("Aggregated Profile")[0]
        found = [line.split(": ", 1) for line in summary.splitlines() if re.match(r".{70}  \S", line)]
        return {label: value.strip() for label, value in found}

    ours = values(run_profile(flops_callbacks.FlopsProfiler, engine(True)))
    theirs = values(run_profile(ds.FlopsProfiler, engine(True)))
    same = [
        "world size", "data parallel size", "model parallel size", "batch size per GPU", "params per GPU",
        "params of model = params per GPU * mp_size", "fwd MACs per GPU", "fwd flops per GPU",
        "fwd flops of model = fwd flops per GPU * mp_size", "fwd latency", "bwd latency", "step latency",
        "iter latency", "samples/second", "fwd FLOPS per GPU = fwd flops per GPU / fwd latency",
        "bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency",
        "FLOPS per GPU = 3 * fwd flops per GPU / iter latency",
    ]  # fmt: skip
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}


def test_both_profile_in_eval_mode_and_only_ours_gives_the_mode_back() -> None:
    def dropout_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.BatchNorm1d(64)).train()

    ours_model, theirs_model = dropout_model(), dropout_model()
    ours = flops_callbacks.get_model_profile(
        ours_model, input_shape=(4, 64), print_profile=False, as_string=False
    )
    theirs = ds.get_model_profile(theirs_model, input_shape=(4, 64), print_profile=False, as_string=False)
    assert ours == theirs  # eval: no dropout work, BatchNorm applies its statistics (2 flops per element)
    assert all(m.training for m in ours_model.modules())
    assert not any(m.training for m in theirs_model.modules())  # DeepSpeed leaves the model in eval


class Block(nn.Module):
    """Two linears, then a ReLU of the block's own (a functional call: no module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.relu(self.fc2(self.fc1(x)))


def test_an_ignored_container_keeps_its_place_in_the_tree_with_its_childrens_numbers() -> None:
    """``ignore_list=[Block]`` skips the block's own hooks, as in DeepSpeed: the block stays in the tree,
    its children under it, its flops and MACs theirs (2 x 16 x 32 x 2 each: 4096 flops, 2048 MACs); its
    own ReLU counts to its parent."""
    counts, trees = [], []
    for library in (ds, flops_callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), nn.Linear(16, 4))
        prof = library.FlopsProfiler(model)
        prof.start_profile(ignore_list=[Block])
        model(torch.randn(2, 16))
        prof.stop_profile()
        counts.append(
            (library.get_module_flops(model[0]), library.get_module_macs(model[0]), prof.get_total_flops())
        )
        out = io.StringIO()
        with redirect_stdout(out):
            prof.print_model_profile(detailed=True)
        prof.end_profile()
        detailed = out.getvalue().split("Detailed Profile per GPU")[1]
        trees.append(
            [line.split("(")[1].split(")")[0] for line in detailed.splitlines() if re.match(r"\s+\(", line)]
        )
    assert (
        counts[0] == counts[1] == (4096, 2048, 4096 + 2 * 2 * 16 * 4 + 2 * 16)
    )  # the Linear(16, 4), the ReLU
    assert trees[0] == trees[1] == ["0", "fc1", "fc2", "1"]
