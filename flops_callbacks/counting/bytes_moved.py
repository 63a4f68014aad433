"""Bytes moved by one aten op: the memory traffic its arguments and results imply.

One rule for every op: it reads each tensor it is given and writes each tensor it returns
(``Tensor.nbytes``), with the exceptions :func:`bytes_rule` lists. These are the bytes an unfused,
uncached execution moves: what a roofline compares with the device's bandwidth (the docs, counting
and timing, say how caches and fusion make real traffic differ). Why not torch's own:
``torch.utils.flop_counter`` counts no bytes, and torchao's ``PerformanceCounterMode`` counts them
for matmul, conv and attention only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BytesRule", "bytes_rule"]

BytesRule = Callable[[tuple, dict, Any], int]
"""``rule(args, kwargs, out) -> bytes`` of one call, read after the call ran."""

aten = torch.ops.aten


def _tensor_bytes(t: torch.Tensor) -> int:
    """A strided tensor's bytes; 0 for a sparse or other layout, whose bytes its shape does not give."""
    return t.nbytes if t.layout == torch.strided else 0


def _nbytes(x: Any) -> int:
    """Bytes of a tensor, or of the tensors of a list or tuple (aten nests no deeper)."""
    if isinstance(x, torch.Tensor):
        return _tensor_bytes(x)
    if type(x) in (tuple, list):
        return sum(_tensor_bytes(t) for t in x if isinstance(t, torch.Tensor))
    return 0


def _reads_and_writes(args: tuple, kwargs: dict, out: Any) -> int:
    """Every tensor given is read, every tensor returned is written (an ``out=`` only written)."""
    moved = _nbytes(out)
    for a in args:
        moved += _nbytes(a)
    if kwargs:
        moved += sum(_nbytes(v) for k, v in kwargs.items() if k != "out")
    return moved


def _copy(args: tuple, kwargs: dict, out: Any) -> int:
    return _nbytes(args[0]) + _nbytes(args[1])  # copy_(dst, src): dst written, src read


def _written(args: tuple, kwargs: dict, out: Any) -> int:
    return _nbytes(out)  # fill_, zero_: the operand is overwritten, never read


def _gather(indices_at: int) -> BytesRule:
    """A gather reads as many elements of its table as it returns, and its indices."""

    def rule(args: tuple, kwargs: dict, out: Any) -> int:
        indices = args[indices_at] if len(args) > indices_at else kwargs.get("index", kwargs.get("indices"))
        return 2 * _nbytes(out) + _nbytes(indices)

    return rule


_NOTHING = frozenset(
    """
    empty empty_like new_empty new_empty_strided empty_strided _unsafe_view set_ resize_ detach_
    unsafe_split unsafe_split_with_sizes unsafe_chunk lift_fresh _assert_async _assert_tensor_metadata
    sym_constrain_range_for_size _functional_sym_constrain_range record_stream _local_scalar_dense
    """.split()
)
_BY_NAME: dict[str, BytesRule] = {
    "copy_": _copy,
    "fill_": _written,
    "zero_": _written,
    "embedding": _gather(1),  # embedding(weight, indices)
    "index_select": _gather(2),  # index_select(self, dim, index)
    "gather": _gather(2),  # gather(self, dim, index)
    "index": _gather(1),  # index(self, indices: list)
    "_unsafe_index": _gather(1),
    "take": _gather(1),  # take(self, index)
}

_RULES: dict[Any, BytesRule | None] = {}  # by overload, resolved once


def bytes_rule(func: torch._ops.OpOverload) -> BytesRule | None:
    """How calls of ``func`` move bytes; None for an op that moves none (a view, an allocation).

    An in-place op (``relu_``) reads and writes its operand; an ``out=`` argument is written, not read.
    Views (``func.is_view``) and ops that only change metadata or allocate (``empty``, ``set_``,
    ``resize_``, ``_unsafe_view`` ...) move nothing; ``copy_`` reads its source and writes its
    destination; ``fill_`` / ``zero_`` only write; gathers (``embedding``, ``index_select``, ``gather``,
    ``index``, ``take``) read the rows they return, not the whole table, plus the indices. NB: a
    broadcast operand counts its expanded elements.

    Args:
        func: the overload called.
    """
    try:
        return _RULES[func]
    except KeyError:
        name = func._overloadpacket.__name__
        rule = None if func.is_view or name in _NOTHING else _BY_NAME.get(name, _reads_and_writes)
        _RULES[func] = rule
        return rule
