"""What a batch holds: its tensors in tree order, its size, and the shape signature flops are keyed by."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from flops_callbacks.batch import batch_tensors, leading_batch_size, shape_signature


def test_tensors_are_found_in_any_nesting_in_tree_order() -> None:
    a, b, c = torch.zeros(2, 3), torch.zeros(4), torch.zeros(5, 1)
    Pair = namedtuple("Pair", "x y")
    batch = {"inputs": [a, (b, 7, "text")], "extra": Pair(c, None)}
    assert [t.shape for t in batch_tensors(batch)] == [a.shape, b.shape, c.shape]


def test_the_batch_size_is_the_leading_dim_of_the_first_tensor_with_one() -> None:
    assert leading_batch_size({"scale": torch.tensor(2.0), "ids": torch.zeros(8, 16)}) == 8
    with pytest.raises(ValueError, match="the batch holds no tensor; pass batch_size_fn"):
        leading_batch_size({"name": "no tensors"})


def test_batches_alike_in_shapes_and_dtypes_share_a_signature() -> None:
    ids = torch.zeros(8, 16, dtype=torch.long)
    assert shape_signature({"input_ids": ids}) == (((8, 16), torch.long),)
    assert shape_signature({"input_ids": ids}) == shape_signature({"input_ids": torch.ones(8, 16).long()})
    assert shape_signature({"input_ids": ids}) != shape_signature({"input_ids": torch.zeros(8, 15).long()})
    assert shape_signature([ids]) != shape_signature([ids.int()])
