"""How a run is split: DeepSpeed's three size rows always, the model-parallel factors when they matter,
and what a device stores of a parameter (2-process sharded runs: test_sharded.py)."""

from __future__ import annotations

import torch

from flops_callbacks.parallel import ParallelSizes, sharded_params, stored_numel


def test_model_parallel_is_the_product_of_its_factors_and_scales_the_model_rows() -> None:
    sizes = ParallelSizes(
        world_size=16, data_parallel=2, tensor_parallel=2, pipeline_parallel=2, context_parallel=2
    )
    assert sizes.model_parallel == 8
    assert (sizes.world_size, sizes.data_parallel) == (16, 2)
    assert dict(sizes.factor_lines()) == {
        "tensor parallel size": "2",
        "pipeline parallel size": "2",
        "context parallel size": "2",
    }


def test_without_model_parallelism_its_factors_are_not_shown() -> None:
    assert ParallelSizes(world_size=4, data_parallel=4).factor_lines() == []


def test_a_plain_tensor_is_stored_whole_and_a_plain_model_is_not_sharded() -> None:
    assert stored_numel(torch.zeros(3, 5)) == 15
    assert sharded_params(torch.nn.Linear(4, 2)) is None
