"""Sharded training on CPU with gloo: every device's profile is the unsharded model's on its local batch.

Real 2-process runs (workers in sharded_workers.py) of Lightning's ModelParallelStrategy with FSDP2
data-parallel sharding and of the HF Trainer with DeepSpeed ZeRO-2 / ZeRO-3 (DeepSpeed's CPU
accelerator). Each profile must hold the flops of the same model unsharded on the same batch (counted
here, in this process, by the CountingEngine on a fresh copy and by torch's FlopCounterMode for the matmuls):
all-gathers and reduce-scatters add nothing. Parameters per device are the shard, parameters of the
model the global size, samples/s counts both replicas.

Lightning's FSDPStrategy and DeepSpeedStrategy and the HF Trainer's FSDP do not train on CPU: for
them, the exact refusal (or fallback) and the parallel sizes read from the real objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from sharded_workers import BATCH, IN, OUT, PERSISTED, PROFILE_STEP, SEQ, TokenDataset, gpt2, mlp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import metrics as names
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.parallel import ParallelSizes, global_numel, sharded_params, stored_numel
from flops_callbacks.units import params_to_string
from tests.support import run_bounded

WORKERS = Path(__file__).parents[1] / "sharded_workers.py"
DEEPSPEED_ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator, whatever else is installed


# --- the unsharded reference, counted in this process --------------------------------------------------


def unsharded(model: torch.nn.Module, step: Any) -> dict[str, int]:
    """Flops of one forward + backward (``step(model)`` returns the loss) of the unsharded ``model``:
    the engine's totals, and FlopCounterMode's (matmuls and attention only, SDPA on its math backend)."""
    tracer = CountingEngine(model)
    tracer.start()
    try:
        step(model).backward()
    finally:
        tracer.stop()
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step(model).backward()
    p = tracer.profile()
    return {"fwd_flops": p.fwd_flops, "bwd_flops": p.bwd_flops, "dense_flops": counter.get_total_flops()}


def mlp_step(model: torch.nn.Module) -> torch.Tensor:
    """The Lightning worker's training_step on one local batch: MSE outside the model's modules."""
    return F.mse_loss(model(torch.randn(BATCH, IN)), torch.randn(BATCH, OUT))


def gpt2_step(model: torch.nn.Module) -> torch.Tensor:
    """The HF Trainer's call on one local batch (transformers 5: no KV cache in training, the loss
    summed over the tokens it counted in the batch and divided by them)."""
    batch = TokenDataset(BATCH).ids
    return model(
        input_ids=batch, labels=batch, use_cache=False, num_items_in_batch=torch.tensor(BATCH * (SEQ - 1))
    ).loss


def halves(model: torch.nn.Module) -> int:
    """Elements one of two devices stores when every parameter is split in two along its first dim."""
    return sum(-(-p.numel() // 2) for p in dict.fromkeys(model.parameters()))


def whole(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))


# --- running the workers ---------------------------------------------------------------------------------


def run_workers(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    run = run_bounded(command, timeout=240, env={**os.environ, **(env or {})})  # torchrun's workers too
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return run_workers([*launcher, str(WORKERS), *args], env)


def ranks(directory: Path) -> list[dict[str, Any]]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(2)]


def report_rows(log_dir: Path) -> dict[str, str]:
    """The summary rows (label: value) of the report rank 0 wrote next to the logs."""
    report = (log_dir / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    return {
        k.strip(): v.strip() for k, v in (line.split(":", 1) for line in report.splitlines() if ":" in line)
    }


def assert_saved_profile(log_dir: Path, rank0: dict[str, Any]) -> None:
    """The JSON rank 0 wrote next to the logs holds the metrics and sizes its callback published."""
    saved = json.loads((log_dir / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert saved["metrics"] == rank0["metrics"]
    assert saved["parallel"] == rank0["parallel"]
    assert saved["profile"]["params"] == rank0["profile"]["params"]


def model_params_rows(rows: dict[str, str]) -> list[str]:
    """The values of the report's "params of model ..." rows (ours and DeepSpeed's)."""
    return [value for label, value in rows.items() if label.startswith("params of model")]


def assert_per_device_profile(seen: dict[str, Any], reference: dict[str, int], params: int) -> None:
    p, metrics = seen["profile"], seen["metrics"]
    assert (p["fwd_flops"], p["bwd_flops"]) == (reference["fwd_flops"], reference["bwd_flops"])
    assert 2 * (p["fwd_macs"] + p["bwd_macs"]) == reference["dense_flops"]
    assert metrics[names.FWD_FLOPS] == p["fwd_flops"] and metrics[names.BWD_FLOPS] == p["bwd_flops"]
    assert p["params"] == metrics[names.PARAMS] == params
    clean = seen["clean"]  # the median step: the slowest rank's times (the same on every rank), its samples
    assert clean["steps"] == 1  # the window's first clean step, after the communication steps and the check
    assert clean["samples"] % BATCH == 0  # whole batches
    assert metrics[names.SAMPLES_PER_SEC] == pytest.approx(2 * clean["samples"] / clean["iter_seconds"])


def assert_sizes_rows(rows: dict[str, str], data: int, tensor: int, pipeline: int, context: int) -> None:
    labels = ("world size", "data parallel size", "model parallel size")
    assert [rows[label] for label in labels] == ["2", str(data), str(tensor * pipeline * context)]
    factors = ("tensor parallel size", "pipeline parallel size", "context parallel size")
    if tensor * pipeline * context == 1:  # no model parallelism: its factors are not shown
        assert not any(label in rows for label in factors)
    else:
        assert [rows[label] for label in factors] == [str(tensor), str(pipeline), str(context)]


# --- real runs --------------------------------------------------------------------------------------------


def test_lightning_fsdp2_each_device_counts_the_whole_model_on_its_batch_and_holds_half(
    tmp_path: Path,
) -> None:
    run_workers([sys.executable, str(WORKERS), "lightning-fsdp2", str(tmp_path)])
    reference = unsharded(mlp(), mlp_step)
    every = ranks(tmp_path)
    for seen in every:
        # FSDP2 splits every parameter by rows: each device holds half of each, and all-gathers the
        # whole layer for its forward and backward; the flops are those of the whole layer, once
        assert_per_device_profile(seen, reference, halves(mlp()))
        assert ParallelSizes(**seen["parallel"]) == ParallelSizes(world_size=2, data_parallel=2)
    assert every[0]["metrics"] == every[1]["metrics"]  # the slowest rank's latencies, everywhere
    rows = report_rows(Path(every[0]["log_dir"]))
    assert_saved_profile(Path(every[0]["log_dir"]), every[0])
    assert_sizes_rows(rows, data=2, tensor=1, pipeline=1, context=1)
    assert params_to_string(whole(mlp())) in model_params_rows(rows)  # the global size


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_deepspeed_zero_counts_the_whole_model_and_its_collectives(
    tmp_path: Path, stage: int
) -> None:
    pytest.importorskip("deepspeed")
    torchrun("hf-zero", str(tmp_path), str(stage), env=DEEPSPEED_ENV)
    reference = unsharded(gpt2(), gpt2_step)
    # ZeRO-2 shards gradients and optimizer states, not parameters; ZeRO-3 partitions each parameter
    per_device = whole(gpt2()) if stage == 2 else halves(gpt2())
    every = ranks(tmp_path)
    for seen in every:
        assert seen["wrapper"] == "deepspeed.runtime.engine.DeepSpeedEngine"
        assert_per_device_profile(seen, reference, per_device)
        assert ParallelSizes(**seen["parallel"]) == ParallelSizes(world_size=2, data_parallel=2)
        tokens_per_sec = seen["metrics"][names.TOKENS_PER_SEC]
        assert tokens_per_sec == pytest.approx(
            2 * seen["clean"]["samples"] * SEQ / seen["clean"]["iter_seconds"]
        )
    rows = report_rows(tmp_path / "out")
    assert_saved_profile(tmp_path / "out", every[0])
    assert_sizes_rows(rows, data=2, tensor=1, pipeline=1, context=1)
    assert params_to_string(whole(gpt2())) in model_params_rows(rows)
    # the communication step's table: ZeRO-2 all-reduces the gradients (gloo: no reduce-scatter) and
    # all-gathers the updated parameters' partitions; ZeRO-3 gathers the parameters for the forward and
    # backward and reduce-scatters the gradients; the Trainer all-reduces a few scalars of its own
    assert every[0]["comm"] == every[1]["comm"]
    table = {row["op"]: row for row in every[0]["comm"]["collectives"]}
    model_bytes = 4 * whole(gpt2())  # fp32
    gathered = table["all_gather"]["bytes"]
    assert gathered % model_bytes == 0 and gathered >= model_bytes
    if stage == 2:
        assert model_bytes <= table["all_reduce"]["bytes"] <= model_bytes + 64
    else:
        assert table["reduce_scatter"]["bytes"] == model_bytes and table["all_reduce"]["bytes"] <= 64


# --- strategies that refuse CPU: the refusal, and the sizes read from the real objects -------------------

LIGHTNING_DEEPSPEED_ERROR = (
    "RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used."
)


def test_readers_on_real_deepspeed_engine_and_hf_fsdp_trainer_and_what_cpu_does_with_them(
    tmp_path: Path,
) -> None:
    pytest.importorskip("deepspeed")
    torchrun("readers", str(tmp_path), env=DEEPSPEED_ENV)
    for seen in ranks(tmp_path):
        # Lightning's DeepSpeedStrategy around an engine with Ulysses sequence parallelism over both
        # devices: one data-parallel replica, the sequence split in two (context parallel)
        expected = ParallelSizes(world_size=2, data_parallel=1, context_parallel=2)
        assert ParallelSizes(**seen["lightning_deepspeed"]) == expected
        assert seen["lightning_deepspeed_error"] == LIGHTNING_DEEPSPEED_ERROR
        # accelerate 1.15 turns FSDP on only for GPU-like devices: on CPU the Trainer asked for FSDP
        # trains with DDP, without a word; the sizes are DDP's
        assert (seen["hf_fsdp_enabled"], seen["hf_distributed_type"]) == (False, "DistributedType.MULTI_CPU")
        assert ParallelSizes(**seen["hf_fsdp"]) == ParallelSizes(world_size=2, data_parallel=2)
        # the engine's ZeRO-3 parameters, outside any forward: each weight split in two over the 2
        # devices, each bias (at most PERSISTED elements) kept whole; the model's size is the global one
        sizes = [p.numel() for p in mlp().parameters()]
        assert seen["zero3_stored"] == [n if n <= PERSISTED else n // 2 for n in sizes] == [64, 16, 32, 4]
        assert seen["zero3_global"] == sizes
        assert seen["zero3_model"] == sum(sizes)


def test_lightning_fsdp_strategy_refuses_cpu_at_trainer_construction() -> None:
    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy

    message = (
        "The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`. Please set "
        "`accelerator='cuda'`, `accelerator='gpu'`, or pass a `CUDAAccelerator()` instance to use FSDP."
    )
    with pytest.raises(ValueError) as error:
        L.Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    assert str(error.value) == message


def test_lightning_fsdp_hybrid_shard_reader_counts_every_device_as_a_data_replica() -> None:
    # HYBRID_SHARD on 2 nodes x 4 GPUs: shards within a node, replicates across nodes; all 8 devices
    # see different samples. The strategy object as the Trainer configures it, read as it exposes it.
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import FSDPStrategy

    from flops_callbacks.integrations.lightning import parallel_sizes

    environment = LightningEnvironment()
    environment.set_world_size(8)
    strategy = FSDPStrategy(
        sharding_strategy="HYBRID_SHARD",
        device_mesh=(2, 4),
        parallel_devices=[torch.device("cuda", i) for i in range(4)],
        cluster_environment=environment,
    )
    strategy.num_nodes = 2
    trainer = SimpleNamespace(
        strategy=strategy, distributed_sampler_kwargs=strategy.distributed_sampler_kwargs, world_size=8
    )
    assert parallel_sizes(trainer) == ParallelSizes(world_size=8, data_parallel=8)


# --- context parallel, and parameter sizes of sharded tensors --------------------------------------------


def test_context_parallel_size_from_accelerate_parallelism_config_is_a_summary_row() -> None:
    # accelerate added ParallelismConfig (and TrainingArguments its argument) in 1.10
    ParallelismConfig = pytest.importorskip("accelerate.parallelism_config").ParallelismConfig
    from transformers import TrainingArguments

    from flops_callbacks.integrations.hf import parallel_sizes

    config = ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], parallelism_config=config)
    sizes = parallel_sizes(SimpleNamespace(world_size=8, parallelism_config=args.parallelism_config))
    assert sizes == ParallelSizes(world_size=8, data_parallel=2, tensor_parallel=2, context_parallel=2)
    assert (sizes.world_size, sizes.data_parallel, sizes.model_parallel) == (8, 2, 4)
    assert dict(sizes.factor_lines()) == {
        "tensor parallel size": "2",
        "pipeline parallel size": "1",
        "context parallel size": "2",
    }


def test_parameter_sizes_of_plain_tensors_are_whole_and_not_sharded() -> None:
    plain = torch.nn.Linear(4, 3)
    assert [stored_numel(p) for p in plain.parameters()] == [12, 3]
    assert [global_numel(p) for p in plain.parameters()] == [12, 3]
    assert sharded_params(plain) is None  # every device holds every parameter whole
