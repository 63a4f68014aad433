"""How a run is split across devices: the sizes both callbacks read from their framework, and how
much of each parameter one device holds.

Sizes are a small frozen dataclass rather than a dict so that every reader (Lightning strategy, HF
Trainer / accelerate state, the DeepSpeed API) fills the same five fields and the report prints
them the same way. Parameter sizes are read by duck typing (a DTensor's ``_local_tensor``,
DeepSpeed ZeRO-3's ``ds_tensor`` / ``ds_numel``) instead of importing torch.distributed.tensor or
deepspeed: a process that never loaded them has no such parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["global_numel", "ParallelSizes", "sharded_params", "stored_numel"]


@dataclass(frozen=True)
class ParallelSizes:
    """World size and its factors. Every size is 1 where that kind of parallelism is not used.

    ``data_parallel`` counts replicas that see different samples (DDP, FSDP/ZeRO shards);
    ``model_parallel`` is how many devices share one copy of the model (tensor x pipeline x
    context), which turns per-device flops into flops of the model as DeepSpeed reports them.
    ``context_parallel`` splits each sequence across devices (accelerate's ``cp_size x sp_size``).
    """

    world_size: int = 1  # processes in the run
    data_parallel: int = 1  # replicas that see different samples
    # the factors of model_parallel: devices that share one copy of the model
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def factor_lines(self) -> list[tuple[str, str]]:
        """Rows DeepSpeed does not print: the factors of the model-parallel size, when it is not 1."""
        if self.model_parallel == 1:
            return []
        return [
            ("tensor parallel size", str(self.tensor_parallel)),
            ("pipeline parallel size", str(self.pipeline_parallel)),
            ("context parallel size", str(self.context_parallel)),
        ]


def stored_numel(param: torch.Tensor) -> int:
    """Elements of ``param`` this device stores while training: a DTensor's local shard (FSDP2,
    tensor parallel); under ZeRO-3 its partition (padding included: DeepSpeed allocates it), or the
    whole parameter for the small ones it keeps whole on every device once gathered; else the tensor.

    Args:
        param: a parameter of the model.
    """
    local = getattr(param, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local.numel()
    partition = getattr(param, "ds_tensor", None)
    if isinstance(partition, torch.Tensor):
        if getattr(param, "ds_persist", False):
            return global_numel(param)
        return int(getattr(partition, "ds_numel", partition.numel()))
    return param.numel()


def global_numel(param: torch.Tensor) -> int:
    """Elements of the whole ``param`` over all devices: a DTensor's and a ZeRO-3 parameter's
    global size (ZeRO-3 empties ``param`` itself outside its module's forward and backward).

    Args:
        param: a parameter of the model.
    """
    ds_numel = getattr(param, "ds_numel", None)
    return int(ds_numel) if isinstance(ds_numel, int) else param.numel()


def sharded_params(model: torch.nn.Module) -> int | None:
    """Parameters of the whole model when some are sharded across devices (DTensors, ZeRO-3
    partitions), each tensor once; None when every device holds every parameter whole.

    Args:
        model: the model whose parameters are counted.
    """
    params = list(dict.fromkeys(model.parameters()))
    if all(stored_numel(p) == global_numel(p) and not hasattr(p, "_local_tensor") for p in params):
        return None
    return sum(global_numel(p) for p in params)
