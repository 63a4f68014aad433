"""The processes of tests/integrations/test_sharded.py: each trains (or sets up) one sharded run on CPU
with gloo
and writes what its callback saw to ``rank{N}.json``, which the test compares with an unsharded copy.

Run as users launch these frameworks: ``python sharded_workers.py lightning-fsdp2 DIR`` (Lightning's
launcher starts the second process), ``python -m torch.distributed.run --nproc-per-node=2
sharded_workers.py hf-zero DIR STAGE`` (the HF Trainer and DeepSpeed under torchrun). The models and
sizes live here so that the test builds the same unsharded model from them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks.session.window_plan import COMM_MIN  # noqa: E402
from tests.support import end_process, window_end  # noqa: E402

PROFILE_STEP = 2
# the window up to its first clean step, after the communication steps and the check (the run ends
# inside the "auto" window, which publishes what it had)
MAX_STEPS = window_end(PROFILE_STEP, 1, comm=True)
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 3  # even sizes: FSDP2 and ZeRO-3 split every parameter in halves
VOCAB, SEQ = 97, 16
PERSISTED = HIDDEN  # elements under which ZeRO-3 keeps a parameter whole: the MLP's biases
TIMEOUT = timedelta(seconds=60)  # bounds any collective a failed rank never joins


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def mlp_batches(samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(samples, IN, generator=generator), torch.randn(samples, OUT, generator=generator)
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs (causal LM)."""

    def __init__(self, size: int) -> None:
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def without_shm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce (C++, about 50 s on a fresh machine,
    once: the first DeepSpeed run of the suite paid it) when its communication starts; only its inference
    all-reduce uses it, never ZeRO training, which runs on the process group's collectives as without it."""
    import importlib

    # by its module's name: the attribute deepspeed.comm.torch is the torch package, which it imports
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def zero_config(stage: int) -> dict[str, Any]:
    """ZeRO ``stage`` with the batch sizes from the Trainer; stage 3 partitions every parameter (by
    default it keeps parameters under 100 K elements whole on every device: all of these)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    batch = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    return {"zero_optimization": zero, "train_batch_size": "auto", **batch}


def save(directory: Path, rank: int, callback: Any, **extra: Any) -> None:
    """What this rank's callback published, through its public surface only."""
    from flops_callbacks.communication.report import comm_data

    result = callback.result
    p = result.profile
    seen = {
        "parallel": dataclasses.asdict(result.parallel),
        "metrics": result.metrics(),
        # what the rates are made of: the median clean step's samples and its fwd + bwd + step seconds
        "clean": {
            "steps": len(result.steps.clean),
            "samples": result.figures().median_step().work.samples,
            "iter_seconds": result.iter_latency,
        },
        "profile": {k: getattr(p, k) for k in ("fwd_flops", "bwd_flops", "fwd_macs", "bwd_macs", "params")},
        "comm": comm_data(result.comm),  # the communication step's, as the JSON file holds it
        **extra,
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(seen))


# --- Lightning: ModelParallelStrategy with FSDP2 data-parallel sharding ----------------------------------


def lightning_fsdp2(directory: Path) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from flops_callbacks.integrations.lightning import FlopsProfilerCallback

    class ShardedMLP(L.LightningModule):
        """The MLP with each Linear and the whole model sharded over the data-parallel mesh (FSDP2)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = mlp()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = FlopsProfilerCallback(profile_step=PROFILE_STEP, detailed=False, comm_steps=COMM_MIN)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT),
        max_steps=MAX_STEPS,
        callbacks=[callback],
        logger=CSVLogger(directory, version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )
    loader = torch.utils.data.DataLoader(mlp_batches(2 * MAX_STEPS * BATCH), batch_size=BATCH)
    trainer.fit(ShardedMLP(), train_dataloaders=loader)
    save(directory, trainer.global_rank, callback, log_dir=trainer.log_dir)
    end_process()


# --- HF Trainer with DeepSpeed ZeRO (DeepSpeed's CPU accelerator) ------------------------------------


def hf_zero(directory: Path, stage: int) -> None:
    from transformers import Trainer, TrainingArguments

    from flops_callbacks.integrations.hf import HFFlopsCallback

    without_shm_build()
    args = TrainingArguments(
        output_dir=str(directory / "out"),
        use_cpu=True,  # without it accelerate finds no GPU and runs each process alone
        deepspeed=zero_config(stage),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        ddp_backend="gloo",
    )
    callback = HFFlopsCallback(profile_step=PROFILE_STEP, detailed=False, comm_steps=COMM_MIN)
    trainer = Trainer(
        model=gpt2(), args=args, train_dataset=TokenDataset(2 * MAX_STEPS * BATCH), callbacks=[callback]
    )
    trainer.train()
    engine = type(trainer.model_wrapped)
    save(directory, args.process_index, callback, wrapper=f"{engine.__module__}.{engine.__name__}")
    end_process()


# --- strategies that do not train on CPU: their sizes read from real objects ----------------------------


def readers(directory: Path) -> None:
    """Lightning's DeepSpeedStrategy around a real DeepSpeed engine (data parallel 1 x Ulysses sequence
    parallel 2) and the HF Trainer asked for FSDP on CPU; the sizes read from each and what each
    framework does on CPU."""
    import deepspeed
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from transformers import Trainer, TrainingArguments

    from flops_callbacks.integrations import hf, lightning
    from flops_callbacks.parallel import global_numel, sharded_params, stored_numel

    without_shm_build()
    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    model = mlp()
    # ZeRO-3 partitions the weights and keeps the biases (at most PERSISTED elements) whole everywhere
    zero = {"stage": 3, "stage3_param_persistence_threshold": PERSISTED}
    config = {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": 2, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config, mesh_param=(1, 2)
    )
    params = list(engine.module.parameters())
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=3), logger=False)
    trainer.strategy.model = engine  # as the strategy's setup leaves it
    try:
        trainer.strategy.setup_environment()
        lightning_error = ""
    except RuntimeError as error:
        lightning_error = f"{type(error).__name__}: {error}"

    args = TrainingArguments(
        output_dir=str(directory / "out"),
        use_cpu=True,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2},
        report_to=[],
        ddp_backend="gloo",
    )
    hf_trainer = Trainer(model=gpt2(), args=args, train_dataset=TokenDataset(8))
    seen = {
        "lightning_deepspeed": dataclasses.asdict(lightning.parallel_sizes(trainer)),
        "lightning_deepspeed_error": lightning_error,
        "hf_fsdp": dataclasses.asdict(
            hf.parallel_sizes(args, hf_trainer.model, hf_trainer.accelerator.state)
        ),
        "hf_fsdp_enabled": hf_trainer.is_fsdp_enabled,
        "hf_distributed_type": str(hf_trainer.accelerator.distributed_type),
        "zero3_stored": [stored_numel(p) for p in params],
        "zero3_global": [global_numel(p) for p in params],
        "zero3_model": sharded_params(engine.module),
    }
    (directory / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(seen))
    end_process()


if __name__ == "__main__":
    kind, where = sys.argv[1], Path(sys.argv[2])
    if kind == "lightning-fsdp2":
        lightning_fsdp2(where)
    elif kind == "hf-zero":
        hf_zero(where, int(sys.argv[3]))
    elif kind == "readers":
        readers(where)
    else:
        raise ValueError(f"unknown worker {kind!r}: lightning-fsdp2, hf-zero or readers")
