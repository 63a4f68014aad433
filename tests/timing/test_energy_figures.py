"""What readings of an energy counter come to, worked out by hand: a span over steps (runs of consecutive
steps joined at their shared reading), how far off it may be, and the job's figures with each GPU and each
host counted once."""

from __future__ import annotations

import pytest

from flops_callbacks.timing.energy_figures import (
    CounterName,
    EnergyFigures,
    EnergySpan,
    Reading,
    energy_figures,
    job_spans,
    read,
    span_over,
)

NVML = CounterName("GPU-a", "NVML total energy", 0.1)


def at(joules: float, seconds: float, counter: CounterName = NVML) -> Reading:
    return Reading(joules, seconds, counter)


def test_consecutive_steps_make_one_run_and_a_step_between_them_starts_another() -> None:
    # steps 1, 2 back to back (their reads shared), step 4 after a step 3 that is not in the span
    r0, r1, r2, r3, r4 = at(100, 10.0), at(160, 10.5), at(220, 11.0), at(400, 12.0), at(460, 12.5)
    span = span_over([(r0, r1), (r1, r2), (r3, r4)])
    assert span == EnergySpan("GPU-a", "NVML total energy", 0.1, 180.0, 1.5, steps=3, brackets=2)
    assert span.error == pytest.approx(2 * 0.1 / 1.5)  # two runs, each end stale by up to 0.1 s
    assert not span.long_enough  # 1.5 s < 20 x 2 x 0.1 s
    assert span.note("the clean steps") == (
        "the clean steps: 1.5 s in 2 runs, under 20x the counter's 0.1 s resolution per run: off by up to 13%"
    )


def test_a_run_of_20_resolutions_is_long_enough_and_says_nothing() -> None:
    span = span_over([(at(0, 0.0), at(600, 2.0))])  # exactly 20 x 0.1 s
    assert (span.joules, span.seconds, span.steps, span.brackets) == (600.0, 2.0, 1, 1)
    assert span.long_enough and span.error == pytest.approx(0.05) and span.note("x") == ""


def test_a_counter_that_goes_back_readings_of_two_counters_and_no_step_are_errors() -> None:
    with pytest.raises(ValueError, match="went back"):
        span_over([(at(5, 0.0), at(4, 1.0))])
    with pytest.raises(ValueError, match="more than one counter"):
        span_over([(at(0, 0.0), at(1, 1.0, CounterName("GPU-b", "NVML total energy", 0.1)))])
    with pytest.raises(ValueError, match="at least one step"):
        span_over([])


def test_a_read_holds_the_joules_the_time_after_and_which_counter() -> None:
    class Counter:
        scope, source, resolution = "RAPL on h", "RAPL package", 0.001

        def read(self) -> float:
            return 12.5

    reading = read(Counter())
    assert (reading.joules, reading.counter) == (12.5, CounterName("RAPL on h", "RAPL package", 0.001))
    assert reading.at > 0


def test_the_jobs_figures_count_each_gpu_and_each_hosts_rapl_once() -> None:
    # 10 steps of 4 samples x 512 tokens per device, 2 replicas: 4096 tokens and 8 samples a job's step.
    # GPU-a 600 J in 4 s, GPU-b 500 J in 4 s, a third rank on GPU-a reads it again (not added)
    spans = [
        EnergySpan("GPU-a", "NVML total energy", 0.1, 600.0, 4.0, 10),
        EnergySpan("GPU-b", "NVML total energy", 0.1, 500.0, 4.0, 10),
        EnergySpan("GPU-a", "NVML total energy", 0.1, 601.0, 4.0, 10),
    ]
    assert [s.scope for s in job_spans(spans)] == ["GPU-a", "GPU-b"]
    figures = energy_figures(spans, tokens_per_step=4096, samples_per_step=8)
    assert figures == EnergyFigures(
        joules_per_step=110.0,  # 60 + 50
        watts=275.0,  # 150 + 125
        joules_per_token=110 / 4096,  # 26.86 mJ
        joules_per_sample=13.75,
        tokens_per_joule=4096 / 110,  # 37.24
        error=0.1 / 4.0,
        counters=2,
    )


def test_unknown_tokens_give_no_per_token_figures_and_a_span_of_no_time_is_an_error() -> None:
    figures = energy_figures([EnergySpan("RAPL on h", "RAPL package", 0.001, 5.0, 1.0, 5)])
    assert (figures.joules_per_step, figures.watts) == (1.0, 5.0)
    assert figures.joules_per_token is figures.joules_per_sample is figures.tokens_per_joule is None
    with pytest.raises(ValueError, match="spans of time and steps"):
        energy_figures([EnergySpan("RAPL on h", "RAPL package", 0.001, 5.0, 0.0, 5)])
    with pytest.raises(ValueError):
        energy_figures([])
