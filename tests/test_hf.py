"""HFFlopsCallback on a real transformers.Trainer (CPU, tiny models built from configs, synthetic data).

Flop counts are checked against an independent count: FlopCounterMode with SDPA's math backend
counts the dense ops (matmuls, attention) of the same micro-batch, which must equal our MACs x 2.
Metrics are read back from the files the Trainer's own reporting callbacks write.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
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
    TrainingArguments,
)

from flops_callbacks import FlopsProfiler
from flops_callbacks import metrics as names
from flops_callbacks.hf import HFFlopsCallback, parallel_sizes
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.units import duration_to_string

PROFILE_STEP = 2
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
    return HFFlopsCallback(profile_step=PROFILE_STEP, print_profile=False, **kwargs)


def make_trainer(
    tmp_path: Path,
    model: torch.nn.Module,
    callbacks: list[TrainerCallback],
    report_to: tuple[str, ...] = ("tensorboard",),
    **overrides: Any,
) -> Trainer:
    settings = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "max_steps": PROFILE_STEP + 2,
        "per_device_train_batch_size": BATCH,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": list(report_to),
        "disable_tqdm": True,
        "seed": 0,
    }
    args = TrainingArguments(**{**settings, **overrides})
    return Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=callbacks)


def train(tmp_path: Path, model: torch.nn.Module, callbacks: list[TrainerCallback], **kwargs: Any) -> Trainer:
    trainer = make_trainer(tmp_path, model, callbacks, **kwargs)
    trainer.train()
    return trainer


def saved_profile(trainer: Trainer) -> dict[str, Any]:
    return json.loads((Path(trainer.args.output_dir) / f"flops_profile_step{PROFILE_STEP}.json").read_text())


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


def hooks_on(model: torch.nn.Module) -> int:
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return sum(len(getattr(module, kind)) for module in model.modules() for kind in kinds)


def assert_nothing_left(trainer: Trainer) -> None:
    assert hooks_on(trainer.model) == 0
    assert not _get_current_dispatch_mode_stack()
    assert not _get_current_function_mode_stack()
    assert "training_step" not in vars(trainer)


# --- TensorBoard: the Trainer's own event files -------------------------------------------------------


def test_metrics_reach_tensorboard_once_at_the_profiled_step_and_losses_are_unchanged(tmp_path: Path) -> None:
    callback = quiet()
    profiled = train(tmp_path / "with", gpt2(), [callback])
    plain = train(tmp_path / "without", gpt2(), [])

    scalars = tensorboard_scalars(profiled.args.output_dir)
    metrics = saved_profile(profiled)["metrics"]
    assert set(metrics) == set(names.ALL)  # tokens_per_sec too: input_ids are counted by default
    for name in names.ALL:
        ((step, value),) = scalars["train/" + name]  # the Trainer's TensorBoardCallback prefixes train/
        assert step == PROFILE_STEP
        assert value == pytest.approx(metrics[name], rel=1e-6)  # event files hold float32
    assert [e for e in profiled.state.log_history if names.FWD_FLOPS in e] == [
        {**metrics, "epoch": pytest.approx(PROFILE_STEP * BATCH / len(TokenDataset())), "step": PROFILE_STEP}
    ]

    # the loss is logged at the same steps with the same values as without the callback
    assert losses(profiled) == losses(plain)
    assert [s for s, _ in losses(profiled)] == list(range(1, PROFILE_STEP + 3))
    assert scalars["train/loss"] == tensorboard_scalars(plain.args.output_dir)["train/loss"]

    # flops: the dense part equals an independent count of one micro-batch, exactly (the fused attention
    # backward's recompute of QK^T is in recompute_macs: the math backend does not recompute)
    profile = callback.result.profile
    assert profile.fwd_macs * 2 == dense_flops(profiled.model, backward=False)
    assert (profile.fwd_macs + profile.bwd_macs) * 2 == dense_flops(profiled.model, backward=True)
    assert profile.fwd_flops > profile.fwd_macs * 2  # plus the elementwise ops (norms, gelu, softmax, loss)
    assert metrics[names.FWD_FLOPS] == profile.fwd_flops
    assert metrics[names.BWD_FLOPS] == profile.bwd_flops

    # the step's own numbers
    result = callback.result
    assert (result.samples, result.tokens, result.micro_batches) == (BATCH, BATCH * SEQ, 1)
    assert result.parallel == ParallelSizes()
    assert metrics[names.ITER_LATENCY] == pytest.approx(
        metrics[names.FWD_LATENCY] + metrics[names.BWD_LATENCY] + metrics[names.STEP_LATENCY]
    )
    assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(BATCH / metrics[names.ITER_LATENCY])
    assert min(metrics[n] for n in (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY)) > 0

    # the report, written next to the run, with the Trainer's own estimate (what total_flos sums)
    report = (Path(profiled.args.output_dir) / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    assert f"Profile Summary at step {PROFILE_STEP}:" in report
    estimate = 6 * BATCH * SEQ * profiled.model.num_parameters(exclude_embeddings=True)
    assert estimate == profiled.floating_point_ops(micro_batch())
    difference = (profile.fwd_flops + profile.bwd_flops - estimate) / estimate * 100
    assert "measured fwd + bwd flops vs Trainer's estimate:" in report
    assert f"{difference:+.1f}%" in report
    assert_nothing_left(profiled)


# --- what the step covers ------------------------------------------------------------------------------


class Probe(TrainerCallback):
    """A user's callback: records the model's hook count at each optimizer step and every on_log."""

    def __init__(self) -> None:
        self.hooks: dict[int, int] = {}
        self.logs: list[tuple[int, dict[str, float]]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.hooks[state.global_step] = hooks_on(model)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append((state.global_step, dict(logs)))


def test_gradient_accumulation_profiles_every_micro_batch_and_hooks_only_that_step(tmp_path: Path) -> None:
    seen: list[Any] = []

    def batch_size(inputs: Any) -> int:
        seen.append(inputs)
        return int(inputs["input_ids"].shape[0])

    before, callback, after = Probe(), quiet(batch_size_fn=batch_size), Probe()
    trainer = train(tmp_path, gpt2(), [before, callback, after], gradient_accumulation_steps=2)
    result = callback.result
    assert (result.micro_batches, result.samples, result.tokens) == (2, 2 * BATCH, 2 * BATCH * SEQ)
    # the profiled step's 2 micro-batches as the model's keyword arguments: the Trainer's inputs
    # (+ num_items_in_batch, for the loss); then the 2 of the last step, for the throughput meter
    assert len(seen) == 4 and all({"input_ids", "labels"} <= set(inputs) for inputs in seen)
    profile = result.profile
    assert profile.fwd_macs * 2 == 2 * dense_flops(trainer.model, backward=False)
    assert (profile.fwd_macs + profile.bwd_macs) * 2 == 2 * dense_flops(trainer.model, backward=True)
    assert profile.modules[""].calls == 2  # the model ran twice in the step
    assert saved_profile(trainer)["metrics"][names.SAMPLES_PER_SEC] == pytest.approx(
        2 * BATCH / result.iter_latency
    )
    # hooks on the model during the profiled step only
    assert after.hooks[PROFILE_STEP] > 0
    assert all(count == 0 for step, count in after.hooks.items() if step != PROFILE_STEP)
    # the user's other callbacks, before and after ours in the list, get the metrics in on_log, once
    for probe in (before, after):
        (logged,) = [(step, logs) for step, logs in probe.logs if names.FWD_FLOPS in logs]
        assert logged[0] == PROFILE_STEP
        assert {k: v for k, v in logged[1].items() if k in names.ALL} == result.metrics()
    assert_nothing_left(trainer)


class StepClock(Probe):
    """After HFFlopsCallback in the list: when each step ends, by the global step after it."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ended[state.global_step] = time.perf_counter()


