"""Built-in formulas for elementwise work, and the ops that do no arithmetic at all.

Norms, softmax, pooling, interpolation, losses and accumulation follow DeepSpeed's per-element
conventions (users compare with DeepSpeed); ops torch tags ``pointwise`` or ``reduction`` need no
entry (:mod:`flops_callbacks.counting.registry` counts them one flop per element). Routing ops of
mixture-of-experts layers (sort, top-k, histograms, accumulating index writes) are counted here
too, so that no op that does arithmetic is left out of an MoE model's count:

* comparisons (``sort``, ``argsort``, ``topk``, ``kthvalue``, ``searchsorted``) count one flop per
  element searched, as ``max`` reductions and max pooling do: not ``n log n``, which depends on
  the algorithm the kernel picks;
* histograms and accumulating writes (``histc``, ``bincount``, ``index_put(accumulate=True)``,
  ``scatter_add``, ``index_add``, ``cumsum``) count one add per element accumulated; writes that
  only overwrite are free;
* on integer tensors alone (``bincount`` of expert indices, without weights) they count 0 flops, as
  every integer or bool call does (:mod:`flops_callbacks.counting.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flops_callbacks.counting.formulas import present
from flops_callbacks.counting.registry import (
    Formula,
    largest_tensor_numel,
    register_formula,
    register_op_kind,
)

__all__ = ["aten", "elementwise"]

aten = torch.ops.aten


def elementwise(ops: Any) -> Callable[[Formula], Formula]:
    """Register an elementwise formula (flops, no MACs) for ``ops``."""
    return register_formula(ops, kind="elementwise")


def _norm_flops(inp: torch.Tensor, weight: Any, affine_cost: int, plain_cost: int) -> int:
    return inp.numel() * (affine_cost if isinstance(weight, torch.Tensor) else plain_cost)


# --- norms: mean, subtract, variance, normalize (+ scale and shift), as DeepSpeed --------------------
# Backward of every norm: twice its forward (input gradient plus affine-parameter gradients).


@elementwise(aten.native_layer_norm)
def _layer_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[2] if len(args) > 2 else None, 5, 4)


@elementwise(aten.native_layer_norm_backward)
def _layer_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _norm_flops(args[1], args[5], 5, 4)


@elementwise(present("_fused_rms_norm"))
def _rms_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[2] if len(args) > 2 else None, 4, 3)


@elementwise(present("_fused_rms_norm_backward"))
def _rms_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * _norm_flops(args[1], args[4] if len(args) > 4 else None, 4, 3)


@elementwise(aten.native_group_norm)
def _group_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[1], 5, 4)


@elementwise(aten.native_group_norm_backward)
def _group_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # (grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)
    return 2 * _norm_flops(args[1], args[4], 5, 4)


@elementwise(
    [aten.native_batch_norm, aten._native_batch_norm_legit]
    + present("_batch_norm_with_update", "cudnn_batch_norm", "miopen_batch_norm")
)
def _batch_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # DeepSpeed: training computes statistics (5 or 4 per element); inference applies them (2 or 1).
    training = args[5] if len(args) > 5 and isinstance(args[5], bool) else True
    return _norm_flops(args[0], args[1], 5, 4) if training else _norm_flops(args[0], args[1], 2, 1)


@elementwise(aten._native_batch_norm_legit_no_training)
def _batch_norm_eval_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return _norm_flops(args[0], args[1], 2, 1)


@elementwise(
    [aten.native_batch_norm_backward]
    + present("batch_norm_backward", "cudnn_batch_norm_backward", "miopen_batch_norm_backward")
)
def _batch_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, ...): twice the
    # forward, training's or inference's
    training = args[7] if len(args) > 7 and isinstance(args[7], bool) else True
    return 2 * (_norm_flops(args[1], args[2], 5, 4) if training else _norm_flops(args[1], args[2], 2, 1))


# Weight normalization (HuBERT's and SpeechT5's positional convolution; torch's registry has no formula):
# w = g * v / ||v||, one norm per element of g.


@elementwise(present("_weight_norm_interface"))
def _weight_norm_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """Square and add per element of v, sqrt and g / norm per norm, then a multiply per element."""
    return 3 * args[0].numel() + 2 * args[1].numel()


@elementwise(present("_weight_norm_interface_backward"))
def _weight_norm_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """grad_g = sum(grad_w v) / norm, grad_v = g / norm (grad_w - v grad_g / norm): 5 per element, 3 per g."""
    return 5 * args[1].numel() + 3 * args[2].numel()


# --- softmax, pooling, interpolation, dropout ---------------------------------------------------------


@elementwise(present("_softmax", "_log_softmax", "_safe_softmax"))
def _softmax_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # DeepSpeed's convention: one flop per element


@elementwise([aten._softmax_backward_data, aten._log_softmax_backward_data])
def _softmax_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[0].numel()


_POOLS = [
    f"{kind}_pool{d}d{suffix}"
    for kind in ("max", "avg", "adaptive_max", "adaptive_avg", "_adaptive_avg")
    for d in (1, 2, 3)
    for suffix in ("", "_with_indices")
]


@elementwise(present(*_POOLS))
def _pool_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # DeepSpeed: every input element is read into one comparison or sum


@elementwise(present(*(name + "_backward" for name in _POOLS), "embedding_dense_backward"))
def _grad_input_sized_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # one add per element of the incoming gradient


_UPSAMPLES = [
    *(f"upsample_nearest{d}d" for d in (1, 2, 3)),
    *(f"_upsample_nearest_exact{d}d" for d in (1, 2, 3)),
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
]


@elementwise(present(*_UPSAMPLES))
def _upsample_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return out.numel() if isinstance(out, torch.Tensor) else 0  # DeepSpeed: one flop per output element


@elementwise(present(*(name + "_backward" for name in _UPSAMPLES)))
def _upsample_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()


@elementwise(aten.native_dropout)
def _dropout_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()


# --- losses -------------------------------------------------------------------------------------------


@elementwise([aten.nll_loss_forward, aten.nll_loss2d_forward])
def _nll_loss_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[1].numel()


@elementwise([aten.nll_loss_backward, aten.nll_loss2d_backward])
def _nll_loss_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[2].numel()


@elementwise([aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss])
def _regression_loss_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 3 * args[0].numel()  # difference, square/abs, reduction


@elementwise([aten.mse_loss_backward, aten.smooth_l1_loss_backward, aten.huber_loss_backward])
def _regression_loss_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return 2 * args[1].numel()


# CTC (the speech models' CTC heads; torch's registry has no formula), on the lattice the kernel allocates:
# log_alpha's (batch, longest input, 2 x longest target + 1) states, as the lengths are tensors a count must
# not read (a fake count cannot, a GPU read synchronizes). Per state, as torch's CPU kernel computes it: a
# log-sum-exp of up to three predecessors plus the emission (2 comparisons, 3 subtractions, 3 exps, 2 adds, a
# log, 2 adds: 13); in the backward, beta likewise (13), alpha + beta folded into its label's gradient by a
# two-term log-sum-exp (9), then 2 exps, 3 adds and a multiply per log-prob. The log-softmax is its own op.


@elementwise(present("_ctc_loss"))
def _ctc_loss_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """The alpha recursion: 13 flops per state."""
    return 13 * out[1].numel()


@elementwise(present("_ctc_loss_backward"))
def _ctc_loss_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """The beta recursion and the gradient's gathering: 22 flops per state, and 6 per log-prob."""
    log_probs, log_alpha = args[1], args[6]
    return 22 * log_alpha.numel() + 6 * log_probs.numel()


