"""The window's energy as people read it, worked out by hand: the full report's rows, the JSON written and
read back, and ``diff`` and ``gate`` on saved runs (``--fail-on energy_per_step:+5%``)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.cli import main
from flops_callbacks.reporting.compare import changes, figures
from flops_callbacks.reporting.energy_rows import energy_lines
from flops_callbacks.reporting.profile_file import from_json, json_data, load
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.window_steps import CleanFigures, CleanStep, StepSeconds, StepWork
from flops_callbacks.timing.energy_figures import EnergySpan
from tests.fake_rapl import Burner, FakeRapl, install
from tests.reporting.test_console_summary import window

SPANS = (
    EnergySpan("GPU-a", "NVML total energy", 0.1, 600.0, 3.0, 3),
    EnergySpan("GPU-b", "NVML total energy", 0.1, 540.0, 3.0, 3),
)


def test_the_full_reports_rows_say_the_counter_each_figure_with_its_formula_and_the_ranks_range() -> None:
    # 200 + 180 J a step, 200 + 180 W; the job's step: 1024 tokens x 2 replicas, 8 samples x 2
    result = dataclasses.replace(window(), energy=SPANS)
    assert energy_lines(result, result.metrics()) == [
        (
            "energy counter (the devices' own: the host's other parts, network and cooling left out)",
            "NVML total energy of 2 GPUs; resolution 100 ms",
        ),
        (
            "energy per step = the job's joules over the clean steps (each: previous step's end -> its end) "
            "/ their number",
            "380 J",
        ),
        ("energy per sample = energy per step / samples per step per GPU * dp_size", "23.75 J"),  # 380 / 16
        ("energy per token = energy per step / tokens per step per GPU * dp_size", "185.55 mJ"),  # 380 / 2048
        ("tokens per joule = 1 / energy per token", "5.39"),
        ("mean power = joules / seconds between the counter's reads (each counter's, summed)", "380 W"),
        (
            "energy per step over the 2 ranks' counters, min .. max (ranks on one GPU or host read it once)",
            "180 J .. 200 J",
        ),
    ]


def test_clean_steps_too_short_for_the_counter_add_a_row_and_no_counter_is_one_row() -> None:
    short = dataclasses.replace(window(), energy=(SPANS[0]._replace(seconds=0.5),))  # 5 resolutions
    rows = energy_lines(short, short.metrics())
    assert rows[-1] == (
        "energy in doubt (clean steps under 20x the counter's resolution)",
        "the clean steps: 0.5 s, under 20x the counter's 0.1 s resolution per run: off by up to 20%",
    )
    none = dataclasses.replace(window(), no_energy_reason="no RAPL counter: /x does not exist")
    assert energy_lines(none, none.metrics()) == [("energy", "n/a: no RAPL counter: /x does not exist")]


def test_spans_longer_than_the_wall_steps_add_a_row_saying_by_how_much() -> None:
    """The counter's spans run from a step's end to the next's, the profiler's votes and reads in them; the
    wall step leaves those out. Spans of 1 s a step against wall steps of 0.6 s: the energy per step holds
    0.4 s of the profiler's time at whatever power the devices drew then, and a row says so."""
    work = StepWork(BatchCounts.zero(), 8, 1024)
    clean = CleanFigures(tuple(CleanStep(work, StepSeconds(0.2, 0.3, 0.05, 0.05, 0.6)) for _ in range(3)))
    result = dataclasses.replace(window(), energy=SPANS, clean=clean)
    assert (
        "energy spans beyond the wall step (the profiler's votes and reads between steps: their joules are "
        "in the energy per step)",
        "1.67x: 1 s a step, the wall step 600 ms",
    ) in energy_lines(result, result.metrics())
    even = dataclasses.replace(result, energy=tuple(s._replace(seconds=1.8) for s in SPANS))  # 0.6 s a step
    assert not [row for row in energy_lines(even, even.metrics()) if "beyond the wall" in row[0]]


def test_the_json_holds_every_ranks_span_or_why_none_and_reads_back_the_same_figures() -> None:
    result = dataclasses.replace(window(), energy=SPANS)
    data = json.loads(json.dumps(json_data(result)))
    assert data["energy"]["ranks"][1] == {
        "scope": "GPU-b", "source": "NVML total energy", "resolution": 0.1, "joules": 540.0, "seconds": 3.0,
        "steps": 3, "brackets": 1,
    }  # fmt: skip
    back = from_json(data)
    assert back.result.energy == SPANS and back.result.metrics() == result.metrics()
    none = dataclasses.replace(window(), no_energy_reason="no RAPL counter: /x does not exist")
    data = json.loads(json.dumps(json_data(none)))
    assert data["energy"] == {"none": "no RAPL counter: /x does not exist"}
    assert from_json(data).result.no_energy_reason == "no RAPL counter: /x does not exist"


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real StepProfiler run's profile file, its counter a fake RAPL tree the forwards advance."""
    rapl: FakeRapl = install(tmp_path, monkeypatch)
    model = Burner(rapl, 1.0, sleep=0.005)
    prof = StepProfiler(model, profile_step=1, clean_steps=8, print_profile=False, log_dir=tmp_path / "run")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        with prof.step({"x": torch.ones(4, 16)}):
            model(torch.ones(4, 16)).sum().backward()
            optimizer.step()
    prof.close()
    return tmp_path / "run" / "flops_profile_step1.json"