def test_throughput_is_logged_at_every_later_logging_step_from_measured_flops(tmp_path: Path) -> None:
    # 22 sequences in batches of 4: the last step of each epoch (steps 5 and 11) has 2, a new shape
    peak, clock = 3e10, StepClock()
    callback = quiet(peak_flops=peak)
    trainer = Trainer(
        model=gpt2(),
        args=TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=12, per_device_train_batch_size=BATCH,
            logging_steps=3, save_strategy="no", report_to=["tensorboard"], disable_tqdm=True, seed=0,
        ),
        train_dataset=TokenDataset(22),
        callbacks=[callback, clock],
    )  # fmt: skip
    trainer.train()

    # the 2-sequence shape was measured once, on its own step, and counted the same as a profile of it
    ids = TokenDataset().ids[:2]
    # as the Trainer calls the model: the loss summed and divided by the step's label count
    short = {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(2 * (SEQ - 1))}
    flops = {BATCH: callback.result.profile.model_flops, 2: profiled_flops(trainer.model, short)}
    assert sorted(callback.meter.flops_per_micro_batch.values()) == sorted(flops.values())
    # hooks at the optimizer step only in the profiled step (the measuring ones end with training_step)
    assert {step for step, hooks in clock.hooks.items() if hooks} == {PROFILE_STEP}
    assert_nothing_left(trainer)

    scalars = tensorboard_scalars(trainer.args.output_dir)
    logged = {
        step: {name: dict(scalars["train/" + name])[step] for name in names.THROUGHPUT}
        for step, _ in scalars["train/" + names.THROUGHPUT_SAMPLES_PER_SEC]
    }
    assert sorted(logged) == [6, 9, 12]  # every logging step after the profiled one
    sizes = {step: 2 if step in (5, 11) else BATCH for step in range(12)}
    previous = PROFILE_STEP + 1
    for step, values in sorted(logged.items()):
        counted = [s for s in range(previous, step) if s != 5]  # the measuring step is left out
        samples = sum(sizes[s] for s in counted)
        model_flops = sum(flops[sizes[s]] for s in counted)
        rate = values[names.THROUGHPUT_SAMPLES_PER_SEC]
        assert values[names.THROUGHPUT_FLOPS_PER_SEC] / rate == pytest.approx(model_flops / samples, rel=1e-5)
        assert values[names.THROUGHPUT_TOKENS_PER_SEC] == pytest.approx(SEQ * rate, rel=1e-5)
        assert values[names.THROUGHPUT_MFU] == pytest.approx(
            values[names.THROUGHPUT_FLOPS_PER_SEC] / peak, 1e-5
        )
        if previous > PROFILE_STEP + 1:  # as in the Lightning test: both clocks include one log write
            assert 5 not in range(previous, step)
            assert rate == pytest.approx(samples / (clock.ended[step] - clock.ended[previous]), rel=0.2)
        previous = step
    # the loss is logged as without the callback, beside its own entries
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [3, 6, 9, 12]


