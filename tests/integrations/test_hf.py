"""HFFlopsCallback on a real transformers.Trainer (CPU, tiny models built from configs, synthetic data).

Flop counts are checked against an independent count: FlopCounterMode with SDPA's math backend
counts the dense ops (matmuls, attention) of the same micro-batch, which must equal our MACs x 2.
Metrics are read back from the Trainer's ``state.log_history`` and from the files its own reporting
callbacks write, at the global step where the profile window ended (``result.published_at``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import re
import subprocess
import sys
import time
import warnings
import weakref
from collections.abc import Container
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from flops_callbacks import FlopsProfiler
from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback, parallel_sizes
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.session.window_plan import COMM_MIN
from flops_callbacks.units import duration_to_string, number_to_string, params_to_string
from tests.raising import RaiseInBackward
from tests.sleepy import Sleepy, SleepySGD
from tests.support import (
    end_process,
    first_clean,
    held_back,
    laid_out,
    module_steps,
    run_bounded,
    window_end,
    window_steps,
)

# The window: counting step 2, the module-timing steps, one clean step; published when that step has
# ended, at WINDOW_END. Runs go one step past it unless a test is about where they end.
PROFILE_STEP, CLEAN_STEPS = 2, 1
MODULE_STEPS, FIRST_CLEAN = module_steps(PROFILE_STEP), first_clean(PROFILE_STEP)
WINDOW_END = window_end(PROFILE_STEP, CLEAN_STEPS)
DDP_END = window_end(PROFILE_STEP, CLEAN_STEPS, comm=True)  # two ranks: with the communication steps
STEPS = window_steps(PROFILE_STEP, CLEAN_STEPS)
VOCAB, SEQ, BATCH = 97, 16, 4


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (causal LM)."""

    def __init__(self, size: int = 64) -> None:
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def micro_batch() -> dict[str, torch.Tensor]:
    ids = TokenDataset().ids[:BATCH]
    return {"input_ids": ids, "labels": ids}


def gpt2_config(n_layer: int = 2) -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=n_layer, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config())


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def quiet(**kwargs: Any) -> HFFlopsCallback:
    settings = {"profile_step": PROFILE_STEP, "clean_steps": CLEAN_STEPS, "print_profile": False}
    return HFFlopsCallback(**{**settings, **kwargs})


def make_trainer(
    tmp_path: Path,
    model: torch.nn.Module,
    callbacks: list[TrainerCallback],
    report_to: tuple[str, ...] = ("tensorboard",),
    trainer_class: type[Trainer] = Trainer,
    datasets: dict[str, torch.utils.data.Dataset] | None = None,
    optimizers: tuple[Any, Any] = (None, None),
    **overrides: Any,
) -> Trainer:
    settings = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "max_steps": WINDOW_END + 1,
        "per_device_train_batch_size": BATCH,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": list(report_to),
        "disable_tqdm": True,
        "seed": 0,
    }
    args = TrainingArguments(**{**settings, **overrides})
    datasets = datasets or {"train_dataset": TokenDataset()}
    return trainer_class(model=model, args=args, callbacks=callbacks, optimizers=optimizers, **datasets)


def train(tmp_path: Path, model: torch.nn.Module, callbacks: list[TrainerCallback], **kwargs: Any) -> Trainer:
    trainer = make_trainer(tmp_path, model, callbacks, **kwargs)
    trainer.train()
    return trainer


def profile_file(output_dir: str | Path, suffix: str) -> Path:
    """The window's ``flops_profile_step{N}.{suffix}`` where the callback writes it: the output dir in
    transformers 5, the Trainer's logging dir in 4.x (by default the run's one folder under ``runs/``)."""
    folder = Path(output_dir)
    if int(transformers.__version__.split(".")[0]) < 5:
        (folder,) = folder.glob("runs/*")
    return folder / f"flops_profile_step{PROFILE_STEP}.{suffix}"


def saved_profile(trainer: Trainer) -> dict[str, Any]:
    return json.loads(profile_file(trainer.args.output_dir, "json").read_text())


