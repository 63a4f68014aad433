"""New batch shapes counted off the clock in real runs: a grouped-length HF Trainer run's window is the
counting step, the module-timing steps, the check and clean steps, each clean step's flops equal to an
offline count of its batch; a Lightning model whose work changes above a length keeps clean steps and
exact flops when later batches cross that length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.reporting.window_rows import module_source
from flops_callbacks.session.meter import LoggingInterval
from flops_callbacks.session.window_plan import CLEAN_MAX, MODULE_TIMING_STEPS
from tests.support import check_step, lightning_settings, module_steps

VOCAB, PAD = 101, 0


class Lengths(torch.utils.data.Dataset):
    """Token sequences of random lengths in 16..256 (labels = inputs)."""

    def __init__(self, size: int = 600) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 257, (size,), generator=generator)
        self.items = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


class PadToLongest:
    """Pads a batch to its longest sequence (attention mask, labels -100 on padding); keeps each batch."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), longest), PAD)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item["input_ids"])] = item["input_ids"]
            mask[row, : len(item["input_ids"])] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        self.batches.append(batch)
        return batch


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def _offline(trainer: Trainer, batch: dict[str, torch.Tensor]) -> int:
    """The batch's flops as run (fwd + bwd, padding included), counted by the engine on a real training
    step of a fresh model of the same config."""
    model = _gpt2().train()
    items = (batch["labels"] != -100).sum()
    tracer = CountingEngine(model)
    tracer.start()
    try:
        trainer.training_step(model, batch, items)
    finally:
        tracer.stop()
    counts = tracer.totals()[0]
    return counts.fwd_flops + counts.bwd_flops


def test_a_grouped_length_run_counts_its_new_shapes_off_the_clock(tmp_path: Path) -> None:
    profile_step = 10
    collator = PadToLongest()
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=60, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        train_sampling_strategy="group_by_length",
    )  # fmt: skip
    callback = HFFlopsCallback(profile_step=profile_step, print_profile=False)
    trainer = Trainer(_gpt2(), args, train_dataset=Lengths(), data_collator=collator, callbacks=[callback])
    trainer.train()
    result = callback.session.result
    assert result is not None and result.clean is not None and result.flops_sources is not None
    steps = result.steps
    assert steps.module_timing == module_steps(profile_step)
    assert steps.shape_counting == (check_step(profile_step),)  # the check alone: no shape-counting step
    assert steps.skipped == ()
    assert 3 <= len(steps.clean) <= CLEAN_MAX
    assert steps.clean == tuple(
        range(check_step(profile_step) + 1, check_step(profile_step) + 1 + len(steps.clean))
    )
    assert steps.clean[-1] - profile_step + 1 <= 1 + MODULE_TIMING_STEPS + 1 + CLEAN_MAX
    assert steps.shapes >= 10  # every clean step a length of its own, counted off the clock
    assert result.flops_sources.checked and result.flops_sources.uncertainty == 0
    assert result.flops_sources.on_steps == ""
    for number, step in zip(steps.clean, result.clean.steps, strict=True):  # each padded batch as run
        assert step.work.counts.run_flops == _offline(trainer, collator.batches[number]), number
    # the tree's batch: the module-timing step of the median batch size, chosen from the data (two runs of
    # one configuration log the same flops whatever their timings), counted off the clock
    by_size = sorted(steps.module_timing, key=lambda n: collator.batches[n]["input_ids"].numel())
    assert steps.module_trace == by_size[(len(by_size) - 1) // 2] and steps.module_trace_by == "batch"
    assert f"the tree of step {steps.module_trace}, their median batch size" in module_source(result)
    tree = result.profile.fwd_flops + result.profile.bwd_flops
    assert tree == _offline(trainer, collator.batches[steps.module_trace])


class LoggingTrainer(Trainer):
    """A Trainer whose ``compute_loss`` logs each batch's length and counts its tokens on ``self.state``."""

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, **kwargs: Any) -> Any:
        self.log({"seq_len": float(inputs["input_ids"].shape[1])})
        self.state.my_tokens = getattr(self.state, "my_tokens", 0) + int(inputs["attention_mask"].sum())
        return super().compute_loss(model, inputs, return_outputs, **kwargs)


