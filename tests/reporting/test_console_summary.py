"""The console summary: a window's figures in at most 25 lines, every value the metrics dict's, worked out
by hand on a window of known latencies and a three-module tree."""

from __future__ import annotations

import dataclasses

from flops_callbacks.communication.slow_rank import find_slow_rank
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile
from flops_callbacks.reporting.console_summary import MAX_LINES, Split, bound_by, render_console_summary
from flops_callbacks.reporting.tree_check import TreeCheck
from flops_callbacks.session.result import WindowResult, WindowSteps
from flops_callbacks.timing.energy_figures import EnergySpan
from tests.communication.test_slow_rank import forward_sleep

PEAK = Peak(1000.0, "peak_flops argument")


def window(peak: Peak | None = PEAK) -> WindowResult:
    """fwd / bwd / step 0.25 / 0.5 / 0.25 s; the model (100 + 200 flops) holds ``a`` (60 + 120) and ``b``
    (30 + 60); its module-timing step's latencies: the model 0.2 + 0.4 s, a 0.05 + 0.1 s, b 0.1 + 0.2 s."""
    modules = {
        "": ModuleProfile(fwd_flops=100, bwd_flops=200, params=1000, name="", class_name="Net"),
        "a": ModuleProfile(fwd_flops=60, bwd_flops=120, params=600, name="a", class_name="Linear", depth=1),
        "b": ModuleProfile(fwd_flops=30, bwd_flops=60, params=300, name="b", class_name="Linear", depth=1),
    }
    times = {"": (0.2, 0.4), "a": (0.05, 0.1), "b": (0.1, 0.2)}
    modules = {
        n: dataclasses.replace(m, fwd_latency=times[n][0], bwd_latency=times[n][1])
        for n, m in modules.items()
    }
    return WindowResult(
        profile=Profile(0.25, 0.5, "cpu", modules, Counts(), Coverage()),
        steps=WindowSteps(10, (11, 12, 13), (15, 16, 17), (), "median of 3 clean step(s)", module_trace=12),
        fwd_latency=0.25,
        bwd_latency=0.5,
        step_latency=0.25,
        samples=8,
        tokens=1024,
        micro_batches=2,
        parallel=ParallelSizes(world_size=2, data_parallel=2),
        compute_dtype="bf16",
        peak=peak,
        no_peak_reason="no peak FLOPS for a cpu device",
    )


def test_the_summary_holds_the_rates_the_split_the_verdict_the_top_modules_and_the_sizes() -> None:
    text = render_console_summary(window(), TreeCheck(), "logs/flops_profile_step10.txt")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    top = slice(12, 15)  # the top modules' rows: their words (the columns' widths aside)
    assert [" ".join(line.split()) for line in lines[top]] == [
        "b 300 ms 50% a 180 60%",
        "(Net) 150 ms 25% b 90 30%",
        "a 150 ms 25% (Net) 30 10%",
    ]
    lines[top] = [" ".join(line.split()) for line in lines[top]]
    assert lines == [
        f"{' flops_callbacks Flops Profiler ':-^78}",
        "Profile Summary at step 10 (full report: logs/flops_profile_step10.txt)",
        "FLOPS         300 FLOPS per device",  # (100 + 200) flops / (0.25 + 0.5 + 0.25) s
        "MFU / HFU     MFU 30.00%, HFU 30.00% of 1 KFLOPS given",  # 300 / 1000, no recompute; the argument's
        "samples/s     16.00 (step)",  # 8 a step x 2 replicas / 1 s; no wall step was timed
        "tokens/s      2048.00 (step)",
        "energy        n/a: no energy counter was read",  # a result built without one, or a file without
        "median step   fwd        bwd        step       iter",
        "              250 ms     500 ms     250 ms     1 s",
        "              25%        50%        25%        100%",
        "bound by      the model's fwd + bwd (75% of the step); roofline: n/a (no peak bandwidth or FLOPS)",
        "top modules   by own time (fwd + bwd)                     by own flops (fwd + bwd)",
        # own: b 0.3 s of 0.6 and 90 flops of 300; the model 0.6 - 0.45 s and 300 - 270 flops; a 0.15 s, 180
        "b 300 ms 50% a 180 60%",
        "(Net) 150 ms 25% b 90 30%",
        "a 150 ms 25% (Net) 30 10%",
        "model         1 K params, cpu, bf16; flops per step: fwd 100, bwd 200; batch 4 x 2 micro-batches",
        "sizes         world 2, data parallel 2, model parallel 1",
        "from          flops: step 10; modules: steps 11-13; phases: median of 3 clean step(s), steps 15-17",
        "-" * 78,
    ]