def dense_flops(model: torch.nn.Module, backward: bool) -> int:
    """Independent count of one micro-batch: FlopCounterMode, attention as plain matmuls."""
    model.train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = model(**micro_batch()).loss
        if backward:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def tensorboard_scalars(output_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard run the Trainer's TensorBoardCallback wrote: tag -> [(step, value)]."""
    (run_dir,) = (Path(output_dir) / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def losses(trainer: Trainer) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def logged(trainer: Trainer, name: str) -> list[tuple[int, float]]:
    """(step, value) of every ``name`` in the Trainer's log history."""
    return [(entry["step"], entry[name]) for entry in trainer.state.log_history if name in entry]


_GLOBAL_HOOKS = [name for name in vars(torch.nn.modules.module) if name.startswith("_global_")]


def leftovers(trainer: Trainer) -> list[str]:
    """Whatever of a profiler is installed now: torch's global module hooks, hooks on the model's
    modules, modes on either stack, instance attributes that shadow the Trainer's methods."""
    found = [name for name in _GLOBAL_HOOKS if getattr(torch.nn.modules.module, name)]
    found += [
        f"{name or 'model'}.{kind}"
        for name, module in trainer.model.named_modules()
        for kind, hooks in vars(module).items()
        if "hook" in kind and isinstance(hooks, dict) and hooks
    ]
    found += ["dispatch mode"] * len(_get_current_dispatch_mode_stack())
    found += ["function mode"] * len(_get_current_function_mode_stack())
    return found + sorted({"training_step", "compute_loss"} & set(vars(trainer)))


def assert_nothing_left(trainer: Trainer) -> None:
    assert leftovers(trainer) == []


class WarningsAtFirstStep(TrainerCallback):
    """The callbacks' warnings already issued when the first step begins (``caught``: the list of a
    ``warnings.catch_warnings(record=True)`` around the run)."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self.caught = caught
        self.seen: list[str] | None = None

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.seen is None:
            self.seen = [str(w.message) for w in self.caught if "HFFlopsCallback" in str(w.message)]


class StopsAt(TrainerCallback):
    """After ours: stops the run at a step's end, after our ``on_step_end``, or at an evaluation there (as
    ``EarlyStoppingCallback`` does in its ``on_evaluate``, at a step's or an epoch's end)."""

    def __init__(self, step: int, evaluating: bool = False) -> None:
        self.step, self.evaluating = step, evaluating

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step and not self.evaluating:
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("stop", ["max_steps", "a callback after ours", "an evaluation at the epoch's end"])
def test_a_window_the_runs_end_cuts_short_reaches_the_reporters_own_tensorboard_file_and_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """The run ends in the window's module-timing steps: its window is published at the last step's end
    (at the epoch's end where a later callback stops the run), while the Trainer's TensorBoard writer and
    MLflow run are open (their on_train_end, before ours, closes them: a later log opened a second event
    file and a second MLflow run, which got every metric of the profile)."""
    pytest.importorskip("mlflow")
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store opt-in
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())  # over one an earlier MLFlowLogger set for good
    end = PROFILE_STEP + 1  # the counting step and a module-timing step
    callback = quiet()
    callbacks, steps = ([callback], end) if stop == "max_steps" else ([callback, StopsAt(end)], end + 10)
    evaluating: dict[str, Any] = {}
    if stop == "an evaluation at the epoch's end":  # an epoch of `end` steps, evaluated at its end
        callbacks[1] = StopsAt(end, evaluating=True)
        datasets = {"train_dataset": TokenDataset(end * BATCH), "eval_dataset": TokenDataset(BATCH)}
        evaluating = {"datasets": datasets, "eval_strategy": "epoch", "logging_steps": 2}
    report_to = ("tensorboard", "mlflow")
    trainer = train(tmp_path, gpt2(), callbacks, report_to=report_to, max_steps=steps, **evaluating)
    assert trainer.state.global_step == end
    assert callback.result is not None and callback.result.published_at == end
    (run_dir,) = (Path(trainer.args.output_dir) / "runs").iterdir()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    scalars = tensorboard_scalars(trainer.args.output_dir)
    assert [step for step, _ in scalars["train/" + names.FWD_FLOPS]] == [end]
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert {"loss", names.FWD_FLOPS} <= set(run.data.metrics)


# --- TensorBoard: the Trainer's own event files -------------------------------------------------------


def test_metrics_reach_tensorboard_once_at_the_window_end_and_losses_are_unchanged(tmp_path: Path) -> None:
    callback = quiet()
    profiled = train(tmp_path / "with", gpt2(), [callback])
    plain = train(tmp_path / "without", gpt2(), [])

    result = callback.result
    assert (laid_out(result.steps), result.step, result.published_at) == (STEPS, PROFILE_STEP, WINDOW_END)
    saved = saved_profile(profiled)
    metrics = saved["metrics"]
    assert (saved["step"], saved["published_at_step"]) == (PROFILE_STEP, WINDOW_END)
    assert saved["steps"]["clean"] == [FIRST_CLEAN]
    assert set(metrics) == set(names.ALL)  # tokens_per_sec too: input_ids are counted by default
    scalars = tensorboard_scalars(profiled.args.output_dir)
    for name in names.ALL:
        ((step, value),) = scalars["train/" + name]  # the Trainer's TensorBoardCallback prefixes train/
        assert step == WINDOW_END
        assert value == pytest.approx(metrics[name], rel=1e-6)  # event files hold float32
    assert [e for e in profiled.state.log_history if names.FWD_FLOPS in e] == [
        {**metrics, "step": WINDOW_END}
    ]
    # the Trainer's own epoch is logged once a logging step, as without the callback (not again with ours)
    assert [s for s, _ in scalars["train/epoch"]] == [
        s for s, _ in tensorboard_scalars(plain.args.output_dir)["train/epoch"]
    ]

    # the report in TensorBoard's Text tab, as a Markdown code block of the report file
    (run_dir,) = (Path(profiled.args.output_dir) / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("flops_profiler/report/text_summary")
    report = profile_file(profiled.args.output_dir, "txt").read_text()
    assert text.step == WINDOW_END
    assert [line[4:] for line in text.tensor_proto.string_val[0].decode().splitlines()] == report.splitlines()

    # the loss is logged at the same steps with the same values as without the callback
    assert losses(profiled) == losses(plain)
    assert [s for s, _ in losses(profiled)] == list(range(1, WINDOW_END + 2))
    assert scalars["train/loss"] == tensorboard_scalars(plain.args.output_dir)["train/loss"]

    # flops: the dense part equals an independent count of one micro-batch, exactly (the fused attention
    # backward's recompute of QK^T is in recompute_macs: the math backend does not recompute)
    profile = result.profile
    assert profile.fwd_macs * 2 == dense_flops(profiled.model, backward=False)
    assert (profile.fwd_macs + profile.bwd_macs) * 2 == dense_flops(profiled.model, backward=True)
    assert profile.fwd_flops > profile.fwd_macs * 2  # plus the elementwise ops (norms, gelu, softmax, loss)
    assert metrics[names.FWD_FLOPS] == profile.fwd_flops
    assert metrics[names.BWD_FLOPS] == profile.bwd_flops

    # the step's own numbers
    assert (result.samples, result.tokens, result.micro_batches) == (BATCH, BATCH * SEQ, 1)
    assert result.parallel == ParallelSizes()
    assert metrics[names.ITER_LATENCY] == pytest.approx(
        metrics[names.FWD_LATENCY] + metrics[names.BWD_LATENCY] + metrics[names.STEP_LATENCY]
    )
    assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(BATCH / metrics[names.ITER_LATENCY])
    assert metrics[names.TOKENS_PER_SEC] == pytest.approx(BATCH * SEQ / metrics[names.ITER_LATENCY])
    assert min(metrics[n] for n in (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY)) > 0

    # the report, written next to the run, with the Trainer's own estimate (what total_flos sums) and
    # the steps each figure comes from
    report = profile_file(profiled.args.output_dir, "txt").read_text()
    assert f"Profile Summary at step {PROFILE_STEP}:" in report
    estimate = 6 * BATCH * SEQ * profiled.model.num_parameters(exclude_embeddings=True)
    assert estimate == profiled.floating_point_ops(micro_batch())
    difference = (profile.fwd_flops + profile.bwd_flops - estimate) / estimate * 100
    params = profiled.model.num_parameters(exclude_embeddings=True)
    assert re.search(
        r"Trainer's estimate \(floating_point_ops: 6 x params less every embedding table x tokens\): +"
        + re.escape(f"{number_to_string(estimate)} = 6 x {params_to_string(params)} x {BATCH * SEQ}"),
        report,
    )
    assert "measured fwd + bwd flops vs Trainer's estimate:" in report
    assert f"{difference:+.1f}%" in report
    assert re.search(
        rf"fwd / bwd / step latency from: +median of 1 clean step\(s\): step {FIRST_CLEAN}", report
    )
    # the meter's first interval after the window: the one step after it
    ((step, rate),) = logged(profiled, names.THROUGHPUT_SAMPLES_PER_SEC)
    assert step == WINDOW_END + 1 and rate > 0
    assert_nothing_left(profiled)


# --- what the window covers ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut_short", [False, True])
def test_the_callback_keeps_neither_the_trainer_nor_the_model_once_the_run_ended(
    tmp_path: Path, cut_short: bool
) -> None:
    # users keep the callback to read its result: the window's context (the Trainer's estimate rows close
    # over the Trainer) and the meter's model once kept the Trainer, its model, optimizer and data alive;
    # a window the run's end cut short started the meter after the run's end had closed it
    callback = quiet()
    model = gpt2()
    ended = {"max_steps": WINDOW_END - 1} if cut_short else {}
    trainer = train(tmp_path, model, [callback], report_to=(), **ended)
    assert callback.result is not None
    held = [weakref.ref(trainer), weakref.ref(model)]
    del trainer, model
    gc.collect()
    assert [ref() for ref in held] == [None, None]


class Probe(TrainerCallback):
    """A user's callback: what is left installed at each optimizer step and its end, and every on_log."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.left: dict[tuple[int, str], list[str]] = {}
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.left[state.global_step, "optimizer step"] = leftovers(self.trainer)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.left[state.global_step - 1, "step end"] = leftovers(self.trainer)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append((state.global_step, dict(logs)))


def test_gradient_accumulation_profiles_every_micro_batch_and_nothing_stays_between_them(
    tmp_path: Path,
) -> None:
    seen: list[Any] = []

    def batch_size(inputs: Any) -> int:
        seen.append(inputs)
        return int(inputs["input_ids"].shape[0])

    before, callback, after = Probe(), quiet(batch_size_fn=batch_size), Probe()
    trainer = make_trainer(tmp_path, gpt2(), [before, callback, after], gradient_accumulation_steps=2)
    before.trainer = after.trainer = trainer
    trainer.train()
    result = callback.result
    assert (result.micro_batches, result.samples, result.tokens) == (2, 2 * BATCH, 2 * BATCH * SEQ)
    # the Trainer's inputs of the window's steps x 2 micro-batches, then of the metered last step
    window = WINDOW_END - PROFILE_STEP
    assert len(seen) == 2 * (window + 1) and all({"input_ids", "labels"} <= set(inputs) for inputs in seen)
    profile = result.profile
    assert profile.fwd_macs * 2 == 2 * dense_flops(trainer.model, backward=False)
    assert (profile.fwd_macs + profile.bwd_macs) * 2 == 2 * dense_flops(trainer.model, backward=True)
    assert profile.modules[""].calls == 2  # the model ran twice in the step
    assert saved_profile(trainer)["metrics"][names.SAMPLES_PER_SEC] == pytest.approx(
        2 * BATCH / result.iter_latency
    )
    # nothing installed at any optimizer step or step end, the window's included
    for probe in (before, after):
        steps = sorted({step for step, _ in probe.left})
        assert steps == list(range(WINDOW_END + 1))
    assert {key: left for key, left in after.left.items() if left} == {}
    # the user's other callbacks, before and after ours in the list, get the metrics in on_log, once
    for probe in (before, after):
        (logged_at,) = [(step, logs) for step, logs in probe.logs if names.FWD_FLOPS in logs]
        assert logged_at[0] == WINDOW_END
        assert {k: v for k, v in logged_at[1].items() if k in names.ALL} == result.metrics()
    assert_nothing_left(trainer)


def test_a_run_ending_inside_the_window_warns_at_train_start_and_publishes_at_train_end(
    tmp_path: Path,
) -> None:
    callback = quiet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_step = WarningsAtFirstStep(caught)
        trainer = train(tmp_path, gpt2(), [first_step, callback], max_steps=FIRST_CLEAN)
    (warning,) = [w for w in caught if "profile window" in str(w.message)]
    assert first_step.seen == [str(warning.message)]  # before the first step ran
    assert f"needs steps {PROFILE_STEP} .. {WINDOW_END - 1}" in str(warning.message)
    assert "the latencies will rest on 0 clean step(s)" in str(warning.message)
    # the counting and module-timing steps ran: their result is published when training ends
    result = callback.result
    assert (result.steps.counting, result.steps.module_timing, result.steps.clean) == (
        PROFILE_STEP,
        MODULE_STEPS,
        (),
    )
    assert result.steps.latency_source.startswith("the module timing step")
    assert result.published_at == FIRST_CLEAN
    assert [step for step, _ in logged(trainer, names.FWD_FLOPS)] == [FIRST_CLEAN]
    ((step, _),) = tensorboard_scalars(trainer.args.output_dir)["train/" + names.FWD_FLOPS]
    assert step == FIRST_CLEAN
    report = profile_file(trainer.args.output_dir, "txt").read_text()
    assert "alone (no clean step ran" in report and result.steps.latency_source in report
    assert_nothing_left(trainer)


class Marks(TrainerCallback):
    """A stopwatch at the events where the meter starts, logs, pauses and resumes: one of these before
    our callback and one after it enclose each of our marks."""

    def __init__(self) -> None:
        self.step_end: dict[int, float] = {}
        self.evaluate: dict[int, float] = {}
        self.save: dict[int, float] = {}
        self.log: dict[int, float] = {}  # the Trainer's training logs (its loss)

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.step_end[state.global_step] = time.perf_counter()

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.evaluate[state.global_step] = time.perf_counter()

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.save[state.global_step] = time.perf_counter()

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if "loss" in kwargs["logs"]:
            self.log[state.global_step] = time.perf_counter()


class StepClock(Probe):
    """After HFFlopsCallback in the list: when each step ends, by the global step after it. Each step
    sleeps ``STEP_SLEEP`` first, so that an interval's time is not the few milliseconds of the tiny
    model's steps, where a log write or a hiccup of the machine is a fifth of it (a flake once)."""

    STEP_SLEEP = 0.01

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        time.sleep(self.STEP_SLEEP)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        super().on_step_end(args, state, control, **kwargs)
        self.ended[state.global_step] = time.perf_counter()


def test_throughput_is_logged_at_every_later_logging_step_over_every_steps_wall_time(tmp_path: Path) -> None:
    # batches of 4 and a last one of 2 in each epoch, first just after the window: a shape outside what
    # the window verified is counted under fake tensors when it first arrives, out of its interval's
    # clock (throughput/profiler_seconds says how long): every interval logs flops
    peak, before, clock, short, max_steps = 3e10, Marks(), StepClock(), WINDOW_END + 1, WINDOW_END + 8
    callback = quiet(peak_flops=peak)
    trainer = make_trainer(
        tmp_path, gpt2(), [before, callback, clock],
        datasets={"train_dataset": TokenDataset(BATCH * short + 2)},
        max_steps=max_steps, logging_steps=3,
    )  # fmt: skip
    clock.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "neither counted" in str(w.message)]

    # nothing installed at any optimizer step after the window, nothing left
    assert {key: left for key, left in clock.left.items() if left} == {}
    assert_nothing_left(trainer)

    scalars = tensorboard_scalars(trainer.args.output_dir)
    samples_logged = scalars["train/" + names.THROUGHPUT_SAMPLES_PER_SEC]
    flops_logged = dict(scalars.get("train/" + names.THROUGHPUT_FLOPS_PER_SEC, []))
    own = dict(scalars["train/" + names.THROUGHPUT_PROFILER_SECONDS])
    logging = list(range(3, max_steps + 1, 3))
    assert [step for step, _ in samples_logged] == [s for s in logging if s > WINDOW_END]  # after the window
    sizes = {step: 2 if step % (short + 1) == short else BATCH for step in range(max_steps)}
    flops = callback.result.profile.model_flops  # of a 4-sequence step
    first_short = min(s for s in range(WINDOW_END, max_steps) if sizes[s] == 2)
    counted_in = min(step for step in own if step > first_short)
    assert own[counted_in] > 0 and all(own[step] == 0 for step in own if step != counted_in)  # once
    previous = WINDOW_END
    for step, rate in samples_logged:
        interval = range(previous, step)
        samples = sum(sizes[s] for s in interval)
        assert step in flops_logged
        # per sample as a 4-sequence step's (the loss's normalisation apart: a few flops in a million)
        assert flops_logged[step] / rate == pytest.approx(flops / BATCH, rel=1e-3)
        # the interval's seconds between the stopwatches just before and just after our callback, from
        # the last log (or the window's end) to this one, less the count off its clock (at most ``own``,
        # which was timed around it)
        b, a = before.step_end, clock.ended
        shortest, longest = b[step] - a[previous] - own[step], a[step] - b[previous]
        assert samples / longest <= rate <= samples / shortest, step
        previous = step
    # the loss is logged as without the callback, beside its own entries
    assert [step for step, _ in losses(trainer)] == logging
    # the profile's files say what the profiler took after the window, at the run's end
    after = saved_profile(trainer)["after_window"]
    assert after["counts"] == 1 and after["seconds"] == pytest.approx(sum(own.values()), rel=1e-3)
    report = profile_file(trainer.args.output_dir, "txt").read_text()
    assert "profiler's own counting after the window (off throughput's clock)" in report


def profiled_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Model flops (fwd + bwd) of one training micro-batch, from the core profiler directly."""
    model.train()
    with FlopsProfiler(model) as profiler:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return profiler.get_profile().model_flops


# --- phases of known durations, evaluation, logging strategies -----------------------------------------
# Sleeps around many tiny ops (tests/sleepy.py): a figure taken while counting would be inflated by the
# ops, one taken on the wrong boundaries would miss a sleep.

SLEEP = 0.1


class SleepyRegressor(nn.Module):
    """A forward and a backward that sleep known times, and a loss for the Trainer."""

    def __init__(self, fwd: float, bwd: float, tiny_ops: int = 60, eval_sleep: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = Sleepy(fwd, bwd, tiny_ops)
        self.eval_sleep = eval_sleep

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.training:
            time.sleep(self.eval_sleep)
        return {"loss": F.mse_loss(self.body(x), labels)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 4, generator=generator), torch.randn(size, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class SlowToPrepareInputs(Trainer):
    """The Trainer's own work in ``training_step`` before ``compute_loss`` (moving the inputs), made long."""

    def _prepare_inputs(self, inputs: Any) -> Any:
        time.sleep(SLEEP)
        return super()._prepare_inputs(inputs)


def test_forward_backward_and_optimizer_step_of_known_durations_are_reported_within_15_percent(
    tmp_path: Path,
) -> None:
    model = SleepyRegressor(SLEEP, SLEEP)
    callback = quiet(profile_step=1, clean_steps=2)
    trainer = train(
        tmp_path, model, [callback], report_to=(), datasets={"train_dataset": Pairs(10)},
        optimizers=(SleepySGD(model.parameters(), SLEEP), None), max_steps=window_end(1, 2),
        per_device_train_batch_size=2, trainer_class=SlowToPrepareInputs,
    )  # fmt: skip
    result = callback.result
    assert (result.steps.counting, result.steps.module_timing, result.steps.clean) == (
        1, module_steps(1), tuple(range(first_clean(1), window_end(1, 2)))
    )  # fmt: skip
    assert result.fwd_latency == pytest.approx(SLEEP, rel=0.15)  # compute_loss: not the inputs' sleep
    assert result.bwd_latency == pytest.approx(SLEEP, rel=0.15)
    assert result.step_latency == pytest.approx(SLEEP, rel=0.15)
    # the Trainer's work before compute_loss is the wall step's other
    metrics = result.metrics()  # the median step's wall step, less its wait for data and fwd + bwd + step
    other = metrics[names.WALL_LATENCY] - metrics[names.DATA_LATENCY] - result.iter_latency
    assert other == pytest.approx(SLEEP, rel=0.15)
    # the module-timing step: the model's forward, and its backward (the sleeping node's execution)
    root = result.profile.modules[""]
    assert (root.fwd_latency, root.bwd_latency) == pytest.approx((SLEEP, SLEEP), rel=0.15)
    assert_nothing_left(trainer)


class SlowToStartEvaluation(Trainer):
    """Evaluation that takes a while before its first batch (set-up a user's subclass might do)."""

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        time.sleep(0.1)
        return super().evaluate(*args, **kwargs)


@pytest.mark.parametrize("sets", [1, 2])
def test_evaluation_from_its_first_instruction_to_its_last_leaves_throughput_unchanged(
    tmp_path: Path, sets: int
) -> None:
    # training steps of 0.05 s; an evaluation of 0.1 s set-up + 8 batches x 0.05 s (for each of ``sets``
    # evaluation sets: a dict of them is evaluated set by set, one on_evaluate each) runs after step 9's
    # log, inside the interval logged at 12: three times the interval itself if it were counted; the
    # window ends at 6, the meter's first interval starts there; no step is audited (an audited step is
    # out of its interval, as the evaluation is): each interval is its three steps
    step_sleep = 0.05
    model = SleepyRegressor(step_sleep, 0.0, tiny_ops=2, eval_sleep=0.0)
    before, after = Marks(), Marks()
    evaluated = Pairs(8 * BATCH) if sets == 1 else {name: Pairs(8 * BATCH) for name in "ab"[:sets]}
    trainer = train(
        tmp_path, model, [before, quiet(profile_step=0, flops_audit=0), after], report_to=(),
        trainer_class=SlowToStartEvaluation,
        datasets={"train_dataset": Pairs(64), "eval_dataset": evaluated}, max_steps=18,
        logging_steps=3, eval_strategy="steps", eval_steps=9, per_device_eval_batch_size=BATCH,
    )  # fmt: skip
    loss = "eval_loss" if sets == 1 else "eval_b_loss"  # the last set's
    assert [e["step"] for e in trainer.state.log_history if loss in e] == [9, 18]
    rates = dict(logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC))
    assert sorted(rates) == [9, 12, 15, 18] and window_end(0, 1) == 6  # every logging step after the window
    assert BATCH / (step_sleep + 0.02) < rates[9] < BATCH / step_sleep  # a step's sleep and a little more
    # each interval's seconds lie between what the two stopwatches read around our marks: from the last
    # log (or the window's end) to this log; at 12, less the evaluation, from our pause (just after step
    # 9's log) to our resume (the evaluation's end)
    b, a = before.step_end, after.step_end
    for step in (9, 12, 15, 18):
        shortest, longest = b[step] - a[step - 3], a[step] - b[step - 3]
        if step == 12:
            shortest = b[12] - after.evaluate[9]
            longest = a[12] - before.evaluate[9] + (a[9] - b[9])
        assert 3 * BATCH / longest <= rates[step] <= 3 * BATCH / shortest, step
    # counted, the evaluation would show: it took over twice the interval's training
    assert before.evaluate[9] - a[9] > 2 * (a[12] - before.evaluate[9])


