"""The gate's rule on figures worked out by hand: a figure fails only when the new run is worse than the
base by more than the limit and beyond the base run's own range over its clean steps; the message says
which of the two held."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.reporting.compare import (
    Change,
    Figure,
    figure_text,
    figures,
    is_noise,
    module_changes,
    spread_range,
)
from flops_callbacks.reporting.gate_rules import Rule, gate, judge
from flops_callbacks.reporting.profile_file import SavedProfile, load
from flops_callbacks.reporting.run_notes import varying_note, work_note

MS = 1e-3


def latency(value: float, low: float, high: float) -> Figure:
    return Figure("fwd_latency", value * MS, low * MS, high * MS)


def test_a_median_inside_the_base_runs_range_is_noise_whatever_the_new_runs_own_range() -> None:
    # the runs of the report that asked for this rule: B's median inside A's range, A's outside B's
    a, b = latency(1.12, 0.72833, 1.33), latency(1.30, 1.17, 1.46)
    assert is_noise(a, b) and not is_noise(b, a)
    check = judge(Rule.parse("fwd_latency:+10%"), Change(a, b))
    assert not check.failed
    assert check.reason == (
        "fwd_latency: 1.12 ms -> 1.3 ms (+16.1%), beyond fwd_latency:+10% but within the base run's "
        "range over its clean steps (A 728.33 us .. 1.33 ms): noise"
    )


def test_a_median_above_the_base_runs_slowest_step_and_beyond_the_limit_fails() -> None:
    a, b = latency(1.12, 0.72833, 1.33), latency(1.40, 1.35, 1.46)
    check = judge(Rule.parse("fwd_latency:+10%"), Change(a, b))
    assert check.failed
    assert check.reason == (
        "fwd_latency got worse: 1.12 ms -> 1.4 ms (+25.0%), beyond fwd_latency:+10% and above the base "
        "run's range over its clean steps (A 728.33 us .. 1.33 ms)"
    )


def test_of_several_base_runs_the_range_is_their_values_and_the_reason_says_how_many() -> None:
    # five runs' medians 0.95 .. 1.25 ms around a median of 1 ms: 1.3 ms is +30% and above them all,
    # 1.15 ms +15% but as slow as one of them
    a = Figure("fwd_latency", 1.00 * MS, 0.95 * MS, 1.25 * MS, runs=5)
    rule = Rule.parse("fwd_latency:+10%")
    check = judge(rule, Change(a, latency(1.30, 1.30, 1.30)))
    assert check.failed
    assert check.reason == (
        "fwd_latency got worse: 1 ms -> 1.3 ms (+30.0%), beyond fwd_latency:+10% and above the base's "
        "range over its 5 runs (A 950 us .. 1.25 ms)"
    )
    inside = judge(rule, Change(a, latency(1.15, 1.15, 1.15)))
    assert not inside.failed
    assert inside.reason == (
        "fwd_latency: 1 ms -> 1.15 ms (+15.0%), beyond fwd_latency:+10% but within the base's range over "
        "its 5 runs (A 950 us .. 1.25 ms): noise"
    )


def test_beyond_the_range_but_within_the_limit_passes() -> None:
    # a steady base (1.00 .. 1.02 ms): 1.05 ms is beyond its range, but only +5%
    a, b = latency(1.01, 1.00, 1.02), latency(1.05, 1.04, 1.06)
    check = judge(Rule.parse("fwd_latency:+10%"), Change(a, b))
    assert not check.failed
    assert check.reason == "fwd_latency: 1.01 ms -> 1.05 ms (+4.0%), within fwd_latency:+10%"


def test_a_rate_fails_when_it_falls_below_the_base_runs_slowest_steps_rate() -> None:
    a = Figure("samples_per_sec", 100.0, 90.0, 110.0)
    inside, below = Figure("samples_per_sec", 91.0, 85.0, 95.0), Figure("samples_per_sec", 80.0, 78.0, 82.0)
    rule = Rule.parse("samples_per_sec:-5%")
    assert not judge(rule, Change(a, inside)).failed  # -9%, but a step of A was as slow
    failed = judge(rule, Change(a, below))
    assert failed.failed
    assert failed.reason == (
        "samples_per_sec got worse: 100.00 -> 80.00 (-20.0%), beyond samples_per_sec:-5% and below the "
        "base run's range over its clean steps (A 90.00 .. 110.00)"
    )
    # a rise is better for a -N% rule, however far it goes
    assert not judge(rule, Change(a, Figure("samples_per_sec", 150.0, 140.0, 160.0))).failed


def test_an_exact_count_has_no_range_so_any_growth_beyond_the_limit_fails() -> None:
    a, b = Figure("fwd_flops", 1000.0, 1000.0, 1000.0), Figure("fwd_flops", 1001.0, 1001.0, 1001.0)
    check = judge(Rule.parse("fwd_flops:+0%"), Change(a, b))
    assert check.failed and check.reason.startswith("fwd_flops got worse: 1 K -> 1 K (+0.1%)")
    assert not judge(Rule.parse("fwd_flops:+0%"), Change(a, a)).failed


def test_a_minus_zero_rule_fails_on_any_fall_beyond_the_range_and_never_on_a_rise() -> None:
    # -0% keeps its sign: a rate's fall fails, its rise passes, however small the limit
    a = Figure("mfu", 0.50, 0.49, 0.51)
    rule = Rule.parse("mfu:-0%")
    assert (rule.limit, rule.grows, str(rule)) == (0.0, False, "mfu:-0%")
    fell = judge(rule, Change(a, Figure("mfu", 0.20, 0.20, 0.20)))
    assert fell.failed and fell.reason.startswith("mfu got worse: 50.00% -> 20.00% (-60.0%), beyond mfu:-0% ")
    assert not judge(rule, Change(a, Figure("mfu", 0.90, 0.90, 0.90))).failed


@pytest.mark.parametrize("text", ["fwd_latency:+10%", "mfu:-5%", "iter_latency:+0.5%", "mfu:-0%", "x:+0%"])
def test_a_rule_reads_back_as_written(text: str) -> None:
    assert str(Rule.parse(text)) == text


def test_a_range_leaves_out_the_fastest_and_slowest_tenth_of_ten_steps_or_more() -> None:
    # 20 steps: the 3rd fastest .. the 3rd slowest; one stalled step (95 ms) does not widen it
    twenty = [50.0 + i for i in range(19)] + [95.0]
    assert spread_range(twenty) == (52.0, 67.0)
    assert spread_range([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)  # under 10 steps: all of them
    assert spread_range([float(v) for v in range(10)]) == (1.0, 8.0)


def test_a_count_of_steps_reads_as_a_whole_number() -> None:
    assert figure_text(Figure("clean_steps", 5.0, 5.0, 5.0)) == "5"
    assert figure_text(Figure("clean_steps", 19.5, 19.0, 20.0, runs=4)) == "19.5"  # a median of runs


def rewritten(path: Path, tmp_path: Path, edit: Callable[[dict], None]) -> SavedProfile:
    """The saved run at ``path`` with ``edit`` applied to its JSON, read back."""
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / f"edited_{path.parent.name}.json"
    out.write_text(json.dumps(data))
    return load(out)


def test_a_rates_range_is_its_steps_own_rates_so_batches_of_changing_lengths_at_one_rate_are_exact(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Six clean steps of 1, 2 and 3 times the work in 1, 2 and 3 ms: every step ran at one rate, so
    FLOPS has no range; samples per second (4 samples a step) spreads from 4 / 3 ms to 4 / 1 ms. The
    steps' times alone spread 3x, and read the lengths as noise."""
    scale = [1, 2, 3, 1, 2, 3]

    def edit(data: dict) -> None:
        for step, k in zip(data["clean_each"], scale, strict=True):
            step["work"]["counts"] = {name: k * 1000 for name in step["work"]["counts"]}
            step["work"]["samples"] = 4
            step["seconds"].update(fwd=k * 3e-4, bwd=k * 6e-4, step=k * 1e-4)
        # the median step by FLOPS: a tie, so the middle two in order (3 and 1 times): 2 ms and 4000 flops
        data["metrics"][names.FLOPS_PER_SEC] = 2 * 2000 / 2e-3
        data["metrics"][names.SAMPLES_PER_SEC] = 4 / 2e-3

    found = figures(rewritten(runs["A"], tmp_path, edit))
    rate, samples = found["flops_per_sec"], found["samples_per_sec"]
    assert (rate.low, rate.high) == (pytest.approx(2e6), pytest.approx(2e6))
    assert (samples.low, samples.high) == (pytest.approx(4 / 3e-3), pytest.approx(4 / 1e-3))


