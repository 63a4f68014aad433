"""How a run is split across devices: the sizes both callbacks read from their framework."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelSizes:
    """World size and its factors. Every size is 1 where that kind of parallelism is not used.

    ``data_parallel`` counts replicas that see different samples (DDP, FSDP/ZeRO shards);
    ``model_parallel`` is how many devices share one copy of the model (tensor x pipeline x
    context), which turns per-device flops into flops of the model as DeepSpeed reports them.
    """

    world_size: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def summary_lines(self) -> list[tuple[str, str]]:
        """DeepSpeed's summary rows for these sizes."""
        return [
            ("world size", str(self.world_size)),
            ("data parallel size", str(self.data_parallel)),
            ("model parallel size", str(self.model_parallel)),
        ]
