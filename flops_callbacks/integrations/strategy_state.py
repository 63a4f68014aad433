"""What a Lightning strategy and precision say about a run, for the Trainer's callback and for
:class:`~flops_callbacks.StepProfiler` with ``fabric=``: the Trainer and Fabric keep the same facts in
classes of their own (``lightning.pytorch.strategies`` and ``lightning.fabric.strategies``), so each
adapter picks out the mesh, the engine and the precision string, and these functions read them alike.
Nothing of Lightning is imported here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import BF16, FP8, FP16, FP64, parameters_dtype

__all__ = ["precision_dtype", "strategy_sizes"]


def strategy_sizes(
    world_size: int, sampler_kwargs: Mapping[str, Any] | None, mesh: Any = None, engine: Any = None
) -> ParallelSizes:
    """How a strategy splits the run; every size is 1 where that parallelism is not used.

    Data parallel from the sampler's ``num_replicas`` (DDP, FSDP, FSDP2), tensor parallel from a
    ``ModelParallelStrategy``'s ``mesh``, and with a DeepSpeed ``engine`` the engine's own sizes: data
    parallel, tensor (``mp_world_size``), pipeline (``num_stages``) and Ulysses sequence parallel
    (``sequence_parallel_size``, context parallel here). Lightning 2.6 has no context parallelism of its
    own: its ``ModelParallelStrategy`` mesh is data x tensor only.

    Args:
        world_size: the run's processes.
        sampler_kwargs: the strategy's ``distributed_sampler_kwargs`` (None on one device).
        mesh: a ``ModelParallelStrategy``'s device mesh, or None.
        engine: a DeepSpeed engine, or None.
    """
    data_parallel = int((sampler_kwargs or {}).get("num_replicas", 1))
    tensor_parallel = pipeline_parallel = context_parallel = 1
    if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
        tensor_parallel = mesh["tensor_parallel"].size()
    if engine is not None:
        data_parallel = int(getattr(engine, "dp_world_size", data_parallel))
        tensor_parallel = int(getattr(engine, "mp_world_size", 1))
        pipeline_parallel = int(getattr(engine, "num_stages", 1))
        context_parallel = int(getattr(engine, "sequence_parallel_size", 1))
    return ParallelSizes(
        world_size=world_size,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
    )


def precision_dtype(precision: str, model: torch.nn.Module) -> str | None:
    """What the matmuls run in, from a Lightning precision string: ``bf16-*`` -> bf16, ``16-*`` -> fp16,
    Transformer Engine -> fp8, ``32-true`` -> the parameters' dtype (tf32 when torch allows it).

    Args:
        precision: the Lightning precision string.
        model: the model, for its parameters' dtype.
    """
    if precision.startswith("transformer-engine"):
        return FP8
    if precision.startswith("bf16"):
        return BF16
    if precision.startswith("16"):
        return FP16
    if precision.startswith("32"):
        return parameters_dtype(model)
    return FP64 if precision.startswith("64") else None
