"""The processes of tests/integrations/test_ranks.py: data-parallel fine-tuning of a tiny GPT-2 with a
pad-to-longest collator, each rank reading sequences of its own lengths, as users launch it.

``python rank_workers.py FRAMEWORK DATA CLEAN DIR [STRATEGY] [PROCESSES] [FAIL_RANK]``

* FRAMEWORK: ``lightning`` (its own launcher for ``ddp``, mp spawn for ``ddp_spawn``, or the processes
  torchrun / accelerate started) or ``hf`` (under torchrun or accelerate launch);
* DATA: ``skewed`` (rank 0 reads lengths 6..14, rank 1 and up 20..44, a new length nearly every batch)
  or ``constant`` (rank 0 always 16 tokens, the others 64);
* CLEAN: ``clean_steps`` (an int or ``auto``); FAIL_RANK: a rank whose counting raises (a registered
  formula for ``aten.tanh`` fails there, GPT-2's GELU calls it).

Each rank writes ``rank{N}.json``: the global step it ended at, its batches' shapes (what its collator
made, in order), the window it saw and the metrics; rank 0 also the time of each step's end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

PROFILE_STEP = 2
MAX_STEPS = 40  # auto's window ends by step 28 with no shape counting: throughput after it
LOG_EVERY = 5  # throughput/* after the window at every 5th step
VOCAB, MAX_LEN, BATCH = 61, 48, 2
COLLATE_SLEEP = 0.015  # each batch's wait: a step's time is not the few ms a log write or a hiccup takes
TIMEOUT = timedelta(seconds=60)  # the training's own process group: bounds a collective a rank misses


def rank() -> int:
    return (
        torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def length(data: str, reader: int, index: int) -> int:
    """The length of sequence ``index`` as rank ``reader`` reads it."""
    if data == "constant":
        return 16 if reader == 0 else 44
    return 6 + (index * 7) % 9 if reader == 0 else 20 + (index * 5) % 25


class Sequences(torch.utils.data.Dataset):
    """Token sequences whose length depends on the reading rank (read in its own process)."""

    def __init__(self, data: str, size: int = 400) -> None:
        self.data, self.size = data, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> list[int]:
        n = length(self.data, rank(), i)
        return [(i * 13 + k * 7) % (VOCAB - 1) + 1 for k in range(n)]


class PadToLongest:
    """The collator: input_ids and attention_mask padded to the batch's longest, labels -100 there; it
    keeps the shape and tokens of every batch it made, in order (after a known wait, as slow input)."""

    def __init__(self, data: str) -> None:
        self.data = data
        self.made: list[dict[str, Any]] = []

    def __call__(self, items: list[list[int]]) -> dict[str, torch.Tensor]:
        time.sleep(COLLATE_SLEEP)
        longest = max(len(s) for s in items)
        ids = torch.zeros(len(items), longest, dtype=torch.long)
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for row, s in enumerate(items):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        self.made.append({"shape": list(ids.shape), "real": int(mask.sum()), "ids": ids.tolist()})
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fail_on(bad_rank: int) -> None:
    """A formula that raises on ``bad_rank`` only: that rank's counting fails."""
    from flops_callbacks import register_formula

    @register_formula(torch.ops.aten.tanh, kind="elementwise", replace=True)
    def tanh(args: Any, kwargs: Any, out: Any) -> int:
        if rank() == bad_rank:
            raise ValueError(f"a broken formula on rank {bad_rank}")
        return out.numel()


def save(
    directory: Path, callback: Any, collator: PadToLongest, step: int, ends: list[float], items: list[int]
) -> None:
    result = callback.result
    seen: dict[str, Any] = {"rank": rank(), "global_step": step, "batches": collator.made, "ends": ends}
    seen |= {"data": collator.data, "items": items}
    if result is not None:
        seen |= {
            "metrics": result.metrics(),
            "steps": {"counting": result.steps.counting, "clean": list(result.steps.clean),
                      "shape_counting": list(result.steps.shape_counting),
                      "module_timing": list(result.steps.module_timing), "profiled": result.steps.profiled},
            "published_at": result.published_at,
            "first": result.step,
            "clean_counts": result.figures().counts._asdict(),
            "median_step_tokens": result.figures().median_step().work.tokens,  # what tokens/second divides
            "world": result.parallel.world_size,
            "sources": None if result.flops_sources is None else str(result.flops_sources),
        }  # fmt: skip
    (directory / f"rank{rank()}.json").write_text(json.dumps(seen))


