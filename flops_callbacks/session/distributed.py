"""What a profile needs from the other ranks of a multi-process run: their phase latencies."""

from __future__ import annotations

import torch

__all__ = ["gather_latencies", "Latencies"]

Latencies = tuple[float, float, float]  # (fwd, bwd, step) seconds


def gather_latencies(local: tuple[float, ...], device: torch.device) -> list[tuple[float, ...]]:
    """Every rank's row of times (``(fwd, bwd, step)`` latencies, or any row of floats of one length),
    by rank: an all-gather that every rank of the default process group must join (just ``[local]``
    without one).

    The tensor lives where the backend can move it: on the CPU for gloo / MPI, on the model's device
    otherwise (this rank's GPU for NCCL).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [local]
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend:
        device = torch.device("cpu")
    elif device.type == "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(local, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [tuple(float(v) for v in row) for row in torch.stack(every).tolist()]