EVERY_STEP_EVALUATION: dict[str, Any] = {
    "eval_strategy": "steps",
    "eval_steps": 1,
    "per_device_eval_batch_size": BATCH,
}


def held_out(
    tmp_path: Path, trainer_class: type[Trainer], after: tuple[TrainerCallback, ...] = (), **arguments: Any
) -> dict[str, float]:
    """The metrics of a window (two clean steps) of a Trainer of ``trainer_class`` whose work after each
    step (``arguments``, or callbacks ``after`` ours: an evaluation, a save) is slow: what the clean
    steps' data and wall hold."""
    callback = quiet(profile_step=1, clean_steps=2)
    train(
        tmp_path, SleepyRegressor(0.0, 0.0, tiny_ops=2), [callback, *after], report_to=(),
        trainer_class=trainer_class, datasets={"train_dataset": Pairs(64), "eval_dataset": Pairs(BATCH)},
        max_steps=window_end(1, 2), **arguments,
    )  # fmt: skip
    result = callback.result
    assert result is not None and len(result.steps.clean) == 2
    return result.metrics()


def test_evaluation_inside_the_window_is_neither_a_clean_steps_data_nor_its_wall(tmp_path: Path) -> None:
    """An evaluation of 0.1 s after every step, inside the window too: out of the clean steps' data wait
    and wall step (it read as the next step's data: "bound by the input pipeline")."""
    metrics = held_out(tmp_path, SlowToStartEvaluation, **EVERY_STEP_EVALUATION)
    assert metrics[names.DATA_LATENCY] < 0.05 and metrics[names.WALL_LATENCY] < 0.05, metrics


