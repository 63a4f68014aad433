"""Across ranks: one window for the whole job, never a hang, the job's figures from every rank.

Real multi-process runs on CPU (gloo) of data-parallel fine-tuning with a pad-to-longest collator, each
rank reading sequences of its own lengths (tests/rank_workers.py), launched as users launch them:
Lightning's own launcher (``ddp``), ``ddp_spawn``, ``torchrun`` and ``accelerate launch``; and loops of
one's own with ``StepProfiler`` (tests/loop_workers.py): plain DDP under ``torchrun``, accelerate under
``accelerate launch``, Fabric starting its two processes. Every run is bounded: a hang kills its whole
process group and fails the test.

The truth is outside the profiler's run: each rank's batches, as its collator made them, counted again
here by the counting engine on a fresh model (the convention of the logged counts, elementwise work
included), and the tokens of every rank's batches over rank 0's own clock.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flops_callbacks import metrics as names
from flops_callbacks.counting.engine import CountingEngine
from tests.loop_workers import LOOP_END, LOOP_STEPS
from tests.rank_workers import LOG_EVERY, MAX_STEPS, PROFILE_STEP, gpt2
from tests.support import run_bounded

WORKERS = Path(__file__).parents[1] / "rank_workers.py"
LOOPS = Path(__file__).parents[1] / "loop_workers.py"
ROOT = Path(__file__).parents[2]
TIMEOUT = 300  # seconds: the same runs take 15-40 s without the callback on 2 cores


def launch(directory: Path, framework: str, data: str, clean: str, launcher: str, processes: int = 2,
           fail_rank: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run the workers as ``launcher`` starts them; every rank's saved view, by rank."""
    args = [framework, data, clean, str(directory), "ddp_spawn" if launcher == "ddp_spawn" else "ddp",
            str(processes)] + ([] if fail_rank is None else [str(fail_rank)])  # fmt: skip
    own = launcher in ("ddp", "ddp_spawn")  # Lightning starts the other processes itself
    command = launched(WORKERS, args, None if own else launcher, processes)
    return run_ranks(directory, command, MAX_STEPS, processes)


def launched(script: Path, args: list[str], launcher: str | None, processes: int = 2) -> list[str]:
    """The command that runs ``script`` under ``launcher`` (None: the script starts its processes)."""
    python = sys.executable
    if launcher is None:
        return [python, str(script), *args]
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                str(script), *args]  # fmt: skip
    return [python, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}",
            "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "--main_process_port=0",
            str(script), *args]  # fmt: skip


def run_ranks(directory: Path, command: list[str], steps: int, processes: int = 2) -> list[dict[str, Any]]:
    """Run ``command`` bounded; every rank's saved view, by rank, each having trained ``steps`` steps."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = run_bounded(command, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-16000:]  # every rank's traceback, the one that failed first
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(processes)]
    for r, seen in enumerate(ranks):  # every rank trained to the end, as without the profiler
        assert seen["rank"] == r and seen["global_step"] == steps
    ranks[0]["stderr"] = done.stderr
    return ranks


def batch(made: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A batch as the collator made it (its tokens and padding)."""
    ids = torch.tensor(made["ids"])
    mask = torch.arange(ids.shape[1]) < torch.tensor([[len([t for t in row if t])] for row in made["ids"]])
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(mask == 0, -100)}


def counted_fwd(made: dict[str, Any], **kwargs: Any) -> int:
    """The forward flops of one batch, counted again here on a fresh model (as the run's model sees it)."""
    model = gpt2()
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(**batch(made), **kwargs).loss.backward()
    finally:
        tracer.stop()
    return tracer.profile().fwd_flops