def test_a_replay_of_a_compute_loss_that_logs_and_counts_on_the_state_logs_and_counts_as_unprofiled(
    tmp_path: Path,
) -> None:
    """The fake counts run the Trainer's ``training_step`` again on each new length: its ``self.log`` says
    nothing (a log is written to the reporters and ``log_history`` at once: the fake lengths showed as
    points) and what it adds to ``self.state`` is put back."""
    runs = {}
    for profiled in (False, True):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(profiled)), use_cpu=True, max_steps=24,
            per_device_train_batch_size=4, logging_steps=1, save_strategy="no", report_to=[],
            disable_tqdm=True, seed=0, train_sampling_strategy="group_by_length",
        )  # fmt: skip
        callback = HFFlopsCallback(profile_step=3, print_profile=False)
        trainer = LoggingTrainer(
            _gpt2(), args, train_dataset=Lengths(200), data_collator=PadToLongest(),
            callbacks=[callback] if profiled else [],
        )  # fmt: skip
        trainer.train()
        logged = [(e["step"], e["seq_len"]) for e in trainer.state.log_history if "seq_len" in e]
        runs[profiled] = (logged, trainer.state.my_tokens, callback.session.result)
    result = runs[True][2]
    assert result is not None and result.steps.shapes > 1  # new lengths counted off the clock
    assert result.steps.shape_counting == (check_step(3),) and result.steps.skipped == ()
    assert runs[True][:2] == runs[False][:2] and len(runs[False][0]) == 24


VOCAB_L, WIDTH, BRANCH = 50, 16, 48  # the model's extra block runs on sequences longer than BRANCH


class Branching(L.LightningModule):
    """A token model with an extra block on sequences longer than ``BRANCH`` positions: its flops are a
    polynomial of the length on each side of the branch, another one above it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_L, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB_L)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(ids)).relu()
        if ids.shape[1] > BRANCH:
            h = self.extra(h).relu()
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch
        losses = F.cross_entropy(self(ids).flatten(0, 1), ids.flatten(), reduction="none")
        loss = (losses * mask.flatten()).sum() / mask.sum()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Drifting(torch.utils.data.Dataset):
    """Batch ``k`` (of 4 sequences) padded to its longest, ``16 + 2k`` positions: lengths drift upward."""

    def __len__(self) -> int:
        return 80

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(k)
        longest = 16 + 2 * k
        lengths = [longest, *torch.randint(8, longest + 1, (3,), generator=generator).tolist()]
        ids = torch.randint(1, VOCAB_L, (4, longest), generator=generator)
        mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
        return ids * mask, mask


def _truth(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """The batch's model flops, counted by the engine on a real step of a fresh model."""
    module = Branching()
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no Trainer to log to
    tracer = CountingEngine(module)
    tracer.start()
    try:
        module.training_step(batch, 0).backward()
    finally:
        tracer.stop()
    counts = tracer.totals()[0]
    return counts.fwd_flops + counts.bwd_flops


def test_a_model_that_branches_on_length_keeps_exact_flops_when_batches_cross_it(tmp_path: Path) -> None:
    profile_step, steps = 10, 50  # clean steps from 15: lengths 46, 48, then above the branch
    callback = FlopsProfilerCallback(profile_step=profile_step, print_profile=False, flops_audit=0)
    trainer = L.Trainer(callbacks=[callback], **lightning_settings(tmp_path, steps))
    meter = callback.session.meter
    assert meter is not None
    intervals: list[LoggingInterval] = []
    interval = meter.interval

    def kept() -> LoggingInterval:
        intervals.append(interval())
        return intervals[-1]

    meter.interval = kept  # type: ignore[method-assign]
    trainer.fit(Branching(), torch.utils.data.DataLoader(Drifting(), batch_size=None))
    result = callback.result
    assert result is not None and result.clean is not None
    data = Drifting()
    window_steps = result.steps
    assert len(window_steps.clean) >= 3 and window_steps.skipped == ()
    assert window_steps.shape_counting == (check_step(profile_step),)
    crossed = [n for n in window_steps.clean if 16 + 2 * n > BRANCH]
    assert crossed and len(crossed) < len(window_steps.clean)  # clean steps on both sides of the branch
    each = [step.work.counts.model_flops for step in result.clean.steps]
    truth = [_truth(data[n]) for n in window_steps.clean]
    assert each == truth  # exact, so within 1% of the per-batch truth
    # after the window: one interval per step (logged at each), every batch a length of its own
    first = result.published_at  # the global step after the window's last: the meter's first
    assert first is not None and len(intervals) == steps - first
    after = [_truth(data[n]) for n in range(first, steps)]
    assert [i.flops for i in intervals] == after