class SlowToSave(Trainer):
    """A checkpoint's save that takes 0.1 s (a large model's, on a slow disk)."""

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.1)
        super()._save_checkpoint(*args, **kwargs)


@pytest.mark.parametrize("evaluates", [False, True])
def test_a_checkpoints_save_inside_the_window_is_neither_a_clean_steps_data_nor_its_wall(
    tmp_path: Path, evaluates: bool
) -> None:
    """A save of 0.1 s after every step (after an evaluation, too), inside the window: out of the clean
    steps' data wait and wall step (it read as the next step's data: "bound by the input pipeline")."""
    evaluation = EVERY_STEP_EVALUATION if evaluates else {}
    metrics = held_out(tmp_path, SlowToSave, save_strategy="steps", save_steps=1, **evaluation)
    assert metrics[names.DATA_LATENCY] < 0.05 and metrics[names.WALL_LATENCY] < 0.05, metrics


class LateFlags(TrainerCallback):
    """A user's own schedule, after ours in the list: at a step's end it logs every ``log_every`` steps,
    evaluates and saves at the steps given; decisions our ``on_step_end`` (before it) does not see."""

    def __init__(self, log_every: int, evaluate: Container[int] = (), save: Container[int] = ()) -> None:
        self.log_every, self.evaluate, self.save = log_every, evaluate, save

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        step = state.global_step
        control.should_log |= step % self.log_every == 0
        control.should_evaluate |= step in self.evaluate
        control.should_save |= step in self.save