def check_one_window_and_the_jobs_figures(ranks: list[dict[str, Any]], hf: bool = False) -> dict[str, float]:
    """Every rank ran the same window and holds the same job's metrics; per-GPU flops are the ranks' mean
    counted outside; tokens/second counts every rank's tokens. Returns the metrics."""
    world = len(ranks)
    agreed = ("counting", "clean", "shape_counting")  # (the module-timing steps are this rank's tree's)
    for seen in ranks[1:]:
        assert [seen["steps"][k] for k in agreed] == [ranks[0]["steps"][k] for k in agreed]
        assert seen["published_at"] == ranks[0]["published_at"] and seen["metrics"] == ranks[0]["metrics"]
    steps, metrics = ranks[0]["steps"], ranks[0]["metrics"]
    assert steps["counting"] == PROFILE_STEP and steps["clean"]
    assert ranks[0]["world"] == world
    # who the others wait for, or that none stands out (the ranks' lengths differ: either may be said)
    assert names.SLOW_RANK in metrics and names.SLOW_RANK_EXTRA_LATENCY in metrics

    def fwd(seen: dict[str, Any], step: int) -> int:
        extra = {"num_items_in_batch": torch.tensor(seen["items"][step])} if hf else {}
        return counted_fwd(seen["batches"][step], **extra)

    # each rank's profile's batch: the counting step's, or (the tree's batch, of the median size of its own
    # module-timing steps) one of those steps' where they had other shapes, counted apart
    truth = [fwd(seen, seen["steps"]["profiled"]) for seen in ranks]
    assert metrics[names.FWD_FLOPS] == round(sum(truth) / world)  # per GPU: the ranks' mean
    assert len(set(truth)) == world or ranks[0]["data"] == "constant"  # the ranks did differ
    clean = [sum(fwd(seen, s) for s in steps["clean"]) for seen in ranks]
    # within 1%: a batch with no padding skips the mask's work, which the shape table (the same shapes
    # with padding) does not know (content-dependent work: the shape table's issue); rank 0's alone
    # would read 0.5x or less here
    assert ranks[0]["clean_counts"]["fwd_flops"] == pytest.approx(sum(clean) / world, rel=0.01)
    # tokens/second: the median step's tokens per device (the ranks' mean that step: one of the clean
    # steps' means) x the ranks, over its time (the slowest rank's, which every rank waited for)
    means = [sum(seen["batches"][s]["shape"][0] * seen["batches"][s]["shape"][1] for seen in ranks) / world
             for s in steps["clean"]]  # fmt: skip
    tokens = ranks[0]["median_step_tokens"]
    # one step's mean, or of an even count of steps the mean of the two middle ones
    assert tokens in means or any(abs((a + b) / 2 - tokens) < 1e-9 for a in means for b in means)
    assert metrics[names.TOKENS_PER_SEC] * metrics[names.ITER_LATENCY] == pytest.approx(
        tokens * world, rel=1e-9
    )
    return metrics


def throughput_after_the_window(ranks: list[dict[str, Any]], logged: dict[int, float]) -> None:
    """``throughput/tokens_per_sec`` at each logging step after the window: every rank's tokens of the
    interval over rank 0's clock, within 10%."""
    ends = ranks[0]["ends"]  # each step's end on rank 0's clock
    first = ranks[0]["published_at"] // LOG_EVERY * LOG_EVERY + LOG_EVERY  # the first logging step after
    intervals = [(a, a + LOG_EVERY) for a in range(first, MAX_STEPS, LOG_EVERY)]
    assert intervals and all(b in logged for _, b in intervals)
    for a, b in intervals:
        tokens = sum(seen["batches"][s]["shape"][0] * seen["batches"][s]["shape"][1] for seen in ranks
                     for s in range(a, b))  # fmt: skip
        assert logged[b] == pytest.approx(tokens / (ends[b - 1] - ends[a - 1]), rel=0.10)


def csv_series(directory: Path, name: str) -> dict[int, float]:
    """A Lightning run's CSV series of ``name``, by global step (Lightning's loggers draw a batch one step
    behind the global step after it, where its own metrics of that batch are)."""
    path = directory / "lightning_logs" / "version_0" / "metrics.csv"
    if not path.exists():  # nothing was logged
        return {}
    with open(path, newline="") as f:
        return {int(row["step"]) + 1: float(row[name]) for row in csv.DictReader(f) if row.get(name)}


