"""Energy through real runs, on a fake RAPL tree (this machine has none): a real ``lightning.Trainer``, a real
``transformers.Trainer`` and a ``StepProfiler`` loop, whose model's every forward adds a known 1.1 J to
the counter (1 J on the package, 0.1 J on its DRAM), and where said, a background thread adds 10 W more.

Each run also reads the counter by hand at each step's end, just before the profiler does (a callback
ahead of the profiler's, the loop's block's last line): joules per step over the window's clean steps,
each from the end of the step before it, must be the profiler's within 5% (exactly 1.1 J where only the
forwards add). The figures are read back from the files the loggers wrote: Lightning's CSV and TensorBoard
events, the HF Trainer's TensorBoard events, the loop's ``log`` calls. Without a counter, one line says why
and nothing else changes.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.reporting.console_summary import render_console_summary
from flops_callbacks.reporting.window_rows import report_text, tree_doubts
from tests.fake_rapl import Burner, FakeRapl, install, remove
from tests.support import hf_arguments, lightning_settings

JOULES = 1.1  # what each forward adds: 1 J on the package, 0.1 J on the DRAM
FORWARD = 1.0  # the joules Burner is given (the fake counter adds the DRAM's tenth)
WATTS = 10.0  # the background thread's power, where one runs (its writes may lag under load: kept small)
SLEEP = 0.01  # each forward's sleep: steps of tens of milliseconds, many of RAPL's 1 ms resolutions
BATCH, STEPS, PROFILE_STEP, CLEAN = 8, 16, 2, 5


@pytest.fixture
def rapl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeRapl:
    return install(tmp_path, monkeypatch)


def data() -> torch.utils.data.DataLoader:
    torch.manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 16)), batch_size=BATCH)


def by_hand(ends: dict[int, float], clean: tuple[int, ...]) -> float:
    """Joules per step read by hand: each clean step from the end of the step before it to its own end."""
    return sum(ends[n] - ends[n - 1] for n in clean) / len(clean)


def energy_only(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k in names.ENERGY}


def check_follows(metrics: dict[str, float], tokens_per_step: float, wall_seconds: float, steps: int) -> None:
    """The power and tokens per joule follow from the printed numbers."""
    per_step = metrics[names.ENERGY_PER_STEP]
    assert metrics[names.ENERGY_PER_TOKEN] == pytest.approx(per_step / tokens_per_step, rel=1e-12)
    assert metrics[names.TOKENS_PER_JOULE] == pytest.approx(tokens_per_step / per_step, rel=1e-12)
    assert metrics[names.ENERGY_PER_SAMPLE] == pytest.approx(per_step / BATCH, rel=1e-12)
    # the mean power is the clean steps' joules over their time: the wall steps' (the reads' own seconds)
    assert metrics[names.POWER] == pytest.approx(per_step * steps / wall_seconds, rel=0.05)


class LitBurner(L.LightningModule):
    def __init__(self, rapl: FakeRapl | None) -> None:
        super().__init__()
        self.model = Burner(rapl, FORWARD, SLEEP)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HandReads(L.Callback):
    """The counter read by hand at each step's end, keyed by the step that ended (the profiler's number)."""

    def __init__(self, rapl: FakeRapl) -> None:
        self.rapl, self.ends = rapl, {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends[trainer.global_step - 1] = self.rapl.joules()


def test_lightning_joules_per_step_are_the_counter_read_by_hand_around_the_clean_steps(
    tmp_path: Path, rapl: FakeRapl, capsys: pytest.CaptureFixture[str]
) -> None:
    hand = HandReads(rapl)
    callback = FlopsProfilerCallback(
        profile_step=PROFILE_STEP, clean_steps=CLEAN, tokens_fn=lambda batch: batch[0].numel()
    )
    csv_logger, tb_logger = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(
        callbacks=[hand, callback], **lightning_settings(tmp_path, STEPS, logger=[csv_logger, tb_logger])
    )
    with rapl.burning(WATTS):
        trainer.fit(LitBurner(rapl), data())
    result = callback.result
    assert result is not None and len(result.steps.clean) == CLEAN
    metrics = result.metrics()
    expected = by_hand(hand.ends, result.steps.clean)
    assert expected > JOULES  # the forwards' 1.1 J and the thread's share of each step
    assert metrics[names.ENERGY_PER_STEP] == pytest.approx(expected, rel=0.05)
    (span,) = result.energy
    assert (span.source, span.resolution, span.steps, span.brackets) == ("RAPL package+dram", 0.001, CLEAN, 1)
    check_follows(metrics, BATCH * 16, result.figures().sums["wall"], CLEAN)
    assert metrics[names.POWER] == pytest.approx(
        WATTS + JOULES / result.figures().sums["wall"] * CLEAN, rel=0.1
    )
    # as the loggers wrote them: the CSV file and the TensorBoard events
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(names.ENERGY_PER_STEP)]
    assert len(rows) == 1
    for name, value in energy_only(metrics).items():
        assert float(rows[0][name]) == pytest.approx(value, rel=1e-6), name
        assert tensorboard(Path(tb_logger.log_dir), name) == [pytest.approx(value, rel=1e-6)], name
    # one line of the console summary
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("energy ")]
    assert len(lines) == 1 and "J per step" in lines[0] and "RAPL package+dram of 1 host" in lines[0]


def tensorboard(directory: Path, tag: str) -> list[float]:
    """Every value of scalar ``tag`` in the event files under ``directory``."""
    found: list[float] = []
    for events in directory.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            found += [e.value for e in accumulator.Scalars(tag)]
    return found


class HFBurner(torch.nn.Module):
    """The burner as the HF Trainer calls it: a dict batch in, a loss out."""

    def __init__(self, rapl: FakeRapl) -> None:
        super().__init__()
        self.model = Burner(rapl, FORWARD)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.model(x).pow(2).mean()}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(256, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i]}


def test_hf_trainer_joules_per_step_are_what_the_forwards_added_and_tensorboard_holds_them(
    tmp_path: Path, rapl: FakeRapl
) -> None:
    from transformers import Trainer, TrainerCallback

    from flops_callbacks.integrations.hf import HFFlopsCallback

    ends: dict[int, float] = {}

    class Hand(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends[state.global_step - 1] = rapl.joules()

    callback = HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
    args = hf_arguments(
        tmp_path / "out", STEPS, BATCH, report_to=["tensorboard"], remove_unused_columns=False
    )
    trainer = Trainer(model=HFBurner(rapl), args=args, train_dataset=Rows(), callbacks=[Hand(), callback])
    trainer.train()
    result = callback.result
    assert result is not None and len(result.steps.clean) == CLEAN
    metrics = result.metrics()
    assert by_hand(ends, result.steps.clean) == pytest.approx(JOULES, rel=1e-9)  # one forward a step
    assert metrics[names.ENERGY_PER_STEP] == pytest.approx(JOULES, rel=1e-9)
    assert metrics[names.ENERGY_PER_SAMPLE] == pytest.approx(JOULES / BATCH, rel=1e-9)
    assert names.ENERGY_PER_TOKEN not in metrics  # no token in a batch of floats
    log_dir = Path(getattr(args, "logging_dir", None) or args.output_dir)
    for name, value in energy_only(metrics).items():
        assert tensorboard(log_dir, f"train/{name}") == [pytest.approx(value, rel=1e-6)], name
    saved = json.loads((log_dir / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert [r["joules"] for r in saved["energy"]["ranks"]] == [pytest.approx(JOULES * CLEAN, rel=1e-9)]


def loop(model: torch.nn.Module, prof: StepProfiler, rapl: FakeRapl | None, steps: int) -> dict[int, tuple]:
    """A plain loop under ``prof``; the counter read by hand as each step's last line, with the time."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ends = {}
    for (x,) in list(data())[:steps]:
        with prof.step({"input_ids": torch.ones(BATCH, 4, dtype=torch.long), "x": x}):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if rapl is not None:
                ends[prof.global_step] = (rapl.joules(), time.perf_counter())
    prof.close()
    return ends