class SlowToEvaluateAndSave(SlowToStartEvaluation, SlowToSave):
    """Both: an evaluation's 0.1 s set-up and a save's 0.1 s."""


@pytest.mark.parametrize("work", ["evaluate", "save", "best"])
def test_a_log_and_an_evaluation_or_a_save_a_callback_after_ours_decides_are_seen(
    tmp_path: Path, work: str
) -> None:
    # the Trainer's own schedule never logs (logging_steps past the run's end), never saves nor evaluates:
    # the late callback logs every 3 steps and evaluates (0.1 s set-up + 8 batches) or saves (0.1 s) after
    # step 9's log; "best": the Trainer evaluates at 9 (announced) and saves (0.1 s) after it, for a best
    # loss. The window ends at 6: throughput/* was logged nowhere (the flags came after our on_step_end),
    # and the work after step 9 was in the interval logged at 12 (a save: 46 vs 219 samples/s)
    step_sleep = 0.05
    before, after = Marks(), Marks()
    late, trainer_class, schedule = LateFlags(3), SlowToEvaluateAndSave, {"save_strategy": "no"}
    if work == "best":
        schedule = {"save_strategy": "best", "metric_for_best_model": "loss", "eval_strategy": "steps"}
    else:
        late = LateFlags(3, **{work: (9,)})
    trainer = train(
        tmp_path, SleepyRegressor(step_sleep, 0.0, tiny_ops=2), report_to=(),
        callbacks=[before, quiet(profile_step=0, flops_audit=0), late, after], trainer_class=trainer_class,
        datasets={"train_dataset": Pairs(64), "eval_dataset": Pairs(8 * BATCH)}, max_steps=18,
        logging_steps=100, per_device_eval_batch_size=BATCH, eval_steps=9, **schedule,
    )  # fmt: skip
    assert sorted(before.log) == [3, 6, 9, 12, 15, 18]
    rates = dict(logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC))
    assert sorted(rates) == [9, 12, 15, 18] and window_end(0, 1) == 6  # the window's end logs no interval
    # each interval's seconds lie between what the two stopwatches read around our logs (ours in the
    # Trainer's log, between theirs); at 12, from the work's end (our resume) to the log
    done = "evaluate" if work == "evaluate" else "save"
    worked_before, worked_after = getattr(before, done)[9], getattr(after, done)[9]
    assert worked_before - after.log[9] > 0.09  # the work took more than half the interval's training
    for step in (12, 15):  # (18's: to the pause of its evaluation, announced where it is "best")
        shortest, longest = before.log[step] - after.log[step - 3], after.log[step] - before.log[step - 3]
        if step == 12:
            shortest, longest = before.log[12] - worked_after, after.log[12] - worked_before
        assert 3 * BATCH / longest <= rates[step] <= 3 * BATCH / shortest, step


def test_an_evaluation_a_callback_after_ours_decides_at_the_windows_end_is_out_of_the_first_interval(
    tmp_path: Path,
) -> None:
    """The meter starts at the window's end, in our on_step_end at step 6, and a callback after ours then
    asks for an evaluation (0.1 s set-up + 8 batches of a 0.05 s step's): no step of the meter's had ended,
    so the pause found no step's end to start from and the evaluation was metered (27 vs 125 samples/s)."""
    step_sleep = 0.05
    before, after = Marks(), Marks()
    trainer = train(
        tmp_path, SleepyRegressor(step_sleep, 0.0, tiny_ops=2), report_to=(),
        callbacks=[before, quiet(profile_step=0, flops_audit=0), LateFlags(3, evaluate=(6,)), after],
        trainer_class=SlowToStartEvaluation, per_device_eval_batch_size=BATCH, max_steps=12,
        logging_steps=100, datasets={"train_dataset": Pairs(64), "eval_dataset": Pairs(8 * BATCH)},
    )  # fmt: skip
    rates = dict(logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC))
    assert sorted(rates) == [9, 12] and window_end(0, 1) == 6
    # from the evaluation's end (our resume, which the meter's start precedes) to the log at 9
    shortest, longest = before.log[9] - after.evaluate[6], after.log[9] - before.evaluate[6]
    assert 3 * BATCH / longest <= rates[9] <= 3 * BATCH / shortest


@pytest.mark.parametrize("work", ["evaluate", "save"])
def test_an_evaluation_or_a_save_a_callback_after_ours_decides_inside_the_window_is_neither_data_nor_wall(
    tmp_path: Path, work: str
) -> None:
    """As with the Trainer's own schedule: out of the clean steps' data wait and wall step, though no event
    announced it before it ran (it read as the next step's data: "bound by the input pipeline")."""
    every_step = LateFlags(1000, **{work: range(1000)})
    trainer_class = SlowToStartEvaluation if work == "evaluate" else SlowToSave
    metrics = held_out(tmp_path, trainer_class, after=(every_step,), per_device_eval_batch_size=BATCH)
    assert metrics[names.DATA_LATENCY] < 0.05 and metrics[names.WALL_LATENCY] < 0.05, metrics


class SlowToLog(TrainerCallback):
    """A reporting backend that takes a while to write each log (an MLflow server, a W&B upload): before
    ours in the list, as the Trainer puts the ``report_to`` backends."""

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(SLEEP)


def test_a_backends_writing_of_each_steps_log_is_the_steps_other_not_the_next_ones_data(
    tmp_path: Path,
) -> None:
    model = SleepyRegressor(0.0, 0.0, tiny_ops=2)
    callback = quiet(profile_step=1, clean_steps=2)
    train(
        tmp_path, model, [SlowToLog(), callback], report_to=(), datasets={"train_dataset": Pairs(64)},
        max_steps=window_end(1, 2), logging_steps=1,
    )  # fmt: skip
    metrics = callback.result.metrics()
    assert metrics[names.DATA_LATENCY] < SLEEP / 2, metrics  # it read as the next step's wait for data
    assert metrics[names.WALL_LATENCY] > SLEEP, metrics  # in the wall step: its other