def steady(path: Path, out: Path) -> Path:
    """The profile at ``path`` with its 8 clean steps' wall times set: 9 ms, six of 10 ms, 11 ms (a range of
    0.9 .. 1.1 of the median, whatever the machine's load was)."""
    data = json.loads(path.read_text())
    walls = [0.009, *[0.01] * 6, 0.011]
    for step, wall in zip(data["clean_each"], walls, strict=True):
        step["seconds"]["wall"] = wall
    out.write_text(json.dumps(data))
    return out


def scaled(path: Path, factor: float, out: Path) -> Path:
    """The profile at ``path`` with every joule times ``factor``: a step that costs more energy."""
    data = json.loads(path.read_text())
    for name in names.ENERGY:
        if name in data["metrics"]:
            data["metrics"][name] *= 1 / factor if name == names.TOKENS_PER_JOULE else factor
    for rank in data["energy"]["ranks"]:
        rank["joules"] *= factor
    out.write_text(json.dumps(data))
    return out


def cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(args), out=out), out.getvalue()


def test_gate_fails_on_energy_per_step_beyond_5_percent_and_its_range_and_diff_shows_it(
    saved: Path, tmp_path: Path
) -> None:
    base_file = steady(saved, tmp_path / "base.json")
    base = load(base_file)
    assert base.metrics[names.ENERGY_PER_STEP] == pytest.approx(1.1, rel=1e-9)  # one forward a step
    found = figures(base)["energy_per_step"]
    assert (found.low, found.high) == (pytest.approx(0.99), pytest.approx(1.21))  # 1.1 J x 0.9 .. 1.1
    worse = scaled(base_file, 2.0, tmp_path / "worse.json")
    code, text = cli("gate", str(base_file), str(worse), "--fail-on", "energy_per_step:+5%")
    assert code == 1 and text.startswith("FAIL: energy_per_step got worse: 1.1 J -> 2.2 J (+100.0%)")
    noise = scaled(base_file, 1.08, tmp_path / "noise.json")  # beyond 5%, within the base's range
    code, text = cli("gate", str(base_file), str(noise), "--fail-on", "energy_per_step:+5%")
    assert (
        code == 0
        and text.startswith("ok: energy_per_step: 1.1 J -> 1.19 J (+8.0%), beyond")
        and "noise" in text
    )
    # lower energy is better; the power is neither
    moved = {
        c.name: c.direction for c in changes(base, load(worse)) if c.name in ("energy_per_step", "power")
    }
    assert moved == {"energy_per_step": -1, "power": 0}
    code, text = cli("diff", str(base_file), str(worse))
    assert code == 0 and "energy_per_step" in text


def test_gate_on_a_file_without_energy_is_bad_input_that_says_why(saved: Path, tmp_path: Path) -> None:
    data = json.loads(saved.read_text())
    data["metrics"] = {k: v for k, v in data["metrics"].items() if k not in names.ENERGY}
    data["energy"] = {"none": "no RAPL counter: /sys/class/powercap does not exist"}
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    err = io.StringIO()
    import contextlib

    with contextlib.redirect_stderr(err):
        code, _ = cli("gate", str(saved), str(bare), "--fail-on", "energy_per_step:+5%")
    assert code == 2
    assert (
        "has no figure 'energy_per_step': no RAPL counter: /sys/class/powercap does not exist"
        in err.getvalue()
    )


def test_the_ranges_of_figures_of_the_clean_steps_totals_are_the_fastest_and_slowest_steps_own(
    saved: Path, tmp_path: Path
) -> None:
    """Wall samples per second and the energy per step are the clean steps' totals (over their summed wall
    time), not their median step's: with six steps of 10 ms and two of 50 ms (mean 20 ms, median 10 ms) the
    ranges are the slowest and the fastest step's own rate and energy at the window's power."""
    data = json.loads(saved.read_text())
    for step, wall in zip(data["clean_each"], [0.01] * 6 + [0.05] * 2, strict=True):
        step["seconds"]["wall"] = wall
    data["metrics"][names.WALL_SAMPLES_PER_SEC] = 4 / 0.02  # 4 samples a step over the mean step
    data["metrics"][names.ENERGY_PER_STEP] = 1.1  # 55 W over the mean step
    skewed = tmp_path / "skewed.json"
    skewed.write_text(json.dumps(data))
    found = figures(load(skewed))
    rate, energy = found["wall_samples_per_sec"], found["energy_per_step"]
    assert (rate.low, rate.high) == (pytest.approx(4 / 0.05), pytest.approx(4 / 0.01))
    assert (energy.low, energy.high) == (pytest.approx(55 * 0.01), pytest.approx(55 * 0.05))
