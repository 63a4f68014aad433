"""``profile_every=N``: after the first window, a re-profile window every N steps, in real runs.

A Lightning run (CSV logger) of 100 steps re-profiled every 20 gives 5 windows (counted at 5; re-profiled
at 25, 45, 65, 85), each with its ``flops_profile_step{N}.json`` and its ``flops_profiler/*`` metrics in
metrics.csv at the step it ended; a re-profile window runs no counting and no module hook (the model's
forward sees none of the profiler's hooks or modes there) and pauses the throughput meter. An HF Trainer
run and a StepProfiler loop give theirs the same way. The window grid and the option's check are unit
tests below.
"""

from __future__ import annotations

import csv
import json
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.options import Options
from flops_callbacks.reporting.profile_file import load
from flops_callbacks.session.ranks import Ranks
from flops_callbacks.session.window_plan import Decision, Kind, WindowPlan
from tests.support import first_clean, hf_arguments, lightning_settings, module_steps, run_bounded

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4
PROFILE_STEP, CLEAN, EVERY, STEPS = 5, 3, 20, 100
REPROFILED = (25, 45, 65, 85)  # PROFILE_STEP + k * EVERY after the previous window's last step
WINDOW_STARTS = (PROFILE_STEP, *REPROFILED)


def fwd_flops(batch: int) -> int:
    """Linear(IN, HIDDEN) + ReLU + Linear(HIDDEN, OUT): 2*b*i*o per addmm, 1 per ReLU output."""
    return 2 * batch * IN * HIDDEN + batch * HIDDEN + 2 * batch * HIDDEN * OUT


def ends(start: int) -> int:
    """The global step at which the window starting at ``start`` ended and logged (Lightning and HF
    count the step that ended): the first window after its counting, module-timing, check and clean
    steps; a re-profile window after its lead-in step (its end starts the first clean step's wall) and
    its clean steps."""
    return first_clean(PROFILE_STEP) + CLEAN if start == PROFILE_STEP else start + 1 + CLEAN


