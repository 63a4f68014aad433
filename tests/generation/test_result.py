"""A generation's metrics from plain result data, every number worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.generation.report import render_generation
from flops_callbacks.generation.result import CountedStep, GenerationResult, quantile
from flops_callbacks.generation.run import RunTimes, cache_bytes
from flops_callbacks.peaks import Bandwidth, Peak


def result(peaks: bool = True, **changes: object) -> GenerationResult:
    fields: dict[str, object] = dict(
        device="cpu",
        compute_dtype="fp32",
        batch_size=2,
        prompt_tokens=8,
        padding_tokens=3,
        # the prefill, then three decode steps whose attention grows with the cache
        work=(
            CountedStep(100, 40, 1000),
            CountedStep(10, 4, 300),
            CountedStep(12, 5, 320),
            CountedStep(14, 6, 340),
        ),
        prefill=None,
        decode=None,
        decode_shown=1,
        runs=(
            RunTimes(
                total=1.0,
                first_token=0.3,
                tokens=4,
                prefill_steps=1,
                steps=(0.2, 0.1, 0.1, 0.1),
                token_gaps=(0.2, 0.25, 0.3),
            ),
            RunTimes(
                total=3.0,
                first_token=0.5,
                tokens=4,
                prefill_steps=1,
                steps=(0.4, 0.1, 0.2, 0.3),
                token_gaps=(0.9, 0.9, 0.9),
            ),
        ),
        warm_up=1,
        kv_cache_bytes=4096,
        peak=Peak(1000.0, "given") if peaks else None,
        no_peak_reason="" if peaks else "no peak",
        bandwidth=Bandwidth(10_000.0, "given") if peaks else None,
        no_bandwidth_reason="" if peaks else "no bandwidth",
    )
    fields.update(changes)
    return GenerationResult(**fields)  # type: ignore[arg-type]


def test_every_metric_worked_out_by_hand() -> None:
    m = result().metrics()
    assert m == pytest.approx(
        {
            names.PREFILL_FLOPS: 100,
            names.PREFILL_BYTES: 1000,
            names.PREFILL_LATENCY: 0.3,  # median of 0.2 and 0.4
            names.TIME_TO_FIRST_TOKEN: 0.4,  # median of 0.3 and 0.5
            names.DECODE_FLOPS_PER_TOKEN: 12,  # (10 + 12 + 14) / 3
            names.DECODE_BYTES_PER_TOKEN: 320,
            names.DECODE_LATENCY_PER_TOKEN: 0.6,  # both runs' gaps pooled: 0.2 0.25 0.3 0.9 0.9 0.9
            names.DECODE_LATENCY_P90: 0.9,
            names.DECODE_FORWARD_LATENCY: 0.1,  # median of 0.1, 0.1, 0.1, 0.1, 0.2, 0.3
            names.GENERATION_LATENCY: 2.0,
            names.GENERATION_TOKENS_PER_SEC: 2 * 4 / 2.0,  # sequences x a run's tokens / the latency
            names.KV_CACHE_BYTES: 4096,
            names.PREFILL_MFU: 100 / 0.3 / 1000,
            names.PREFILL_MBU: 1000 / 0.3 / 10_000,
            names.DECODE_MFU: 12 / 0.6 / 1000,
            names.DECODE_MBU: 320 / 0.6 / 10_000,
        }
    )


def test_without_peaks_or_batch_size_the_fractions_and_the_rate_are_left_out() -> None:
    m = result(peaks=False, batch_size=None).metrics()
    assert set(m) == set(names.GENERATION) - {names.GENERATION_TOKENS_PER_SEC}
    assert result(peaks=False).rooflines() == {}


def test_decode_is_memory_bound_against_the_roofs() -> None:
    verdicts = result().rooflines()
    # prefill: 100 flops / 1000 FLOPS = 0.1 s against 1000 B / 10 kB/s = 0.1 s: a tie goes to memory
    assert verdicts["prefill"].bound_seconds == pytest.approx(0.1)
    decode = verdicts["decode"]
    assert (decode.limiter, decode.flops, decode.bytes) == ("memory", 12, 320)
    assert decode.roofline_fraction == pytest.approx(0.032 / 0.6)


def test_a_generation_of_one_token_has_no_decode_figures() -> None:
    one = result(work=(CountedStep(100, 40, 1000),), runs=(RunTimes(1.0, 0.3, 1, 1, (0.2,), ()),))
    assert not {k for k in one.metrics() if "decode" in k}
    report = render_generation(one)
    assert "new tokens per sequence:" in report and "1 (1 from the prefill, 0 from decode steps)" in report
    assert "    no decode step (one new token: the prefill's)" in report


def test_quantile_interpolates_between_ranks() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.9) == pytest.approx(3.7)
    assert quantile([5.0], 0.9) == 5.0
    assert math.isnan(quantile([], 0.5))


def test_tokens_per_sec_is_the_latencys_not_dragged_down_by_one_slow_run() -> None:
    """A stall in one of three runs: the latency is the median run's, and so is the rate beside it."""
    runs = result().runs
    slow = (runs[0], dataclasses.replace(runs[0], total=10.0), dataclasses.replace(runs[0], total=1.25))
    m = result(runs=slow).metrics()
    assert m[names.GENERATION_LATENCY] == 1.25
    assert m[names.GENERATION_TOKENS_PER_SEC] == pytest.approx(2 * 4 / 1.25)