class SlowEvaluation(TrainerCallback):
    def on_prediction_step(self, args, state, control, **kwargs) -> None:
        time.sleep(0.1)


def test_evaluation_time_is_left_out_of_throughput(tmp_path: Path) -> None:
    # evaluation (2 batches, 0.2 s) runs after the logs of steps 3 and 6: inside the interval logged at 9
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=9, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, logging_steps=3, eval_strategy="steps", eval_steps=3,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    callbacks = [quiet(), SlowEvaluation()]
    trainer = Trainer(
        gpt2(), args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(2 * BATCH), callbacks=callbacks
    )
    trainer.train()
    history = trainer.state.log_history
    assert [e["step"] for e in history if "eval_loss" in e] == [3, 6, 9]
    logged = [
        (e["step"], e[names.THROUGHPUT_SAMPLES_PER_SEC])
        for e in history
        if names.THROUGHPUT_SAMPLES_PER_SEC in e
    ]
    assert [step for step, _ in logged] == [6, 9]
    assert logged[1][1] > 3 * BATCH / 0.2  # 3 steps of BATCH samples; 0.2 s of evaluation in between


def profiled_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Model flops (fwd + bwd) of one training micro-batch, from the core profiler directly."""
    model.train()
    with FlopsProfiler(model) as profiler:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return profiler.get_profile().model_flops


def test_frozen_layers_make_backward_far_below_twice_forward(tmp_path: Path) -> None:
    model = llama()
    frozen = [model.model.embed_tokens, *model.model.layers[:3], model.lm_head]
    for module in frozen:
        module.requires_grad_(False)
    params = model.num_parameters()
    assert model.num_parameters(only_trainable=True) <= 0.25 * params  # 75% frozen
    callback = quiet()
    trainer = train(tmp_path, model, [callback])
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
    train(tmp_path / "plain", gpt2(), [plain])
    peak = 3e10
    callback = quiet(peak_flops=peak)
    # activation_checkpointing: transformers 5's name for gradient_checkpointing (a deprecated alias)
    trainer = train(tmp_path / "checkpointed", gpt2(), [callback], activation_checkpointing=True)
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
    assert step == PROFILE_STEP and value == pytest.approx(profile.recompute_flops, rel=1e-6)

    # MFU counts model flops (fwd + bwd), HFU the hardware's (recompute too), against the given peak
    iter_latency = callback.result.iter_latency
    mfu = (profile.fwd_flops + profile.bwd_flops) / iter_latency / peak
    hfu = (profile.fwd_flops + profile.bwd_flops + profile.recompute_flops) / iter_latency / peak
    for name, expected in ((names.MFU, mfu), (names.HFU, hfu)):
        ((step, value),) = scalars["train/" + name]
        assert step == PROFILE_STEP and value == pytest.approx(expected, rel=1e-6)
    assert hfu > mfu
    report = (Path(trainer.args.output_dir) / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
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
        assert row["train/global_step"] == PROFILE_STEP
        assert row["train/" + name] == pytest.approx(metrics[name])
    loss_steps = [row["train/global_step"] for row in history if "train/loss" in row]
    assert loss_steps == list(range(1, PROFILE_STEP + 3))


# --- exceptions: propagate unchanged, nothing left behind ----------------------------------------------


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
            output.loss = RaiseInBackward.apply(output.loss, self.error)
        return output


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: Exception) -> torch.Tensor:
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise ctx.error


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_exception_in_profiled_step_propagates_and_leaves_nothing(tmp_path: Path, in_backward: bool) -> None:
    torch.manual_seed(0)
    model = RaisingGPT2(gpt2_config(), fail_call=PROFILE_STEP + 1, in_backward=in_backward)
    callback = quiet()
    trainer = make_trainer(tmp_path, model, [callback], report_to=())
    with pytest.raises(Boom) as raised:
        trainer.train()
    assert raised.value is model.error  # the same exception, not wrapped or replaced
    assert trainer.state.global_step == PROFILE_STEP
    assert not callback.profiler.active and callback.result is None
    assert_nothing_left(trainer)
    assert not list(Path(trainer.args.output_dir).glob("flops_profile_*"))

    trainer.train()  # the next run profiles its step as usual
    assert callback.result is not None and callback.result.micro_batches == 1
    assert_nothing_left(trainer)


class RaiseBeforeOptimizerStep(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if state.global_step == PROFILE_STEP:
            raise Boom("in on_pre_optimizer_step")


def test_exception_after_the_backward_is_cleaned_up_by_the_next_event(tmp_path: Path) -> None:
    callback = quiet()
    trainer = make_trainer(tmp_path, gpt2(), [RaiseBeforeOptimizerStep(), callback], report_to=())
    with pytest.raises(Boom):
        trainer.train()
    assert callback.profiler.active  # documented: the Trainer has no event that tells us
    trainer.remove_callback(RaiseBeforeOptimizerStep)
    with pytest.warns(UserWarning, match="did not finish"):
        trainer.train()
    assert callback.result is not None
    assert_nothing_left(trainer)


# --- resuming past the profiled step --------------------------------------------------------------------


def test_resuming_past_profile_step_says_whether_it_was_profiled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save = {"save_strategy": "steps", "save_steps": PROFILE_STEP + 1, "max_steps": PROFILE_STEP + 1}
    resume = {"max_steps": PROFILE_STEP + 2, "report_to": ()}
    train(tmp_path / "plain", gpt2(), [], report_to=(), **save)
    callback = quiet()
    with pytest.warns(
        UserWarning, match=f"resumed at step {PROFILE_STEP + 1}, past profile_step={PROFILE_STEP}"
    ):
        make_trainer(tmp_path / "plain", gpt2(), [callback], **resume).train(resume_from_checkpoint=True)
    assert callback.result is None

    train(tmp_path / "profiled", gpt2(), [quiet()], report_to=(), **save)
    callback = quiet()
    with caplog.at_level(logging.INFO, logger="flops_callbacks.hf"):
        make_trainer(tmp_path / "profiled", gpt2(), [callback], **resume).train(resume_from_checkpoint=True)
    assert f"step {PROFILE_STEP} was profiled before the checkpoint" in caplog.text
    assert callback.result is None


# --- data parallel: two processes ----------------------------------------------------------------------


def test_ddp_two_processes_report_data_parallel_size_from_world_process_zero(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(f"Profile Summary at step {PROFILE_STEP}") == 1  # world process zero only
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # every rank profiled its step; the gathered latencies are the same everywhere, the slowest reported
    assert ranks[0]["ranks"] == ranks[1]["ranks"] and len(ranks[0]["ranks"]) == 2
    slowest = max(ranks[0]["ranks"], key=sum)
    for rank in ranks:
        assert ParallelSizes(**rank["parallel"]) == ParallelSizes(world_size=2, data_parallel=2)
        metrics = rank["metrics"]
        assert [metrics[n] for n in (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY)] == slowest
        assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(2 * BATCH / metrics[names.ITER_LATENCY])
        model_flops = metrics[names.FWD_FLOPS] + metrics[names.BWD_FLOPS]
        assert metrics[names.MFU] == pytest.approx(model_flops / metrics[names.ITER_LATENCY] / 1e9)
    output_dir = str(tmp_path / "out")
    saved = json.loads((Path(output_dir) / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert saved["metrics"] == ranks[0]["metrics"]
    scalars = tensorboard_scalars(output_dir)  # written by world process zero's TensorBoardCallback
    for name in names.ALL + names.WITH_PEAK:
        ((step, value),) = scalars["train/" + name]  # one set of metrics: rank 1 logged none
        assert step == PROFILE_STEP and value == pytest.approx(ranks[0]["metrics"][name], rel=1e-6)
    report = (Path(output_dir) / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    lines = dict(line.split(":", 1) for line in report.splitlines() if ":" in line)
    assert [lines[k].strip() for k in ("world size", "data parallel size", "model parallel size")] == [
        "2",
        "2",
        "1",
    ]
    low, high = sorted(map(sum, ranks[0]["ranks"]))
    spread = lines["iter latency over 2 ranks, min .. max (slowest shown)"]
    assert spread.split() == [*duration_to_string(low).split(), "..", *duration_to_string(high).split()]


def ddp_worker(directory: Path) -> None:
    """One process of the DDP test: trains on CPU with gloo and saves what its callback saw."""
    callback = HFFlopsCallback(profile_step=PROFILE_STEP, detailed=False, peak_flops=1e9)
    trainer = train(directory, gpt2(), [callback], ddp_backend="gloo")
    result = callback.result
    seen = {"parallel": vars(result.parallel), "metrics": result.metrics(), "ranks": result.rank_latencies}
    (directory / f"rank{trainer.args.process_index}.json").write_text(json.dumps(seen))
    # The Trainer leaves the group up; gloo's threads still running at interpreter exit can abort it.
    torch.distributed.destroy_process_group()
    # Even so, about one run in twenty aborted in interpreter teardown ("terminate called without an
    # active exception"), after everything above was written and no hook or mode was left: skip the
    # teardown, whose C++ destructors are not what this test is about.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- bad input, missing transformers, runs that never reach the step -----------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"profile_step": -1}, "profile_step"),
        ({"profile_step": "10"}, "profile_step"),
        ({"profile_step": True}, "profile_step"),
        ({"module_depth": -2}, "module_depth"),
        ({"top_modules": 0}, "top_modules"),
        ({"causal_attention": "quarter"}, "causal_attention"),
        ({"batch_size_fn": 4}, "batch_size_fn"),
        ({"tokens_fn": "input_ids"}, "tokens_fn"),
        ({"peak_flops": -1.0}, "peak_flops"),
        ({"peak_flops": True}, "peak_flops"),
        ({"throughput": "yes"}, "throughput"),
    ],
)
def test_bad_arguments_raise_at_construction_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        HFFlopsCallback(**kwargs)


def test_missing_transformers_says_which_extra_to_install() -> None:
    code = "import sys; sys.modules['transformers'] = None; import flops_callbacks.hf"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert run.returncode != 0
    assert "ImportError: HFFlopsCallback needs transformers: pip install 'flops-callbacks[hf]'" in run.stderr


def test_profile_step_beyond_the_run_warns_at_the_end(tmp_path: Path) -> None:
    callback = HFFlopsCallback(profile_step=50, print_profile=False)
    with pytest.warns(UserWarning, match="profile_step=50"):
        trainer = train(tmp_path, gpt2(), [callback])
    assert callback.result is None
    assert_nothing_left(trainer)


# --- parallel sizes from transformers / accelerate -----------------------------------------------------


def test_parallel_sizes_of_a_single_process_run_are_all_one() -> None:
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    assert parallel_sizes(args, gpt2()) == ParallelSizes()


def test_parallel_sizes_from_accelerate_parallelism_config() -> None:
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
    from transformers.distributed import DistributedConfig

    model = gpt2()
    model.config.distributed_config = DistributedConfig(tp_size=4)
    args = SimpleNamespace(world_size=8)
    assert parallel_sizes(args, model) == ParallelSizes(world_size=8, data_parallel=2, tensor_parallel=4)


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
