"""Where the session reads the energy counter: at each window step's end (a clean step from the step before
it to its own end), over the meter's intervals with its pauses left out, and what that comes to; a counter
that cannot be read or fails is one reason, and nothing else changes."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
import torch

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.session.energy_reads import (
    IntervalEnergy,
    WindowEnergy,
    energy_metrics,
    job_energy,
    rank_energy,
    throughput_energy,
)
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import WindowStep
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.energy import RaplEnergy, SampledPower
from flops_callbacks.timing.energy_figures import EnergySpan, energy_figures
from flops_callbacks.timing.phases import StepPhases
from tests.fake_rapl import Burner, FakeRapl, install, remove

CPU = torch.device("cpu")


@pytest.fixture
def rapl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeRapl:
    return install(tmp_path, monkeypatch)


def steps(*kinds: Kind) -> list[WindowStep]:
    return [WindowStep(kind, n, StepPhases(CpuClock())) for n, kind in enumerate(kinds, start=10)]


def test_each_clean_step_runs_from_the_previous_steps_end_and_a_step_between_starts_another_run(
    rapl: FakeRapl,
) -> None:
    window = steps(Kind.COUNTING, Kind.CHECK, Kind.CLEAN, Kind.CLEAN, Kind.SHAPE_COUNTING, Kind.CLEAN)
    energy = WindowEnergy()
    energy.start(torch.nn.Linear(1, 1))
    for step, joules in zip(window, (5.0, 1.0, 2.0, 3.0, 7.0, 4.0), strict=True):
        rapl.add(joules)  # the step's own joules (and a tenth on the DRAM)
        energy.read(step)
    energy.stop()
    clean = [s for s in window if s.kind == Kind.CLEAN]
    span = rank_energy(window, clean)
    assert isinstance(span, EnergySpan)
    assert span.joules == pytest.approx(1.1 * (2 + 3 + 4))  # not the shape-counting step's 7 J
    assert (span.source, span.steps, span.brackets) == ("RAPL package+dram", 3, 2)
    assert energy.counter is None and not energy.running  # nothing held after the window


def test_no_counter_leaves_the_reason_on_every_step_and_no_clean_step_is_a_reason_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = remove(tmp_path, monkeypatch)
    window = steps(Kind.COUNTING, Kind.CLEAN)
    energy = WindowEnergy()
    energy.start(torch.nn.Linear(1, 1))
    for step in window:
        energy.read(step)
    why = f"no RAPL counter: {missing} does not exist (no powercap interface on this machine)"
    assert [s.energy for s in window] == [why, why]
    assert rank_energy(window, window[1:]) == why
    assert rank_energy(window, []) == "no clean step ran"
    meta = WindowEnergy()
    meta.start(torch.nn.Linear(1, 1, device="meta"))
    assert meta.why.startswith("no energy counter for meta devices")


def test_a_read_that_fails_is_the_reason_from_then_on_and_the_counter_stops(
    rapl: FakeRapl, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = steps(Kind.COUNTING, Kind.CLEAN, Kind.CLEAN)
    energy = WindowEnergy()
    energy.start(torch.nn.Linear(1, 1))
    energy.read(window[0])
    (rapl.package / "energy_uj").unlink()
    energy.read(window[1])
    energy.read(window[2])
    why = window[1].energy
    assert isinstance(why, str) and why.startswith(
        "reading the RAPL package+dram counter failed (FileNotFound"
    )
    assert window[2].energy == why and energy.counter is None
    assert rank_energy(window, window[1:]) == why


def test_a_window_whose_counter_fails_keeps_every_other_figure(
    rapl: FakeRapl, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = {"n": 0}
    original = RaplEnergy.read

    def failing(self: RaplEnergy) -> float:
        reads["n"] += 1
        if reads["n"] == 6:
            raise PermissionError(13, "Permission denied")
        return original(self)

    monkeypatch.setattr(RaplEnergy, "read", failing)
    model = Burner(rapl, 1.0)
    prof = StepProfiler(model, profile_step=1, clean_steps=4, print_profile=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(14):
        with prof.step({"x": torch.ones(2, 16)}):
            model(torch.ones(2, 16)).sum().backward()
            optimizer.step()
    prof.close()
    result = prof.result
    assert result is not None and len(result.steps.clean) == 4
    assert result.energy == ()
    assert result.no_energy_reason == (
        "reading the RAPL package+dram counter failed (PermissionError: [Errno 13] Permission denied)"
    )
    assert names.ITER_LATENCY in result.metrics() and not set(result.metrics()) & set(names.ENERGY)


def test_a_counter_that_does_not_move_over_the_clean_steps_gives_no_figure_and_says_why(
    rapl: FakeRapl, capsys: pytest.CaptureFixture[str]
) -> None:
    # NVML's counter moves about every 100 ms, a VM's powercap may read a constant: 0 J over steps that
    # did work is not a figure (it gave 0 J per step and 0 W, and the report's tokens-per-joule row failed)
    model = torch.nn.Linear(16, 16)  # burns nothing on the fake counter
    prof = StepProfiler(model, profile_step=1, clean_steps=4, print_profile=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(14):
        batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "x": torch.ones(2, 16)}
        with prof.step(batch):
            model(batch["x"]).sum().backward()
            optimizer.step()
    prof.close()
    result = prof.result
    assert result is not None and len(result.steps.clean) == 4 and result.energy == ()
    assert result.no_energy_reason.startswith("the energy counter did not move over the clean steps (")
    assert result.no_energy_reason.endswith(" s; it updates about every 0.001 s)")
    assert names.TOKENS_PER_SEC in result.metrics() and not set(result.metrics()) & set(names.ENERGY)
    summary = capsys.readouterr().out
    assert f"energy        n/a: {result.no_energy_reason}" in summary  # the report rendered


def test_no_per_token_figure_or_throughput_power_from_a_counter_that_did_not_move() -> None:
    still = EnergySpan("RAPL on h", "RAPL package", 0.001, 0.0, 0.5, 2)
    figures = energy_figures([still], 4096, 8)
    assert (figures.joules_per_step, figures.joules_per_token, figures.tokens_per_joule) == (0.0, None, None)
    assert figures.joules_per_sample is None
    assert throughput_energy([still], 10_000, 1.0) == {}


def test_sampled_powers_thread_runs_only_inside_the_window_and_the_window_pickles_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = SampledPower(lambda: 100.0, "GPU-a", interval=0.01)
    monkeypatch.setattr("flops_callbacks.session.energy_reads.energy_counter", lambda device: counter)
    energy = WindowEnergy()
    energy.start(torch.nn.Linear(1, 1))  # the counter: the patched one
    assert [t for t in threading.enumerate() if t.name == "flops-callbacks-power"]
    assert pickle.loads(pickle.dumps(energy)).counter is None
    energy.stop()
    assert not [t for t in threading.enumerate() if t.name == "flops-callbacks-power"]


def test_the_job_has_no_figure_when_a_rank_has_none_and_says_which() -> None:
    span = EnergySpan("GPU-a", "NVML total energy", 0.1, 10.0, 1.0, 2)
    assert job_energy([span, span._replace(scope="GPU-b")]) == ((span, span._replace(scope="GPU-b")), "")
    assert job_energy([span, "no NVML counter: nvidia-ml-py is not installed"]) == (
        (),
        "rank 1: no NVML counter: nvidia-ml-py is not installed",
    )
    assert job_energy(["no clean step ran"]) == ((), "no clean step ran")
    assert job_energy([""]) == ((), "the energy counter was not read")


def test_the_windows_metrics_worked_out_by_hand() -> None:
    # 2 steps, 30 J in 0.5 s: 15 J a step, 60 W; 4096 tokens and 8 samples a job's step
    spans = [EnergySpan("RAPL on h", "RAPL package", 0.001, 30.0, 0.5, 2)]
    assert energy_metrics(spans, 4096, 8) == {
        names.ENERGY_PER_STEP: 15.0,
        names.POWER: 60.0,
        names.ENERGY_PER_SAMPLE: 15 / 8,
        names.ENERGY_PER_TOKEN: 15 / 4096,
        names.TOKENS_PER_JOULE: 4096 / 15,
    }
    assert energy_metrics(spans, None, None) == {names.ENERGY_PER_STEP: 15.0, names.POWER: 60.0}
    assert energy_metrics([], 4096, 8) == {}


class Scripted(RaplEnergy):
    """A RAPL counter whose reads return given joules, in turn."""

    def __init__(self, joules: list[float]) -> None:
        self.source, self.scope, self.resolution = "RAPL package", "RAPL on h", 0.001
        self._joules = iter(joules)

    def read(self) -> float:
        return next(self._joules)


def test_an_interval_leaves_out_what_its_pauses_hold_and_the_next_starts_at_its_last_read() -> None:
    interval = IntervalEnergy(Scripted([100.0, 110.0, 150.0, 153.0, 160.0, 170.0]))
    interval.restart()  # 100
    interval.pause()  # 110: 10 J, then an evaluation's 40 J left out
    interval.resume()  # 150
    first = interval.take()  # 153: 3 J more; the next interval starts here
    second = interval.take()  # 160
    assert first is not None and second is not None
    assert (first.joules, first.brackets, second.joules, second.brackets) == (13.0, 2, 7.0, 1)


def test_an_interval_paused_late_has_no_figure_and_the_next_one_has() -> None:
    interval = IntervalEnergy(Scripted([100.0, 150.0, 153.0, 160.0]))
    interval.restart()  # 100
    interval.pause(late=True)  # not read: the pause began at a step's end, where nothing was read
    interval.resume()  # 150: its 50 J are the interval's and the save's, in untold shares
    assert interval.take() is None  # 153
    second = interval.take()  # 160
    assert second is not None and (second.joules, second.brackets) == (7.0, 1)


def test_an_interval_longer_than_the_counters_range_keeps_every_wrap_by_reading_at_step_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RAPL range of 10 J and steps of 4 J: an interval of five steps wraps twice; read at its ends only,
    it would lose 10 J. Read at a step's end once ``KEEP_UP_S`` have passed since the last read (0 here:
    every step), it is exact; with the default, a step a few milliseconds long reads nothing."""
    path, raw = tmp_path / "energy_uj", 0

    def advance(joules: float) -> None:
        nonlocal raw
        raw += round(joules * 1e6)
        path.write_text(f"{raw % 10_000_000}\n")

    advance(1.0)
    reads: list[Path] = []

    def read_text(file: Path) -> str:
        reads.append(file)
        return file.read_text()

    counter = RaplEnergy([(path, 10_000_000, 1_000_000)], "RAPL package", "RAPL on test", read_text)
    interval = IntervalEnergy(counter)
    interval.restart()
    for _ in range(3):
        advance(4.0)
        interval.keep_up()  # the default KEEP_UP_S: not yet
    assert len(reads) == 1  # the interval's start only
    interval.take()
    monkeypatch.setattr("flops_callbacks.session.energy_reads.KEEP_UP_S", 0.0)
    for _ in range(5):
        advance(4.0)
        interval.keep_up()
    span = interval.take()
    assert span is not None and span.joules == pytest.approx(20.0, abs=1e-9)


