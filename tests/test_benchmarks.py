"""The comparison benchmark keeps running: ``benchmarks/compare.py --quick`` exits 0 and its tables show
our matmul/conv/attention counts equal to the aten reference, forward and forward + backward, on
every model of the subset (the other tools' columns say "not installed" when they are absent); and the
window the benchmarks leave out of their unprofiled tables is the run plan's, step for step."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch.nn as nn

from tests.support import check_step, first_clean, module_steps, window_end

ROOT = Path(__file__).resolve().parents[1]
TITLES = ("### Forward", "### Forward + backward (one training step)")


def benchmark(name: str) -> ModuleType:
    """A script of ``benchmarks/``, imported as its siblings import each other (that folder on the path)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def table(output: str, title: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table under the heading ``title``: (header cells, row cells)."""
    lines = output.splitlines()
    start = lines.index(title) + 2  # heading, blank line, then the table
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, _separator, *body = rows
    return header, body


def test_compare_quick_runs_and_our_dense_counts_are_exact() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,  # a hang guard only: the script's own goal is < 60 s on CPU
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for title in TITLES:
        header, rows = table(done.stdout, title)
        ours = header.index("flops_callbacks, matmul")
        assert [row[0] for row in rows] == [
            "GPT-2 (4 x 128 wide), seq 128",
            "LSTM LM (2x256), 32x16",
            "functional block (einsum, @, SDPA)",
            "GPT-2 (4 x 128 wide) fine-tune, last block trainable",
        ]
        assert all(row[ours] == "1 (exact)" for row in rows), (title, rows)
        assert all(float(row[1]) > 0 for row in rows)  # the reference counted something


def test_the_benchmarks_window_is_the_run_plans_counting_module_timing_and_clean_steps() -> None:
    window_steps = benchmark("common").window_steps
    # counting at 10, three module-timing steps, the check, no clean step: 10-14; the first after it is 15
    assert window_steps(10) == range(10, 15) == range(10, window_end(10, 0))
    laid = [1, *module_steps(1), check_step(1), first_clean(1), first_clean(1) + 1]
    assert list(window_steps(1, 2)) == laid


def test_comm_truths_blocks_count_steps_that_follow_their_own_kind_and_pairs_alternate() -> None:
    comm_truth = benchmark("comm_truth")
    BLOCK, schedule = comm_truth.BLOCK, comm_truth.schedule
    steps = schedule(100)
    # 100 counted steps of each kind per truth, one uncounted lead-in per block of 6 (20 rounds)
    assert Counter(steps) == {("S", True): 100, ("N", False): 100, ("P", True): 100, ("P", False): 100,
                     ("s", True): 100, ("n", False): 100,
                     ("S0", True): 20, ("N0", False): 20, ("s0", True): 20, ("n0", False): 20}  # fmt: skip
    for (block, sync), (_, before) in zip(steps[1:], steps, strict=False):
        if block in ("S", "N", "s", "n"):  # a counted block step follows one of its own kind
            assert before == sync
    pairs = [sync for block, sync in steps if block == "P"]
    # sync first, then no_sync first, in turn, across the rounds too: half the no_sync steps follow a sync
    assert pairs == [True, False, False, True] * 50
    # each round holds the five blocks, their order rotating: the first steps of rounds 1-5
    per_round = 4 * BLOCK + 2 * (BLOCK - 1)
    assert [steps[per_round * r][0] for r in range(5)] == ["S0", "N0", "P", "s0", "n0"]
    # whole rounds: at least the steps asked for, of each kind
    assert Counter(schedule(7))["N", False] == 10


def test_comm_truths_training_blocks_bracket_the_window_and_count_each_kind_alike() -> None:
    comm_truth = benchmark("comm_truth")
    BLOCK, WARMUP, TrainBlocks = comm_truth.BLOCK, comm_truth.WARMUP, comm_truth.TrainBlocks
    train = TrainBlocks(100)
    plan = list(train.plan)  # (a block's first step, synced, aligned)
    # 20 rounds of a synced and a no_sync block of 6, free-running and aligned: each block's first
    # step uncounted, 100 counted steps of each of the four kinds
    assert len(plan) == train.steps == 20 * 4 * BLOCK
    assert Counter(plan) == {
        **{(True, sync, aligned): 20 for sync in (True, False) for aligned in (True, False)},
        **{(False, sync, aligned): 100 for sync in (True, False) for aligned in (True, False)},
    }
    blocks = [plan[i : i + BLOCK] for i in range(0, len(plan), BLOCK)]
    assert all(b[0][0] and not any(step[0] for step in b[1:]) for b in blocks)
    assert all(len({step[1:] for step in b}) == 1 for b in blocks)  # one kind a block
    # in each round the free-running blocks, then the aligned ones, each pair in the round's order:
    # synced first in even rounds, no_sync first in odd ones
    kinds = [b[0][1:] for b in blocks[:8]]
    assert kinds == [(True, False), (False, False), (True, True), (False, True),
                     (False, False), (True, False), (False, True), (True, True)]  # fmt: skip
    # the first ten rounds run before the window, after the warm-up steps
    assert train.profile_step == WARMUP + 10 * 4 * BLOCK
    assert TrainBlocks(1).profile_step == WARMUP + 4 * BLOCK  # two rounds at least: one each side
    assert TrainBlocks(11).steps == 4 * 4 * BLOCK  # three rounds' worth: four, two each side


def test_comm_truths_halves_are_the_training_blocks_before_and_after_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comm_truth = benchmark("comm_truth")
    monkeypatch.setattr(comm_truth.torch.distributed, "barrier", lambda: None)
    now = [0.0]
    monkeypatch.setattr(comm_truth, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    train, model = comm_truth.TrainBlocks(100), nn.Linear(2, 2)
    # a synced step takes 2 s before the window and 4 s after it, a no_sync step 1 s throughout
    for step in range(comm_truth.WARMUP, train.profile_step + train.steps):
        published = step >= train.profile_step
        train.begin(model, step, published)
        if train.current is None:
            continue
        synced = train.current[1]
        now[0] += (4.0 if published else 2.0) if synced else 1.0
        train.end()
    assert not train.plan and model.require_backward_grad_sync
    assert train.half(after=False) == 1.0 and train.half(after=True) == 3.0
    assert train.truth() == 2.0  # the median synced step of both halves, (2 + 4) / 2, less 1


def test_energy_truths_cpu_path_meets_its_goal_on_a_rapl_tree_and_without_one_says_why_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.fake_rapl import install, remove

    energy_truth = benchmark("energy_truth")
    rapl = install(tmp_path, monkeypatch)
    with rapl.burning(30.0):  # a CPU at 30 W: the loop's reads and the profiler's see the same counter
        args = ["--device", "cpu", "--clean", "10", "--profile-step", "1", "--width", "768", "--batch", "256"]
        code = energy_truth.main(args)  # steps of tens of ms: many of the fake counter's few-ms updates
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| joules per step |" in out and "goal: ratio within (0.95, 1.05): met" in out
    missing = remove(tmp_path, monkeypatch)
    assert energy_truth.main(["--device", "cpu"]) == 2
    assert capsys.readouterr().out == (
        f"energy_truth: no RAPL counter: {missing} does not exist (no powercap interface on this machine)\n"
    )
