"""Built-in formulas for the dense aten ops: matmuls, grouped (mixture-of-experts) matmuls,
attention kernels, triangular solves, FFTs, convolution backward and RNN kernels.

Most dense ops are counted by torch's own ``flop_registry`` (through
:mod:`flops_callbacks.counting.registry`),
so our counts are FlopCounterMode's by construction. This module registers only what that registry
lacks or gets wrong: the CPU SDPA kernel and RNN kernels (torch counts 0), grouped matmuls,
triangular solves and FFTs (torch has no formula), vector products, a grouped convolution's backward (torch
overcounts it), and the most frequent matmuls restated without torch's per-call shape mapping, which
costs 50x their arithmetic. Each formula is a function of the call's arguments.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flops_callbacks.counting.registry import register_formula, torch_formula

__all__ = ["aten", "bound_arg", "causal_fraction", "grouped_mm_flops", "present"]

aten = torch.ops.aten


def present(*names: str) -> list[Any]:
    """The aten overload packets among ``names`` that this torch build has."""
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


def causal_fraction(s_q: int, s_k: int) -> float:
    """Fraction of the (s_q x s_k) score matrix that a top-left causal mask keeps (torch's is_causal)."""
    kept = sum(min(i + 1, s_k) for i in range(s_q))
    return kept / (s_q * s_k)


def bound_arg(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of argument ``name`` of an aten call, positional or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else arg.default_value
    return None


# --- attention --------------------------------------------------------------------------------------
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


def _attention_causal_share(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> float:
    """The kept part of the score matrix when the kernel is called with ``is_causal=True``."""
    if not bound_arg(func, args, kwargs, "is_causal"):
        return 1.0
    q, k = args[1:3] if func._overloadpacket.__name__.endswith("backward") else args[0:2]
    return causal_fraction(q.shape[-2], k.shape[-2])


def _attention_recompute_share(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> float:
    """Fused attention backwards recompute the score matrix QK^T instead of storing it: of their 3
    QK-sized and 2 AV-sized products, one QK-sized is a recompute. Reporting it as recompute keeps
    model flops (fwd + bwd) equal to the math backend's, and hardware flops honest."""
    d_q, d_v = args[1].shape[-1], args[3].shape[-1]  # head dims are last in every layout
    return d_q / (3 * d_q + 2 * d_v)


@register_formula(present(*_ATTENTION), causal_share=_attention_causal_share)
def _attention_flop(args: tuple, kwargs: dict, out: Any) -> int:
    q, k, v = args[:3]
    *batch_heads, s_q, d_q = q.shape
    return 2 * math.prod(batch_heads) * s_q * k.shape[-2] * (d_q + v.shape[-1])  # QK^T, then AV


@register_formula(
    present(*(f"{name}_backward" for name in _ATTENTION)),
    causal_share=_attention_causal_share,
    recompute_share=_attention_recompute_share,
)
def _attention_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    q, k, v = args[1:4]
    *batch_heads, s_q, d_q = q.shape
    # the recomputed QK^T, dV, dP = dO V^T, dQ, dK: three products over d_q, two over d_v
    return 2 * math.prod(batch_heads) * s_q * k.shape[-2] * (3 * d_q + 2 * v.shape[-1])


# torch's registry counts the lower-level flash / memory-efficient backwards; they recompute QK^T too.
for _packet in present("_flash_attention_backward", "_efficient_attention_backward"):
    register_formula(_packet, recompute_share=_attention_recompute_share)(torch_formula(_packet))


# --- matmuls -------------------------------------------------------------------------------------
# mm/bmm and their add- forms are in torch's registry too, with these counts; ours skip its pytree
# shape mapping (done twice per addmm), which costs 50x the arithmetic on the most frequent ops.
@register_formula([aten.mm, aten.bmm])
def _matmul_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel() * args[1].shape[-1]


@register_formula([aten.addmm, aten.baddbmm])
def _add_matmul_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel() * args[2].shape[-1]


@register_formula(aten.mv)
def _mv_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


@register_formula(aten.addmv)
def _addmv_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel()


@register_formula([aten.dot, aten.vdot])
def _dot_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


@register_formula(aten.addbmm)
def _addbmm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    b, m, k = args[1].shape
    return 2 * b * m * k * args[2].shape[-1]


@register_formula(present("_addmm_activation"))
def _addmm_activation_flop(args: tuple, kwargs: dict, out: Any) -> int:
    m, k = args[1].shape
    return 2 * m * k * args[2].shape[-1]


# --- grouped matmuls (mixture-of-experts experts) ---------------------------------------------------


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> int:
    """Flops of ``torch._grouped_mm(a, b, offs)``: every row multiplied by one group's matrix.

    The layouts torch accepts, with G groups and ``offs`` the groups' cumulative ends:

    * 2D (M, K) x 3D (G, K, N): the rows of ``a`` are split among the groups (the experts'
      forward): ``2 * rows * K * N``;
    * 3D (G, M, K) x 3D (G, K, N): a batched matmul, ``2 * G * M * K * N``;
    * 2D (M, K) x 2D (K, N): the contraction is split, giving a (G, M, N) result (the experts'
      weight gradient): ``2 * M * K * N``;
    * 3D (G, M, K) x 2D (K, N): the columns of ``b`` are split (the input gradient of a transposed
      layout): ``2 * M * K * N``.

    The kernel skips what lies past ``offs[-1]`` (expert parallelism sorts tokens of other ranks'
    experts there), so the split extent is ``offs[-1]``: read from the device (a synchronization on
    a GPU, once per call), or the full size on the meta device.
    """
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * m * k * n
    split = a.shape[0] if b.dim() == 3 else k if a.dim() == 2 else n
    if offs is not None and offs.numel() and offs.device.type != "meta":
        split = min(split, int(offs[-1]))
    if b.dim() == 3:
        return 2 * split * k * n
    return 2 * m * split * n if a.dim() == 2 else 2 * m * k * split


@register_formula(present("_grouped_mm"))
def _grouped_mm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return grouped_mm_flops(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs"))


@register_formula(present("_scaled_grouped_mm"))
def _scaled_grouped_mm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # (self, mat2, scale_a, scale_b, offs, ...): the scales multiply outputs, not the products
    return grouped_mm_flops(args[0], args[1], args[4] if len(args) > 4 else kwargs.get("offs"))


# --- triangular solves (the chunked delta rule of gated-delta-net linear attention) ------------------


@register_formula(aten.linalg_solve_triangular)
def _solve_triangular_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Substitution through the n x n triangle: row i of a right-hand side takes i multiply-adds and a
    # division, n^2 flops per right-hand side (LAPACK's count for trsm); n^2 - n on a unit diagonal.
    # Every element of B is one row of one right-hand side, whichever side A multiplies.
    a, b = args[0], args[1]
    n = a.shape[-1]
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    per_element = n - 1 if kwargs.get("unitriangular", False) else n
    return batch * b.shape[-2] * b.shape[-1] * per_element


# --- FFTs (FNet's token mixing) ------------------------------------------------------------------------
# torch's registry has no FFT. n is the product of the transformed sizes: a transform over several dims
# is 1-D ones along each, N / n_i transforms of 5 n_i log2 n_i on N elements, 5 N log2 n in all. The
# normalization (a multiply per element) is left out, as in FFTW's count. Flops without MACs: a
# butterfly's multiplies and adds do not pair.


def _points(x: torch.Tensor, dims: Any) -> int:
    return math.prod(x.shape[d] for d in dims)


@register_formula(aten._fft_c2c, kind="elementwise")
def _fft_c2c_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """5 n log2 n real flops per complex transform of n points (the radix-2 count FFTW's benchmarks use)."""
    x = args[0]
    return round(5 * x.numel() * math.log2(max(_points(x, args[1]), 1)))


@register_formula(aten._fft_r2c, kind="elementwise")
def _fft_r2c_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """A real-input transform: half a complex one, 2.5 n log2 n per transform of n real points."""
    x = args[0]
    return round(2.5 * x.numel() * math.log2(max(_points(x, args[1]), 1)))


@register_formula(aten._fft_c2r, kind="elementwise")
def _fft_c2r_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """A real-output transform: half a complex one, 2.5 n log2 n per transform of n real points (out's)."""
    return round(2.5 * out.numel() * math.log2(max(_points(out, args[1]), 1)))


# --- convolution backward ----------------------------------------------------------------------


@register_formula(aten.convolution_backward)
def _conv_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Each requested gradient (input, weight) is one forward-sized convolution. Torch's formula
    # counts a grouped convolution's weight gradient `groups` times over (it folds the groups into
    # one big convolution; pytorch/pytorch#183405), so a depthwise layer's would read channels x.
    grad_out, inp, weight, transposed, output_mask = args[0], args[1], args[2], args[7], args[10]
    positions = math.prod((inp if transposed else grad_out).shape[2:])
    forward = 2 * inp.shape[0] * positions * weight.numel()
    return forward * (int(output_mask[0]) + int(output_mask[1]))


# --- RNN kernels (torch counts them as 0) -----------------------------------------------------------


def _rnn_tokens(inp: torch.Tensor, batch_sizes: Any) -> int:
    # Packed input is (sum of lengths, features); padded input is (seq, batch, features) in any order.
    if isinstance(batch_sizes, torch.Tensor) and batch_sizes.numel() > 0:
        return inp.shape[0]
    return inp.numel() // inp.shape[-1]


@register_formula(present("mkldnn_rnn_layer"))
def _mkldnn_rnn_layer_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # One layer, one direction: every token multiplies by W_ih and W_hh (the standard RNN formula).
    inp, w_ih, w_hh = args[0], args[1], args[2]
    return 2 * _rnn_tokens(inp, args[8]) * (w_ih.numel() + w_hh.numel())


@register_formula(present("mkldnn_rnn_layer_backward"))
def _mkldnn_rnn_layer_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # Gradients w.r.t. the input/hidden state and w.r.t. both weight matrices: twice the forward.
    inp, w_ih, w_hh = args[0], args[1], args[2]
    return 4 * _rnn_tokens(inp, args[20]) * (w_ih.numel() + w_hh.numel())


def _rnn_weight_numel(weights: Any) -> int:
    return sum(w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2)


@register_formula(present("_cudnn_rnn", "miopen_rnn"))
def _fused_rnn_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # All layers and directions in one kernel; every layer sees every token once.
    return 2 * _rnn_tokens(args[0], args[14] if len(args) > 14 else None) * _rnn_weight_numel(args[1])


@register_formula(present("_cudnn_rnn_backward", "miopen_rnn_backward"))
def _fused_rnn_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 4 * _rnn_tokens(args[0], None) * _rnn_weight_numel(args[1])
