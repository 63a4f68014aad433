"""Exact flop counts of single ops, forward and backward, against arithmetic done by hand.

Every expected value is written out from the op's definition (multiply-accumulates of a matmul or
convolution, DeepSpeed's per-element costs for norms and softmax), never taken from our formulas.
``2 * macs`` isolates the dense (matmul/conv/attention) part; ``flops`` adds elementwise work.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from support import FLOP_COUNTER_COUNTS_CPU_SDPA
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from flops_callbacks import FlopsProfiler, Profile, get_model_profile
from flops_callbacks.counting.registry import entry_for, registered


class Call(nn.Module):
    """A module whose forward is one function call, so a single op can be profiled."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs)


def profile_of(model: nn.Module, *inputs: torch.Tensor, backward: bool = False, **options: str) -> Profile:
    """Profile one forward (and the backward of ``output.sum()``, which runs outside the model).

    Gradients of parameters and inputs are cleared first: adding into an existing ``.grad`` is real
    work (counted, see the test below) that would blur the op under test.
    """
    model.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    prof = FlopsProfiler(model, **options)
    prof.start_profile()
    try:
        out = model(*inputs)
        if backward:
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
    finally:
        prof.stop_profile()
    profile = prof.get_profile()
    prof.end_profile()
    return profile


def count_flops(func: torch._ops.OpOverload, args: tuple, out: object = None) -> int:
    """Flops of one call of ``func`` on ``args`` (giving ``out``) by its registry entry, recomputed work
    included."""
    count = entry_for(func).count(func, args, {}, out, causal_half=False)
    return count.flops + count.recompute_flops


def dense(profile: Profile) -> tuple[int, int]:
    """(forward, backward) flops of the multiply-accumulate ops only."""
    return 2 * profile.fwd_macs, 2 * profile.bwd_macs


def leaf(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(grad)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --- Linear --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_forward_and_backward(bias: bool, input_grad: bool) -> None:
    tokens, d_in, d_out = 6, 8, 16
    model = nn.Linear(d_in, d_out, bias=bias)
    profile = profile_of(model, leaf(2, 3, d_in, grad=input_grad), backward=True)

    matmul = 2 * tokens * d_in * d_out  # every output element: d_in multiply-adds
    bias_grad = tokens * d_out if bias else 0  # sum of the output gradient over tokens
    assert dense(profile) == (matmul, matmul * (2 if input_grad else 1))  # grad_W always, grad_x if needed
    assert profile.fwd_flops == matmul  # the bias add is fused into addmm, counted as FlopCounterMode does
    assert profile.bwd_flops == matmul * (2 if input_grad else 1) + bias_grad
    assert profile.modules[""].functionals["linear"].fwd_flops == matmul


def test_linear_through_get_model_profile() -> None:
    batch, d_in, d_out = 4, 8, 16
    flops, macs, params = get_model_profile(
        nn.Linear(d_in, d_out), input_shape=(batch, d_in), print_profile=False, as_string=False
    )
    assert (flops, macs, params) == (2 * batch * d_in * d_out, batch * d_in * d_out, d_in * d_out + d_out)

    # A training step: the input (ones) needs no grad, so backward is grad_W (a matmul) + grad_b (a sum).
    flops, macs, _ = get_model_profile(
        nn.Linear(d_in, d_out), input_shape=(batch, d_in), print_profile=False, as_string=False, backward=True
    )
    assert macs == batch * d_in * d_out * 2
    assert flops == 2 * batch * d_in * d_out * 2 + batch * d_out


def test_accumulating_into_existing_grads_adds_once_per_parameter_element() -> None:
    model = nn.Linear(8, 16)
    x = leaf(4, 8, grad=False)
    model(x).sum().backward()  # .grad now holds a gradient; the next backward adds into it
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x).sum().backward()
    prof.stop_profile()
    matmul = 2 * 4 * 8 * 16
    params = 8 * 16 + 16
    assert prof.get_profile().bwd_flops == matmul + 4 * 16 + params


# --- Convolutions --------------------------------------------------------------------------------


def conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@pytest.mark.parametrize(
    ("dims", "c_in", "c_out", "kernel", "stride", "padding", "dilation", "groups", "size"),
    [
        (1, 4, 6, 3, 1, 0, 1, 1, 17),
        (1, 6, 9, 5, 2, 2, 3, 3, 23),
        (2, 3, 8, 3, 1, 1, 1, 1, 10),
        (2, 8, 16, 3, 2, 1, 2, 4, 13),
        (2, 8, 8, 3, 1, 1, 1, 8, 9),  # depthwise
        (3, 4, 6, 3, 2, 1, 1, 2, 7),
    ],
)
def test_conv(dims, c_in, c_out, kernel, stride, padding, dilation, groups, size) -> None:
    conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    conv = conv_cls(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    batch = 2
    spatial = [size + d for d in range(dims)]  # unequal sides catch a swapped axis
    x = leaf(batch, c_in, *spatial)
    out_spatial = [conv_out(s, kernel, stride, padding, dilation) for s in spatial]
    assert list(conv(x).shape) == [batch, c_out, *out_spatial]

    positions = batch
    for s in out_spatial:
        positions *= s
    # Each output element: (c_in / groups) * kernel^dims multiply-adds; the bias is not counted.
    forward = 2 * positions * c_out * (c_in // groups) * kernel**dims
    profile = profile_of(conv, x, backward=True)
    assert profile.fwd_flops == 2 * profile.fwd_macs == forward
    # Backward: grad_input and grad_weight each cost one forward (grad_bias is fused in the kernel).
    assert profile.bwd_flops == 2 * profile.bwd_macs == 2 * forward

    frozen_input = profile_of(conv, leaf(batch, c_in, *spatial, grad=False), backward=True)
    assert frozen_input.bwd_flops == forward  # grad_weight only


def test_grouped_conv_backward_is_not_torchs_overcount() -> None:
    # torch's FlopCounterMode counts a grouped convolution's weight gradient `groups` times over.
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = leaf(1, 8, 6, 6)
    forward = 2 * 36 * 8 * 1 * 9
    with FlopCounterMode(display=False) as counter:
        conv(x).sum().backward()
    assert counter.get_total_flops() == forward + forward + 8 * forward
    assert profile_of(conv, x, backward=True).bwd_flops == 2 * forward


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose2d(groups: int) -> None:
    c_in, c_out, kernel, stride, padding, out_pad = 8, 12, 3, 2, 1, 1
    conv = nn.ConvTranspose2d(c_in, c_out, kernel, stride, padding, out_pad, groups=groups)
    batch, h, w = 2, 5, 6
    x = leaf(batch, c_in, h, w)
    assert conv(x).shape == (batch, c_out, (h - 1) * stride - 2 * padding + kernel + out_pad, 12)
    # Every input element is scattered into (c_out / groups) * kernel^2 output positions.
    forward = 2 * batch * h * w * c_in * (c_out // groups) * kernel * kernel
    profile = profile_of(conv, x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (forward, 2 * forward)
    assert dense(profile) == (forward, 2 * forward)


# --- Matrix products -----------------------------------------------------------------------------


def test_bmm_matmul_operator_and_einsum() -> None:
    b, m, k, n = 3, 4, 5, 6
    products = {
        "bmm": (Call(torch.bmm), (leaf(b, m, k), leaf(b, k, n))),
        "matmul": (Call(torch.matmul), (leaf(b, m, k), leaf(k, n))),  # broadcast: one (b*m, k) @ (k, n) mm
        "@": (Call(lambda x, y: x @ y), (leaf(b, m, k), leaf(b, k, n))),
        "einsum": (Call(lambda x, y: torch.einsum("bmk,bkn->bmn", x, y)), (leaf(b, m, k), leaf(b, k, n))),
    }
    forward = 2 * b * m * k * n
    for name, (model, inputs) in products.items():
        profile = profile_of(model, *inputs, backward=True)
        # Backward: grad_x = grad @ y^T and grad_y = x^T @ grad, each as large as the forward.
        assert (profile.fwd_flops, profile.bwd_flops) == (forward, 2 * forward), name
        assert dense(profile) == (forward, 2 * forward), name


def test_einsum_attention_scores() -> None:
    b, h, q, k, d = 2, 3, 4, 5, 8
    model = Call(lambda x, y: torch.einsum("bhqd,bhkd->bhqk", x, y))
    profile = profile_of(model, leaf(b, h, q, d), leaf(b, h, k, d))
    assert profile.fwd_flops == 2 * b * h * q * k * d


def test_mv_and_dot() -> None:
    m, n = 7, 9
    profile = profile_of(Call(torch.mv), leaf(m, n), leaf(n), backward=True)
    assert profile.fwd_flops == 2 * m * n
    # Backward: grad_vector = A^T @ grad (a matrix-vector product), grad_A = outer(grad, v): m*n products.
    assert dense(profile)[1] == 2 * m * n
    assert profile.bwd_flops == 2 * m * n + m * n

    assert profile_of(Call(torch.dot), leaf(n), leaf(n)).fwd_flops == 2 * n


# --- Triangular solves (gated-delta-net linear attention) --------------------------------------


def substitution_flops(n: int, unit_diagonal: bool) -> int:
    """One right-hand side through an n x n triangle: row i takes i multiply-adds and a division."""
    return sum(2 * i + (0 if unit_diagonal else 1) for i in range(n))


@pytest.mark.parametrize(("left", "unit"), [(True, False), (False, True)])
def test_solve_triangular_forward_and_backward(left: bool, unit: bool) -> None:
    batch, n, k = 2, 5, 3
    assert substitution_flops(5, False) == 25 and substitution_flops(5, True) == 20
    a = torch.randn(batch, n, n).tril().add(3 * torch.eye(n)).requires_grad_()  # well conditioned
    b = leaf(batch, n, k) if left else leaf(batch, k, n)  # k right-hand sides, columns or rows
    solve = Call(lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=left, unitriangular=unit))
    profile = profile_of(solve, a, b, backward=True)

    forward = batch * k * substitution_flops(n, unit)
    # Backward: grad_B solves the transposed triangle for the same k sides; grad_A = -grad_B X^T (one
    # (n x k) @ (k x n) product per batch, or X^T grad_B on the right), negated (one flop per element),
    # then masked to the triangle (free).
    product = batch * 2 * n * k * n
    assert dense(profile) == (forward, forward + product)
    assert (profile.fwd_flops, profile.bwd_flops) == (forward, forward + product + batch * n * n)
    assert profile.coverage.uncounted == []


def test_solve_triangular_broadcasts_a_single_right_hand_side_over_the_batch() -> None:
    a, b = torch.empty(4, 6, 6, device="meta"), torch.empty(6, 2, device="meta")
    solve = torch.ops.aten.linalg_solve_triangular.default
    assert entry_for(solve).count(solve, (a, b), {"upper": True}, None, causal_half=False).flops == (
        4 * 2 * 36
    )


# --- Attention -----------------------------------------------------------------------------------


def causal_kept(s_q: int, s_k: int) -> int:
    """Entries a top-left causal mask keeps (torch's is_causal), counted from the mask itself."""
    return int(torch.ones(s_q, s_k, dtype=torch.bool).tril().sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("s_q", "s_k"), [(6, 6), (5, 7)])
def test_sdpa_on_the_default_cpu_kernel(causal: bool, s_q: int, s_k: int) -> None:
    b, h, d = 2, 3, 4
    model = Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    inputs = leaf(b, h, s_q, d), leaf(b, h, s_k, d), leaf(b, h, s_k, d)
    product = 2 * b * h * s_q * s_k * d  # one of QK^T, PV (or a gradient of either)

    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    # torch before 2.15 has no formula for this kernel (why we count it); from 2.15 its count is ours
    assert counter.get_total_flops() == (2 * product if FLOP_COUNTER_COUNTS_CPU_SDPA else 0)

    profile = profile_of(model, *inputs, backward=True)
    assert profile.fwd_flops == 2 * profile.fwd_macs == 2 * product  # QK^T and PV, full matrix by default
    # Backward: dV, dP, dQ, dK; the kernel's recomputed QK^T is reported apart.
    assert profile.bwd_flops == 2 * profile.bwd_macs == 4 * product
    assert profile.recompute_flops == 2 * profile.recompute_macs == product
    assert profile.model_flops == 3 * profile.fwd_flops

    half = profile_of(model, *inputs, backward=True, causal_attention="half")
    kept = causal_kept(s_q, s_k) if causal else s_q * s_k
    scaled = [round(n * product * kept / (s_q * s_k)) for n in (2, 4, 1)]
    assert [half.fwd_flops, half.bwd_flops, half.recompute_flops] == scaled


def test_causal_half_counts_exactly_the_unmasked_entries() -> None:
    # 5 queries x 7 keys, top-left aligned: rows keep 1, 2, 3, 4, 5 keys = 15 of 35 entries.
    assert causal_kept(5, 7) == 1 + 2 + 3 + 4 + 5
    b, h, d = 1, 2, 8
    model = Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    half = profile_of(model, leaf(b, h, 5, d), leaf(b, h, 7, d), leaf(b, h, 7, d), causal_attention="half")
    assert half.fwd_flops == 2 * (2 * b * h * 15 * d)


GPU_ATTENTION = [
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
]


@pytest.mark.parametrize("kernel", GPU_ATTENTION)
def test_gpu_attention_kernels_count_as_torch_registry_does(kernel: str) -> None:
    # These kernels only run on a GPU; their formulas are checked on shapes alone (meta tensors)
    # against torch's own registry, with grouped-query heads and a value head dim unlike the query's.
    b, h_q, h_kv, s_q, s_k, d_q, d_v = 2, 8, 2, 5, 7, 16, 12
    meta = {"device": "meta"}
    q, k, v = (
        torch.empty(b, h_q, s_q, d_q, **meta),
        torch.empty(b, h_kv, s_k, d_q, **meta),
        torch.empty(b, h_kv, s_k, d_v, **meta),
    )
    grad_out = torch.empty(b, h_q, s_q, d_v, **meta)
    forward, backward = getattr(torch.ops.aten, kernel), getattr(torch.ops.aten, f"{kernel}_backward")
    product = 2 * b * h_q * s_q * s_k  # times a head dim: one batched matmul of q's heads
    assert count_flops(forward.default, (q, k, v)) == product * (d_q + d_v)
    assert count_flops(backward.default, (grad_out, q, k, v)) == product * (3 * d_q + 2 * d_v)
    if forward not in flop_registry:  # the cuDNN kernel is missing on some builds
        return
    try:  # torch counts the same
        flop_registry[forward](q, k, v)
    except AssertionError:  # torch before 2.13 refuses grouped-query heads: count them repeated
        k, v = k.repeat_interleave(h_q // h_kv, 1), v.repeat_interleave(h_q // h_kv, 1)
    assert count_flops(forward.default, (q, k, v)) == flop_registry[forward](q, k, v) == product * (d_q + d_v)
    assert count_flops(backward.default, (grad_out, q, k, v)) == flop_registry[backward](grad_out, q, k, v)


# --- Grouped matmuls (mixture-of-experts experts) ------------------------------------------------


def per_group_flops(layout: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> int:
    """2 * m * k * n of every group's own matmul, the groups' extents read from ``offs``."""
    ends = offs.tolist() if offs is not None else []
    sizes = [end - start for start, end in zip([0, *ends], ends, strict=False)]  # one per group
    if layout == "3d-3d":  # group g: a[g] (M, K) @ b[g] (K, N)
        return sum(2 * a.shape[1] * a.shape[2] * b.shape[2] for _ in range(a.shape[0]))
    if layout == "2d-3d":  # group g: its rows of a @ b[g]
        return sum(2 * rows * a.shape[1] * b.shape[2] for rows in sizes)
    if layout == "2d-2d":  # group g: a[:, its columns] @ b[its rows, :]
        return sum(2 * a.shape[0] * k * b.shape[1] for k in sizes)
    return sum(2 * a.shape[1] * a.shape[2] * n for n in sizes)  # "3d-2d": a[g] @ b[:, its columns]


# Sizes are multiples of 4 floats: the kernel needs 16-byte strides.
GROUPED_LAYOUTS = {
    "2d-3d": ((12, 8), (3, 8, 16), [2, 7, 12]),
    "3d-3d": ((3, 4, 8), (3, 8, 16), None),
    "2d-2d": ((16, 12), (12, 8), [4, 4, 12]),  # an empty group in the middle
    "3d-2d": ((3, 16, 8), (8, 12), [4, 8, 12]),
}


@pytest.mark.parametrize("layout", list(GROUPED_LAYOUTS))
def test_grouped_mm_forward_and_backward_in_every_layout(layout: str) -> None:
    a_shape, b_shape, ends = GROUPED_LAYOUTS[layout]
    a, b = leaf(*a_shape), leaf(*b_shape)
    offs = torch.tensor(ends, dtype=torch.int32) if ends is not None else None
    model = Call(lambda a, b: torch._grouped_mm(a, b, offs=offs))
    with FlopsProfiler(model) as prof:
        out = model(a, b)
        (out * torch.randn_like(out)).sum().backward()  # a dense upstream gradient, as a loss gives
    forward = per_group_flops(layout, a, b, offs)
    # each input's gradient is a grouped matmul of the same size (FlopCounterMode has no formula)
    assert dense(prof.get_profile()) == (forward, 2 * forward)
    assert prof.get_profile().coverage.uncounted == []


def test_grouped_mm_counts_only_rows_up_to_the_last_offset() -> None:
    # Expert parallelism sorts tokens routed to other ranks past offs[-1]; the kernel skips them.
    a, b = leaf(12, 8), leaf(3, 8, 16)
    offs = torch.tensor([2, 5, 6], dtype=torch.int32)
    profile = profile_of(Call(lambda a, b: torch._grouped_mm(a, b, offs=offs)), a, b)
    assert dense(profile)[0] == 2 * 6 * 8 * 16


def test_scaled_grouped_mm_counts_its_products_from_shapes_on_meta() -> None:
    # A GPU (fp8) kernel: checked on meta tensors, where offs cannot be read and the shapes count.
    meta = {"device": "meta"}
    a, b = torch.empty(64, 32, **meta), torch.empty(4, 32, 16, **meta)
    scale_a, scale_b = torch.empty(64, **meta), torch.empty(4, 16, **meta)
    offs = torch.empty(4, dtype=torch.int32, **meta)
    assert count_flops(torch.ops.aten._scaled_grouped_mm.default, (a, b, scale_a, scale_b, offs)) == (
        2 * 64 * 32 * 16
    )


# --- Recurrent layers ----------------------------------------------------------------------------


def standard_rnn_flops(gates: int, d_in: int, hidden: int, tokens: int, layers: int, directions: int) -> int:
    """Every token of every layer and direction multiplies by W_ih (gates*H x in) and W_hh (gates*H x H)."""
    total = 0
    for layer in range(layers):
        layer_in = d_in if layer == 0 else hidden * directions
        total += directions * 2 * tokens * (gates * hidden * layer_in + gates * hidden * hidden)
    return total


RNN_CASES = [(1, False), (2, False), (1, True), (2, True)]


@pytest.mark.parametrize(("layers", "bidirectional"), RNN_CASES)
def test_lstm(layers: int, bidirectional: bool) -> None:
    batch, seq, d_in, hidden = 3, 5, 6, 8
    lstm = nn.LSTM(d_in, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    forward = standard_rnn_flops(4, d_in, hidden, batch * seq, layers, 2 if bidirectional else 1)
    profile = profile_of(lstm, leaf(batch, seq, d_in), backward=True)
    assert dense(profile) == (forward, 2 * forward)  # the fused CPU kernel: FlopCounterMode counts 0 here


@pytest.mark.parametrize(("layers", "bidirectional"), RNN_CASES)
def test_gru(layers: int, bidirectional: bool) -> None:
    batch, seq, d_in, hidden = 3, 5, 6, 8
    directions = 2 if bidirectional else 1
    gru = nn.GRU(d_in, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    forward = standard_rnn_flops(3, d_in, hidden, batch * seq, layers, directions)

    h0 = leaf(layers * directions, batch, hidden)
    every_grad = profile_of(gru, leaf(batch, seq, d_in), h0, backward=True)
    assert dense(every_grad) == (forward, 2 * forward)
    assert every_grad.fwd_flops > forward  # gate arithmetic runs as separate elementwise ops on CPU
    assert every_grad.coverage.uncounted == []  # its gate split (aten.unsafe_split) is a view

    # The real backward skips what nobody needs: the input's gradient through layer 0's W_ih, and
    # the zero initial state's gradient through W_hh at the first step of every layer and direction.
    default = profile_of(gru, leaf(batch, seq, d_in, grad=False), backward=True)
    input_grad = directions * 2 * batch * seq * 3 * hidden * d_in
    h0_grad = layers * directions * 2 * batch * 3 * hidden * hidden
    assert dense(default) == (forward, 2 * forward - input_grad - h0_grad)


# --- Elementwise: norms, softmax, interpolation ------------------------------------------------


@pytest.mark.parametrize(("affine", "per_element"), [(True, 5), (False, 4)])
def test_layer_norm(affine: bool, per_element: int) -> None:
    x = leaf(3, 4, 10)
    profile = profile_of(nn.LayerNorm(10, elementwise_affine=affine), x, backward=True)
    # mean, subtract, variance, normalize (+ scale and shift) per element; backward twice that.
    assert (profile.fwd_flops, profile.bwd_flops) == (per_element * x.numel(), 2 * per_element * x.numel())
    assert dense(profile) == (0, 0)


@pytest.mark.parametrize(("affine", "per_element"), [(True, 5), (False, 4)])
def test_group_norm_backward_is_twice_its_forward_with_or_without_weights(
    affine: bool, per_element: int
) -> None:
    x = leaf(2, 4, 5, 5)
    profile = profile_of(nn.GroupNorm(2, 4, affine=affine), x, backward=True)
    # (the backward read N, an int, as its weight: always 4 per element, 1600 for 2000 here)
    assert (profile.fwd_flops, profile.bwd_flops) == (per_element * x.numel(), 2 * per_element * x.numel())


@pytest.mark.parametrize(("training", "per_element"), [(True, 5), (False, 2)])
def test_batch_norm_backward_is_twice_its_forward_in_training_or_inference(
    training: bool, per_element: int
) -> None:
    """Inference applies the running statistics (scale and shift: 2 per element); its backward was
    counted as training's (10 per element for 2 forward)."""
    x, norm = leaf(2, 4, 5, 5), nn.BatchNorm2d(4)
    profile = profile_of(norm.train(training), x, backward=True)
    norm_flops = [
        (c.fwd_flops, c.bwd_flops) for name, c in profile.modules[""].functionals.items() if "norm" in name
    ]
    assert norm_flops == [(per_element * x.numel(), 2 * per_element * x.numel())]


def test_fold_adds_every_column_value_into_its_output() -> None:
    """``F.fold`` (aten.col2im) sums overlapping patches: one add per value (it was counted free)."""
    columns = leaf(1, 8, 9, grad=False)  # 2 channels x 2x2 kernel, 3x3 positions, stride 1 -> 4x4
    profile = profile_of(Call(lambda t: F.fold(t, (4, 4), 2)), columns)
    assert profile.fwd_flops == columns.numel() and profile.coverage.uncounted == []


def test_softmax() -> None:
    x = leaf(3, 4, 7)
    profile = profile_of(Call(lambda t: F.softmax(t, dim=-1)), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel(), 2 * x.numel())


@pytest.mark.parametrize("activation", [F.softplus, F.logsigmoid], ids=["softplus", "logsigmoid"])
def test_softplus_and_logsigmoid_count_one_flop_per_element_each_way(activation: Callable) -> None:
    # aten.softplus is tagged pointwise; its backward (Mamba's step size) and both log-sigmoid ops are not
    x = leaf(3, 4, 7)
    profile = profile_of(Call(activation), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel(), x.numel())
    assert profile.coverage.uncounted == []


ACTIVATIONS = {
    **{f.__name__: f for f in (F.elu, F.celu, F.selu, F.leaky_relu, F.hardtanh, F.relu6, F.hardsigmoid)},
    **{f.__name__: f for f in (F.mish, F.hardswish, F.softshrink, F.hardshrink)},
}


@pytest.mark.parametrize("activation", ACTIVATIONS.values(), ids=ACTIVATIONS.keys())
def test_activations_whose_backward_torch_does_not_tag_pointwise_count_one_flop_per_element(
    activation: Callable,
) -> None:
    # their backwards (and Hardswish's forward) carry no pointwise tag: counted as the tagged ones are
    x = leaf(3, 4, 7)
    profile = profile_of(Call(activation), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel(), x.numel())
    assert profile.coverage.uncounted == []


def test_prelu_counts_its_multiply_and_both_gradients() -> None:
    prelu = nn.PReLU(4)
    x = leaf(3, 4, 5)
    profile = profile_of(prelu, x, backward=True)
    # forward: one multiply per element; backward: the input's and the weight's gradient per element,
    # then the weight's summed to its 4 channels (a reduction: one flop per element read)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel(), 3 * x.numel())
    assert profile.coverage.uncounted == []


def test_glu_counts_one_flop_per_output_element_each_way() -> None:
    x = leaf(3, 8)
    profile = profile_of(Call(lambda t: F.glu(t, dim=-1)), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel() // 2, x.numel())  # the gradient: all of x
    assert profile.coverage.uncounted == []


def test_mish_in_place_counts_as_mish() -> None:
    x = leaf(3, 4, 7)
    profile = profile_of(Call(lambda t: F.mish(t * 2.0, inplace=True)), x, backward=True)
    # the scaling and the activation, each one flop per element both ways
    assert (profile.fwd_flops, profile.bwd_flops) == (2 * x.numel(), 2 * x.numel())
    assert profile.coverage.uncounted == []


IN_PLACE = {f.__name__: f for f in (F.elu, F.celu, F.selu, F.leaky_relu, F.hardtanh, F.hardsigmoid)}


@pytest.mark.parametrize("activation", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_in_place_activations_count_as_their_out_of_place_forms(activation: Callable) -> None:
    x = leaf(3, 4, 7)
    profile = profile_of(Call(lambda t: activation(t * 2.0, inplace=True)), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (2 * x.numel(), 2 * x.numel())
    assert profile.coverage.uncounted == []


def test_activations_older_torch_does_not_tag_pointwise_are_counted_by_a_rule_of_our_own() -> None:
    # torch 2.13 tags these pointwise, 2.10 and 2.11 do not (the three versions' op tags compared): a
    # count from the tag alone would leave them uncounted on the older torch
    names = ("leaky_relu", "leaky_relu_", "elu_", "celu_", "selu_", "hardtanh_", "hardsigmoid_")
    assert [name for name in names if registered(getattr(torch.ops.aten, name)) is None] == []


@pytest.mark.parametrize("training", [True, False])
def test_rrelu_multiplies_by_its_slope_once_per_element_each_way(training: bool) -> None:
    # random slopes while training (their draw is free, the multiply is not: as dropout's mask), the
    # slopes' mean in eval
    x = leaf(3, 4, 7)
    profile = profile_of(Call(lambda t: F.rrelu(t, training=training)), x, backward=True)
    assert (profile.fwd_flops, profile.bwd_flops) == (x.numel(), x.numel())
    assert profile.coverage.uncounted == []


def test_polar_counts_one_flop_per_complex_output_element() -> None:
    # Llama 4's rotary embedding: unit-length complex rotations from (positions x frequencies) angles
    angles = torch.outer(torch.arange(6.0), torch.rand(4))
    profile = profile_of(Call(lambda a: torch.polar(torch.ones_like(a), a)), angles)
    assert profile.fwd_flops == 6 * 4
    assert profile.coverage.uncounted == []


@pytest.mark.parametrize(
    ("options", "out_hw"),
    [({"scale_factor": 2, "mode": "nearest"}, (6, 8)), ({"size": (5, 7), "mode": "bilinear"}, (5, 7))],
)
def test_interpolate_counts_output_elements(options: dict, out_hw: tuple[int, int]) -> None:
    x = leaf(2, 3, 3, 4)
    profile = profile_of(Call(lambda t: F.interpolate(t, **options)), x, backward=True)
    out_numel = 2 * 3 * out_hw[0] * out_hw[1]
    assert (profile.fwd_flops, profile.bwd_flops) == (out_numel, out_numel)
    assert profile.modules[""].functionals["interpolate"].fwd_flops == out_numel


# --- FFTs (FNet), CTC loss and weight normalization (speech models) ------------------------------


def test_fnet_fourier_mixing_counts_five_n_log2_n_per_transform_each_way() -> None:
    # FNet's token mixing: a 2-D FFT over (sequence, hidden) of every batch element, its real part kept.
    x = leaf(2, 16, 32)
    profile = profile_of(Call(lambda t: torch.fft.fftn(t, dim=(1, 2)).real), x, backward=True)
    n = 16 * 32  # points per transform, log2(512) = 9
    assert profile.fwd_flops == 2 * 5 * n * 9  # 46,080: 2 transforms of 5 n log2 n
    assert profile.bwd_flops == 2 * 5 * n * 9  # the gradient: an inverse transform of the same size
    assert dense(profile) == (0, 0)  # flops, no multiply-accumulate pairs
    assert profile.coverage.uncounted == []


def test_real_input_and_real_output_ffts_count_half_a_complex_one() -> None:
    aten = torch.ops.aten
    x = torch.randn(4, 8)
    spectrum = torch.fft.rfft(x)  # 5 frequencies of each 8-point row
    back = torch.fft.irfft(spectrum, n=8)
    r2c = count_flops(aten._fft_r2c.default, (x, [1], 0, True), spectrum)
    c2r = count_flops(aten._fft_c2r.default, (spectrum, [1], 2, 8), back)
    assert r2c == c2r == 4 * 2.5 * 8 * 3  # 4 rows of 2.5 n log2 n, n = 8: 240
    odd = torch.randn(3, 12)  # 12 points, log2(12) = 3.585: 2.5 * 36 * 3.585 = 322.6
    assert count_flops(aten._fft_r2c.default, (odd, [1], 0, True)) == 323
    profile = profile_of(Call(lambda t: torch.fft.irfft(torch.fft.rfft(t), n=8)), leaf(4, 8), backward=True)
    assert profile.fwd_flops == 240 + 240
    assert profile.coverage.uncounted == []


@pytest.mark.parametrize("lengths_as", ["ints", "tensors"])
def test_ctc_loss_counts_its_lattice_of_states_each_way(lengths_as: str) -> None:
    t, n, c, s = 50, 3, 20, 10  # time steps, batch, labels, longest target
    log_probs = leaf(t, n, c)
    targets = torch.randint(1, c, (n, s))
    input_lengths, target_lengths = [50, 40, 30], [10, 7, 4]
    if lengths_as == "tensors":  # as transformers' CTC heads call it
        input_lengths, target_lengths = torch.tensor(input_lengths), torch.tensor(target_lengths)

    def ctc(lp: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(lp, targets, input_lengths, target_lengths, reduction="sum")

    profile = profile_of(Call(ctc), log_probs, backward=True)
    states = n * t * (2 * s + 1)  # the kernel's lattice: batch x longest input x (2 x longest target + 1)
    assert profile.fwd_flops == 13 * states + n  # the alpha recursion, then the sum of the 3 losses
    assert profile.bwd_flops == 22 * states + 6 * t * n * c  # beta and the gathering, then the gradient
    assert profile.coverage.uncounted == []


@pytest.mark.parametrize(("v_shape", "g_shape", "dim"), [((32, 8, 16), (1, 1, 16), 2), ((6, 10), (6, 1), 0)])
def test_weight_norm_counts_the_norm_and_the_scaling(v_shape: tuple, g_shape: tuple, dim: int) -> None:
    # HuBERT's positional convolution normalizes its (32, 8, 16) kernel over dim 2; a Linear's over dim 0
    v, g = leaf(*v_shape), leaf(*g_shape)
    profile = profile_of(Call(lambda a, b: torch._weight_norm(a, b, dim)), v, g, backward=True)
    elements, norms = v.numel(), g.numel()
    assert profile.fwd_flops == 3 * elements + 2 * norms  # square, add, scale; sqrt and g / norm
    assert profile.bwd_flops == 5 * elements + 3 * norms
    assert profile.coverage.uncounted == []


# --- Ops without arithmetic, and ops without a formula ------------------------------------------


def test_views_cat_and_indexing_are_free() -> None:
    index = torch.tensor([2, 0, 5])

    def shuffle(x: torch.Tensor) -> torch.Tensor:
        picked = x.view(-1)[index]  # view, advanced index
        joined = torch.cat([picked, torch.zeros(4)])  # cat with a constant
        return joined.reshape(1, 7).transpose(0, 1)[1:, 0]  # reshape, transpose, slice, select

    x = leaf(2, 3)
    profile = profile_of(Call(shuffle), x, backward=True)
    # Only the advanced index's backward adds: it accumulates the 3 picked gradients into zeros
    # (index_put with accumulate=True: one add per value, as an indices may repeat).
    assert (profile.fwd_flops, profile.bwd_flops) == (0, 3)
    assert profile.coverage.uncounted == []
    assert profile.coverage.free_calls > 0


def test_op_without_formula_is_listed_with_its_calls(tmp_path) -> None:
    def transform_and_scale(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(x).R * 2  # aten.linalg_qr: a factorization, no flop formula

    model = Call(transform_and_scale)
    x = leaf(4, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    for _ in range(3):
        model(x)
    prof.stop_profile()
    profile = prof.get_profile()

    assert profile.fwd_flops == 3 * 4 * 8  # the multiply only, on R's 4 x 8 elements
    [qr] = profile.coverage.uncounted
    assert (qr.op, qr.calls) == ("aten.linalg_qr", 3)
    assert qr.seconds > 0 and 0 < qr.time_share <= 1

    report_file = tmp_path / "report.txt"
    prof.print_model_profile(output_file=report_file)
    report = report_file.read_text()
    coverage = report.split(" Coverage ", 1)[1]
    assert "Ops with no flop formula" in coverage
    [line] = [line for line in coverage.splitlines() if "aten.linalg_qr" in line]
    assert line.split()[:3] == ["aten.linalg_qr", "3", "calls"]
