"""Truth in the runs people have: batches padded per batch, a slow input pipeline, and the meter after the
window, on a real ``transformers.Trainer`` and a real ``lightning.Trainer`` with a tiny GPT-2.

Each run pads every batch to its longest sample (lengths drawn at random), and its collator sleeps a
known time. The test keeps every batch the collator made (batch ``i`` is the one of global step ``i``)
and checks the window's figures against independent counts of the same batches: torch's
``FlopCounterMode`` for the dense flops (matmuls and attention: 2 x our MACs) and the counting engine run
again on each clean step's batch for all flops, over the clean steps' phase times read from the JSON.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.session.shape_flops import BatchCounts
from tests.reporting.test_report_arithmetic import check_arithmetic
from tests.support import lightning_settings, loss_counts

VOCAB, BATCH, SLEEP = 97, 4, 0.5  # the collator's sleep: most of a step, even on a busy machine
PROFILE_STEP, CLEAN_STEPS, MAX_STEPS = 1, 3, 16


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of random lengths 8 .. 48."""

    def __init__(self, size: int = 128) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 49, (size,), generator=generator)
        self.items = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


class SlowPaddingCollator:
    """Pads a batch to its longest sequence (mask 0 and label -100 on padding), after a known sleep;
    keeps every batch it made, in order."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        time.sleep(SLEEP)
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.long)
        mask = torch.zeros(len(samples), longest, dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, : len(s["input_ids"])] = s["input_ids"]
            mask[row, : len(s["input_ids"])] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def engine_counts(batch: dict[str, torch.Tensor], hf: bool) -> BatchCounts:
    """The counting engine on one step's batch (a step's first micro-batch: no gradient to add to),
    called as the Trainer calls the model (the HF Trainer divides the loss by the real labels' count)."""
    extra = {"num_items_in_batch": (batch["labels"][:, 1:] != -100).sum()} if hf else {}
    return loss_counts(gpt2(), batch, **extra)


def rows_alone(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Each row of a padded batch cut to its real tokens: the sequences as if run alone."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [{k: v[r : r + 1, :n] for k, v in batch.items()} for r, n in enumerate(lengths)]


def model_passes(batch: dict[str, torch.Tensor], hf: bool) -> tuple[int, int]:
    """The forward and backward flops of a padded batch's rows, each counted alone on its real tokens
    (the HF Trainer's loss divisor is the batch's, as its step passes it to every row)."""
    extra = {"num_items_in_batch": (batch["labels"][:, 1:] != -100).sum()} if hf else {}
    each = [loss_counts(gpt2(), row, **extra) for row in rows_alone(batch)]
    return sum(c.fwd_flops for c in each), sum(c.bwd_flops for c in each)


def work(batch: dict[str, torch.Tensor], hf: bool) -> BatchCounts:
    """A padded batch's counts as run, its model slots its rows' own."""
    return engine_counts(batch, hf).with_model(*model_passes(batch, hf))


def torch_dense_flops(batch: dict[str, torch.Tensor]) -> int:
    """torch's own count of the same forward and backward (SDPA's math backend: attention as matmuls)."""
    model = gpt2()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


def check_window(
    saved: dict[str, Any], batches: list[dict[str, torch.Tensor]], report: str, hf: bool
) -> None:
    """The acceptance checks on a window's JSON and report, against the batches of its clean steps."""
    steps, metrics, totals = saved["steps"], saved["metrics"], saved["clean_totals"]
    assert steps["skipped"] == [] and len(steps["clean"]) == CLEAN_STEPS  # no clean step left out
    assert steps["shapes_predicted"] >= 1 and steps["shape_counting"]  # new lengths: counted, then predicted
    clean = [batches[s] for s in steps["clean"]]
    assert len({b["input_ids"].shape for b in clean}) > 1  # the clean steps had other shapes
    # the flops of the clean steps' batches, as the engine counts each of them on its own
    each = [work(batch, hf) for batch in clean]
    counted = BatchCounts.zero()
    for counts in each:
        counted = counted.plus(counts)
    # predicted = counted, exactly: the batches as run, and the model's work on their rows alone
    assert BatchCounts.from_dict(totals["counts"]) == counted
    # and independently: torch's counter sees the dense work, 2 x our MACs (the fused attention's
    # backward re-running its forward is recompute, which the math backend has not)
    dense = sum(torch_dense_flops(b) for b in clean)
    assert dense == 2 * (counted.fwd_macs + counted.bwd_macs)
    # the model flops leave the padding out: torch's count of the rows alone, and our elementwise work
    alone = sum(torch_dense_flops(row) for b in clean for row in rows_alone(b))
    ratio = counted.model_flops / alone
    assert alone < counted.model_flops < dense and ratio < 1.3, ratio
    # the latencies and rates: the clean step of the median FLOPS (its own flops over its own time)
    iters = totals["iter_seconds_per_step"]
    rates = [c.model_flops / t for c, t in zip(each, iters, strict=True)]
    at = rates.index(sorted(rates)[(len(rates) - 1) // 2])
    median = each[at]
    assert BatchCounts.from_dict(saved["clean_median_step"]["counts"]) == median
    seconds, iter_latency = totals["seconds"], metrics[names.ITER_LATENCY]
    assert iter_latency == pytest.approx(iters[at], rel=1e-12)
    assert (
        iter_latency == metrics[names.FWD_LATENCY] + metrics[names.BWD_LATENCY] + metrics[names.STEP_LATENCY]
    )
    assert metrics[names.FLOPS_PER_SEC] == pytest.approx(median.model_flops / iter_latency, rel=1e-9)
    assert metrics[names.HARDWARE_FLOPS_PER_SEC] == pytest.approx(
        median.hardware_flops / iter_latency, rel=1e-9
    )
    samples = BATCH * CLEAN_STEPS
    assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(BATCH / iter_latency, rel=1e-9)
    assert metrics[names.FLOPS_PER_SEC] == pytest.approx(statistics.median(rates), rel=1e-9)  # 5: odd
    # padding: the share of the clean steps' positions that are padding
    real = sum(int(b["attention_mask"].sum()) for b in clean)
    positions = sum(b["attention_mask"].numel() for b in clean)
    assert metrics[names.PADDING_FRACTION] == pytest.approx(1 - real / positions, rel=1e-12)
    real_median = int(clean[at]["attention_mask"].sum())  # the median step's
    assert metrics[names.REAL_TOKENS_PER_SEC] == pytest.approx(real_median / iter_latency, rel=1e-9)
    # the wait for data is the collator's sleep, and the wall step holds it and the compute
    assert SLEEP <= metrics[names.DATA_LATENCY] <= SLEEP * 1.2
    wall = metrics[names.WALL_LATENCY]
    assert metrics[names.DATA_LATENCY] + metrics[names.ITER_LATENCY] <= wall * 1.2
    assert wall <= SLEEP * 1.2 + 2 * metrics[names.ITER_LATENCY]
    assert metrics[names.WALL_SAMPLES_PER_SEC] == pytest.approx(samples / seconds["wall"], rel=1e-9)
    assert saved["spread"]["wall"]["steps"] == CLEAN_STEPS
    assert saved["spread"]["wall"]["low"] <= wall <= saved["spread"]["wall"]["high"]
    bottleneck = metrics[names.DATA_LATENCY] >= 0.3 * wall
    assert ("BOTTLENECK: the input pipeline" in report) == bottleneck  # the rule, as the report applies it
    assert bottleneck and "num_workers" in report
    assert (
        "padding fraction (padding positions / positions, from attention_mask or position_ids; tokens are "
        "positions, padding included)" in report
    )
    check_arithmetic(report)  # every formula row, from the printed values (the clean step's flops, printed)
    # per-module latencies whatever the module-timing steps' shapes: the tree is the timed step's batch's
    timed = [m["fwd_latency"] for m in saved["profile"]["modules"].values()]
    assert steps["module_shapes_match"] and any(t > 0 for t in timed)
    profiled = steps["counting"] if steps["profile_step"] is None else steps["profile_step"]
    assert profiled == steps["counting"] or profiled in steps["module_timing"]
    root = saved["profile"]["modules"][""]
    assert 2 * (root["fwd_macs"] + root["bwd_macs"]) == torch_dense_flops(batches[profiled])


def tensorboard_steps(directory: Path, tag: str) -> list[int]:
    """The steps at which ``tag`` was written in the event files under ``directory``."""
    found: list[int] = []
    for events in directory.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            found += [e.step for e in accumulator.Scalars(tag)]
    return sorted(found)


def test_hf_trainer_padded_lm_with_a_slow_collator(tmp_path: Path) -> None:
    collator = SlowPaddingCollator()
    callback = HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN_STEPS, print_profile=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1, save_strategy="no", report_to=["tensorboard"], disable_tqdm=True, seed=0,
        remove_unused_columns=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=gpt2(), args=args, train_dataset=Sequences(), data_collator=collator, callbacks=[callback]
    )
    trainer.train()
    result = callback.result
    assert result is not None
    log_dir = Path(getattr(args, "logging_dir", None) or args.output_dir)
    saved = json.loads((log_dir / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    report = (log_dir / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    check_window(saved, collator.batches, report, hf=True)
    # throughput/* at every logging step after the window, as TensorBoard holds them
    after = list(range(result.published_at + 1, MAX_STEPS + 1))
    for name in (names.THROUGHPUT_SAMPLES_PER_SEC, names.THROUGHPUT_FLOPS_PER_SEC):
        assert tensorboard_steps(log_dir, f"train/{name}") == after, name


class LitGPT2(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_trainer_padded_lm_with_a_slow_collator(tmp_path: Path) -> None:
    collator = SlowPaddingCollator()
    callback = FlopsProfilerCallback(
        profile_step=PROFILE_STEP,
        clean_steps=CLEAN_STEPS,
        print_profile=False,
        tokens_fn=lambda batch: batch["input_ids"].numel(),
    )
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    settings = lightning_settings(tmp_path, MAX_STEPS, logger=[csv_logger, tb_logger])
    trainer = L.Trainer(callbacks=[callback], **settings)
    data = torch.utils.data.DataLoader(Sequences(), batch_size=BATCH, collate_fn=collator)
    trainer.fit(LitGPT2(), data)
    result = callback.result
    assert result is not None
    log_dir = Path(trainer.log_dir or tmp_path)
    saved = json.loads((log_dir / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    report = (log_dir / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    check_window(saved, collator.batches, report, hf=False)
    # throughput/* at every logging step after the window, in the CSV file and the TensorBoard events
    after = list(range(result.published_at + 1, MAX_STEPS + 1))
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    drawn = [step - 1 for step in after]  # where Lightning's loggers draw those batches: one behind
    for name in (names.THROUGHPUT_SAMPLES_PER_SEC, names.THROUGHPUT_FLOPS_PER_SEC):
        assert sorted(int(r["step"]) for r in rows if r.get(name)) == drawn, name
        assert tensorboard_steps(Path(tb_logger.log_dir), name) == drawn, name
