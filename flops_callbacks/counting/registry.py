"""The formula registry: how every aten op (or a user's ``torch.library`` op) is counted.

One entry per op says its kind (dense, elementwise, free, metadata, uncounted), its formula, and
whether its flops shrink under a causal mask or partly recompute forward work. Like torch's
``register_flop_formula`` (``torch/utils/flop_counter.py``), adding an op is one decorated function
and a second registration of an op is refused; unlike it, :meth:`FormulaEntry.count` returns MACs
beside flops, formulas see the call's own arguments (no shape mapping per call), and an op with no
entry is not silently 0: ops torch's registry knows get its formula, pointwise and reduction ops
one flop per element, views and random draws none, and anything else is listed as uncounted. A call
whose tensors are all integer or bool counts no flops, whatever its entry (mask and index arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import flop_registry as _torch_registry

__all__ = [
    "decomposes",
    "entry_for",
    "Formula",
    "FormulaEntry",
    "largest_tensor_numel",
    "OpCount",
    "OpKind",
    "register_formula",
    "register_op_kind",
    "registered",
    "Share",
    "torch_formula",
]

Formula = Callable[[tuple, dict, Any], int]
"""``formula(args, kwargs, out) -> flops``: the op's arguments as called, and its output."""

Share = Callable[[torch._ops.OpOverload, tuple, dict], float]
"""``share(func, args, kwargs) -> fraction`` of a call's flops, for causal scaling and recompute."""


class OpKind(str, Enum):
    """How an op's arithmetic is classified. Bytes moved are apart
    (:mod:`flops_callbacks.counting.bytes_moved`):
    a FREE copy, gather or creation moves bytes, a FREE view and a METADATA query none."""

    DENSE = "dense"  # multiply-accumulates (matmul, conv, attention): MACs = flops / 2
    ELEMENTWISE = "elementwise"  # pointwise, reductions, norms, softmax, pooling: flops, no MACs
    FREE = "free"  # views, copies, creation, indexing: no arithmetic
    UNCOUNTED = "uncounted"  # does arithmetic we have no formula for: listed in the coverage section
    METADATA = "metadata"  # size, stride, device queries: not even a call to report


_COUNTED = (OpKind.DENSE, OpKind.ELEMENTWISE)


class OpCount(NamedTuple):
    """One call's work: flops and MACs, and the part of them that recomputes forward work."""

    flops: int = 0
    macs: int = 0
    recompute_flops: int = 0
    recompute_macs: int = 0


_NOTHING = OpCount()


@dataclass(frozen=True, slots=True)
class FormulaEntry:
    """How one op is counted.

    ``causal_share`` (when set) gives the kept fraction of a call's flops when it applies a causal
    mask; it is used only when the profile asks for ``causal_attention="half"``. ``recompute_share``
    (when set) gives the fraction of a backward call's flops that recomputes forward work (fused
    attention backwards recompute QK^T): reported as recompute, not backward.
    """

    kind: OpKind
    formula: Formula | None = None
    causal_share: Share | None = None
    recompute_share: Share | None = None

    def count(
        self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any, causal_half: bool
    ) -> OpCount:
        """Flops and MACs of one call of ``func`` (nothing for free, metadata and uncounted ops).

        Args:
            func: the overload called.
            args: the call's positional arguments.
            kwargs: its keyword arguments.
            out: its output.
            causal_half: whether a causal call counts its kept share only.
        """
        # NB: a call on integer and bool tensors only does no floating-point operation: 0 flops, bytes kept
        if self.formula is None or _integer_only(args, kwargs, out):
            return _NOTHING
        flops = int(self.formula(args, kwargs, out))
        if causal_half and self.causal_share is not None:
            flops = round(flops * self.causal_share(func, args, kwargs))
        dense = self.kind is OpKind.DENSE
        macs = flops // 2 if dense else 0  # a multiply-accumulate is two flops
        if self.recompute_share is None:
            return OpCount(flops, macs)
        rec_flops = round(flops * self.recompute_share(func, args, kwargs))
        rec_macs = rec_flops // 2 if dense else 0
        return OpCount(flops - rec_flops, macs - rec_macs, rec_flops, rec_macs)


_INTEGER = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)}
)