def test_step_profiler_window_and_throughput_power_follow_the_counter_read_by_hand(rapl: FakeRapl) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    model = Burner(rapl, FORWARD, SLEEP)
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, log_every_n_steps=5,
        log=lambda metrics, step: logged.append((step, metrics)),
        flops_audit=0,  # no audited step: its time and joules are no interval's, and the hand reads hold them
    )  # fmt: skip
    with rapl.burning(WATTS):
        ends = loop(model, prof, rapl, 30)
    result = prof.result
    assert result is not None
    metrics = result.metrics()
    joules = {n: e[0] for n, e in ends.items()}
    assert metrics[names.ENERGY_PER_STEP] == pytest.approx(by_hand(joules, result.steps.clean), rel=0.05)
    assert metrics[names.TOKENS_PER_JOULE] == pytest.approx(BATCH * 4 / metrics[names.ENERGY_PER_STEP])
    # throughput/power at each logging step after the window: the counter by hand over the same steps
    after = [(step, m) for step, m in logged if names.THROUGHPUT_POWER in m]
    assert len(after) >= 3
    for step, m in after[1:]:  # the first interval starts at the window's end, not at a step's
        (e1, t1), (e0, t0) = ends[step - 1], ends[step - 6]
        assert m[names.THROUGHPUT_POWER] == pytest.approx((e1 - e0) / (t1 - t0), rel=0.05)
        tokens = 5 * BATCH * 4
        assert m[names.THROUGHPUT_TOKENS_PER_JOULE] == pytest.approx(tokens / (e1 - e0), rel=0.05)


