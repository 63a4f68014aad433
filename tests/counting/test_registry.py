"""The formula registry: users' ops are counted in forward and backward, duplicates are refused, and an
op without a formula stays in the coverage section. Expected counts are a matmul's 2*m*k*n by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from flops_callbacks import FlopsProfiler, OpKind, Profile, register_formula, register_op_kind
from flops_callbacks.counting.registry import entry_for

ROOT = Path(__file__).resolve().parents[2]
aten = torch.ops.aten


# --- a custom op with its own backward op, as a Triton kernel is wrapped -----------------------------


@torch.library.custom_op("flops_test::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (a @ b) * scale


@scaled_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("flops_test::scaled_mm_backward", mutates_args=())
def scaled_mm_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad * scale
    return grad @ b.T, a.T @ grad


@scaled_mm_backward.register_fake
def _(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(a), torch.empty_like(b)


def _setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    a, b, scale = inputs
    ctx.save_for_backward(a, b)
    ctx.scale = scale


def _backward(ctx: object, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    return (*torch.ops.flops_test.scaled_mm_backward(grad, a, b, ctx.scale), None)


scaled_mm.register_autograd(_backward, setup_context=_setup)


@register_formula(torch.ops.flops_test.scaled_mm)
def _scaled_mm_flops(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    a, b, _ = args
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


@register_formula(torch.ops.flops_test.scaled_mm_backward.default)  # an overload, not the packet
def _scaled_mm_backward_flops(args: tuple, kwargs: dict, out: tuple) -> int:
    grad, a, b, _ = args
    return 2 * (2 * a.shape[0] * a.shape[1] * b.shape[1])  # grad_a and grad_b


@torch.library.custom_op("flops_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x.exp()


@opaque.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Projection(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        opaque(x.detach())  # a side computation with no formula
        return scaled_mm(x, self.weight, 0.5)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Projection(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def profile_step(model: nn.Module, x: torch.Tensor, backward: bool = True) -> Profile:
    with FlopsProfiler(model) as prof:
        y = model(x)
        if backward:
            y.sum().backward()  # the sum is outside the model
    return prof.get_profile()


def test_a_custom_op_with_a_formula_is_counted_in_forward_and_backward_in_its_module() -> None:
    m, k, n = 4, 16, 8
    x = torch.randn(m, k, requires_grad=True)
    profile = profile_step(Net(), x)
    assert (profile.fwd_flops, profile.fwd_macs) == (2 * m * k * n, m * k * n)
    assert (profile.bwd_flops, profile.bwd_macs) == (4 * m * k * n, 2 * m * k * n)
    proj = profile.modules["proj"]
    assert (proj.fwd_flops, proj.bwd_flops) == (2 * m * k * n, 4 * m * k * n)
    assert proj.functionals["scaled_mm"].fwd_flops == 2 * m * k * n
    assert proj.functionals["scaled_mm"].bwd_flops == 4 * m * k * n  # the backward op, under its forward
    [uncounted] = profile.coverage.uncounted
    assert (uncounted.op, uncounted.calls) == ("flops_test.opaque", 1)


def test_registering_an_op_twice_is_refused_unless_replaced() -> None:
    with pytest.raises(ValueError, match=r"aten\.mm already registered; pass replace=True"):
        register_formula(aten.mm)(lambda args, kwargs, out: 0)
    # an overload of a registered packet: its entry would take over the packet's (it did, silently)
    with pytest.raises(ValueError, match=r"aten\.mm\.default already registered; pass replace=True"):
        register_formula(aten.mm.default)(lambda args, kwargs, out: 0)
    weight = torch.ones(8, 2)
    assert (
        profile_step(Call(lambda x: torch.mm(x, weight)), torch.ones(4, 8), backward=False).fwd_flops
        == 2 * 4 * 8 * 2
    )
    with pytest.raises(ValueError, match="flops_test.scaled_mm already registered"):
        register_formula([aten.erfinv, torch.ops.flops_test.scaled_mm])(lambda args, kwargs, out: 0)
    assert entry_for(aten.erfinv.default).kind is OpKind.ELEMENTWISE  # nothing of a refused list is kept
    assert entry_for(aten.erfinv.default).formula is not None

    @torch.library.custom_op("flops_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    register_formula(torch.ops.flops_test.double, kind="elementwise")(lambda args, kwargs, out: out.numel())
    x = torch.randn(5)
    assert profile_step(Call(double), x, backward=False).fwd_flops == 5
    register_formula(torch.ops.flops_test.double, kind="elementwise", replace=True)(
        lambda args, kwargs, out: 3 * out.numel()
    )
    assert (
        profile_step(Call(double), x, backward=False).fwd_flops == 15
    )  # the cached lookup saw the replacement


def test_a_packet_whose_overload_has_a_formula_is_refused_unless_replaced_and_then_counts() -> None:
    """The overload's entry comes first when an op is looked up: the packet's, accepted, was never used."""

    @torch.library.custom_op("flops_test::tripled", mutates_args=())
    def tripled(x: torch.Tensor) -> torch.Tensor:
        return 3 * x

    packet, x = torch.ops.flops_test.tripled, torch.randn(5)
    register_formula(packet.default, kind="elementwise")(lambda args, kwargs, out: out.numel())
    with pytest.raises(ValueError, match=r"flops_test\.tripled already registered; pass replace=True"):
        register_formula(packet, kind="elementwise")(lambda args, kwargs, out: 100 * out.numel())
    assert profile_step(Call(tripled), x, backward=False).fwd_flops == 5
    register_formula(packet, kind="elementwise", replace=True)(lambda args, kwargs, out: 100 * out.numel())
    assert profile_step(Call(tripled), x, backward=False).fwd_flops == 500  # the packet's, for its overloads


def test_the_deepspeed_style_profiler_says_a_formula_that_raised() -> None:
    """The engine stops counting at a failed count, and kept the failure: nothing read it (the profile
    read as complete, its op's work and everything after it missing)."""

    @torch.library.custom_op("flops_test::broken", mutates_args=())
    def broken(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    register_formula(torch.ops.flops_test.broken)(lambda args, kwargs, out: 1 / 0)
    model = Call(lambda x: broken(x @ torch.ones(5, 2)) @ torch.ones(2, 3))
    with FlopsProfiler(model) as prof:
        model(torch.ones(4, 5))
    said_it = (
        r"counting flops_test.broken.default with its formula failed \(ZeroDivisionError: division by zero\)"
    )
    with pytest.warns(UserWarning, match=said_it + "; counting stopped there") as said:
        assert prof.get_total_flops() == 2 * 4 * 5 * 2  # the first matmul's
        prof.get_profile()
    assert len(said) == 1


class Call(nn.Module):
    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def test_an_op_marked_free_leaves_the_coverage_section() -> None:
    @torch.library.custom_op("flops_test::shuffle", mutates_args=())
    def shuffle(x: torch.Tensor) -> torch.Tensor:
        return x.flip(0)

    before = profile_step(Call(shuffle), torch.randn(6), backward=False)
    assert [(u.op, u.calls) for u in before.coverage.uncounted] == [("flops_test.shuffle", 1)]
    register_op_kind(torch.ops.flops_test.shuffle, "free")
    after = profile_step(Call(shuffle), torch.randn(6), backward=False)
    assert after.coverage.uncounted == []
    assert after.fwd_flops == 0


def test_dense_counts_macs_as_half_the_flops_and_elementwise_none() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    mm = entry_for(aten.mm.default).count(aten.mm.default, (a, b), {}, None, causal_half=False)
    assert (mm.flops, mm.macs) == (2 * 3 * 4 * 5, 3 * 4 * 5)
    out = a.exp()
    exp = entry_for(aten.exp.default).count(aten.exp.default, (a,), {}, out, causal_half=False)
    assert (exp.flops, exp.macs) == (12, 0)


def test_calls_on_integer_and_bool_tensors_count_no_flops_but_their_bytes() -> None:
    # mask and index arithmetic (a mask built from position ids, an expert histogram): no floating point
    x, y = torch.arange(12).reshape(3, 4), torch.full((3, 4), 5)

    def masks_and_sum(y: torch.Tensor) -> Call:
        return Call(lambda t: ((t == y) & (t <= y), t + y))

    ints = profile_step(masks_and_sum(y), x, backward=False)
    assert ints.fwd_flops == 0
    # eq and le read 2 x 96 bytes of int64 and write 12 of bool each, & reads 24 and writes 12, + 3 x 96
    assert ints.fwd_bytes == 2 * (2 * 96 + 12) + (24 + 12) + 3 * 96
    floats = profile_step(masks_and_sum(y.float()), x.float(), backward=False)
    # comparing floats is floating-point work (bool out, float in): eq, le and + one flop per element;
    # the & of their two bool masks none
    assert floats.fwd_flops == 3 * 12
    assert floats.fwd_bytes == 2 * (2 * 48 + 12) + (24 + 12) + 3 * 48


def test_routing_histograms_count_no_flops_on_integer_indices_alone() -> None:
    experts = torch.tensor([0, 2, 2, 1, 3, 2])
    weights = torch.rand(6)
    for func, args, flops in [
        (aten.bincount.default, (experts,), 0),  # expert indices in, counts out: integers only
        (aten.bincount.default, (experts, weights), 6),  # weighted: one float add per element
        (aten.histc.default, (experts.float(), 4, 0, 4), 6),  # histc takes floats only
        (aten.cumsum.default, (experts, 0), 0),  # token offsets per expert
    ]:
        out = func(*args)
        assert entry_for(func).count(func, args, {}, out, causal_half=False).flops == flops, (func, args)


def test_attention_entries_carry_their_causal_and_recompute_shares() -> None:
    b, h, s, d = 1, 2, 4, 8
    q = k = v = torch.empty(b, h, s, d, device="meta")
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    full = 2 * b * h * s * s * (d + d)
    causal = {"is_causal": True}
    assert entry_for(forward).count(forward, (q, k, v), causal, None, causal_half=False).flops == full
    kept = entry_for(forward).count(forward, (q, k, v), causal, None, causal_half=True).flops
    assert kept == full * (1 + 2 + 3 + 4) // 16  # row i of the 4x4 score matrix keeps i + 1 entries
    grad_out = torch.empty(b, h, s, d, device="meta")
    bwd = entry_for(backward).count(backward, (grad_out, q, k, v), {}, None, causal_half=False)
    assert bwd.recompute_flops == 2 * b * h * s * s * d  # the recomputed QK^T
    assert bwd.flops == 2 * b * h * s * s * (2 * d + 2 * d)  # dV, dP, dQ, dK


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: register_formula("aten.mm"), r"ops must be torch op overload packets or overloads"),
        (lambda: register_formula(aten.erfinv, kind="fused"), r"kind must be one of 'dense', 'elementwise'"),
        (lambda: register_formula(aten.erfinv, kind="free"), r"kind must be 'dense' or 'elementwise'"),
        (lambda: register_op_kind(aten.erfinv, "dense"), r"kind must be 'free', 'metadata' or 'uncounted'"),
    ],
    ids=["not-an-op", "unknown-kind", "free-with-formula", "dense-without-formula"],
)
def test_bad_arguments_are_refused_by_name(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def docs_example() -> str:
    """The Python block of the docs' "Counting your own ops" page."""
    text = (ROOT / "docs" / "custom-ops.md").read_text()
    assert text.startswith("# Counting your own ops"), text[:80]
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


def test_the_docs_example_runs_and_counts_its_custom_op(capsys: pytest.CaptureFixture) -> None:
    namespace: dict = {}
    exec(compile(docs_example(), "docs/custom-ops.md", "exec"), namespace)
    assert capsys.readouterr().out.split()[-1] == str(2 * 8 * 16 * 32)
    assert namespace["prof"].get_profile().fwd_macs == 8 * 16 * 32


def test_collectives_move_data_and_do_no_arithmetic() -> None:
    """FSDP's all-gathers and reduce-scatters run as c10d ops: free, so the coverage section stays clean."""
    for op in (
        torch.ops.c10d.allgather_.default,
        torch.ops.c10d.reduce_scatter_.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    ):
        assert entry_for(op).kind is OpKind.FREE, op