def tokens(batch: Any) -> int:
    return int(batch["input_ids"].numel())


import lightning as L  # noqa: E402  (the LightningModule and callback are pickled by ddp_spawn: module level)

from flops_callbacks.session.window_plan import COMM_MIN  # noqa: E402
from tests.sharded_workers import without_shm_build, zero_config  # noqa: E402  (the checkout is on the path)
from tests.support import end_group_at_exit, end_process  # noqa: E402


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Saves(L.Callback):
    """Keeps each step's end time and, at the train end (in every process, spawned ones too), saves."""

    def __init__(self, directory: Path, profiler: Any, collator: PadToLongest) -> None:
        self.directory, self.profiler, self.collator = directory, profiler, collator
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        save(self.directory, self.profiler, self.collator, trainer.global_step, self.ends, [])
        end_group_at_exit()  # a spawned rank ends by returning, through the interpreter's teardown


def lightning(data: str, clean: Any, directory: Path, strategy: str, processes: int) -> None:
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    from flops_callbacks.integrations.lightning import FlopsProfilerCallback

    collator = PadToLongest(data)
    every = os.environ.get("FLOPS_PROFILE_EVERY")  # test_profile_every: re-profile windows across ranks
    callback = FlopsProfilerCallback(
        profile_step=PROFILE_STEP, clean_steps=clean, tokens_fn=tokens, print_profile=False, peak_flops=1e12,
        profile_every=int(every) if every else None,
        comm_steps=int(os.environ.get("FLOPS_COMM_STEPS", COMM_MIN)),
    )  # fmt: skip
    start_method = {"ddp_spawn": "spawn"}.get(strategy, "popen")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=processes,
        strategy=DDPStrategy(start_method=start_method, timeout=TIMEOUT),
        max_steps=MAX_STEPS,
        log_every_n_steps=LOG_EVERY,
        callbacks=[callback, Saves(directory, callback, collator)],
        logger=CSVLogger(directory, version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=directory,
    )
    loader = torch.utils.data.DataLoader(Sequences(data), batch_size=BATCH, collate_fn=collator)
    trainer.fit(LM(), train_dataloaders=loader)
    if strategy != "ddp_spawn":  # spawned processes have ended by now; this one is the launcher
        end_process()


def hf(data: str, clean: Any, directory: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from flops_callbacks.integrations.hf import HFFlopsCallback

    class Ends(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    items: list[int] = []  # the loss's num_items_in_batch at each step (the model's forward takes it)

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            items.append(int(kwargs.get("num_items_in_batch", -1)))
            return super().compute_loss(model, inputs, *args, **kwargs)

    collator, ends = PadToLongest(data), Ends()
    callback = HFFlopsCallback(
        profile_step=PROFILE_STEP, clean_steps=clean, print_profile=False, peak_flops=1e12,
        comm_steps=int(os.environ.get("FLOPS_COMM_STEPS", COMM_MIN)),  # "auto"'s up to 25: test_comm
    )  # fmt: skip
    zero = os.environ.get("FLOPS_ZERO_STAGE")  # test_ranks: the same run sharded by DeepSpeed ZeRO
    if zero:
        without_shm_build()
    args = TrainingArguments(
        output_dir=str(directory / "out"),
        use_cpu=True,
        ddp_backend="gloo",
        deepspeed=zero_config(int(zero)) if zero else None,  # sharded: DeepSpeed ZeRO on its CPU accelerator
        ddp_timeout=int(TIMEOUT.total_seconds()),
        per_device_train_batch_size=BATCH,
        max_steps=MAX_STEPS,
        logging_steps=LOG_EVERY,
        save_strategy="no",
        report_to=["tensorboard"],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = InOrder(
        model=gpt2(),
        args=args,
        train_dataset=Sequences(data),
        data_collator=collator,
        callbacks=[callback, ends],
    )
    trainer.train()
    save(directory, callback, collator, trainer.state.global_step, ends.ends, items)
    end_process()


if __name__ == "__main__":
    framework, data, clean_arg, folder = sys.argv[1:5]
    strategy = sys.argv[5] if len(sys.argv) > 5 else "ddp"
    processes = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    if len(sys.argv) > 7:
        fail_on(int(sys.argv[7]))
    clean_steps: Any = clean_arg if clean_arg == "auto" else int(clean_arg)
    if framework == "lightning":
        lightning(data, clean_steps, Path(folder), strategy, processes)
    else:
        hf(data, clean_steps, Path(folder))