class MLP(L.LightningModule):
    """Records, at each training step, whether any hook or dispatch mode of the profiler is live."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
        self.instrumented: dict[int, bool] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        hooks = any(m._forward_hooks or m._forward_pre_hooks for m in self.modules()) or any(
            getattr(torch.nn.modules.module, f"_global_forward{kind}_hooks") for kind in ("", "_pre")
        )
        self.instrumented[self.trainer.global_step] = hooks or bool(_get_current_dispatch_mode_stack())
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("every")
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(STEPS * BATCH, IN, generator=generator),
        torch.randn(STEPS * BATCH, OUT, generator=generator),
    )
    callback = FlopsProfilerCallback(
        profile_step=PROFILE_STEP, clean_steps=CLEAN, profile_every=EVERY, print_profile=False
    )
    logger = CSVLogger(root, name="csv")
    module = MLP()
    trainer = L.Trainer(callbacks=[callback], **lightning_settings(root, STEPS, logger=logger))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=BATCH))
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return dict(trainer=trainer, module=module, log_dir=Path(logger.log_dir), rows=rows)


def test_a_100_step_lightning_run_re_profiled_every_20_leaves_a_json_per_window(lightning_run: dict) -> None:
    log_dir = lightning_run["log_dir"]
    saved = sorted(p.name for p in log_dir.glob("flops_profile_step*.json") if ".trace." not in p.name)
    assert saved == sorted(f"flops_profile_step{n}.json" for n in WINDOW_STARTS)
    first = load(log_dir / f"flops_profile_step{PROFILE_STEP}.json").result.steps
    assert (first.counting, first.module_timing, first.first) == (PROFILE_STEP, module_steps(PROFILE_STEP), 5)
    for start in REPROFILED:
        steps = load(log_dir / f"flops_profile_step{start}.json").result.steps
        # its own clean steps only: nothing counted (every shape known), no module timed; the counts and
        # the module tree are the first window's, and say so
        assert steps.first == start and steps.reused
        assert steps.clean == tuple(range(start + 1, start + 1 + CLEAN))
        assert (steps.shape_counting, steps.skipped) == ((), ())
        wall = load(log_dir / f"flops_profile_step{start}.json").result.figures().spreads["wall"]
        assert wall.low > 0 and wall.steps == CLEAN  # the first clean step's wall starts at the lead-in's end
        assert (steps.counting, steps.module_timing, steps.module_trace) == (
            first.counting,
            first.module_timing,
            first.module_trace,
        )


def test_each_windows_metrics_are_in_metrics_csv_at_its_end_as_in_its_json(lightning_run: dict) -> None:
    rows, log_dir = lightning_run["rows"], lightning_run["log_dir"]
    # by global step: Lightning logs a batch at one behind the global step after it (its own metrics' step)
    logged = {int(row["step"]) + 1: row for row in rows if row.get(names.FWD_FLOPS)}
    assert sorted(logged) == [ends(start) for start in WINDOW_STARTS]
    for start in WINDOW_STARTS:
        row, saved = logged[ends(start)], load(log_dir / f"flops_profile_step{start}.json")
        assert float(row[names.FWD_FLOPS]) == fwd_flops(BATCH) == saved.metrics[names.FWD_FLOPS]
        for name in (names.FWD_LATENCY, names.BWD_LATENCY, names.ITER_LATENCY, names.FLOPS_PER_SEC):
            assert float(row[name]) == pytest.approx(saved.metrics[name], rel=1e-6), (start, name)
            assert saved.metrics[name] > 0
        # the rates are the window's own clean steps': the median step's flops over its time
        figures = saved.result.figures()
        assert figures.counts.model_flops == CLEAN * saved.result.profile.model_flops
        median = figures.median_step()
        assert saved.metrics[names.FLOPS_PER_SEC] == pytest.approx(
            median.work.counts.model_flops / median.latency("iter")
        )


def test_a_re_profile_window_runs_no_counting_and_no_hook_and_pauses_the_meter(lightning_run: dict) -> None:
    instrumented, rows = lightning_run["module"].instrumented, lightning_run["rows"]
    assert instrumented[PROFILE_STEP]  # the counting step's mode: the check can see one
    assert all(instrumented[s] for s in module_steps(PROFILE_STEP))
    for start in REPROFILED:
        assert not any(instrumented[s] for s in range(start, ends(start))), start
    # by global step (Lightning draws a batch one behind the global step after it)
    throughput = {int(row["step"]) + 1 for row in rows if row.get(names.THROUGHPUT_SAMPLES_PER_SEC)}
    for start in REPROFILED:  # logged every step (log_every_n_steps=1) but while a window runs
        assert {start, ends(start) + 1} <= throughput
        assert not throughput & set(range(start + 1, ends(start) + 1)), start


def test_diff_between_two_windows_of_the_run_exits_0_and_prints_both(lightning_run: dict) -> None:
    a = lightning_run["log_dir"] / f"flops_profile_step{REPROFILED[0]}.json"
    b = lightning_run["log_dir"] / f"flops_profile_step{REPROFILED[-1]}.json"
    done = run_bounded([sys.executable, "-m", "flops_callbacks", "diff", str(a), str(b)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"window at step {REPROFILED[0]}, counts of counting step {PROFILE_STEP}" in done.stdout
    assert f"window at step {REPROFILED[-1]}," in done.stdout
    assert "fwd_latency" in done.stdout or "fwd latency" in done.stdout
    # both windows reuse the first one's module tree: no module change of theirs is shown as measured
    reused = f"re-profile window: its module tree is the window's of step {PROFILE_STEP}, reused"
    assert f"NOTE: A timed no module (a {reused})" in done.stdout
    assert (
        "(no module changed)" not in done.stdout and "(left out: a run's module times are not" in done.stdout
    )
    data = json.loads(
        run_bounded(
            [sys.executable, "-m", "flops_callbacks", "diff", str(a), str(b), "--json"], timeout=120
        ).stdout
    )
    assert data["module_times_measured"] == {"a": False, "b": False} and data["modules"] == []


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size: int = 64, vocab: int = 97, seq: int = 16) -> None:
        self.ids = torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_an_hf_trainer_run_logs_each_window_in_log_history_at_its_end(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    every, clean, max_steps = 15, 2, 40
    callback = HFFlopsCallback(profile_step=2, clean_steps=clean, profile_every=every, print_profile=False)
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=hf_arguments(tmp_path, max_steps, 4),
        train_dataset=TokenDataset(),
        callbacks=[callback],
    )
    trainer.train()
    first_end = first_clean(2) + clean  # counting at 2, then module timing, the check and 2 clean steps
    starts = (2, 17, 32)  # 2 + k * 15 after the previous window's last step
    logged = {e["step"]: e for e in trainer.state.log_history if names.FWD_FLOPS in e}
    assert sorted(logged) == [first_end, 17 + 1 + clean, 32 + 1 + clean]  # a lead-in, 2 clean steps
    for start, end in zip(starts, sorted(logged), strict=True):
        saved = load(tmp_path / f"flops_profile_step{start}.json")
        assert saved.result.steps.clean[0] == (first_clean(2) if start == 2 else start + 1)
        for name in (names.FWD_FLOPS, names.ITER_LATENCY, names.TOKENS_PER_SEC):
            assert logged[end][name] == pytest.approx(saved.metrics[name], rel=1e-9), (start, name)
    assert logged[first_end][names.FWD_FLOPS] == logged[32 + 1 + clean][names.FWD_FLOPS] > 0


def test_a_step_profiler_loop_re_profiles_and_logs_each_window(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[tuple[int, dict[str, float]]] = []
    prof = StepProfiler(
        model, log=lambda m, s: logged.append((s, m)), log_dir=tmp_path, profile_step=2, clean_steps=2,
        profile_every=10, print_profile=False,
    )  # fmt: skip
    for _ in range(30):
        with prof.step(torch.randn(BATCH, IN)):
            model(torch.randn(BATCH, IN)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    windows = [(step, m) for step, m in logged if names.FWD_FLOPS in m]
    assert [m[names.FWD_FLOPS] for _, m in windows] == [fwd_flops(BATCH)] * 3  # at 2, then 12 and 22
    for start in (2, 12, 22):
        assert load(tmp_path / f"flops_profile_step{start}.json").result.step == start


def test_two_ddp_ranks_with_skewed_batch_lengths_re_profile_on_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank 1's long batches need shape counts rank 0's do not: the votes keep the windows in lock step
    from tests.integrations.test_ranks import csv_series, launch
    from tests.rank_workers import MAX_STEPS
    from tests.rank_workers import PROFILE_STEP as FIRST

    monkeypatch.setenv("FLOPS_PROFILE_EVERY", "15")
    # the first window (with rank 1's shape counts) must end before step 17: without the communication
    # steps, which this test is not about, it does
    monkeypatch.setenv("FLOPS_COMM_STEPS", "0")
    ranks = launch(tmp_path, "lightning", "skewed", "3", "ddp")  # bounded; every rank reached MAX_STEPS
    last = ranks[0]
    assert last["first"] == FIRST + 2 * 15 and last["steps"]["counting"] == FIRST  # 32: the last window's
    agreed = ("counting", "clean", "shape_counting")  # (the module-timing steps are each rank's tree's)
    for other in ranks[1:]:
        assert (other["first"], other["published_at"], other["metrics"]) == (
            last["first"],
            last["published_at"],
            last["metrics"],
        )
        assert [other["steps"][k] for k in agreed] == [last["steps"][k] for k in agreed]
    windows = csv_series(tmp_path, names.FWD_FLOPS)  # by global step
    assert len(windows) == 3 and max(windows) == last["published_at"] <= MAX_STEPS
    assert len(set(windows.values())) == 1  # the first window's per-GPU counts, reused


# --- the plan and the option, alone --------------------------------------------------------------


def test_the_next_window_starts_on_the_grid_after_the_last_one_ended() -> None:
    plan = WindowPlan(Options(profile_step=5, profile_every=20), Ranks())
    assert not plan.due(100)  # no window ended yet: the first one starts at profile_step, not here
    plan.ended(12)
    assert plan.next_window == 25 and not plan.due(24) and plan.due(25) and plan.reprofile
    assert plan.start_step() == Kind.LEAD_IN and plan.before_clean == 1  # then its batches decide
    known = Decision(drop=False, new_shape=False, checkable=True, content=False, done=False)
    assert plan.start_step() is None and plan.batch_kind(known) == Kind.CLEAN  # the first window checked
    plan.reset()
    plan.ended(46)  # a window longer than the gap: the next grid step after it
    assert plan.next_window == 65
    plan.reset(run=True)  # a dropped window, or a new run: none until a first window ends
    assert plan.next_window is None and not plan.due(65)
    never = WindowPlan(Options(profile_step=5), Ranks())
    never.ended(12)
    assert never.next_window is None


@pytest.mark.parametrize(("max_steps", "third"), [(56, None), (57, 45)])
def test_with_two_global_steps_an_optimizer_step_a_window_the_run_would_cut_is_not_started(
    max_steps: int, third: int | None
) -> None:
    """Lightning's manual optimization with two optimizers: the run's steps go 0, 2, 4 ...; the grid's 45
    starts at 46, and its lead-in and 5 clean steps end at 56: a run of 56 steps would cut it."""
    plan = WindowPlan(Options(profile_step=5, profile_every=20, clean_steps=5), Ranks())
    plan.new_run(0, max_steps, 2)
    plan.ended(36)  # the second window's last step (it started at 26)
    assert plan.next_window == third


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "20"])
def test_profile_every_must_be_an_int_of_at_least_1_or_none(bad: object) -> None:
    with pytest.raises(ValueError, match=f"profile_every must be an int >= 1 or None, got {bad!r}"):
        Options(profile_every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FlopsProfilerCallback: profile_every must be an int >= 1 or None"):
        FlopsProfilerCallback(profile_every=bad)  # type: ignore[arg-type]


class Endless(torch.utils.data.IterableDataset):
    """60 batches and no ``__len__``: Lightning cannot know the run's length."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(0)
        return ((torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator))
                for _ in range(60))  # fmt: skip


