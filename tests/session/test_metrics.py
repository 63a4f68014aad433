"""The metrics dict of a window: every key computed from plain result data, numbers worked out by hand."""

from __future__ import annotations

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Peak
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile
from flops_callbacks.session.result import WindowResult, WindowSteps, phase_rates, window_metrics


def profile(fwd: int, bwd: int, recompute: int) -> Profile:
    root = ModuleProfile(
        fwd_flops=fwd, bwd_flops=bwd, recompute_flops=recompute, fwd_macs=fwd // 2, params=1000, name="",
        fwd_bytes=3 * fwd, bwd_bytes=5 * bwd, saved_bytes=7 * fwd,
    )  # fmt: skip
    return Profile(0.0, 0.0, "cpu", {"": root}, Counts(), Coverage())


def result(p: Profile, tokens: int | None = None, peak: Peak | None = None) -> WindowResult:
    steps = WindowSteps(
        counting=10, module_timing=(11,), clean=(12, 13, 14), skipped=(), latency_source="clean"
    )
    return WindowResult(
        profile=p,
        steps=steps,
        fwd_latency=0.25,
        bwd_latency=0.5,
        step_latency=0.25,
        samples=8,
        tokens=tokens,
        micro_batches=2,
        parallel=ParallelSizes(world_size=4, data_parallel=4),
        peak=peak,
    )


def test_every_metric_of_a_window_by_hand() -> None:
    p = profile(fwd=100, bwd=200, recompute=50)
    m = window_metrics(result(p, tokens=1024, peak=Peak(1000.0, "given")))
    assert m == {
        names.FWD_FLOPS: 100.0,
        names.BWD_FLOPS: 200.0,
        names.RECOMPUTE_FLOPS: 50.0,
        names.FWD_MACS: 50.0,
        names.FWD_BYTES: 300.0,
        names.BWD_BYTES: 1000.0,
        names.SAVED_ACTIVATION_BYTES: 700.0,
        names.PARAMS: 1000.0,
        names.FWD_LATENCY: 0.25,
        names.BWD_LATENCY: 0.5,
        names.STEP_LATENCY: 0.25,
        names.ITER_LATENCY: 1.0,
        names.FWD_FLOPS_PER_SEC: 400.0,  # 100 / 0.25
        names.BWD_FLOPS_PER_SEC: 500.0,  # (200 + 50 recomputed) / 0.5: the work of the backward phase
        names.FLOPS_PER_SEC: 350.0,  # (100 + 200 + 50) / 1.0
        names.SAMPLES_PER_SEC: 32.0,  # 8 per device x 4 replicas / 1.0
        names.TOKENS_PER_SEC: 4096.0,
        names.MFU: 0.3,  # model flops (100 + 200) / 1.0 / 1000
        names.HFU: 0.35,  # with recompute
    }


def test_without_tokens_or_a_peak_those_keys_are_absent() -> None:
    m = window_metrics(result(profile(fwd=100, bwd=200, recompute=0)))
    # one step standing for the clean steps, with no step before it: no wall step either
    assert set(m) == set(names.ALL) - {names.TOKENS_PER_SEC, *names.WALL}


def test_phase_rates_are_zero_where_a_latency_is_zero() -> None:
    rates = phase_rates(profile(fwd=100, bwd=200, recompute=0), 0.0, 0.0, 0.0)
    assert (rates.fwd, rates.bwd, rates.fwd_bwd, rates.iter) == (0.0, 0.0, 0.0, 0.0)
    rates = phase_rates(profile(fwd=100, bwd=200, recompute=100), 0.5, 1.0, 0.5)
    expected = (200.0, 300.0, 400 / 1.5, 200.0)  # fwd 100 / 0.5; bwd (200 + 100) / 1; 400 / 1.5; 400 / 2
    assert (rates.fwd, rates.bwd, rates.fwd_bwd, rates.iter) == pytest.approx(expected)


def test_names_are_prefixed_and_listed_once() -> None:
    assert all(k.startswith(names.PREFIX) for k in (*names.ALL, *names.WITH_PEAK))
    assert all(k.startswith(names.THROUGHPUT_PREFIX) for k in names.THROUGHPUT)
    assert len(set(names.ALL)) == len(names.ALL)
