"""Flop formulas for aten ops: which ops do arithmetic, how much, and which do none.

Dense ops (matmul, conv, attention) reuse torch's own ``flop_registry`` from
``torch.utils.flop_counter``, so our counts are FlopCounterMode's counts by construction. This
module only adds what that registry lacks: the CPU SDPA kernel and RNN kernels (which torch counts
as 0), vector products, and elementwise / norm / softmax / pooling ops (DeepSpeed counts those, and
users compare with DeepSpeed). Torch's convolution backward is replaced (it overcounts grouped
convolutions), and its matmul formulas are restated for speed. Every formula is a pure function of
the op's arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import flop_registry as _torch_registry

aten = torch.ops.aten


class OpKind(str, Enum):
    """How an op's arithmetic is classified."""

    DENSE = "dense"  # matmul / conv / attention: multiply-accumulates, MACs = flops / 2
    ELEMENTWISE = "elementwise"  # pointwise, reductions, norms, softmax, pooling, interpolation
    FREE = "free"  # views, copies, creation, indexing: no arithmetic
    UNCOUNTED = "uncounted"  # does arithmetic we have no formula for: listed in the coverage section
    METADATA = "metadata"  # size, stride, device queries: not even a call to report


Formula = Callable[..., int]

# Ours, keyed by overload packet; each takes (args, kwargs, out) and returns flops.
_DENSE: dict[Any, Formula] = {}
_ELEMENTWISE: dict[Any, Formula] = {}


def _register(table: dict[Any, Formula], *ops: Any) -> Callable[[Formula], Formula]:
    def deco(fn: Formula) -> Formula:
        for op in ops:
            if op is not None:
                table[op] = fn
        return fn

    return deco


def _op(name: str) -> Any:
    """The aten overload packet ``name``, or None on a torch build without it."""
    return getattr(aten, name, None)


def _numel(x: Any) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def _largest_tensor_numel(x: Any) -> int:
    if isinstance(x, torch.Tensor):  # most ops: skip the pytree walk, which costs microseconds
        return x.numel()
    leaves = torch.utils._pytree.tree_leaves(x)
    return max((t.numel() for t in leaves if isinstance(t, torch.Tensor)), default=0)


def _first_tensor_numel(args: tuple) -> int:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel()
    return 0


# --- dense ops torch's registry does not have ---------------------------------------------------


def causal_fraction(s_q: int, s_k: int) -> float:
    """Fraction of the (s_q x s_k) score matrix that a top-left causal mask keeps (torch's is_causal)."""
    kept = sum(min(i + 1, s_k) for i in range(s_q))
    return kept / (s_q * s_k)


# The fused attention kernels all take (batch, heads, seq, head dim) tensors, q, k, v first (a
# backward: grad_out first). torch's registry lacks the default CPU kernel (FlopCounterMode counts 0
# for it), and its sdpa formulas cost ~60 us a call: each of their bmm terms goes through the
# pytree shape mapping. These are the same sums (GQA: k and v may have fewer heads than q).
_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


@_register(_DENSE, *(_op(name) for name in _ATTENTION))
def _attention_flop(args: tuple, kwargs: dict, out: Any) -> int:
    q, k, v = args[:3]
    *batch_heads, s_q, d_q = q.shape
    return 2 * math.prod(batch_heads) * s_q * k.shape[-2] * (d_q + v.shape[-1])  # QK^T, then AV


@_register(_DENSE, *(_op(f"{name}_backward") for name in _ATTENTION))
def _attention_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    q, k, v = args[1:4]
    *batch_heads, s_q, d_q = q.shape
    # the recomputed QK^T, dV, dP = dO V^T, dQ, dK: three products over d_q, two over d_v
    return 2 * math.prod(batch_heads) * s_q * k.shape[-2] * (3 * d_q + 2 * v.shape[-1])


# mm/bmm and their add- forms are in torch's registry too, with these counts; ours skip its pytree
# shape mapping (done twice per addmm), which costs 50x the arithmetic on the most frequent ops.
@_register(_DENSE, aten.mm, aten.bmm)
def _matmul_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel() * args[1].shape[-1]


@_register(_DENSE, aten.addmm, aten.baddbmm)
def _add_matmul_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel() * args[2].shape[-1]


@_register(_DENSE, aten.mv)
def _mv_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


@_register(_DENSE, aten.addmv)
def _addmv_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel()


@_register(_DENSE, aten.dot, aten.vdot)
def _dot_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


@_register(_DENSE, aten.addbmm)
def _addbmm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    b, m, k = args[1].shape
    return 2 * b * m * k * args[2].shape[-1]