def test_epoch_logging_logs_throughput_at_every_epoch_end_after_the_window(tmp_path: Path) -> None:
    # 16 sequences in batches of 4: epochs end at steps 4, 8, 12 and 16; the window ends at 8
    callback = quiet()
    trainer = train(
        tmp_path, gpt2(), [callback], report_to=(), datasets={"train_dataset": TokenDataset(16)},
        max_steps=-1, num_train_epochs=4, logging_strategy="epoch",
    )  # fmt: skip
    assert [step for step, _ in losses(trainer)] == [4, 8, 12, 16]
    assert [step for step, _ in logged(trainer, names.FWD_FLOPS)] == [WINDOW_END] == [8]
    rates = logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC)
    assert [step for step, _ in rates] == [12, 16]
    flops_per_sample = callback.result.profile.model_flops / BATCH
    for (_, rate), (_, tokens), (_, flops) in zip(
        rates,
        logged(trainer, names.THROUGHPUT_TOKENS_PER_SEC),
        logged(trainer, names.THROUGHPUT_FLOPS_PER_SEC),
        strict=True,
    ):
        assert rate > 0
        assert tokens == pytest.approx(SEQ * rate, rel=1e-9)
        assert flops == pytest.approx(flops_per_sample * rate, rel=1e-9)


def test_a_run_that_never_logs_warns_once_at_train_start(tmp_path: Path) -> None:
    callback = quiet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_step = WarningsAtFirstStep(caught)
        trainer = train(tmp_path, gpt2(), [first_step, callback], report_to=(), logging_strategy="no")
    (message,) = [str(w.message) for w in caught if "logging_strategy" in str(w.message)]
    assert first_step.seen == [message]
    assert "logging_strategy='no'" in message and "throughput=False" in message
    assert logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC) == []
    # the profile itself is still in the history (Trainer.log appends whatever the strategy)
    assert [step for step, _ in logged(trainer, names.FWD_FLOPS)] == [WINDOW_END]
    assert losses(trainer) == []


# --- reuse: a second train() and a second Trainer --------------------------------------------------------


def test_a_second_train_and_a_second_trainer_profile_again(tmp_path: Path) -> None:
    callback = quiet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path / "first", gpt2(), [callback], report_to=())
        trainer.train()
        first = callback.result
        trainer.train()  # a new run of the same Trainer: state.global_step starts at 0 again
        again = callback.result
        other = train(tmp_path / "second", gpt2(), [callback], report_to=())
        second = callback.result
    assert [str(w.message) for w in caught if "HFFlopsCallback" in str(w.message)] == []
    assert first is not again and again is not second and first is not None
    for result in (first, again, second):
        assert (laid_out(result.steps), result.published_at) == (STEPS, WINDOW_END)
        profile = result.profile
        assert (profile.fwd_flops, profile.bwd_flops, profile.fwd_macs) == (
            first.profile.fwd_flops,
            first.profile.bwd_flops,
            first.profile.fwd_macs,
        )
        assert profile.bwd_flops > 0
    # each run's own history holds its profile once; each Trainer's output dir its report
    for run in (trainer, other):
        assert [step for step, _ in logged(run, names.FWD_FLOPS)] == [WINDOW_END]
        assert saved_profile(run)["metrics"][names.FWD_FLOPS] == first.profile.fwd_flops
        assert_nothing_left(run)


# --- the console: the report above the bar, no metrics dict line ----------------------------------------


@pytest.mark.parametrize("disable_tqdm", [False, True], ids=["progress bar", "printer"])
def test_the_console_gets_the_report_above_the_bar_and_no_metrics_dict(
    tmp_path: Path, disable_tqdm: bool
) -> None:
    console = io.StringIO()  # stdout and stderr together, as a terminal shows them
    with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
        trainer = train(tmp_path, gpt2(), [quiet(print_profile=True)], disable_tqdm=disable_tqdm)
    out = console.getvalue()
    # the Trainer's printer (ProgressCallback with the bar, PrinterCallback without) prints each log as
    # a dict: the losses are there, the profiler's metrics are not
    assert "'loss'" in out
    assert "'flops_profiler/" not in out and "'throughput/" not in out
    # TensorBoard still got them
    scalars = tensorboard_scalars(trainer.args.output_dir)
    assert [step for step, _ in scalars["train/" + names.FWD_FLOPS]] == [WINDOW_END]
    assert [step for step, _ in scalars["train/" + names.THROUGHPUT_SAMPLES_PER_SEC]] == [WINDOW_END + 1]
    # the report's first rule line begins a line of the terminal: written above the bar, not after it
    report = profile_file(trainer.args.output_dir, "txt").read_text()
    rule = next(line for line in report.splitlines() if line.startswith("---"))
    assert rule in re.split(r"[\r\n]", out)
    assert out.count(rule) == 1
    if not disable_tqdm:
        assert f"{WINDOW_END + 1}/{WINDOW_END + 1}" in out  # the bar ran to its end


# --- model variants -------------------------------------------------------------------------------------


def test_frozen_layers_make_backward_far_below_twice_forward(tmp_path: Path) -> None:
    model = llama()
    frozen = [model.model.embed_tokens, *model.model.layers[:3], model.lm_head]
    for module in frozen:
        module.requires_grad_(False)
    params = model.num_parameters()
    assert model.num_parameters(only_trainable=True) <= 0.25 * params  # 75% frozen
    callback = quiet()
    trainer = train(tmp_path, model, [callback], report_to=(), max_steps=WINDOW_END)
    profile = callback.result.profile
    assert profile.trainable_params == model.num_parameters(only_trainable=True)
    assert profile.bwd_flops < 0.6 * profile.fwd_flops  # not 2 x fwd: 3 of 4 layers need no backward
    assert profile.fwd_macs * 2 == dense_flops(trainer.model, backward=False)
    assert (profile.fwd_macs + profile.bwd_macs) * 2 == dense_flops(trainer.model, backward=True)
    for index in range(3):
        assert profile.modules[f"model.layers.{index}"].bwd_flops == 0
    assert profile.modules["model.layers.3"].bwd_flops > 0