class WarmedUp(L.LightningModule):
    """A warmup stepped by hand in ``training_step`` (automatic optimization): a fake count's replay of the
    step steps the scheduler too, and must leave it, and the optimizer's learning rate, as they were."""

    def __init__(self, schedule: str) -> None:
        super().__init__()
        self.net, self.schedule = nn.Linear(8, 4), schedule

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.lr_schedulers().step()
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        warmup: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        if self.schedule == "linear, then cosine":  # schedulers stepped by another
            linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
            warmup = torch.optim.lr_scheduler.SequentialLR(optimizer, [linear, cosine], milestones=[4])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        pass  # stepped in training_step


def _warmed_up(root: Path, callbacks: list[L.Callback], schedule: str) -> tuple[WarmedUp, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module, generator = WarmedUp(schedule), torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 4, generator=generator)
    )
    batches = [list(range(4 * i, 4 * i + 4)) for i in range(12)]
    # new shapes after the check: step 6's counted on its step, where fake counts are tried; step 7's faked
    batches[6], batches[7] = batches[6][:3], batches[7][:2]
    trainer = L.Trainer(callbacks=callbacks, **lightning_settings(root, 12))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_sampler=batches))
    return module, trainer


@pytest.mark.parametrize("schedule", ["lambda", "linear, then cosine"])
def test_a_replay_of_a_step_that_steps_its_lr_scheduler_leaves_the_schedule_and_the_weights_as_unprofiled(
    tmp_path: Path, schedule: str
) -> None:
    plain, plain_trainer = _warmed_up(tmp_path / "plain", [], schedule)
    callback = FlopsProfilerCallback(profile_step=1, clean_steps=2, print_profile=False)
    profiled, trainer = _warmed_up(tmp_path / "profiled", [callback], schedule)
    assert callback.result is not None and callback.session.off_clock.counts == 2  # the trial, step 7
    steps = callback.result.steps
    assert (steps.shape_counting, steps.clean) == ((5, 6), (7, 8))  # 5: the check step, counted too
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == plain_trainer.lr_scheduler_configs[0].scheduler.last_epoch == 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == plain_trainer.optimizers[0].param_groups[0]["lr"]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), profiled.parameters(), strict=True))


class Unfreezes(L.LightningModule):
    """A frozen backbone, unfrozen at step 20 (after the window) by a callback: from then on a step's count
    is another model's than the counting step's."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU()).requires_grad_(False)
        self.head = nn.Linear(32, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.head(self.backbone(batch[0])), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 20:
            self.backbone.requires_grad_(True)


def test_a_model_changed_since_the_counting_step_is_not_checked_against_its_count(tmp_path: Path) -> None:
    """Fake counts are tried where first wanted (here the meter's short batch at step 30): a backbone unfrozen
    since the counting step makes that step's count another model's, so no count can check a fake one, as
    said. It was compared anyway, and fake counts were off for the run as if they had counted wrong ("a fake
    count of the counting step's batch did 7568 flops, its real count 4240")."""
    batches = [list(range(4 * i, 4 * i + 4)) for i in range(40)]
    batches[30] = batches[30][:2]  # after the window, after the unfreeze
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(160, 8, generator=generator), torch.randn(160, 4))
    callback = FlopsProfilerCallback(profile_step=1, clean_steps=3, print_profile=False)
    trainer = L.Trainer(callbacks=[callback], **lightning_settings(tmp_path, 40))
    trainer.fit(Unfreezes(), torch.utils.data.DataLoader(data, batch_sampler=batches))
    assert callback.result is not None and callback.session.off_clock.counts == 0  # none checked, none ran
    assert callback.session.off_clock.why_not == (
        "the model's parameters changed since the counting step: no count checks a fake"
    )