def tensorboard_series(directory: Path, name: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (directory / "out").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    if "train/" + name not in accumulator.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in accumulator.Scalars("train/" + name)}


# --- Lightning -----------------------------------------------------------------------------------------


def test_lightning_ddp_skewed_lengths_one_window_for_the_job_and_its_summed_figures(tmp_path: Path) -> None:
    # the run that hung: rank 0's short batches needed fewer shape-counting steps than rank 1's long ones
    ranks = launch(tmp_path, "lightning", "skewed", "5", "ddp")
    metrics = check_one_window_and_the_jobs_figures(ranks)
    assert len(ranks[0]["steps"]["clean"]) == 5
    assert csv_series(tmp_path, names.FWD_FLOPS) == {ranks[0]["published_at"]: metrics[names.FWD_FLOPS]}
    throughput_after_the_window(ranks, csv_series(tmp_path, names.THROUGHPUT_TOKENS_PER_SEC))


def test_lightning_ddp_constant_lengths_per_rank_with_auto_clean_steps_ends_on_one_step(
    tmp_path: Path,
) -> None:
    ranks = launch(tmp_path, "lightning", "constant", "auto", "ddp")
    check_one_window_and_the_jobs_figures(ranks)
    throughput_after_the_window(ranks, csv_series(tmp_path, names.THROUGHPUT_TOKENS_PER_SEC))


def test_lightning_ddp_spawn_pickles_the_callback_and_finishes(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "lightning", "skewed", "3", "ddp_spawn")
    check_one_window_and_the_jobs_figures(ranks)


def test_lightning_under_torchrun_with_four_processes(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "lightning", "skewed", "auto", "torchrun", processes=4)
    check_one_window_and_the_jobs_figures(ranks)


def test_lightning_a_profiler_failure_on_rank_1_only_drops_the_window_on_every_rank(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "lightning", "skewed", "5", "ddp", fail_rank=1)
    assert all("metrics" not in seen for seen in ranks)  # no rank published a window
    stderr = ranks[0]["stderr"]
    assert stderr.count("a broken formula on rank 1") == 1  # said once, by the rank it failed on
    assert stderr.count("rank 1's profiler failed") == 1  # and the drop once, by the logging rank
    assert not csv_series(tmp_path, names.FWD_FLOPS) and not csv_series(
        tmp_path, names.THROUGHPUT_SAMPLES_PER_SEC
    )


# --- the HF Trainer ------------------------------------------------------------------------------------


def test_hf_trainer_torchrun_skewed_lengths_one_window_and_the_jobs_figures(tmp_path: Path) -> None:
    # the run that aborted: rank 0's gather met the Trainer's own per-step gather of the loss
    ranks = launch(tmp_path, "hf", "skewed", "5", "torchrun")
    metrics = check_one_window_and_the_jobs_figures(ranks, hf=True)
    assert tensorboard_series(tmp_path, names.FWD_FLOPS) == {
        ranks[0]["published_at"]: pytest.approx(metrics[names.FWD_FLOPS])
    }
    throughput_after_the_window(ranks, tensorboard_series(tmp_path, names.THROUGHPUT_TOKENS_PER_SEC))


def test_hf_trainer_deepspeed_zero2_skewed_lengths_one_window_and_the_jobs_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sharded: each rank holds half of the optimizer state and gradients, counts its own batches
    monkeypatch.setenv("FLOPS_ZERO_STAGE", "2")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ranks = launch(tmp_path, "hf", "skewed", "3", "torchrun")
    check_one_window_and_the_jobs_figures(ranks, hf=True)


def test_hf_trainer_accelerate_launch_constant_lengths_per_rank_auto(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "hf", "constant", "auto", "accelerate")
    check_one_window_and_the_jobs_figures(ranks, hf=True)