def test_without_a_counter_one_line_says_why_and_nothing_else_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(rapl: FakeRapl | None) -> tuple[Any, list[dict[str, float]]]:
        logged: list[dict[str, float]] = []
        model = Burner(rapl, FORWARD, SLEEP)  # intervals of 5 steps: 20 of RAPL's resolutions, and more
        prof = StepProfiler(
            model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, log_every_n_steps=5,
            log=lambda metrics, step: logged.append(metrics),
        )  # fmt: skip
        loop(model, prof, rapl, 20)
        assert prof.result is not None
        return prof.result, logged

    with_counter, logged_with = run(install(tmp_path / "with", monkeypatch))
    missing = remove(tmp_path, monkeypatch)
    without, logged_without = run(None)
    why = f"no RAPL counter: {missing} does not exist (no powercap interface on this machine)"
    assert (without.energy, without.no_energy_reason) == ((), why)
    assert with_counter.energy and with_counter.no_energy_reason == ""
    # the metrics: the same names but the energy ones, at the window's end and after it
    assert set(without.metrics()) == set(with_counter.metrics()) - set(names.ENERGY)
    energy = {*names.ENERGY, *names.THROUGHPUT_ENERGY}
    assert [set(m) for m in logged_without] == [set(m) - energy for m in logged_with]
    assert any(set(m) & set(names.THROUGHPUT_ENERGY) for m in logged_with)
    # the console summary: the same rows (its warnings are the timing's), one of which says why
    summary = render_console_summary(without, tree_doubts(without)).splitlines()
    counted = render_console_summary(with_counter, tree_doubts(with_counter)).splitlines()
    rows = [line[:14] for line in counted[: [line[:5] for line in counted].index("from ") + 1]]
    assert [line[:14] for line in summary[: len(rows)]] == rows
    assert [line for line in summary if line.startswith("energy")] == [f"{'energy':<14}n/a: {why}"]
    # the full report: one row says why, where the counted run's rows are
    from flops_callbacks.options import Options

    report = report_text(without, Options(), detailed=False)
    assert [line for line in report.splitlines() if "energy" in line] == [f"{'energy: ':<70}  n/a: {why}"]


def test_each_re_profile_window_reads_the_counter_over_its_own_clean_steps(rapl: FakeRapl) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    model = Burner(rapl, FORWARD)
    prof = StepProfiler(
        model, profile_step=1, clean_steps=3, print_profile=False, profile_every=15,
        log=lambda metrics, step: logged.append((step, metrics)),
    )  # fmt: skip
    loop(model, prof, None, 50)
    windows = [m for _, m in logged if names.ENERGY_PER_STEP in m]
    assert len(windows) == 4  # the first window and three re-profile windows
    assert [m[names.ENERGY_PER_STEP] for m in windows] == [pytest.approx(JOULES, rel=1e-9)] * 4
    assert prof.result is not None and prof.result.steps.reused and len(prof.result.energy) == 1
