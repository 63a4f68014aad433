"""What accelerate's state says about a run: how it is split across devices and what the matmuls run in.

Read by the HF Trainer's callback (whose Trainer runs on accelerate) and by
:class:`~flops_callbacks.StepProfiler` with ``accelerator=``; duck-typed (nothing of transformers or
accelerate is imported), so the core imports it without either installed.
"""

from __future__ import annotations

from typing import Any

import torch

from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import BF16, FP8, FP16, parameters_dtype

__all__ = ["compute_dtype", "parallel_sizes"]


def _size(value: Any) -> int:
    """A parallel size as an int; 1 for anything unset, "auto" or not positive."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _field(config: Any, name: str) -> Any:
    """``config.name`` or ``config[name]`` (configs arrive as objects or as dicts), None if absent."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def parallel_sizes(
    args: Any, model: Any = None, accelerator_state: Any = None, world_size: int | None = None
) -> ParallelSizes:
    """How the run is split, read from every place transformers and accelerate keep it; 1 where unused.

    World size from ``args.world_size`` (or ``world_size``: an accelerate loop has no Trainer args);
    data, tensor and context parallel sizes from accelerate's
    ``ParallelismConfig`` (``dp_replicate x dp_shard``, ``tp``, ``cp x sp``: sequence parallelism
    splits each sequence across ranks as context parallelism does); tensor parallelism also from
    the DeepSpeed plugin (``tensor_parallel.autotp_size``), accelerate's torch TP plugin, the Megatron
    plugin (with its pipeline size) and the model (``tp_size``, ``config.distributed_config``).
    Without a ``ParallelismConfig`` the data-parallel size is the world over the model-parallel size.

    Args:
        args: the Trainer's ``TrainingArguments``, or any object with their attributes.
        model: the model, for its ``tp_size`` and ``config.distributed_config`` (None: not read).
        accelerator_state: accelerate's state (None: not read).
        world_size: the world size where ``args`` has none.
    """
    state = accelerator_state
    config = getattr(args, "parallelism_config", None) or getattr(state, "parallelism_config", None)
    distributed = _field(getattr(model, "config", None), "distributed_config")
    megatron = getattr(state, "megatron_lm_plugin", None)
    tensor_parallel = max(
        _size(_field(config, "tp_size")),
        _size(_field(distributed, "tp_size")),
        _size(getattr(model, "tp_size", None)),
        _size(getattr(getattr(state, "torch_tp_plugin", None), "tp_size", None)),
        _size(getattr(megatron, "tp_degree", None)),
        _deepspeed_autotp_size(state),
    )
    pipeline_parallel = max(
        _size(_field(distributed, "pp_size")),
        _size(getattr(megatron, "pp_degree", None)),
    )
    context_parallel = _size(_field(config, "cp_size")) * _size(_field(config, "sp_size"))
    world = _size(world_size if world_size is not None else getattr(args, "world_size", 1))
    if config is None:
        data_parallel = max(world // (tensor_parallel * pipeline_parallel * context_parallel), 1)
    else:
        data_parallel = _size(_field(config, "dp_replicate_size")) * _size(_field(config, "dp_shard_size"))
    return ParallelSizes(
        world_size=world,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
    )


def _deepspeed_autotp_size(accelerator_state: Any) -> int:
    """DeepSpeed's AutoTP size (``tensor_parallel.autotp_size`` of the config), over all its plugins."""
    plugins = getattr(accelerator_state, "deepspeed_plugins", None) or {}
    if not isinstance(plugins, dict):
        plugins = {"default": plugins}
    configs = (getattr(plugin, "deepspeed_config", None) for plugin in plugins.values())
    return max((_size(_field(_field(c, "tensor_parallel"), "autotp_size")) for c in configs), default=1)


def compute_dtype(args: Any, model: torch.nn.Module, accelerator: Any = None) -> str | None:
    """What the matmuls run in: fp8 under accelerate's fp8 mixed precision, bf16 / fp16 with
    ``args.bf16`` / ``args.fp16``, else the model's parameter dtype (a model loaded in bf16 trains in
    bf16; fp32 is tf32 when torch allows it, as ``args.tf32`` sets it).

    Args:
        args: the Trainer's ``TrainingArguments``, or None.
        model: the model, for its parameters' dtype.
        accelerator: the accelerator, for its mixed precision (None: not read).
    """
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed == "fp8":
        return FP8
    if _autocasts_nothing(accelerator, mixed):
        return parameters_dtype(model)
    if getattr(args, "bf16", False) or mixed == "bf16":
        return BF16
    if getattr(args, "fp16", False) or mixed == "fp16":
        return FP16
    return parameters_dtype(model)


def _autocasts_nothing(accelerator: Any, mixed: str) -> bool:
    """Whether accelerate, asked for fp16 or bf16, autocasts nothing: fp16 on a CPU (its ``native_amp``
    off, with no error), where the matmuls run in the parameters' dtype. DeepSpeed and Megatron-LM cast
    the model themselves, with ``native_amp`` off too."""
    if accelerator is None or mixed not in ("fp16", "bf16") or getattr(accelerator, "native_amp", True):
        return False
    backend = str(getattr(accelerator, "distributed_type", ""))
    return "DEEPSPEED" not in backend and "MEGATRON" not in backend
