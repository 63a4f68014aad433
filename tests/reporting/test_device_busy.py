"""A GPU's busy time per phase, worked out by hand: the kernels a module-timing step launched in each phase
over the phase's latency, the idle share of fwd + bwd, the verdict that names the host, the report's rows,
and the JSON written and read back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.reporting.console_summary import Split, bound_by
from flops_callbacks.reporting.profile_file import from_json, json_data
from flops_callbacks.reporting.window_rows import device_busy_lines, module_source
from tests.reporting.test_console_summary import window

# fwd / bwd / step latencies 0.25 / 0.5 / 0.25 s: kernels 0.05 + 0.1 of 0.75 s, the device idle 80%
BUSY = {"forward": 0.05, "backward": 0.1, "optimizer_step": 0.2}


def split(data: float, fwd: float, bwd: float, step: float, other: float) -> Split:
    parts = {"data": data, "fwd": fwd, "bwd": bwd, "step": step, "other": other}
    return Split(parts, sum(parts.values()), timed_wall=True)


def test_each_phases_busy_share_and_the_idle_share_of_fwd_and_bwd() -> None:
    result = dataclasses.replace(window(), device_busy=BUSY)
    metrics = result.metrics()
    assert metrics[names.DEVICE_BUSY_FWD] == pytest.approx(0.05 / 0.25)
    assert metrics[names.DEVICE_BUSY_BWD] == pytest.approx(0.1 / 0.5)
    assert metrics[names.DEVICE_BUSY_STEP] == pytest.approx(0.2 / 0.25)
    assert metrics[names.DEVICE_IDLE] == pytest.approx(1 - 0.15 / 0.75)
    assert not set(names.DEVICE) & set(window().metrics())  # not read: no figure


def test_a_device_idle_for_30_percent_of_fwd_and_bwd_is_the_host_after_the_data() -> None:
    idle = dataclasses.replace(window(), device_busy=BUSY)
    assert bound_by(split(0.05, 0.4, 0.4, 0.1, 0.05), idle) == (
        "the host: the GPU idle 80% of fwd + bwd, waiting for launches "
        "(torch.compile, CUDA graphs or a larger batch usually help)"
    )
    # before the loop's own work and the optimizer step (their host time is the same cause)
    assert bound_by(split(0.1, 0.2, 0.2, 0.15, 0.35), idle).startswith("the host: the GPU idle 80%")
    assert bound_by(split(0.4, 0.2, 0.2, 0.1, 0.1), idle).startswith("the input pipeline: 40%")
    # a data wait of 30% or more beside a larger part of the host's: said too (its remedy is another)
    assert bound_by(split(0.35, 0.1, 0.1, 0.05, 0.4), idle).endswith(
        "usually help); 35% of the step waits for data"
    )
    # a device busy 71% of fwd + bwd (idle 29%): the model bounds the step, as without the figure
    busy = dataclasses.replace(window(), device_busy={"forward": 0.2, "backward": 0.335, "optimizer_step": 0})
    assert bound_by(split(0.05, 0.4, 0.4, 0.1, 0.05), busy).startswith(
        "the model's fwd + bwd (80% of the step)"
    )


def test_the_report_says_each_phases_kernels_against_its_latency_and_where_module_times_come_from() -> None:
    result = dataclasses.replace(window(), device_busy=BUSY)
    result = dataclasses.replace(result, steps=dataclasses.replace(result.steps, module_kernels=True))
    assert device_busy_lines(result, result.metrics()) == [
        (
            "device busy fwd / bwd / step (kernels launched on step 12 / the phase's latency)",
            "50 ms of 250 ms (20%) / 100 ms of 500 ms (20%) / 200 ms of 250 ms (80%)",
        ),
        ("device idle in fwd + bwd (waiting for the host: launches, Python)", "80%"),
    ]
    assert module_source(result).startswith(
        "steps 11-13 (the device's kernels each call launched (torch.profiler)"
    )
    assert device_busy_lines(window(), window().metrics()) == []


def test_the_json_keeps_the_kernel_seconds_and_reads_back_the_same_figures() -> None:
    result = dataclasses.replace(window(), device_busy=BUSY)
    result = dataclasses.replace(result, steps=dataclasses.replace(result.steps, module_kernels=True))
    data = json.loads(json.dumps(json_data(result)))
    assert data["device_busy"] == BUSY and data["steps"]["module_kernels"] is True
    back = from_json(data).result
    assert back.device_busy == BUSY and back.steps.module_kernels
    assert back.metrics() == result.metrics()