def test_tokens_per_sec_is_the_median_runs_when_runs_made_different_numbers_of_tokens() -> None:
    """Sampling to an EOS: runs of 10 tokens in 5 s, 100 in 1 s and 50 in 0.5 s. The latency is the 1 s
    run's, and so is the rate: 100 tokens a sequence in 1 s (the tokens' median over the seconds' read
    50)."""
    run = result().runs[0]
    runs = tuple(
        dataclasses.replace(run, tokens=tokens, total=total)
        for tokens, total in ((10, 5.0), (100, 1.0), (50, 0.5))
    )
    m = result(runs=runs).metrics()
    assert m[names.GENERATION_LATENCY] == 1.0 and m[names.GENERATION_TOKENS_PER_SEC] == 2 * 100 / 1.0


def test_cache_bytes_counts_each_view_once_and_a_storage_at_most_whole() -> None:
    import torch

    keys = torch.zeros(2, 4, 10, 8)
    assert cache_bytes(((keys, torch.zeros(2, 4, 10, 8)), (keys, keys[:, :, :5]))) == 2 * keys.nbytes
    assert cache_bytes(None) is None and cache_bytes(3) is None
    # a preallocated buffer's layers, and a fused tensor's key and value halves: their whole storage
    buffer = torch.zeros(2, 4, 2, 8, 32, 16)
    assert cache_bytes(tuple((buffer[0, layer], buffer[1, layer]) for layer in range(4))) == buffer.nbytes
    fused = torch.zeros(2, 8, 32, 32)
    assert cache_bytes(((fused[..., :16], fused[..., 16:]),)) == fused.nbytes


def test_a_prefill_in_chunks_is_the_steps_before_the_first_token() -> None:
    run = RunTimes(
        total=1.0,
        first_token=0.45,
        tokens=3,
        prefill_steps=2,
        steps=(0.2, 0.2, 0.1, 0.1),
        token_gaps=(0.2, 0.2),
    )
    chunked = result(prefill_steps=2, runs=(run,))
    m = chunked.metrics()
    assert (m[names.PREFILL_FLOPS], m[names.PREFILL_BYTES]) == (110, 1300)  # the two chunks' sum
    assert (m[names.DECODE_FLOPS_PER_TOKEN], m[names.DECODE_BYTES_PER_TOKEN]) == (
        13,
        330,
    )  # the two steps' mean
    assert m[names.PREFILL_LATENCY] == pytest.approx(0.4)
    assert m[names.DECODE_FORWARD_LATENCY] == pytest.approx(0.1)


def test_module_times_are_split_by_the_models_calls_and_containers_filled() -> None:
    from flops_callbacks.generation.module_times import step_module_times
    from flops_callbacks.phase_names import FORWARD
    from flops_callbacks.timing.spans import ModuleSpan

    spans = [
        ModuleSpan("", FORWARD, 0.0, 1.0, 0),  # step 0
        ModuleSpan("a", FORWARD, 0.1, 0.5, 1),
        ModuleSpan("h.0", FORWARD, 0.6, 0.2, 2),  # in the never-called container "h"
        ModuleSpan("", FORWARD, 1.0, 0.4, 0),  # step 1, starting where step 0 ends
        ModuleSpan("a", FORWARD, 1.1, 0.2, 1),
    ]
    assert step_module_times(spans, [0, 1, 5]) == {
        0: {"": 1.0, "a": 0.5, "h.0": 0.2, "h": 0.2},
        1: {"": 0.4, "a": 0.2},
    }