def test_without_a_peak_the_mfu_line_says_why_and_without_a_file_where_the_full_report_is() -> None:
    lines = render_console_summary(window(peak=None), TreeCheck(), "").splitlines()
    assert lines[1] == "Profile Summary at step 10 (full report: report='full' prints it)"
    assert lines[3] == "MFU / HFU     n/a: no peak FLOPS for a cpu device"


def test_without_a_batch_size_samples_per_second_says_why_and_tokens_are_left_out() -> None:
    result = dataclasses.replace(window(), samples=None, tokens=None)
    lines = render_console_summary(result, TreeCheck(), "").splitlines()
    assert lines[4] == "samples/s     n/a: the batch size was not found (pass batch_size_fn)"
    assert not any(line.startswith("tokens/s") for line in lines)


def test_a_module_with_no_own_time_is_not_a_top_module() -> None:
    """A LightningModule whose training_step calls its ``model`` never runs itself: 0 s of its own."""
    result = window()
    root = dataclasses.replace(result.profile.modules[""], fwd_latency=0.15, bwd_latency=0.3)  # a + b's
    profile = dataclasses.replace(result.profile, modules={**result.profile.modules, "": root})
    text = render_console_summary(dataclasses.replace(result, profile=profile), TreeCheck())
    rows = [" ".join(line.split()) for line in text.splitlines()[12:15]]
    assert rows == ["b 300 ms 67% a 180 60%", "a 150 ms 33% b 90 30%", "(Net) 30 10%"]


def test_the_top_modules_shares_are_of_the_models_flops_and_time_when_a_shared_module_counts_twice() -> None:
    """``a`` calls ``b``, its sibling (a shared module: its call is in ``a``'s figures and in its own): a
    holds 270 flops and 0.45 s, b's 90 and 0.3 s in them. The own figures sum to more than the model's
    300 flops and 0.6 s (the model's own is 300 - 360: none), so shares of their sum read low (a: 75%
    of the flops, 60% of the time)."""
    result = window()
    modules = result.profile.modules
    a = dataclasses.replace(modules["a"], fwd_flops=90, bwd_flops=180, fwd_latency=0.15, bwd_latency=0.3)
    profile = dataclasses.replace(result.profile, modules={**modules, "a": a})
    text = render_console_summary(dataclasses.replace(result, profile=profile), TreeCheck())
    rows = [" ".join(line.split()) for line in text.splitlines()[12:14]]
    assert rows == ["a 450 ms 75% a 270 90%", "b 300 ms 50% b 90 30%"]
    assert text.splitlines()[14].startswith("model ")


def test_the_verdict_names_the_largest_part_of_30_percent_or_more_as_printed() -> None:
    result = window()

    def split(data: float, fwd: float, bwd: float, step: float, other: float) -> Split:
        parts = {"data": data, "fwd": fwd, "bwd": bwd, "step": step, "other": other}
        return Split(parts, sum(parts.values()), timed_wall=True)

    assert bound_by(split(0.4, 0.2, 0.2, 0.1, 0.1), result) == (
        "the input pipeline: 40% of the step waits for data "
        "(more DataLoader num_workers, pin_memory=True, prefetch_factor)"
    )
    assert bound_by(split(0.1, 0.2, 0.2, 0.15, 0.35), result) == (
        "the loop's own work: 35% of the step is outside the phases"
    )
    assert bound_by(split(0.1, 0.2, 0.2, 0.3, 0.2), result) == "the optimizer step: 30% of the step"
    assert bound_by(split(0.05, 0.4, 0.4, 0.1, 0.05), result).startswith(
        "the model's fwd + bwd (80% of the step)"
    )
    # a checkpoint callback's 52% over a collate's 35%: the larger bounds the step (data was named first)
    assert bound_by(split(0.35, 0.05, 0.05, 0.03, 0.52), result).startswith("the loop's own work: 52%")
    assert bound_by(split(0.33, 0.0, 0.0, 0.31, 0.36), result).startswith("the loop's own work: 36%")
    # 29.7% prints as 30%: it bounds the step as printed
    assert bound_by(split(0.297, 0.25, 0.25, 0.1, 0.103), result).startswith("the input pipeline: 30%")


