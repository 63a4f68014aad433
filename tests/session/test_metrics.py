"""The metrics dict of a window: every key computed from plain result data, numbers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Peak
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile
from flops_callbacks.session.result import WindowResult, WindowSteps, phase_rates, window_metrics
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.window_steps import CleanFigures, CleanStep, StepSeconds, StepWork


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
        names.SAVED_ACTIVATION_BYTES: 350.0,  # 700 over the step's 2 micro-batches: one micro-batch's
        names.PARAMS: 1000.0,
        names.FWD_LATENCY: 0.25,
        names.BWD_LATENCY: 0.5,
        names.STEP_LATENCY: 0.25,
        names.ITER_LATENCY: 1.0,
        names.CLEAN_STEPS: 3.0,
        names.FWD_FLOPS_PER_SEC: 400.0,  # 100 / 0.25
        names.BWD_FLOPS_PER_SEC: 400.0,  # 200 / 0.5: model flops, the 50 recomputed apart
        names.FLOPS_PER_SEC: 300.0,  # (100 + 200) / 1.0
        names.HARDWARE_FLOPS_PER_SEC: 350.0,  # (100 + 200 + 50 recomputed) / 1.0
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
    assert (rates.fwd, rates.bwd, rates.fwd_bwd, rates.iter, rates.hardware) == (0.0, 0.0, 0.0, 0.0, 0.0)
    rates = phase_rates(profile(fwd=100, bwd=200, recompute=100), 0.5, 1.0, 0.5)
    # fwd 100 / 0.5; bwd 200 / 1; (100 + 200) / 1.5; 300 / 2; with the 100 recomputed 400 / 2
    expected = (200.0, 200.0, 300 / 1.5, 150.0, 200.0)
    assert (rates.fwd, rates.bwd, rates.fwd_bwd, rates.iter, rates.hardware) == pytest.approx(expected)


def test_one_slow_step_moves_latencies_and_rates_not_but_the_wall_rate_and_the_range() -> None:
    """Five clean steps of 100 fwd + 200 bwd flops and 4 samples, the third 3x as slow: the latencies and
    rates are the median step's (by FLOPS), the wall rate carries the slow step's time, the range shows it."""
    counts = BatchCounts(100, 200, 0, 50, 100, 0)
    times = [(0.25, 0.5, 0.25), (0.2, 0.6, 0.3), (0.75, 1.5, 0.75), (0.3, 0.4, 0.2), (0.25, 0.5, 0.2)]
    steps = (CleanStep(StepWork(counts, 4, 64), StepSeconds(*t, 0.1, sum(t) + 0.1)) for t in times)
    figures = CleanFigures(tuple(steps))
    r = dataclasses.replace(
        result(profile(fwd=100, bwd=200, recompute=0)), micro_batches=1, clean=figures,
        fwd_latency=0.25, bwd_latency=0.5, step_latency=0.25,
    )  # fmt: skip
    # per-step FLOPS: 300 over 1.0, 1.1, 3.0, 0.9, 0.95 s; the median is step 0's (1.0 s)
    assert figures.median_step() == figures.steps[0]
    m = window_metrics(r)
    assert m[names.ITER_LATENCY] == 1.0  # 0.25 + 0.5 + 0.25, the median step's
    assert m[names.FLOPS_PER_SEC] == 300.0  # its 300 flops / 1.0 s: the median of the 5 per-step rates
    assert m[names.SAMPLES_PER_SEC] == 16.0  # 4 per step x 4 replicas / 1.0
    assert m[names.TOKENS_PER_SEC] == 256.0
    assert m[names.WALL_LATENCY] == 1.1  # the median step's
    wall = sum(sum(t) + 0.1 for t in times)  # 7.45 s, the slow step's 3.1 in it
    assert m[names.WALL_SAMPLES_PER_SEC] == pytest.approx(20 * 4 / wall)  # 5 steps x 4 samples x 4 replicas
    iters = figures.spreads["iter"]  # the range shows the slow step
    assert (iters.median, iters.low, iters.high, iters.steps) == pytest.approx((1.0, 0.9, 3.0, 5))
    assert m[names.CLEAN_STEPS] == 3.0  # the result's clean steps (12, 13, 14)


def test_names_are_prefixed_and_listed_once() -> None:
    assert all(k.startswith(names.PREFIX) for k in (*names.ALL, *names.WITH_PEAK))
    assert all(k.startswith(names.THROUGHPUT_PREFIX) for k in names.THROUGHPUT)
    assert len(set(names.ALL)) == len(names.ALL)