@_register(_DENSE, _op("_addmm_activation"))
def _addmm_activation_flop(args: tuple, kwargs: dict, out: Any) -> int:
    m, k = args[1].shape
    return 2 * m * k * args[2].shape[-1]


@_register(_DENSE, aten.convolution_backward)
def _conv_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Each requested gradient (input, weight) is one forward-sized convolution. Torch's formula
    # counts a grouped convolution's weight gradient `groups` times over (it folds the groups into
    # one big convolution; pytorch/pytorch#183405), so a depthwise layer's would read channels x.
    grad_out, inp, weight, transposed, output_mask = args[0], args[1], args[2], args[7], args[10]
    positions = math.prod((inp if transposed else grad_out).shape[2:])
    forward = 2 * inp.shape[0] * positions * weight.numel()
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def _rnn_tokens(inp: torch.Tensor, batch_sizes: Any) -> int:
    # Packed input is (sum of lengths, features); padded input is (seq, batch, features) in any order.
    if isinstance(batch_sizes, torch.Tensor) and batch_sizes.numel() > 0:
        return inp.shape[0]
    return inp.numel() // inp.shape[-1]


@_register(_DENSE, _op("mkldnn_rnn_layer"))
def _mkldnn_rnn_layer_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # One layer, one direction: every token multiplies by W_ih and W_hh (the standard RNN formula).
    inp, w_ih, w_hh = args[0], args[1], args[2]
    return 2 * _rnn_tokens(inp, args[8]) * (w_ih.numel() + w_hh.numel())


@_register(_DENSE, _op("mkldnn_rnn_layer_backward"))
def _mkldnn_rnn_layer_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Gradients w.r.t. the input/hidden state and w.r.t. both weight matrices: twice the forward.
    inp, w_ih, w_hh = args[0], args[1], args[2]
    return 4 * _rnn_tokens(inp, args[20]) * (w_ih.numel() + w_hh.numel())


def _rnn_weight_numel(weights: Any) -> int:
    return sum(w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2)


@_register(_DENSE, _op("_cudnn_rnn"), _op("miopen_rnn"))
def _fused_rnn_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # All layers and directions in one kernel; every layer sees every token once.
    return 2 * _rnn_tokens(args[0], args[14] if len(args) > 14 else None) * _rnn_weight_numel(args[1])


@_register(_DENSE, _op("_cudnn_rnn_backward"), _op("miopen_rnn_backward"))
def _fused_rnn_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 4 * _rnn_tokens(args[0], None) * _rnn_weight_numel(args[1])


# --- elementwise ops with a named formula (DeepSpeed's conventions where it has one) ---------------


def _norm_flops(inp: torch.Tensor, weight: Any, affine_cost: int, plain_cost: int) -> int:
    return inp.numel() * (affine_cost if isinstance(weight, torch.Tensor) else plain_cost)


@_register(_ELEMENTWISE, aten.native_layer_norm)
def _layer_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # mean, subtract, variance, normalize (+ scale and shift): 4 or 5 per element, as DeepSpeed.
    return _norm_flops(args[0], args[2] if len(args) > 2 else None, 5, 4)


@_register(_ELEMENTWISE, aten.native_layer_norm_backward)
def _layer_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Backward of every norm: twice its forward (input gradient plus affine-parameter gradients).
    return 2 * _norm_flops(args[1], args[5], 5, 4)


@_register(_ELEMENTWISE, _op("_fused_rms_norm"))
def _rms_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[2] if len(args) > 2 else None, 4, 3)


@_register(_ELEMENTWISE, _op("_fused_rms_norm_backward"))
def _rms_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _norm_flops(args[1], args[4] if len(args) > 4 else None, 4, 3)


@_register(_ELEMENTWISE, aten.native_group_norm)
def _group_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[1], 5, 4)


@_register(_ELEMENTWISE, aten.native_group_norm_backward)
def _group_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _norm_flops(args[1], args[5], 5, 4)


@_register(
    _ELEMENTWISE,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    _op("_batch_norm_with_update"),
    _op("cudnn_batch_norm"),
    _op("miopen_batch_norm"),
)
def _batch_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # DeepSpeed: training computes statistics (5 or 4 per element); inference applies them (2 or 1).
    training = args[5] if len(args) > 5 and isinstance(args[5], bool) else True
    return _norm_flops(args[0], args[1], 5, 4) if training else _norm_flops(args[0], args[1], 2, 1)


@_register(_ELEMENTWISE, aten._native_batch_norm_legit_no_training)
def _batch_norm_eval_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[1], 2, 1)