def test_hf_trainer_a_profiler_failure_on_rank_1_only_drops_the_window_on_every_rank(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "hf", "skewed", "5", "torchrun", fail_rank=1)
    assert all("metrics" not in seen for seen in ranks)
    stderr = ranks[0]["stderr"]
    assert stderr.count("a broken formula on rank 1") == 1
    assert stderr.count("rank 1's profiler failed") == 1
    assert not tensorboard_series(tmp_path, names.FWD_FLOPS)
    assert not tensorboard_series(tmp_path, names.THROUGHPUT_SAMPLES_PER_SEC)


# --- loops of one's own with StepProfiler ----------------------------------------------------------------


def tensorboard_scalars(directory: Path, name: str) -> dict[int, float]:
    """Scalar ``name`` from every TensorBoard event file under ``directory``: step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[int, float] = {}
    for events in directory.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if name in accumulator.Tags()["scalars"]:
            found |= {e.step: e.value for e in accumulator.Scalars(name)}
    return found


def loop_run(directory: Path, loop: str, launcher: str | None) -> tuple[dict[str, float], list[list]]:
    """A 2-process loop (tests/loop_workers.py): one window whose figures are the job's; the metrics and
    what each rank's ``log`` received (rank 0 only: the window at its end, throughput at the next step)."""
    ranks = run_ranks(directory, launched(LOOPS, [loop, str(directory)], launcher), LOOP_STEPS)
    (directory / "stderr.txt").write_text(ranks[0]["stderr"])
    metrics = check_one_window_and_the_jobs_figures(ranks)
    assert ranks[0]["published_at"] == LOOP_END
    logged = [json.loads((directory / f"rank{r}.logged.json").read_text()) for r in range(2)]
    assert [step for step, _ in logged[0]] == [LOOP_END, LOOP_STEPS] and logged[1] == []
    assert logged[0][0][1] == metrics and names.THROUGHPUT_TOKENS_PER_SEC in logged[0][1][1]
    return metrics, logged


def test_plain_ddp_loop_under_torchrun_one_window_and_the_jobs_figures(tmp_path: Path) -> None:
    loop_run(tmp_path, "plain", "torchrun")


def test_accelerate_loop_under_accelerate_launch_logs_the_jobs_figures_to_tensorboard(tmp_path: Path) -> None:
    metrics, _ = loop_run(tmp_path, "accelerate", "accelerate")
    fwd = metrics[names.FWD_FLOPS]
    assert tensorboard_scalars(tmp_path, names.FWD_FLOPS) == {LOOP_END: pytest.approx(fwd)}
    assert list(tensorboard_scalars(tmp_path, names.THROUGHPUT_TOKENS_PER_SEC)) == [LOOP_STEPS]


def test_accelerate_on_a_cpu_without_cpu_true_profiles_the_process_group_logged_by_its_rank_0(
    tmp_path: Path,
) -> None:
    """``accelerate launch`` on a CPU with ``Accelerator()``: accelerate calls each process a single-process
    run (its main), while torch.distributed holds both. The profile is the process group's (two ranks,
    one window), said once; rank 0 alone logs and writes the files."""
    metrics, logged = loop_run(tmp_path, "accelerate-no-cpu", "accelerate")
    assert logged[1] == []  # rank 1 is accelerate's main process too: it does not log
    said = (tmp_path / "stderr.txt").read_text().count("StepProfiler: accelerate runs 1 process(es) as ")
    assert said == 1  # on rank 0, once
    assert tensorboard_scalars(tmp_path, names.FWD_FLOPS) == {
        LOOP_END: pytest.approx(metrics[names.FWD_FLOPS])
    }


def test_fabric_loop_with_two_processes_logs_the_jobs_figures_to_tensorboard(tmp_path: Path) -> None:
    metrics, _ = loop_run(tmp_path, "fabric", None)
    fwd = metrics[names.FWD_FLOPS]
    assert tensorboard_scalars(tmp_path, names.FWD_FLOPS) == {LOOP_END: pytest.approx(fwd)}
    assert list(tensorboard_scalars(tmp_path, names.THROUGHPUT_TOKENS_PER_SEC)) == [LOOP_STEPS]
