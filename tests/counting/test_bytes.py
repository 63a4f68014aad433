"""Bytes moved and activations saved, per module, counted by hand: every op reads each tensor it is
given and writes each tensor it returns (fp32: 4 bytes an element); a saved storage counts once,
parameters never."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flops_callbacks.counting.bytes_moved import bytes_rule
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.profile import Profile

F32 = 4
B, D_IN, D_OUT = 4, 8, 16


def traced(model: nn.Module, x: torch.Tensor) -> Profile:
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(x).sum().backward()
    finally:
        tracer.stop()
    return tracer.profile()


def test_linear_reads_input_weight_bias_and_writes_its_output_saving_only_its_input() -> None:
    torch.manual_seed(0)
    profile = traced(nn.Sequential(nn.Linear(D_IN, D_OUT)), torch.randn(B, D_IN))
    linear = profile.modules["0"]
    # addmm(bias, x, weight.t()): reads 16 + 32 + 128 elements, writes 4 x 16; weight.t() is a view
    assert linear.fwd_bytes == F32 * (D_OUT + B * D_IN + D_IN * D_OUT + B * D_OUT) == 960
    # addmm saves x and weight.t(); the weight is a parameter's storage
    assert linear.saved_bytes == F32 * B * D_IN == 128
    assert profile.saved_bytes == linear.saved_bytes and profile.fwd_bytes == linear.fwd_bytes


def test_linear_backward_bytes_are_those_of_its_three_gradient_ops() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, D_IN, requires_grad=True)
    linear = traced(nn.Sequential(nn.Linear(D_IN, D_OUT)), x).modules["0"]
    grad_input = B * D_OUT + D_OUT * D_IN + B * D_IN  # mm(grad, weight): reads both, writes 4 x 8
    grad_weight = B * D_OUT + B * D_IN + D_OUT * D_IN  # mm(grad.t(), x): reads both, writes 16 x 8
    grad_bias = B * D_OUT + D_OUT  # sum(grad, 0): reads 4 x 16, writes 16
    assert linear.bwd_bytes == F32 * (grad_input + grad_weight + grad_bias) == 2112
    assert linear.functionals["linear"].bwd_bytes == linear.bwd_bytes


def test_relu_reads_and_writes_its_input_in_place_or_not_and_saves_its_output() -> None:
    torch.manual_seed(0)
    n = B * D_OUT
    for inplace in (False, True):
        model = nn.Sequential(nn.Linear(D_IN, D_OUT), nn.ReLU(inplace=inplace))
        profile = traced(model, torch.randn(B, D_IN))
        relu = profile.modules["1"]
        # relu(x): reads x, writes a new tensor; relu_(x): reads x and writes x
        assert relu.fwd_bytes == F32 * 2 * n == 512
        assert relu.saved_bytes == F32 * n == 256  # its output, which the backward thresholds
        assert relu.bwd_bytes == F32 * 3 * n  # threshold_backward(grad, out): two reads, one write
        # the Linear saved its input, not its output: the model saves input + ReLU output
        assert profile.saved_bytes == F32 * (B * D_IN + n)


def test_layer_norm_reads_input_and_affine_writes_output_and_statistics() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, D_IN, requires_grad=True)
    norm = traced(nn.Sequential(nn.LayerNorm(D_IN)), x).modules["0"]
    # native_layer_norm: reads x, weight, bias; writes out, mean and rstd (one per row)
    assert norm.fwd_bytes == F32 * (B * D_IN + 2 * D_IN + B * D_IN + 2 * B) == 352
    assert norm.saved_bytes == F32 * (B * D_IN + 2 * B) == 160  # x, mean, rstd (weight, bias: params)


def test_conv2d_reads_input_kernel_and_bias_and_saves_its_input() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    conv = traced(nn.Sequential(nn.Conv2d(3, 4, 3)), x).modules["0"]
    inputs, kernel, bias, out = 2 * 3 * 6 * 6, 4 * 3 * 3 * 3, 4, 2 * 4 * 4 * 4
    assert conv.fwd_bytes == F32 * (inputs + kernel + bias + out) == 1824
    assert conv.saved_bytes == F32 * inputs == 864


class Attention(nn.Module):
    """q, k, v as views of one input: the views move nothing and share one storage."""

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(0)
        return F.scaled_dot_product_attention(q, k, v)


def test_attention_reads_q_k_v_writes_output_and_logsumexp_and_saves_each_storage_once() -> None:
    torch.manual_seed(0)
    batch, heads, length, dim = 2, 2, 5, 4
    qkv = torch.randn(3, batch, heads, length, dim, requires_grad=True)
    attention = traced(nn.Sequential(Attention()), qkv).modules["0"]
    each, lse = batch * heads * length * dim, batch * heads * length
    # the CPU kernel returns the output and the log-sum-exp of each score row
    assert attention.fwd_bytes == F32 * (3 * each + each + lse) == 1360
    # saved: q, k, v (one storage, qkv's, counted once), the output and the log-sum-exp
    assert attention.saved_bytes == F32 * (3 * each + each + lse) == 1360
    assert attention.functionals["scaled_dot_product_attention"].saved_bytes == 1360


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_IN, D_OUT, bias=False)
        self.act = nn.ReLU()
        self.down = nn.Linear(D_OUT, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, x, use_reentrant=False)


class Plain(Checkpointed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_checkpointing_changes_what_is_saved_and_adds_recompute_bytes_and_nothing_else() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, D_IN)
    # a fresh leaf each: a second backward into the same x would add the gradient accumulation (add_)
    plain = traced(Plain(), x.clone().requires_grad_())
    checkpointed = traced(Checkpointed(), x.clone().requires_grad_())
    for name in ("mlp", "mlp.up", "mlp.act", "mlp.down"):
        a, b = plain.modules[name], checkpointed.modules[name]
        assert (a.fwd_bytes, a.bwd_bytes) == (b.fwd_bytes, b.bwd_bytes), name
    assert plain.fwd_bytes == checkpointed.fwd_bytes and plain.bwd_bytes == checkpointed.bwd_bytes
    # plain: up saves x, act its output (down saves the same storage again: counted once)
    assert plain.saved_bytes == F32 * (B * D_IN + B * D_OUT) == 384
    assert plain.recompute_bytes == 0
    # checkpointed: only the checkpoint's input, saved outside the region; the region saves nothing
    assert checkpointed.saved_bytes == F32 * B * D_IN == 128
    assert checkpointed.modules["mlp"].saved_bytes == 0
    # the recompute re-runs up and act (the backward needs act's output), with their forward bytes
    ups, act = plain.modules["mlp.up"], plain.modules["mlp.act"]
    assert checkpointed.recompute_bytes == ups.fwd_bytes + act.fwd_bytes
    assert checkpointed.modules["mlp.up"].recompute_bytes == ups.fwd_bytes


def test_views_and_allocations_move_nothing_copies_move_both_ways() -> None:
    aten = torch.ops.aten
    for op in (aten.view.default, aten.t.default, aten.expand.default, aten.empty.memory_format):
        assert bytes_rule(op) is None, op
    dst, src = torch.zeros(10), torch.ones(10)
    assert bytes_rule(aten.copy_.default)((dst, src), {}, dst) == 2 * 10 * F32
    assert bytes_rule(aten.fill_.Scalar)((dst, 1.0), {}, dst) == 10 * F32
    table, idx = torch.randn(1000, 8), torch.tensor([1, 2, 3])
    rows = aten.embedding.default(table, idx)  # reads 3 rows of the table, not 1000
    assert bytes_rule(aten.embedding.default)((table, idx), {}, rows) == 2 * 3 * 8 * F32 + 3 * 8
    out = torch.empty(4)
    a = torch.ones(4)
    assert bytes_rule(aten.add.out)((a, a), {"out": out}, out) == 3 * 4 * F32  # out= is written, not read


def test_a_saved_tensor_changed_in_place_still_fails_the_backward_as_without_the_profiler() -> None:
    """autograd leaves its version check to saved-tensor hooks: ours does it, or a user's bug would
    become a silently wrong gradient on the counting step."""

    class SigmoidThenScaleInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.sigmoid(x)  # saves its output
            y.mul_(2)  # and changes it
            return y

    x = torch.randn(3, requires_grad=True)
    model = SigmoidThenScaleInPlace()
    message = "modified by an inplace operation"
    with pytest.raises(RuntimeError, match=message):
        model(x).sum().backward()
    tracer = CountingEngine(model)
    tracer.start()
    try:
        with pytest.raises(RuntimeError, match=message):
            model(x).sum().backward()
    finally:
        tracer.stop()


def test_reentrant_checkpointing_saves_its_inputs_only_too() -> None:
    torch.manual_seed(0)

    class Reentrant(Checkpointed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.mlp, x, use_reentrant=True)

    profile = traced(Reentrant(), torch.randn(B, D_IN, requires_grad=True))
    assert profile.saved_bytes == F32 * B * D_IN  # CheckpointFunction saves x; its no-grad forward nothing
    assert profile.modules["mlp"].saved_bytes == 0
    assert profile.recompute_bytes > 0


def test_torch_func_transforms_inside_a_model_run_while_saved_activations_are_counted() -> None:
    """Thread-wide saved-tensor hooks would make torch.func.grad and vmap raise: none are installed."""

    class WithTransforms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(D_IN, D_IN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            slope = torch.func.grad(lambda y: (y.sin() ** 2).sum())(x)
            return self.linear(x + slope + torch.func.vmap(torch.cos)(x))

    torch.manual_seed(0)
    model, x = WithTransforms(), torch.randn(B, D_IN, requires_grad=True)
    model(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    profile = traced(model, x)
    assert torch.equal(x.grad, expected)
    assert profile.modules["linear"].saved_bytes == F32 * B * D_IN  # the Linear's input