# --- accumulation and routing -------------------------------------------------------------------------


@elementwise(
    present(
        *("scatter_add", "index_add", "index_reduce", "cumsum", "cumprod"),
        *("scatter_add_", "index_add_", "index_reduce_", "cumsum_", "cumprod_"),
    )
)
def _accumulate_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # (self, dim, index, source, ...) adds every source element; cumsum(self, dim) adds every element
    return largest_tensor_numel(args[3] if len(args) > 3 else args[0])


@elementwise(present("col2im"))
def _col2im_flop(args: tuple, kwargs: dict, out: Any) -> int:
    """``F.fold`` (and ``F.unfold``'s backward): every column value added into its output position."""
    return args[0].numel()


@elementwise(
    [aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_.reduce, aten.scatter_.value_reduce]
)
def _scatter_reduce_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[2].numel()  # one add or multiply per index


@elementwise(present("scatter_reduce", "scatter_reduce_"))
def _scatter_reduce_two_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[3].numel()  # (self, dim, index, src, reduce): one reduction step per src element


@elementwise(present("index_put", "index_put_", "put_"))
def _index_put_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # (self, indices, values, accumulate): an add per value when accumulating (index's backward),
    # else an overwrite
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return largest_tensor_numel(args[2]) if accumulate else 0


@elementwise(present("histc", "bincount", "sort", "argsort", "msort", "topk", "kthvalue"))
def _per_input_element_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # one add into a bin, or one comparison, per element


