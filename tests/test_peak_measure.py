"""The measured peak: the best dense matmul rate of the model's device in its compute dtype, within 2 s,
once per process; asked for by ``peak_flops="measure"`` or the environment variable, and said as
"measured" in the peak's source."""

from __future__ import annotations

import time

import pytest
import torch

from flops_callbacks import peak_measure
from flops_callbacks.options import Options
from flops_callbacks.peak_measure import MEASURE_SECONDS, Measured, measure_matmul, measured_matmul
from flops_callbacks.peaks import (
    BF16,
    ENV_VAR,
    FP8,
    FP32,
    FP64,
    Peak,
    PeakToMeasure,
    given_peak,
    resolve_peak,
    table_peak,
)

CPU = torch.device("cpu")


class FakeDevice:
    """A clock that a matmul of side n advances by 2 n^3 / rate(n) seconds: a device of known speed."""

    def __init__(self, rate: dict[int, float]) -> None:
        self.now, self.rate, self.sizes = 0.0, rate, set[int]()

    def clock(self) -> float:
        return self.now

    def mm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = a.shape[0]
        self.sizes.add(n)
        self.now += 2 * n**3 / self.rate[n]
        return out


def on(device: FakeDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak_measure, "_clock", device.clock)
    monkeypatch.setattr(peak_measure, "_mm", device.mm)


def test_the_sizes_grow_until_a_call_is_long_enough_and_the_best_rate_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 256: 0.67 ms a call, 512: 5.4 ms, 1024: 21.5 ms >= 20 ms: the sizes stop there, 2048 is never run
    device = FakeDevice({256: 5e10, 512: 5e10, 1024: 1e11, 2048: 1e11})
    on(device, monkeypatch)
    found = measure_matmul(CPU, FP32)
    assert device.sizes == {256, 512, 1024}
    assert found.flops == pytest.approx(1e11) and found.size == 1024
    # each size warmed up and timed once (1.34 + 10.74 + 42.95 ms), then trials of 1 call (21.47 ms:
    # as many as fit in 25 ms) while the next, planned at twice that, ends within 85% of the 2 s: 75
    ladder = sum(2 * 2 * n**3 / device.rate[n] for n in (256, 512, 1024))
    trial = 2 * 1024**3 / 1e11
    assert found.trials == 1 + 75  # the single call at 1024 and the 75 trials
    assert found.seconds == pytest.approx(ladder + 75 * trial)
    assert ladder + 74 * trial + 2 * trial < 0.85 * MEASURE_SECONDS <= ladder + 75 * trial + 2 * trial


def test_a_smaller_size_that_runs_faster_is_the_one_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    device = FakeDevice({256: 5e10, 512: 2e11, 1024: 1e11, 2048: 1e11})
    on(device, monkeypatch)
    found = measure_matmul(CPU, FP32)
    assert (found.flops, found.size) == (pytest.approx(2e11), 512)
    assert found.seconds <= MEASURE_SECONDS


def test_this_cpus_fp32_matmul_is_measured_within_two_seconds_drawing_none_of_the_runs_randoms() -> None:
    torch.manual_seed(0)
    start = time.perf_counter()
    found = measure_matmul(CPU, FP32)
    elapsed = time.perf_counter() - start
    drawn = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(4))  # the run's next numbers are those it would have drawn
    assert found.seconds <= elapsed <= MEASURE_SECONDS  # the stopwatch encloses the measure
    assert 1e9 < found.flops < 1e14  # a CPU core or two: GFLOPS to a few TFLOPS
    assert found.size in (256, 512, 1024, 2048) and found.trials >= 1


def test_fp8_has_no_dense_matmul_to_measure() -> None:
    with pytest.raises(ValueError, match="no dense fp8 matmul to measure"):
        measure_matmul(CPU, FP8)


def test_a_device_and_dtype_are_measured_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def measure(device: torch.device, dtype: str) -> Measured:
        calls.append((device, dtype))
        return Measured(5e10, 1024, 40, 1.9)

    monkeypatch.setattr(peak_measure, "measure_matmul", measure)
    monkeypatch.setattr(peak_measure, "_cache", {})
    assert measured_matmul(CPU, FP32) is measured_matmul(CPU, FP32)
    assert measured_matmul(CPU, "bf16").flops == 5e10
    assert calls == [(CPU, FP32), (CPU, "bf16")]


def test_measure_is_asked_by_the_argument_or_the_environment_and_said_as_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peak_measure, "_cache", {(str(CPU), FP32): Measured(5e10, 1024, 40, 1.94)})
    assert Options(peak_flops="measure").peak_flops == "measure"
    asked = given_peak("measure")
    assert asked == PeakToMeasure(source="peak_flops='measure'")
    assert resolve_peak(asked, CPU, FP32) == (
        Peak(5e10, "measured: fp32 dense matmul 1024x1024 on cpu, best of 40 in 1.9 s, peak_flops='measure'"),
        "",
    )
    monkeypatch.setenv(ENV_VAR, "measure")
    from_env = given_peak(None)
    assert from_env == PeakToMeasure(source=f"{ENV_VAR}=measure")
    peak, _ = resolve_peak(from_env, CPU, FP32)
    assert peak is not None and peak.source.endswith(f", {ENV_VAR}=measure")
    assert given_peak(2e12) == Peak(2e12, "peak_flops argument")  # the argument wins over the environment
    given = given_peak(2e12)
    assert given is not None and (peak.kind, given.kind) == ("measured", "given")
    assert resolve_peak(None, CPU, FP32)[0] is None


def test_a_measure_that_cannot_be_taken_says_why_and_gives_no_peak() -> None:
    peak, why = resolve_peak(PeakToMeasure(), CPU, FP8)
    assert peak is None
    assert why.startswith("could not measure a fp8 matmul on cpu (no dense fp8 matmul to measure")
    assert why.endswith("peak_flops='measure'): pass peak_flops= a number instead of 'measure'")
    assert resolve_peak(PeakToMeasure(), CPU, None) == (
        None,
        "unknown compute dtype, no matmul to measure (peak_flops='measure'): "
        "pass peak_flops= a number instead of 'measure'",
    )


@pytest.mark.parametrize("value", ["Measure", "measured", "auto"])
def test_a_misspelt_measure_fails_at_construction_naming_what_is_taken(value: str) -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 989e12\), 'measure' to measure the device's dense matmul"):
        Options(peak_flops=value)  # type: ignore[arg-type]


def test_each_peak_says_in_a_word_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    datasheet, _ = table_peak("NVIDIA H100 80GB HBM3", BF16)
    assert datasheet is not None and datasheet.kind == "datasheet"
    monkeypatch.setenv(ENV_VAR, "312e12")
    from_env = given_peak(None)
    assert from_env == Peak(312e12, f"{ENV_VAR} environment variable") and from_env.kind == "given"


def test_an_fp64_model_measures_an_fp64_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float64 model's dtype is fp64 (it was unknown: no MFU, and "measure" refused to run)."""
    device = FakeDevice({256: 2e10, 512: 2e10, 1024: 2e10, 2048: 2e10})
    on(device, monkeypatch)
    made: list[torch.dtype] = []
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: made.append(k["dtype"]) or randn(*a, **k))
    peak, why = resolve_peak(PeakToMeasure("peak_flops='measure'"), CPU, FP64)
    assert why == "" and peak is not None and peak.flops == pytest.approx(2e10)
    assert peak.source.startswith("measured: fp64 dense matmul") and set(made) == {torch.float64}