def test_a_lightning_run_of_unknown_length_re_profiles_and_says_nothing_at_its_start(tmp_path: Path) -> None:
    """An iterable dataset of no length and ``max_epochs``: Lightning's length is ``max_steps``, -1, which
    read as a run of -1 steps: "profile_step=5 is never reached", and no re-profile window started."""
    callback = FlopsProfilerCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, profile_every=EVERY,
                                     print_profile=False)  # fmt: skip
    settings = lightning_settings(tmp_path, -1, max_epochs=1, logger=CSVLogger(tmp_path))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = L.Trainer(callbacks=[callback], **settings)
        trainer.fit(MLP(), torch.utils.data.DataLoader(Endless(), batch_size=None))
    assert trainer.global_step == 60
    assert not [w for w in said if "FlopsProfilerCallback" in str(w.message)]
    with open(Path(settings["logger"].log_dir) / "metrics.csv", newline="") as f:
        logged = [int(row["step"]) for row in csv.DictReader(f) if row.get(names.FWD_FLOPS)]
    assert logged == [ends(start) - 1 for start in (PROFILE_STEP, 25, 45)]


# --- the throughput meter around re-profile windows, and a loop that goes on after an exception -----------


def every_loop(
    steps: int, raise_at: int | None = None, data: float = 0.0, max_steps: int | None = None
) -> tuple[list, list[float], list]:
    """A StepProfiler loop of ``steps`` steps (a window at 3, re-profiled every 15, throughput logged every
    5 steps), each waiting ``data`` seconds for its batch; the block of loop index ``raise_at`` raises,
    and the loop goes on. Returns what was logged, each step's stopwatch seconds, and the warnings."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[tuple[int, dict[str, float]]] = []
    prof = StepProfiler(
        model, log=lambda m, s: logged.append((s, m)), profile_step=3, clean_steps=5, profile_every=15,
        log_every_n_steps=5, print_profile=False, flops_audit=0, max_steps=max_steps,
    )  # fmt: skip
    seconds = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for i in range(steps):
            start = time.perf_counter()
            time.sleep(data)
            x = torch.randn(BATCH, IN)
            try:
                with prof.step(x):
                    loss = model(x).sum()
                    if i == raise_at:
                        raise ValueError("a batch the loop skips")
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except ValueError:
                optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
        prof.close()
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    return logged, seconds, [str(w.message) for w in said if "StepProfiler" in str(w.message)]


def test_throughput_across_a_re_profile_window_leaves_out_its_lead_in_steps_wait_for_its_batch() -> None:
    """Each step waits 50 ms for its batch: an interval that spans a window counts the samples of its
    steps outside the window and their time only (the lead-in step's wait for its batch was counted
    without its samples: 4 steps' samples over 5 waits, 0.83x)."""
    data = 0.05
    logged, seconds, _ = every_loop(40, data=data)
    rates = [m[names.THROUGHPUT_SAMPLES_PER_SEC] for _, m in logged if names.THROUGHPUT_SAMPLES_PER_SEC in m]
    windows = [step for step, m in logged if names.FWD_FLOPS in m]
    assert windows == [13, 24, 39] and len(rates) == 4  # at 15, 25, 30 and 40 (20 and 35: in a window)
    step = sorted(seconds)[len(seconds) // 2]  # a metered step: the wait and a tiny model's step
    for rate in rates:
        assert 0.93 < rate * step / BATCH < 1.07


def test_an_exception_the_loop_goes_on_after_keeps_throughput_and_the_re_profile_windows() -> None:
    # outside any window: nothing to drop, every later interval and window logged
    logged, _, said = every_loop(60, raise_at=27)
    assert [s for s, m in logged if names.FWD_FLOPS in m] == [13, 24, 39, 54] and not said
    assert [s for s, m in logged if names.THROUGHPUT_SAMPLES_PER_SEC in m] == [15, 25, 30, 40, 45, 55]
    # in the re-profile window that starts at 18: that window is dropped, said; the next (33) runs
    logged, _, said = every_loop(60, raise_at=20)
    assert said == [
        "StepProfiler: a window step raised (the exception your loop went on after); the re-profile window "
        "is dropped; throughput/* goes on; the next starts at step 33. Training goes on."
    ]
    assert [s for s, m in logged if names.FWD_FLOPS in m] == [13, 39, 54]
    assert [s for s, m in logged if names.THROUGHPUT_SAMPLES_PER_SEC in m] == [15, 25, 30, 40, 45, 55]


@pytest.mark.parametrize(("max_steps", "windows"), [(23, [13]), (24, [13, 24])])
def test_a_re_profile_window_the_run_would_cut_short_is_not_started(
    max_steps: int, windows: list[int]
) -> None:
    """The window at 18 needs its lead-in and 5 clean steps, 18 .. 23: a run of 23 steps (0 .. 22) would
    cut it, so it does not start and throughput goes on through it; a run of 24 has it whole."""
    logged, _, said = every_loop(max_steps, max_steps=max_steps)
    assert [s for s, m in logged if names.FWD_FLOPS in m] == windows and not said
    metered = [s for s, m in logged if names.THROUGHPUT_SAMPLES_PER_SEC in m]
    assert metered == ([15, 20] if max_steps == 23 else [15])
