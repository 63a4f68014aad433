"""What a batch holds: its tensors, its size, and its shape signature (the key flops are measured under).

Batches come as tensors, lists, tuples and namedtuples, mappings (dicts, HF ``BatchEncoding``),
dataclasses, attrs classes and plain objects holding tensors in attributes (all of which Lightning
passes through untouched): the tensors are found in all of them, in a stable order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from flops_callbacks.guard import Guard
from flops_callbacks.options import Options
from flops_callbacks.session.token_layout import CUMULATIVE_KEYS
from flops_callbacks.user_warning import warn

__all__ = [
    "BatchReader",
    "Signature",
    "batch_tensors",
    "find_batch_size",
    "leading_batch_size",
    "shape_signature",
]

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]

_MAX_DEPTH = 16  # objects that hold each other (a batch pointing at its dataset) end here
_SCALARS = (int, float, complex, bool, str, bytes, type(None))


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch, each container's in its own order. Written out for the usual containers
    (this runs on every micro-batch once throughput is metered: a third of pytree's time).

    Args:
        batch: a tensor or nested containers of them.
    """
    yield from _tensors(batch, 0, set(), ())


def _tensors(batch: Any, depth: int, seen: set[int], skip: tuple[str, ...]) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    if isinstance(batch, _SCALARS) or depth > _MAX_DEPTH or id(batch) in seen:
        return
    seen.add(id(batch))
    for item in _items(batch, skip):
        yield from _tensors(item, depth + 1, seen, skip)


def _items(batch: Any, skip: tuple[str, ...]) -> list[Any]:
    """What a container holds, in its order (a mapping's ``skip`` keys left out); nothing for what holds
    no tensor."""
    if isinstance(batch, (list, tuple)):
        return list(batch)
    if isinstance(batch, Mapping):
        return [value for key, value in batch.items() if key not in skip]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    attrs_fields = getattr(type(batch), "__attrs_attrs__", None)
    if attrs_fields is not None:
        return [getattr(batch, a.name) for a in attrs_fields]
    if type(batch) in torch.utils._pytree.SUPPORTED_NODES:
        return torch.utils._pytree.tree_flatten(batch)[0]
    if isinstance(batch, (type, torch.nn.Module)) or callable(batch):
        return []  # classes, modules and functions are not batch content
    held = getattr(batch, "__dict__", None)
    return list(held.values()) if isinstance(held, dict) else []


def find_batch_size(batch: Any) -> int | None:
    """The leading dimension of the first tensor in ``batch`` that has one; None if there is none.

    Args:
        batch: a tensor or nested containers of them.
    """
    for tensor in batch_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def leading_batch_size(batch: Any) -> int:
    """:func:`find_batch_size`, raising where the batch has no tensor with a leading dimension.

    Args:
        batch: a tensor or nested containers of them.
    """
    size = find_batch_size(batch)
    if size is None:
        raise ValueError(
            f"cannot find the batch size of a {type(batch).__name__} batch: it holds no tensor with a "
            "leading dimension; pass batch_size_fn"
        )
    return size


def shape_signature(batch: Any) -> Signature:
    """The shapes and dtypes of the tensors in ``batch``: micro-batches alike in them do the same flops.
    Packed sequences' boundaries (``cu_seq_lens_*``) are left out: their length, the number of sequences in
    a row, sets no kernel's work (the rows x positions tensors beside them do, and the sequences' own work
    is read from the layout); where a kernel reads their values, that is content, which the content check
    finds.

    Args:
        batch: a tensor or nested containers of them.
    """
    # NB: only these named tensors, not 1-D ones at large: a 1-D length can be the work (EmbeddingBag's)
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(batch, 0, set(), CUMULATIVE_KEYS))


class BatchReader:
    """Samples and tokens of a callback's micro-batches: the user's ``batch_size_fn`` / ``tokens_fn``
    through the guard (their errors are theirs), else the leading dimension of the first tensor and the
    adapter's ``default_tokens_fn``. A batch whose size cannot be found is said once per run.

    Args:
        options: the run's options (``batch_size_fn``, ``tokens_fn``).
        owner: the callback's name, as warnings say it.
        guard: the guard the user's functions run through.
        default_tokens_fn: the adapter's tokens of a batch where the user gives none (None: no tokens).
    """

    def __init__(
        self,
        options: Options,
        owner: str,
        guard: Guard,
        default_tokens_fn: Callable[[Any], int | None] | None = None,
    ) -> None:
        self.options, self.owner, self.guard = options, owner, guard
        self.default_tokens_fn = default_tokens_fn
        self.said_no_size = False

    def samples(self, batch: Any, say_unknown: bool = False) -> int | None:
        """Samples in a micro-batch; None when it has no tensor with a leading dimension.

        Args:
            batch: the micro-batch.
            say_unknown: whether a batch whose size cannot be found is said (once per run).
        """
        if self.options.batch_size_fn is not None:
            return int(self.guard.user(self.options.batch_size_fn, batch))
        size = find_batch_size(batch)
        if size is None and say_unknown and not self.said_no_size:
            self.said_no_size = True
            warn(
                f"{self.owner}: cannot find the batch size of a {type(batch).__name__} batch (no tensor "
                "with a leading dimension in it): samples/second is n/a. Pass batch_size_fn (and "
                "tokens_fn) to say how many samples (tokens) a batch holds. Training goes on.",
            )
        return size

    def samples_or_zero(self, batch: Any) -> int:
        """Samples in a micro-batch, 0 when unknown (the meter's count).

        Args:
            batch: the micro-batch.
        """
        return self.samples(batch) or 0

    def tokens(self, batch: Any) -> int | None:
        """Tokens in a micro-batch, or None when unknown.

        Args:
            batch: the micro-batch.
        """
        if self.options.tokens_fn is not None:
            tokens = self.guard.user(self.options.tokens_fn, batch)
        elif self.default_tokens_fn is not None:
            tokens = self.default_tokens_fn(batch)
        else:
            return None
        return None if tokens is None else int(tokens)