def _not_integer(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype not in _INTEGER


def _integer_only(args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether a call has tensors and all of them, inputs and outputs, are integer or bool."""
    if _not_integer(out) or (type(out) in (tuple, list) and any(_not_integer(o) for o in out)):
        return False  # most calls: a floating output, no walk over the arguments
    leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(_not_integer(t) for t in tensors)


_ENTRIES: dict[Any, FormulaEntry] = {}  # by overload packet or overload, as registered
_RESOLVED: dict[torch._ops.OpOverload, FormulaEntry] = {}  # by overload, fallbacks applied


def _ops_of(ops: Any) -> list[Any]:
    found = list(ops) if isinstance(ops, (list, tuple, set, frozenset)) else [ops]
    for op in found:
        if not isinstance(op, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            raise ValueError(
                f"ops must be torch op overload packets or overloads (torch.ops.aten.mm, "
                f"torch.ops.mylib.op.default), got {op!r} of type {type(op).__name__}"
            )
    return found


def _kind_of(kind: OpKind | str) -> OpKind:
    try:
        return OpKind(kind)
    except ValueError:
        accepted = ", ".join(repr(k.value) for k in OpKind)
        raise ValueError(f"kind must be one of {accepted}, got {kind!r}") from None


def _has_formula(op: Any) -> bool:
    """Whether ``op`` (a packet or an overload) has an entry already, its own or, for an overload, its
    packet's (an overload's entry takes over its packet's: registering it replaces that one for it), or,
    for a packet, one of its overloads' (which would keep theirs over the packet's). torch's own
    formulas are fallbacks, which an entry of ours replaces."""
    if op in _ENTRIES:
        return True
    if isinstance(op, torch._ops.OpOverload):
        return op._overloadpacket in _ENTRIES
    return bool(_overloads_of(op))


def _overloads_of(packet: Any) -> list[Any]:
    """The overloads of ``packet`` with an entry of their own."""
    return [op for op in _ENTRIES if isinstance(op, torch._ops.OpOverload) and op._overloadpacket is packet]


def _add(ops: Any, entry: FormulaEntry, replace: bool) -> None:
    found = _ops_of(ops)
    if not replace:
        taken = [str(op) for op in found if _has_formula(op)]
        if taken:
            raise ValueError(f"{', '.join(taken)} already registered; pass replace=True to replace")
    for op in found:
        for overload in _overloads_of(op):  # a packet's entry replaces its overloads' (else they win)
            del _ENTRIES[overload]
        _ENTRIES[op] = entry
    _RESOLVED.clear()
    _DECOMPOSES.clear()


def register_formula(
    ops: Any,
    *,
    kind: OpKind | str = OpKind.DENSE,
    causal_share: Share | None = None,
    recompute_share: Share | None = None,
    replace: bool = False,
) -> Callable[[Formula], Formula]:
    """Decorator: count calls of ``ops`` (one op or a list; packets or overloads) with the function.

    The function takes ``(args, kwargs, out)`` of a call and returns its flops. Registering an op that
    has an entry raises ``ValueError`` unless ``replace=True``.

    Args:
        ops: one op or a list of them, packets or overloads.
        kind: ``"dense"`` (MACs are half the flops) or ``"elementwise"`` (no MACs).
        causal_share: the kept fraction of a call's flops when it applies a causal mask (used under
            ``causal_attention="half"`` only).
        recompute_share: the fraction of a backward call's flops that recomputes forward work (reported as
            recompute).
        replace: whether an op that has an entry may be registered again.
    """
    entry_kind = _kind_of(kind)
    if entry_kind not in _COUNTED:
        raise ValueError(f"kind must be 'dense' or 'elementwise' for a formula, got {kind!r}")
    found = _ops_of(ops)

    def register(formula: Formula) -> Formula:
        _add(found, FormulaEntry(entry_kind, formula, causal_share, recompute_share), replace)
        return formula

    return register


def register_op_kind(ops: Any, kind: OpKind | str, *, replace: bool = False) -> None:
    """Classify ``ops`` as ``"free"`` (no arithmetic), ``"metadata"`` (not even a call to report)
    or ``"uncounted"`` (arithmetic without a formula: listed in the coverage section).

    Args:
        ops: one op or a list of them, packets or overloads.
        kind: ``"free"``, ``"metadata"`` or ``"uncounted"``.
        replace: whether an op that has an entry may be classified again.
    """
    entry_kind = _kind_of(kind)
    if entry_kind in _COUNTED:
        raise ValueError(f"kind must be 'free', 'metadata' or 'uncounted' without a formula, got {kind!r}")
    _add(ops, FormulaEntry(entry_kind), replace)


def registered(op: Any) -> FormulaEntry | None:
    """The entry registered for exactly ``op`` (a packet or an overload), if any.

    Args:
        op: a packet or an overload.
    """
    return _ENTRIES.get(op)


# Profiler marks, and collectives and the copies around them (FSDP's all-gathers, reduce-scatters,
# chunk_cat): they move data between devices; the reductions of a reduce-scatter are not model flops.
_NO_ARITHMETIC_NAMESPACES = frozenset({"profiler", "c10d", "_c10d_functional", "c10d_functional", "fsdp"})


def entry_for(func: torch._ops.OpOverload) -> FormulaEntry:
    """How calls of the overload ``func`` are counted (resolved once per overload).

    Args:
        func: the overload called.
    """
    found = _RESOLVED.get(func)
    if found is None:
        found = _RESOLVED[func] = _resolve(func)
    return found


_DECOMPOSES: dict[torch._ops.OpOverload, bool] = {}


def decomposes(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` has no formula of its own and runs as its parts: an op with a
    CompositeImplicitAutograd kernel (``aten.linear``, ``aten.layer_norm``,
    ``aten.scaled_dot_product_attention``), which autograd splits before a dispatch mode sees it, but which
    reaches the mode whole under ``torch.inference_mode`` (counted as its parts there too, as
    FlopCounterMode does: whole, it was uncounted, and attention 0 with no word).

    Args:
        func: the overload called.
    """
    found = _DECOMPOSES.get(func)
    if found is None:
        if func.namespace == "prim":  # prim.device and its kind answer queries; asked, prim.device aborts
            found = False
        else:
            whole = entry_for(func).kind in _COUNTED or func.is_view
            has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
            found = has_kernel(func.name(), "CompositeImplicitAutograd") and not whole
        _DECOMPOSES[func] = found
    return found