def test_gradient_checkpointing_reports_recompute_apart(tmp_path: Path) -> None:
    plain = quiet()
    train(tmp_path / "plain", gpt2(), [plain], report_to=(), max_steps=WINDOW_END)
    peak = 3e10
    callback = quiet(peak_flops=peak)
    # activation_checkpointing: transformers 5's name for gradient_checkpointing (there a deprecated
    # alias; 4.x knows only the old name)
    new_name = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    checkpointing = {"activation_checkpointing" if new_name else "gradient_checkpointing": True}
    trainer = train(tmp_path / "checkpointed", gpt2(), [callback], max_steps=WINDOW_END, **checkpointing)
    profile, baseline = callback.result.profile, plain.result.profile
    assert (profile.fwd_flops, profile.fwd_macs, profile.bwd_macs) == (
        baseline.fwd_flops, baseline.fwd_macs, baseline.bwd_macs
    )  # fmt: skip
    # the layers' forwards run again in the backward (up to the last op whose saved output the backward
    # needs: torch's non-reentrant checkpoint stops there), booked as recompute, not as fwd or bwd
    layers_fwd = sum(profile.modules[f"transformer.h.{i}"].fwd_flops for i in range(2))
    assert 0.5 * layers_fwd < profile.recompute_flops - baseline.recompute_flops <= layers_fwd
    # FlopCounterMode sees the checkpointed layers' recompute too, but not the fused attention
    # kernel's own recompute of QK^T (its math backend has none)
    recompute_macs = profile.recompute_macs - baseline.recompute_macs
    assert (profile.fwd_macs + profile.bwd_macs + recompute_macs) * 2 == dense_flops(
        trainer.model, backward=True
    )
    scalars = tensorboard_scalars(trainer.args.output_dir)
    ((step, value),) = scalars["train/" + names.RECOMPUTE_FLOPS]
    assert step == WINDOW_END and value == pytest.approx(profile.recompute_flops, rel=1e-6)

    # MFU counts model flops (fwd + bwd), HFU the hardware's (recompute too), against the given peak
    iter_latency = callback.result.iter_latency
    mfu = (profile.fwd_flops + profile.bwd_flops) / iter_latency / peak
    hfu = (profile.fwd_flops + profile.bwd_flops + profile.recompute_flops) / iter_latency / peak
    for name, expected in ((names.MFU, mfu), (names.HFU, hfu)):
        ((step, value),) = scalars["train/" + name]
        assert step == WINDOW_END and value == pytest.approx(expected, rel=1e-6)
    assert hfu > mfu
    report = profile_file(trainer.args.output_dir, "txt").read_text()
    assert "peak FLOPS per device (peak_flops argument):" in report
    assert f"{100 * mfu:.2f}%" in report and f"{100 * hfu:.2f}%" in report


# --- W&B: the offline run's transaction log ------------------------------------------------------------


def test_metrics_reach_the_wandb_run_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "flops-callbacks-test")
    wandb.teardown()  # wandb keeps the settings of an earlier run in this process (WANDB_DIR included)
    callback = quiet()
    train(tmp_path, gpt2(), [callback], report_to=("wandb",))
    wandb.finish()
    wandb.teardown()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    wandb_cli = Path(sys.executable).with_name("wandb")  # wandb's own reader of its transaction log
    inspect = [str(wandb_cli), "leet", "inspect", "--json", str(run_file)]
    lines = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.splitlines()
    history = [record["history"]["item"] for record in map(json.loads, lines) if record["type"] == "history"]
    metrics = callback.result.metrics()
    for name in names.ALL:
        (row,) = [row for row in history if "train/" + name in row]
        assert row["train/global_step"] == WINDOW_END
        assert row["train/" + name] == pytest.approx(metrics[name])
    (row,) = [row for row in history if names.PICTURE + "._type" in row]  # the picture, in the window's row
    assert row["train/global_step"] == WINDOW_END and "train/" + names.FWD_FLOPS in row
    (row,) = [row for row in history if "train/" + names.THROUGHPUT_SAMPLES_PER_SEC in row]
    assert row["train/global_step"] == WINDOW_END + 1
    loss_steps = [row["train/global_step"] for row in history if "train/loss" in row]
    assert loss_steps == list(range(1, WINDOW_END + 2))


# --- exceptions: propagate unchanged, nothing left behind (the full matrix: test_hf_faults.py) ----------


class Boom(RuntimeError):
    pass


class RaisingGPT2(GPT2LMHeadModel):
    """Raises in the forward, or in the backward, of its ``fail_call``-th call."""

    def __init__(self, config: GPT2Config, fail_call: int, in_backward: bool) -> None:
        super().__init__(config)
        self.calls, self.fail_call, self.in_backward, self.error = 0, fail_call, in_backward, Boom("boom")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        self.calls += 1
        failing = self.calls == self.fail_call
        if failing and not self.in_backward:
            raise self.error
        output = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if failing:
            output.loss = RaiseInBackward.apply(output.loss, self.raise_error)
        return output

    def raise_error(self) -> None:
        raise self.error


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_exception_in_the_counting_step_propagates_and_the_next_train_profiles(
    tmp_path: Path, in_backward: bool
) -> None:
    torch.manual_seed(0)
    model = RaisingGPT2(gpt2_config(), fail_call=PROFILE_STEP + 1, in_backward=in_backward)
    callback = quiet()
    trainer = make_trainer(tmp_path, model, [callback], report_to=())
    with pytest.raises(Boom) as raised:
        trainer.train()
    assert raised.value is model.error  # the same exception, not wrapped or replaced
    assert trainer.state.global_step == PROFILE_STEP
    assert callback.result is None
    assert_nothing_left(trainer)
    assert not list(Path(trainer.args.output_dir).rglob("flops_profile_*"))

    trainer.train()  # the next run profiles its window as usual
    assert callback.result is not None and laid_out(callback.result.steps) == STEPS
    assert callback.result.profile.bwd_flops > 0
    assert_nothing_left(trainer)