@elementwise(aten.searchsorted.Tensor)
def _searchsorted_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[1].numel()  # (sorted_sequence, values): one search per value


@elementwise(aten.bucketize.Tensor)
def _bucketize_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return args[0].numel()  # (values, boundaries): one search per value


# --- pointwise, but not tagged so: one flop per output element, as the tagged ones ---------------------
# (softplus's backward: Mamba's step size; log-sigmoid's forward, which returns (output, buffer), and
# backward; polar: Llama 4's rotary embedding; the backwards of ELU / CELU / SELU, LeakyReLU, Hardtanh /
# ReLU6, Hardsigmoid, Mish, Softshrink and Hardshrink, in-place Mish, and Hardswish, RReLU, PReLU and GLU
# both ways: MobileNet's and EfficientNet's activations among them. GLU, a sigmoid and a multiply fused,
# counts one flop per output element as SiLU does. RReLU's random slope is drawn free, its multiply
# counted, as dropout's mask. LeakyReLU's forward and the in-place ELU / CELU / SELU, LeakyReLU, Hardtanh
# and Hardsigmoid: torch 2.13 tags them pointwise, 2.10 and 2.11 do not, so each is named here.)


@elementwise(
    present(
        *("floor_divide", "floor_divide_", "softplus_backward"),
        *("log_sigmoid_forward", "log_sigmoid_backward", "polar"),
        *("elu_backward", "leaky_relu_backward", "hardtanh_backward", "hardsigmoid_backward"),
        *("mish_", "mish_backward", "hardswish", "hardswish_", "hardswish_backward"),
        *("softshrink_backward", "hardshrink_backward", "_prelu_kernel", "glu", "glu_backward"),
        *("rrelu_with_noise", "rrelu_with_noise_", "rrelu_with_noise_backward"),
        *("leaky_relu", "leaky_relu_", "elu_", "celu_", "selu_", "hardtanh_", "hardsigmoid_"),
    )
)
def _untagged_pointwise_flop(args: tuple, kwargs: dict, out: Any) -> int:
    return largest_tensor_numel(out)


@elementwise(present("_prelu_kernel_backward"))
def _prelu_backward_flop(args: tuple, kwargs: dict, out: Any) -> int:
    # two results of the input's shape, one flop per element each: the input's gradient and the weight's
    # per element (its sum to the weight's shape is an aten.sum of its own)
    return sum(t.numel() for t in out)


# --- no arithmetic ----------------------------------------------------------------------------------------
# (unsafe_split & co. are views without alias tracking, used by the CPU GRU/LSTM cells)

_FREE_NAMES = """
    copy_ fill_ zero_ clone _to_copy lift_fresh lift_fresh_copy masked_fill where embedding
    index_select gather index _unsafe_index slice_backward select_backward
    slice_scatter select_scatter diagonal_scatter as_strided_scatter cat stack zeros ones empty
    full zeros_like ones_like empty_like full_like new_empty new_zeros new_ones new_full
    new_empty_strided empty_strided arange scalar_tensor triu tril _unsafe_view _local_scalar_dense
    constant_pad_nd repeat roll flip expand_copy view_copy _reshape_copy resize_ set_ detach_
    _assert_async _assert_tensor_metadata sym_constrain_range_for_size _functional_sym_constrain_range
    masked_fill_ index_fill im2col _pin_memory record_stream eye linspace
    unsafe_split unsafe_split_with_sizes unsafe_chunk
    nonzero nonzero_static _unique _unique2 unique_dim unique_consecutive unique_dim_consecutive
    masked_scatter masked_scatter_ masked_select take index_copy index_copy_ repeat_interleave one_hot
""".split()
# scatter's overloads that copy (its reducing ones have a formula above)
_SCATTERS = [getattr(aten.scatter, name) for name in aten.scatter.overloads() if "reduce" not in name]
register_op_kind(present(*_FREE_NAMES) + _SCATTERS + [aten.scatter_.src, aten.scatter_.value], "free")

register_op_kind(
    present("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim")
    + [aten.is_contiguous, torch.ops.prim.layout, torch.ops.prim.device],
    "metadata",
)