def test_each_doubt_is_one_line_naming_the_file_and_the_summary_stays_within_25_lines() -> None:
    note = (
        "module tree: the model's forward on step 12 of steps 11-13 (176.93 ms) is 1.52x the model's own "
        "forward (116.65 ms, clean steps): the steps that timed the modules were slowed"
    )
    one = render_console_summary(window(), TreeCheck(notes=[note]), "logs/flops_profile_step10.txt")
    assert one.splitlines()[-2] == (
        "doubt: the module tree's forward is 1.52x the model's own forward; "
        "details in flops_profile_step10.txt"
    )
    many = render_console_summary(window(), TreeCheck(notes=[note] * 20), "logs/flops_profile_step10.txt")
    lines = many.splitlines()
    assert len(lines) == MAX_LINES == 25
    shown = MAX_LINES - 19 - 1  # 19 lines before the warnings, one saying how many more
    assert lines[-2] == f"and {20 - shown} more warning(s) in the full report"
    assert lines[-1] == "-" * 78


def test_with_both_peaks_the_verdict_is_the_roofline_limiter_of_most_of_the_modules_time() -> None:
    """Peak 1000 flop/s and 100 B/s. ``a`` moves 20 + 40 bytes: 0.2 s and 0.4 s at the memory roof, more
    than its 0.06 s and 0.12 s of flops: memory-bound, 0.05 + 0.1 s. ``b`` moves 1 + 2 bytes: its 0.03 s and
    0.06 s of flops are the bound, 0.3x its 0.1 + 0.2 s: compute-bound. The model has children: left out."""
    result = window()
    modules = dict(result.profile.modules)
    modules["a"] = dataclasses.replace(modules["a"], fwd_bytes=20, bwd_bytes=40)
    modules["b"] = dataclasses.replace(modules["b"], fwd_bytes=1, bwd_bytes=2)
    result = dataclasses.replace(
        result,
        profile=dataclasses.replace(result.profile, modules=modules),
        bandwidth=Bandwidth(100.0, "peak_bandwidth argument"),
    )
    parts = {"fwd": 0.25, "bwd": 0.5, "step": 0.25, "data": 0.0, "other": 0.0}
    assert bound_by(Split(parts, 1.0, timed_wall=False), result) == (
        "compute-bound (75% of the step in fwd + bwd; module time compute-bound 67%, memory-bound 33%)"
    )


def test_with_several_ranks_one_line_names_the_slow_rank_or_says_none_stands_out() -> None:
    for ranks, said in (
        (forward_sleep(), "1 of 2, fwd +20 ms over the median; the others wait 20 ms a step in all_reduce"),
        ([forward_sleep()[0]] * 2, "none stands out (the ranks agree within their step-to-step noise)"),
    ):
        result = dataclasses.replace(window(), slow_rank=find_slow_rank(ranks))
        lines = render_console_summary(result, TreeCheck(), "").splitlines()
        assert lines[lines.index(next(line for line in lines if line.startswith("bound by"))) + 1] == (
            f"slow rank     {said}"
        )
        assert max(len(line) for line in lines) <= 100
    assert not any(
        line.startswith("slow rank") for line in render_console_summary(window(), TreeCheck()).split("\n")
    )


def test_the_energy_line_is_the_metrics_per_step_per_token_and_power_each_counter_once_or_why_none() -> None:
    """Two ranks on two GPUs over 3 clean steps: 600 J and 540 J in 3 s each: 200 + 180 = 380 J a step and
    200 + 180 = 380 W; the job's tokens per step 1024 x 2 replicas: 380 / 2048 = 185.55 mJ a token, 5.39
    tokens per joule. A third rank on the first GPU reads its counter again: counted once."""
    spans = (
        EnergySpan("GPU-a", "NVML total energy", 0.1, 600.0, 3.0, 3),
        EnergySpan("GPU-b", "NVML total energy", 0.1, 540.0, 3.0, 3),
        EnergySpan("GPU-a", "NVML total energy", 0.1, 601.0, 3.0, 3),
    )
    result = dataclasses.replace(window(), energy=spans)
    lines = render_console_summary(result, TreeCheck(), "").splitlines()
    assert lines[6] == (
        "energy        380 J per step, 185.55 mJ per token, 5.39 tokens/J; 380 W "
        "(NVML total energy of 2 GPUs)"
    )
    short = tuple(s._replace(seconds=1.0) for s in spans)  # 1 s is 10 of NVML's 0.1 s: off by up to 10%
    lines = render_console_summary(dataclasses.replace(window(), energy=short), TreeCheck(), "").splitlines()
    assert lines[6].endswith("; off by up to 10% (too short for the counter)")
    why = "no RAPL counter: /sys/class/powercap does not exist"
    lines = render_console_summary(
        dataclasses.replace(window(), no_energy_reason=why), TreeCheck()
    ).splitlines()
    assert lines[6] == f"energy        n/a: {why}"
