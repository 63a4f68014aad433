"""A generation's energy, on a fake RAPL tree whose counter each model call advances by a known 1.1 J (1 J
on the package, 0.1 J on its DRAM): the timed runs' power and joules per new token, the prefill's and a
decode step's where they span 20 of the counter's resolutions (said where they do not), the JSON read back,
and without a counter, or with one that does not move (a VM's constant powercap), one row saying why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flops_callbacks import metrics as names
from flops_callbacks import profile_decode_loop
from flops_callbacks.generation.json_file import generation_from_json
from flops_callbacks.timing.energy import RaplEnergy
from tests.fake_rapl import Burner, FakeRapl, install, remove

SLEEP = 0.03  # each call: 30 of RAPL's 1 ms
DECODE, BATCH, RUNS = 4, 2, 2


def loop(model: torch.nn.Module) -> Any:
    def run_once(run: Any) -> None:
        with run.prefill():
            out = model(torch.ones(BATCH, 16))
        for _ in range(DECODE):
            with run.decode_step():
                out = model(out)

    return run_once


def generation(rapl: FakeRapl | None, joules: float = 1.0) -> Any:
    model = Burner(rapl, joules, SLEEP)
    return profile_decode_loop(model, loop(model), batch_size=BATCH, runs=RUNS, warm_up=0)


def test_each_call_adds_1_1_joules_so_the_prefill_a_decode_step_and_a_token_cost_what_is_worked_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = generation(install(tmp_path, monkeypatch))
    m = profile.metrics
    assert m[names.PREFILL_ENERGY] == pytest.approx(1.1, rel=1e-9)  # the prefill's one call, per run
    assert m[names.DECODE_ENERGY_PER_TOKEN] == pytest.approx(1.1, rel=1e-9)  # one call a decode step
    # a run: 5 calls, 5.5 J, for 5 tokens of each of 2 sequences
    assert m[names.GENERATION_ENERGY_PER_TOKEN] == pytest.approx(5.5 / 10, rel=1e-9)
    assert m[names.GENERATION_TOKENS_PER_JOULE] == pytest.approx(10 / 5.5, rel=1e-9)
    whole = profile.result.energy()["run"]
    assert (whole.joules, whole.steps, whole.brackets) == (pytest.approx(11.0), RUNS, RUNS)
    assert m[names.GENERATION_POWER] == pytest.approx(whole.joules / whole.seconds, rel=1e-12)
    assert m[names.GENERATION_POWER] == pytest.approx(5.5 / m[names.GENERATION_LATENCY], rel=0.1)
    report = profile.report
    assert "Energy (the device's own counter: RAPL package+dram, resolution 1 ms;" in report
    assert "prefill energy (start -> first token):" in report and "1.1 J" in report
    back = generation_from_json(json.loads(json.dumps(profile.json_data())))
    assert back.metrics() == profile.metrics and back.energy() == profile.result.energy()


def test_phases_too_short_for_the_counters_resolution_are_left_out_and_the_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path, monkeypatch)
    monkeypatch.setattr(RaplEnergy, "resolution", 0.1)  # NVML's: a 30 ms prefill is 0.3 of it
    profile = generation(install(tmp_path / "coarse", monkeypatch))
    m = profile.metrics
    assert names.PREFILL_ENERGY not in m and names.DECODE_ENERGY_PER_TOKEN not in m
    assert names.GENERATION_POWER in m and names.GENERATION_ENERGY_PER_TOKEN in m  # the runs' whole
    report = profile.report.splitlines()
    prefill = next(line for line in report if "prefill energy" in line)
    assert (
        "n/a: the prefill: " in prefill and "in 2 runs, under 20x the counter's 0.1 s resolution" in prefill
    )
    assert any(line.strip().startswith("energy in doubt:") for line in report)  # 2 runs of 150 ms: 0.3 s


def test_without_a_counter_one_row_says_why_and_no_energy_figure_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = remove(tmp_path, monkeypatch)
    profile = generation(None)
    why = f"no RAPL counter: {missing} does not exist (no powercap interface on this machine)"
    assert profile.result.no_energy_reason == why
    assert not set(profile.metrics) & set(names.GENERATION_ENERGY)
    assert [line for line in profile.report.splitlines() if "energy" in line.lower()] == [
        f"{'energy: ':<44}n/a: {why}"
    ]
    back = generation_from_json(json.loads(json.dumps(profile.json_data())))
    assert back.no_energy_reason == why


def test_a_counter_that_does_not_move_makes_no_energy_figure_and_one_row_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = generation(install(tmp_path, monkeypatch), joules=0.0)
    assert not set(profile.metrics) & set(names.GENERATION_ENERGY)  # not 0 W, not 0 J per token
    rows = [line for line in profile.report.splitlines() if "energy" in line.lower()]
    assert len(rows) == 1 and rows[0].startswith(
        f"{'energy: ':<44}n/a: the energy counter did not move over the "
    )
    seconds = float(rows[0].split("timed runs (")[1].split(" s;")[0])
    assert seconds == pytest.approx(sum(run.total for run in profile.result.runs), rel=0.01)
    assert "it updates about every 0.001 s" in rows[0]
    back = generation_from_json(json.loads(json.dumps(profile.json_data())))
    assert back.no_energy == profile.result.no_energy and not set(back.metrics()) & set(
        names.GENERATION_ENERGY
    )