def _resolve(func: torch._ops.OpOverload) -> FormulaEntry:
    packet, tags = func._overloadpacket, func.tags
    entry = _ENTRIES.get(func) or _ENTRIES.get(packet)
    if entry is not None:
        return entry
    if packet in _torch_registry:
        return FormulaEntry(OpKind.DENSE, torch_formula(packet))
    if func.is_view or func.namespace in _NO_ARITHMETIC_NAMESPACES:
        return FormulaEntry(OpKind.FREE)
    if torch.Tag.pointwise in tags:
        return FormulaEntry(OpKind.ELEMENTWISE, _pointwise)
    if torch.Tag.reduction in tags:
        return FormulaEntry(OpKind.ELEMENTWISE, _reduction)
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.inplace_view in tags:
        return FormulaEntry(OpKind.FREE)
    return FormulaEntry(OpKind.UNCOUNTED)


def largest_tensor_numel(x: Any) -> int:
    """Elements of ``x``, or of its largest tensor when it is a tuple or list of them.

    Args:
        x: a tensor, or a tuple or list of them.
    """
    if isinstance(x, torch.Tensor):  # most ops: skip the pytree walk, which costs microseconds
        return x.numel()
    leaves = torch.utils._pytree.tree_leaves(x)
    return max((t.numel() for t in leaves if isinstance(t, torch.Tensor)), default=0)


def _pointwise(args: tuple, kwargs: dict, out: Any) -> int:
    return largest_tensor_numel(out)  # one flop per output element


def _reduction(args: tuple, kwargs: dict, out: Any) -> int:
    for a in args:  # one flop per element of the first tensor argument
        if isinstance(a, torch.Tensor):
            return a.numel()
    return 0


def _shapes(x: Any) -> Any:
    """``x`` with every tensor replaced by its shape, inside plain tuples and lists too."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if type(x) in (tuple, list):
        return type(x)(_shapes(item) for item in x)
    return x


def torch_formula(packet: Any) -> Formula:
    """Torch's ``flop_registry`` formula for ``packet``, called on our ``(args, kwargs, out)``.

    Args:
        packet: the op's packet.
    """
    formula = _torch_registry[packet]
    on_shapes = getattr(formula, "__wrapped__", None)
    if on_shapes is None:  # registered with get_raw=True: takes the tensors themselves
        return lambda args, kwargs, out: formula(*args, **kwargs, out_val=out)
    # torch's shape_wrapper maps tensors to shapes with pytree.tree_map on every call, which cost
    # about as much as the rest of a dense op's accounting; aten arguments nest only in tuples and
    # lists, so mapping those directly gives the formula the same arguments.
    return lambda args, kwargs, out: on_shapes(
        *_shapes(args), **{k: _shapes(v) for k, v in kwargs.items()}, out_shape=_shapes(out)
    )