def test_a_modules_change_within_the_base_runs_phase_wobble_is_noise(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A's clean forwards spread over 5 ms (its backwards as they were): a module that did the same work and
    moved by less than that plus the backwards' spread is noise; B's slowed module (+150 ms) is not."""

    def edit(data: dict) -> None:
        for i, step in enumerate(data["clean_each"]):
            step["seconds"]["fwd"] = 0.06 + (0.005 if i == 0 else 0.0)

    a = rewritten(runs["A"], tmp_path, edit)
    bwd = [step["seconds"]["bwd"] for step in json.loads(runs["A"].read_text())["clean_each"]]
    wobble = 0.005 + max(bwd) - min(bwd)  # six steps: none left out of the range
    found = {m.name: m for m in module_changes(a, load(runs["B"]))}
    assert found["slow"].noise is False
    same = [m for m in found.values() if m.flops[0] == m.flops[1] and m.bytes[0] == m.bytes[1]]
    assert {m.name: m.noise for m in same} == {m.name: abs(m.delta_seconds) <= wobble for m in same}
    assert {"embed", "head", "mixer"} <= {m.name for m in same if m.noise}


def padded(scale: list[int], counted: int, samples: int = 4) -> Callable[[dict], None]:
    """A's run as a shuffled, dynamically padded loader leaves it: its clean steps did ``scale`` times A's
    work (``samples`` each), its counting step ``counted`` times."""

    def edit(data: dict) -> None:
        for step, k in zip(data["clean_each"], scale, strict=True):
            step["work"]["counts"] = {name: k * v for name, v in step["work"]["counts"].items()}
            step["work"]["samples"] = samples
        data["samples_per_device"] = samples
        for name in ("fwd_flops", "bwd_flops"):
            data["profile"]["modules"][""][name] *= counted

    return edit


def test_runs_whose_batches_vary_are_one_configuration_whatever_their_counting_steps_batch(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Two runs of one dynamically padded configuration: counting steps of 1 and 2 times A's work, clean
    steps of 1 to 3 times it, 4 samples each, the same params: no other work, and a gate reads them as one
    configuration's runs. Other params or another batch size still is other work, said with the counting
    steps' flops (A's: 19712 forward + 37520 backward = 57.23 K, twice that 114.46 K)."""
    short = rewritten(runs["A"], tmp_path, padded([1, 2, 3, 1, 2, 3], 1))
    long = rewritten(runs["A2"], tmp_path, padded([3, 1, 2, 2, 3, 1], 2))
    assert work_note(short, long) is None and work_note(long, short) is None
    (check,) = gate([short, long], [long], [Rule.parse("flops_per_sec:-50%")])  # no "not a run of"
    assert check.change.a.runs == 2

    def wider(data: dict) -> None:
        padded([3, 1, 2, 2, 3, 1], 2)(data)
        data["profile"]["modules"][""]["params"] += 1000

    other = "the runs did different work: fwd+bwd+recompute flops per step 57.23 K -> 114.46 K (+100.0%; "
    why = "another model or another batch, so their times are not comparable"
    assert work_note(short, rewritten(runs["A2"], tmp_path, wider)) == (
        f"{other}params 2.53 K -> 3.53 K, samples per device 4 -> 4): {why}"
    )
    bigger = rewritten(runs["A2"], tmp_path, padded([3, 1, 2, 2, 3, 1], 2, samples=8))
    assert work_note(short, bigger) == f"{other}params 2.53 K -> 2.53 K, samples per device 4 -> 8): {why}"
    with pytest.raises(ValueError, match=r"is not a run of .*'s configuration: the runs did different work"):
        gate([short, bigger], [short], [Rule.parse("flops_per_sec:-50%")])


def test_a_count_of_one_batch_of_runs_whose_batches_vary_is_said_and_not_gated(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """With batches of changing lengths a run's fwd_flops is its counting step's one batch's: two runs of
    one configuration differ by their counting steps' lengths (here 1 and 2 times A's work), which a gate on
    it would call a grown model. The gate refuses it naming the file, and the note says which runs vary;
    params, and runs whose batches do not vary, are gated as before."""
    short = rewritten(runs["A"], tmp_path, padded([1, 2, 3, 1, 2, 3], 1))
    long = rewritten(runs["A2"], tmp_path, padded([3, 1, 2, 2, 3, 1], 2))
    with pytest.raises(ValueError, match=r"--fail-on fwd_flops:\+0%: .*edited_.*'s batches vary in length"):
        gate([short], [long], [Rule.parse("fwd_flops:+0%")])
    (check,) = gate([short], [long], [Rule.parse("params:+0%")])
    assert not check.failed
    assert varying_note(short, long) == (
        "A's and B's batches vary in length (dynamic padding, packing): flops, MACs and bytes are each run's "
        "counting step's one batch's, not comparable; the rates (flops_per_sec, mfu) and params are"
    )
    fixed = load(runs["A2"])
    assert varying_note(fixed, long).startswith("B's batches vary") and varying_note(fixed, fixed) is None
    (same,) = gate([fixed], [fixed], [Rule.parse("fwd_flops:+0%")])
    assert not same.failed