@_register(
    _ELEMENTWISE,
    aten.native_batch_norm_backward,
    _op("batch_norm_backward"),
    _op("cudnn_batch_norm_backward"),
    _op("miopen_batch_norm_backward"),
)
def _batch_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _norm_flops(args[1], args[2], 5, 4)


@_register(_ELEMENTWISE, aten._softmax, aten._log_softmax, _op("_safe_softmax"))
def _softmax_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # DeepSpeed's convention: one flop per element


@_register(_ELEMENTWISE, aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


_POOLS = [
    f"{kind}_pool{d}d{suffix}"
    for kind in ("max", "avg", "adaptive_max", "adaptive_avg", "_adaptive_avg")
    for d in (1, 2, 3)
    for suffix in ("", "_with_indices")
]


@_register(_ELEMENTWISE, *(_op(name) for name in _POOLS))
def _pool_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # DeepSpeed: every input element is read into one comparison or sum


@_register(_ELEMENTWISE, *(_op(name + "_backward") for name in _POOLS), _op("embedding_dense_backward"))
def _grad_input_sized_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # one add per element of the incoming gradient


_UPSAMPLES = [
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
]


@_register(_ELEMENTWISE, *(_op(name) for name in _UPSAMPLES))
def _upsample_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _numel(out)  # DeepSpeed: one flop per output element


@_register(_ELEMENTWISE, *(_op(name + "_backward") for name in _UPSAMPLES))
def _upsample_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()


@_register(_ELEMENTWISE, aten.native_dropout)
def _dropout_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()


@_register(_ELEMENTWISE, aten.nll_loss_forward, aten.nll_loss2d_forward)
def _nll_loss_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[1].numel()


@_register(_ELEMENTWISE, aten.nll_loss_backward, aten.nll_loss2d_backward)
def _nll_loss_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[2].numel()


@_register(_ELEMENTWISE, aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss)
def _regression_loss_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 3 * args[0].numel()  # difference, square/abs, reduction


@_register(_ELEMENTWISE, aten.mse_loss_backward, aten.smooth_l1_loss_backward, aten.huber_loss_backward)
def _regression_loss_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel()


@_register(_ELEMENTWISE, aten.scatter_add, aten.index_add, aten.cumsum, aten.cumprod)
def _accumulate_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _largest_tensor_numel(args[3] if len(args) > 3 else args[0])


# --- ops that do no arithmetic ---------------------------------------------------------------------
# (unsafe_split & co. are views without alias tracking, used by the CPU GRU/LSTM cells)

_FREE_NAMES = """
    copy_ fill_ zero_ clone _to_copy lift_fresh lift_fresh_copy masked_fill where embedding
    index_select gather index _unsafe_index index_put scatter slice_backward select_backward
    slice_scatter select_scatter diagonal_scatter as_strided_scatter cat stack zeros ones empty
    full zeros_like ones_like empty_like full_like new_empty new_zeros new_ones new_full
    new_empty_strided empty_strided arange scalar_tensor triu tril _unsafe_view _local_scalar_dense
    constant_pad_nd repeat roll flip expand_copy view_copy _reshape_copy resize_ set_ detach_
    _assert_async _assert_tensor_metadata sym_constrain_range_for_size _functional_sym_constrain_range
    masked_fill_ index_fill im2col col2im _pin_memory record_stream eye linspace
    unsafe_split unsafe_split_with_sizes unsafe_chunk
""".split()
_FREE: frozenset[Any] = frozenset(p for p in (_op(n) for n in _FREE_NAMES) if p is not None)
_METADATA: frozenset[Any] = frozenset(
    (
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.size,
        aten.stride,
        aten.numel,
        aten.dim,
        aten.is_contiguous,
        torch.ops.prim.layout,
        torch.ops.prim.device,
    )
)


def _bound_arg(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of argument ``name`` of an aten call, positional or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else arg.default_value
    return None


class OpRule(NamedTuple):
    """How one aten overload is counted: its kind and its formula (None for free / uncounted)."""

    kind: OpKind
    formula: Formula | None


def _shapes(x: Any) -> Any:
    """``x`` with every tensor replaced by its shape, inside plain tuples and lists too."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if type(x) in (tuple, list):
        return type(x)(_shapes(item) for item in x)
    return x


def _torch_formula(packet: Any) -> Formula:
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


def _pointwise(args: tuple, kwargs: dict, out: Any) -> int:
    return _largest_tensor_numel(out)  # one flop per output element


def _reduction(args: tuple, kwargs: dict, out: Any) -> int:
    return _first_tensor_numel(args)  # one flop per input element


_RULES: dict[Any, OpRule] = {}


def rule(func: torch._ops.OpOverload) -> OpRule:
    found = _RULES.get(func)
    if found is not None:
        return found
    packet, tags = func._overloadpacket, func.tags
    if packet in _METADATA:
        rule = OpRule(OpKind.METADATA, None)
    elif packet in _DENSE:
        rule = OpRule(OpKind.DENSE, _DENSE[packet])
    elif packet in _torch_registry:
        rule = OpRule(OpKind.DENSE, _torch_formula(packet))
    elif packet in _ELEMENTWISE:
        rule = OpRule(OpKind.ELEMENTWISE, _ELEMENTWISE[packet])
    elif packet in _FREE or func.is_view or func.namespace == "profiler":
        rule = OpRule(OpKind.FREE, None)
    elif torch.Tag.pointwise in tags:
        rule = OpRule(OpKind.ELEMENTWISE, _pointwise)
    elif torch.Tag.reduction in tags:
        rule = OpRule(OpKind.ELEMENTWISE, _reduction)
    elif torch.Tag.nondeterministic_seeded in tags or torch.Tag.inplace_view in tags:
        rule = OpRule(OpKind.FREE, None)
    else:
        rule = OpRule(OpKind.UNCOUNTED, None)
    _RULES[func] = rule
    return rule


def count_flops(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any, causal_half: bool = False
) -> int:
    """Flops of one aten call (0 for free and uncounted ops).

    ``causal_half`` scales attention kernels called with ``is_causal=True`` to the unmasked part of
    the score matrix; by default the full QK^T and AV products are counted, as FlopCounterMode,
    DeepSpeed and the PaLM MFU definition do.
    """
    formula = rule(func).formula
    if formula is None:
        return 0
    flops = int(formula(args, kwargs, out))
    return _causal_scaled(func, args, kwargs, flops) if causal_half else flops


def _causal_scaled(func: torch._ops.OpOverload, args: tuple, kwargs: dict, flops: int) -> int:
    """``flops`` of an attention kernel called with ``is_causal=True`` scaled to the kept part of
    the score matrix (torch's top-left mask); any other op's flops unchanged."""
    name = func._overloadpacket.__name__
    if not (name.startswith("_scaled_dot_product") and _bound_arg(func, args, kwargs, "is_causal")):
        return flops
    # These kernels take (batch, heads, seq, dim); backward ones start with grad_out.
    q, k = args[1:3] if name.endswith("backward") else args[0:2]
    return round(flops * causal_fraction(q.shape[-2], k.shape[-2]))


_ATTENTION_BACKWARDS = frozenset(
    op
    for op in (
        _op("_scaled_dot_product_flash_attention_for_cpu_backward"),
        _op("_scaled_dot_product_flash_attention_backward"),
        _op("_scaled_dot_product_efficient_attention_backward"),
        _op("_scaled_dot_product_cudnn_attention_backward"),
        _op("_flash_attention_backward"),
        _op("_efficient_attention_backward"),
    )
    if op is not None
)


def recomputed_share(func: torch._ops.OpOverload, args: tuple) -> float:
    """The part of a backward kernel's flops that recomputes forward work.

    Fused attention backwards (flash, memory-efficient, cuDNN, the CPU kernel) recompute the score
    matrix QK^T instead of storing it: of their 3 QK-sized and 2 AV-sized products, one QK-sized is
    a recompute. Reporting it as recompute keeps model flops (fwd + bwd) equal to the math
    backend's, and hardware flops honest.
    """
    if func._overloadpacket not in _ATTENTION_BACKWARDS:
        return 0.0
    d_q, d_v = args[1].shape[-1], args[3].shape[-1]  # head dims are last in every layout
    return d_q / (3 * d_q + 2 * d_v)


def rnn_flops(
    mode: str,
    input_size: int,
    hidden_size: int,
    tokens: int,
    num_layers: int = 1,
    bidirectional: bool = False,
) -> int:
    """The standard forward formula for ``nn.RNN``/``GRU``/``LSTM`` matmul flops (no gate arithmetic).

    Used by tests and benchmarks as the reference for RNNs, where FlopCounterMode counts 0 on CPU.
    """
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[mode]
    directions = 2 if bidirectional else 1
    total = 0
    for layer in range(num_layers):
        layer_in = input_size if layer == 0 else hidden_size * directions
        total += directions * 2 * tokens * gates * hidden_size * (layer_in + hidden_size)
    return total


__all__ = [
    "OpKind",
    "OpRule",
    "causal_fraction",
    "count_flops",
    "recomputed_share",
    "rnn_flops",
    "rule",
]