def test_the_meter_uses_only_counters_cheap_to_read(rapl: FakeRapl, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(IntervalEnergy.of(CPU), IntervalEnergy)  # RAPL: a file read per domain
    sampled = SampledPower(lambda: 1.0, "GPU-a")
    monkeypatch.setattr("flops_callbacks.session.energy_reads.energy_counter", lambda device: sampled)
    assert IntervalEnergy.of(torch.device("cuda", 0)) is None  # sampled power: a thread for the whole run


def test_the_jobs_throughput_energy_needs_every_rank_and_twenty_resolutions() -> None:
    a = EnergySpan("GPU-a", "NVML total energy", 0.1, 600.0, 2.0, 1)
    b = a._replace(scope="GPU-b", joules=400.0)
    assert throughput_energy([a, b, a], 10_000, 2.0) == {
        names.THROUGHPUT_POWER: 500.0,
        names.THROUGHPUT_TOKENS_PER_JOULE: 10.0,
    }
    assert throughput_energy([a, None], 10_000, 2.0) == {}  # a rank without a cheap counter
    assert throughput_energy([a._replace(seconds=1.9)], 10_000, 1.9) == {}  # under 20 x 0.1 s
    assert throughput_energy([a], None, 2.0) == {names.THROUGHPUT_POWER: 300.0}


def test_tokens_per_joule_are_the_intervals_tokens_per_second_over_its_power() -> None:
    """Two ranks on one host: rank 0's interval (the one its counter is read for) started 1 s after rank
    1's, still writing the window's report; the tokens took the slowest rank's 3 s. Over rank 0's 2 s of
    joules they read 15 tokens/J, 1.5x the tokens per second over the power."""
    first = EnergySpan("RAPL on host0", "RAPL package", 0.001, 600.0, 2.0, 1)
    metrics = throughput_energy([first, first._replace(joules=900.0, seconds=3.0)], 9_000, 3.0)
    assert metrics[names.THROUGHPUT_POWER] == 300.0
    assert metrics[names.THROUGHPUT_TOKENS_PER_JOULE] == pytest.approx(9_000 / 3.0 / 300.0)


def test_the_counter_is_read_once_at_each_window_steps_end_and_after_it_only_per_logging_interval(
    rapl: FakeRapl, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = {"window": 0, "after": 0}
    original = RaplEnergy.read
    prof: StepProfiler | None = None

    def counted(self: RaplEnergy) -> float:
        reads["window" if prof is None or prof.result is None else "after"] += 1
        return original(self)

    monkeypatch.setattr(RaplEnergy, "read", counted)
    for throughput, after in ((False, 0), (True, 6)):  # 60 steps, the window's to step 9, a log every 10
        reads.update(window=0, after=0)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prof = StepProfiler(
            model, profile_step=2, clean_steps=5, print_profile=False, throughput=throughput,
            log_every_n_steps=10, flops_audit=0,
        )  # fmt: skip
        for _ in range(60):
            with prof.step({"x": torch.ones(2, 4)}):
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
        prof.close()
        assert prof.result is not None
        window = prof.result.published_at - 2  # counting, 3 module-timing, check, 5 clean: 10 steps
        assert (window, reads["window"]) == (10, 10)
        # the meter: a read at its start, one at each of the 5 logs after (steps 20 .. 60); none otherwise
        assert reads["after"] == after
        prof = None
