"""What a batch holds: its tensors in tree order, its size, and the shape signature flops are keyed by."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import attrs
import pytest
import torch
from transformers import BatchEncoding, DataCollatorWithFlattening

from flops_callbacks.session.batch import batch_tensors, find_batch_size, leading_batch_size, shape_signature


def test_tensors_are_found_in_any_nesting_in_tree_order() -> None:
    a, b, c = torch.zeros(2, 3), torch.zeros(4), torch.zeros(5, 1)
    Pair = namedtuple("Pair", "x y")
    batch = {"inputs": [a, (b, 7, "text")], "extra": Pair(c, None)}
    assert [t.shape for t in batch_tensors(batch)] == [a.shape, b.shape, c.shape]


def test_the_batch_size_is_the_leading_dim_of_the_first_tensor_with_one() -> None:
    assert leading_batch_size({"scale": torch.tensor(2.0), "ids": torch.zeros(8, 16)}) == 8
    with pytest.raises(ValueError, match="size of a dict batch: it holds no tensor .*; pass batch_size_fn"):
        leading_batch_size({"name": "no tensors"})
    assert find_batch_size({"name": "no tensors"}) is None


@dataclasses.dataclass
class Pair:
    inputs: torch.Tensor
    mask: torch.Tensor | None = None


@attrs.define
class AttrsPair:
    name: str
    inputs: torch.Tensor


class Holder:
    """An object holding tensors in attributes, and itself (the walk must end)."""

    def __init__(self) -> None:
        self.ids, self.me, self.module = torch.zeros(6, 2), self, torch.nn.Linear(1, 1)


def test_tensors_are_found_in_dataclasses_attrs_classes_objects_and_batch_encodings() -> None:
    assert find_batch_size(Pair(torch.zeros(5, 3))) == 5
    assert find_batch_size(AttrsPair("x", torch.zeros(7))) == 7
    assert [t.shape for t in batch_tensors(Holder())] == [(6, 2)]  # not the Linear's weight
    assert find_batch_size(BatchEncoding({"input_ids": torch.zeros(9, 4)})) == 9
    assert shape_signature([Pair(torch.zeros(2, 1), torch.ones(2))]) == (
        ((2, 1), torch.float32),
        ((2,), torch.float32),
    )


def test_batches_alike_in_shapes_and_dtypes_share_a_signature() -> None:
    ids = torch.zeros(8, 16, dtype=torch.long)
    assert shape_signature({"input_ids": ids}) == (((8, 16), torch.long),)
    assert shape_signature({"input_ids": ids}) == shape_signature({"input_ids": torch.ones(8, 16).long()})
    assert shape_signature({"input_ids": ids}) != shape_signature({"input_ids": torch.zeros(8, 15).long()})
    assert shape_signature([ids]) != shape_signature([ids.int()])


def test_packed_rows_of_12_tokens_share_a_signature_whether_they_hold_3_sequences_or_2() -> None:
    flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    three = flatten(
        [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12]}]
    )
    two = flatten([{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7, 8, 9, 10, 11, 12]}])
    assert three["cu_seq_lens_q"].shape == (4,) and two["cu_seq_lens_q"].shape == (3,)
    row = ((1, 12), torch.long)
    assert (
        shape_signature(three) == shape_signature(two) == (row, row, row)
    )  # input_ids, labels, position_ids
    # other 1-D tensors keep their length: EmbeddingBag's 10 flat indices do other work than 12
    bag = {"input": torch.zeros(10, dtype=torch.long), "offsets": torch.tensor([0, 4])}
    assert shape_signature(bag) != shape_signature(bag | {"input": torch.zeros(12, dtype=torch.long)})
