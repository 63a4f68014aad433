"""What a batch holds: its tensors, its size, and its shape signature (the key flops are measured under)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch, in ``tree_leaves`` order. Written out for the usual containers (this
    runs on every micro-batch once throughput is metered: a third of pytree's time), pytree otherwise."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from batch_tensors(item)
    elif isinstance(batch, (dict, Mapping)):
        for item in batch.values():
            yield from batch_tensors(item)
    elif not isinstance(batch, (int, float, str, bytes, type(None))):
        yield from (leaf for leaf in torch.utils._pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor))


def leading_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch`` (any nesting of lists/dicts)."""
    for tensor in batch_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    raise ValueError("cannot find the batch size: the batch holds no tensor; pass batch_size_fn")


def shape_signature(batch: Any) -> Signature:
    """The shapes and dtypes of the tensors in ``batch``: micro-batches alike in them do the same flops."""
    return tuple((tuple(t.shape), t.dtype) for t in batch_tensors(batch))