class RaiseBeforeOptimizerStep(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if state.global_step == PROFILE_STEP:
            raise Boom("in on_pre_optimizer_step")


def test_exception_after_the_backward_leaves_nothing_at_once(tmp_path: Path) -> None:
    callback = quiet()
    trainer = make_trainer(tmp_path, gpt2(), [RaiseBeforeOptimizerStep(), callback], report_to=())
    with pytest.raises(Boom, match="in on_pre_optimizer_step"):
        trainer.train()
    assert_nothing_left(trainer)  # not waiting for a next event of the callback
    trainer.remove_callback(RaiseBeforeOptimizerStep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert [str(w.message) for w in caught if "HFFlopsCallback" in str(w.message)] == []
    assert callback.result is not None and laid_out(callback.result.steps) == STEPS
    assert_nothing_left(trainer)


# --- resuming past the profiled step, runs that never reach it ------------------------------------------


def test_resuming_past_profile_step_warns_at_train_start_whether_or_not_it_was_profiled(
    tmp_path: Path,
) -> None:
    # the first runs end with the window: its metrics are in the checkpoint's log history
    save = {"save_strategy": "steps", "save_steps": WINDOW_END, "max_steps": WINDOW_END, "report_to": ()}
    resume = {"max_steps": WINDOW_END + 1, "report_to": ()}
    train(tmp_path / "plain", gpt2(), [], **save)
    train(tmp_path / "profiled", gpt2(), [quiet()], **save)
    expected = {
        "plain": f"resumed at step {WINDOW_END}, past profile_step={PROFILE_STEP}: no profile runs",
        # its log history says a window's metrics were logged, not at which step the window ran
        "profiled": f"resumed at step {WINDOW_END}, a window ran before the checkpoint (flops_profile_step",
    }
    for run, message in expected.items():
        callback = quiet()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first_step = WarningsAtFirstStep(caught)
            make_trainer(tmp_path / run, gpt2(), [first_step, callback], **resume).train(
                resume_from_checkpoint=True
            )
        (warning,) = [w for w in caught if "HFFlopsCallback" in str(w.message)]
        assert message in str(warning.message) and issubclass(warning.category, UserWarning)
        assert first_step.seen == [str(warning.message)]
        assert callback.result is None


def test_a_run_resumed_past_its_window_logs_throughput_with_the_windows_flops(tmp_path: Path) -> None:
    """A run resumed after its profiled window meters from its first step (counted, out of the metered
    time): ``throughput/*`` at each logging step after it, each step's flops those the window counted."""
    save = {"save_strategy": "steps", "save_steps": WINDOW_END, "max_steps": WINDOW_END, "report_to": ()}
    first = quiet()
    train(tmp_path, gpt2(), [first], **save)
    assert first.result is not None
    per_step = first.result.profile.fwd_flops + first.result.profile.bwd_flops  # model flops, one device
    callback, end = quiet(), WINDOW_END + 6
    trainer = make_trainer(tmp_path, gpt2(), [callback], report_to=(), max_steps=end)
    trainer.train(resume_from_checkpoint=True)
    assert callback.result is None and leftovers(trainer) == []
    rates = dict(logged(trainer, names.THROUGHPUT_SAMPLES_PER_SEC))
    flops = dict(logged(trainer, names.THROUGHPUT_FLOPS_PER_SEC))
    # logged at every step (the checkpoint's logging_steps=1) but the first: its interval has no step
    assert sorted(rates) == sorted(flops) == list(range(WINDOW_END + 2, end + 1))
    for step, rate in rates.items():
        assert flops[step] / rate == pytest.approx(per_step / BATCH, rel=1e-12), step


def test_profile_step_beyond_the_run_warns_once_at_train_start(tmp_path: Path) -> None:
    callback = HFFlopsCallback(profile_step=50, print_profile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_step = WarningsAtFirstStep(caught)
        trainer = train(tmp_path, gpt2(), [first_step, callback], report_to=())
    (warning,) = [w for w in caught if "HFFlopsCallback" in str(w.message)]
    message = str(warning.message)
    assert first_step.seen == [message]  # said before the run, once
    assert "profile_step=50 is never reached" in message
    assert f"the run has {WINDOW_END + 1} optimizer steps" in message
    assert callback.result is None
    assert_nothing_left(trainer)


# --- data parallel: two processes ----------------------------------------------------------------------


def test_ddp_two_processes_report_data_parallel_size_from_world_process_zero(tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    # the worker runs this file as __main__: the checkout on the path makes `tests` importable
    path = os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    run = run_bounded([*launcher, __file__, str(tmp_path)], timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(f"Profile Summary at step {PROFILE_STEP}") == 1  # world process zero only
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # every rank profiled its window; the gathered latencies are the same everywhere, the slowest reported
    assert ranks[0]["ranks"] == ranks[1]["ranks"] and len(ranks[0]["ranks"]) == 2
    slowest = held_back(ranks[0]["ranks"], ranks[0]["metrics"])
    for rank in ranks:
        assert ParallelSizes(**rank["parallel"]) == ParallelSizes(world_size=2, data_parallel=2)
        assert rank["published_at"] == DDP_END and rank["clean"] == CLEAN_STEPS  # the window whole
        metrics = rank["metrics"]
        assert [metrics[n] for n in (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY)] == slowest
        assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(2 * BATCH / metrics[names.ITER_LATENCY])
        model_flops = metrics[names.FWD_FLOPS] + metrics[names.BWD_FLOPS]
        assert metrics[names.MFU] == pytest.approx(model_flops / metrics[names.ITER_LATENCY] / 1e9)
    output_dir = str(tmp_path / "out")
    saved = json.loads(profile_file(output_dir, "json").read_text())
    assert saved["metrics"] == ranks[0]["metrics"]
    scalars = tensorboard_scalars(output_dir)  # written by world process zero's TensorBoardCallback
    for name in names.ALL + names.WITH_PEAK + names.COMM:  # the communication step's too
        ((step, value),) = scalars["train/" + name]  # one set of metrics: rank 1 logged none
        assert step == DDP_END and value == pytest.approx(ranks[0]["metrics"][name], rel=1e-6)
    report = profile_file(output_dir, "txt").read_text()
    lines = dict(line.split(":", 1) for line in report.splitlines() if ":" in line)
    assert [lines[k].strip() for k in ("world size", "data parallel size", "model parallel size")] == [
        "2",
        "2",
        "1",
    ]
    low, high = sorted(map(sum, ranks[0]["ranks"]))
    spread = lines["each rank's own median iter latency over 2 ranks, min .. max"]
    assert spread.split() == [*duration_to_string(low).split(), "..", *duration_to_string(high).split()]


def ddp_worker(directory: Path) -> None:
    """One process of the DDP test: trains on CPU with gloo and saves what its callback saw."""
    callback = HFFlopsCallback(
        profile_step=PROFILE_STEP, clean_steps=CLEAN_STEPS, peak_flops=1e9, comm_steps=COMM_MIN
    )  # a fixed window: its end is known
    trainer = train(directory, gpt2(), [callback], ddp_backend="gloo", max_steps=DDP_END)
    result = callback.result
    seen = {
        "clean": len(result.steps.clean),
        "parallel": vars(result.parallel),
        "metrics": result.metrics(),
        "ranks": result.rank_latencies,
        "published_at": result.published_at,
    }
    (directory / f"rank{trainer.args.process_index}.json").write_text(json.dumps(seen))
    end_process()  # the Trainer leaves the group up: no teardown to abort in (support.end_process)


# --- bad input, missing transformers --------------------------------------------------------------------


def test_missing_transformers_says_what_to_install() -> None:
    code = "import sys; sys.modules['transformers'] = None; import flops_callbacks.integrations.hf"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert run.returncode != 0
    assert (
        "ImportError: HFFlopsCallback needs transformers: pip install transformers accelerate" in run.stderr
    )


# --- parallel sizes from transformers / accelerate -----------------------------------------------------


def test_parallel_sizes_of_a_single_process_run_are_all_one() -> None:
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    assert parallel_sizes(args, gpt2()) == ParallelSizes()


def test_parallel_sizes_from_accelerate_parallelism_config() -> None:
    # accelerate added ParallelismConfig in 1.10; the extra's floor (1.0) has none to read
    ParallelismConfig = pytest.importorskip("accelerate.parallelism_config").ParallelismConfig
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=2)
    args = SimpleNamespace(world_size=16, parallelism_config=config)
    assert parallel_sizes(args) == ParallelSizes(
        world_size=16, data_parallel=4, tensor_parallel=2, pipeline_parallel=1, context_parallel=2
    )


def test_parallel_sizes_from_deepspeed_autotp_and_megatron_plugins() -> None:
    args = SimpleNamespace(world_size=8, parallelism_config=None)
    config = {"tensor_parallel": {"autotp_size": 2}, "train_batch_size": "auto"}
    state = SimpleNamespace(deepspeed_plugins={"default": SimpleNamespace(deepspeed_config=config)})
    expected = ParallelSizes(world_size=8, data_parallel=4, tensor_parallel=2)
    assert parallel_sizes(args, None, state) == expected
    state = SimpleNamespace(megatron_lm_plugin=SimpleNamespace(tp_degree=2, pp_degree=2))
    assert parallel_sizes(args, None, state) == ParallelSizes(
        world_size=8, data_parallel=2, tensor_parallel=2, pipeline_parallel=2
    )


def test_parallel_sizes_from_the_models_distributed_config() -> None:
    # transformers 5 added the model's DistributedConfig
    DistributedConfig = pytest.importorskip("transformers.distributed").DistributedConfig

    model = gpt2()
    model.config.distributed_config = DistributedConfig(tp_size=4)
    args = SimpleNamespace(world_size=8)
    assert parallel_sizes(args, model) == ParallelSizes(world_size=8, data_parallel=2, tensor_parallel=4)


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
