"""The counting engine: forward, backward and recompute attributed to modules, nothing left behind on stop,
totals equal to the profile's, and the running sums laid out as Counts. Counts are matmuls by hand."""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.recording import CALLS, SLOTS, Site
from flops_callbacks.counting.registry import OpCount
from flops_callbacks.options import CausalAttention
from flops_callbacks.profile import Counts

B, D_IN, D_HID, D_OUT = 4, 8, 16, 2


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_IN, D_HID, bias=False)
        self.act = nn.ReLU()
        self.down = nn.Linear(D_HID, D_OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


UP, DOWN = 2 * B * D_IN * D_HID, 2 * B * D_HID * D_OUT  # forward matmul flops


def traced(model: nn.Module, x: torch.Tensor, **options: object) -> CountingEngine:
    tracer = CountingEngine(model, **options)
    tracer.start()
    try:
        model(x).sum().backward()
    finally:
        tracer.stop()
    return tracer


def test_forward_and_backward_are_attributed_to_their_modules() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, D_IN)  # no grad: the first layer's input gradient is never computed
    profile = traced(Mlp(), x).profile()
    up, down = profile.modules["up"], profile.modules["down"]
    assert (up.fwd_macs * 2, up.bwd_macs * 2) == (UP, UP)  # the weight gradient only
    assert (down.fwd_macs * 2, down.bwd_macs * 2) == (DOWN, 2 * DOWN)
    assert profile.modules["act"].fwd_flops == B * D_HID  # one comparison per element
    assert profile.fwd_macs == up.fwd_macs + down.fwd_macs
    assert (up.calls, down.calls, profile.model.calls) == (1, 1, 1)
    params = D_IN * D_HID + D_HID * D_OUT
    assert (up.params, profile.params, profile.trainable_params) == (D_IN * D_HID, params, params)


class HandMatmul(torch.autograd.Function):
    """A custom autograd Function: its node is made by ``apply``, which no torch function mode sees."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad @ w.T, x.T @ grad


class CustomThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D_IN, D_IN))
        self.inner = nn.Linear(D_IN, D_IN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(HandMatmul.apply(x, self.w))


def test_a_custom_functions_backward_is_the_module_that_applied_it_not_the_next_one() -> None:
    """Its node was tagged by the next call's walk, with that call's place: ``inner`` held both
    backwards (4 matmuls) and the model none of its own."""
    x = torch.randn(B, D_IN, requires_grad=True)
    profile = traced(CustomThenLinear(), x).profile()
    matmul = 2 * B * D_IN * D_IN
    assert profile.modules["inner"].bwd_flops == 2 * matmul  # its input's gradient and its weight's
    assert profile.model.bwd_flops == 4 * matmul  # its own two: the Function's backward
    assert profile.modules["inner"].saved_bytes == B * D_IN * 4  # inner saved its input, not x and w


class Looped(nn.Module):
    """An ``nn.Sequential`` looped over, never called (as timm's ``checkpoint_seq`` and torch's
    ``checkpoint_sequential`` cut one), beside one that is called."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.layers = Mlp()
        self.seq = nn.Sequential(
            nn.Linear(D_OUT, D_HID, bias=False), nn.ReLU(), nn.Linear(D_HID, D_OUT, bias=False)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint_sequential(self.seq, 2, x, use_reentrant=False)
        for layer in self.seq:
            x = layer(x)
        return x


@pytest.mark.parametrize("checkpointed", [False, True], ids=["looped", "checkpoint_sequential"])
def test_a_sequential_looped_over_holds_its_layers_work_as_deepspeeds_sums_do(checkpointed: bool) -> None:
    """Its layers' forward, backward and recompute are its own, and the model owns none of them (it read
    0 flops, its work the model's, whose own flops then doubled the top modules' shares)."""
    x = torch.randn(B, D_IN, requires_grad=True)
    profile = traced(Looped(checkpointed), x).profile()
    seq, first, last = (profile.modules[n] for n in ("seq", "seq.0", "seq.2"))
    ahead = 2 * B * D_OUT * D_HID  # each of the two Linear(2 <-> 16)
    assert seq.fwd_flops == first.fwd_flops + profile.modules["seq.1"].fwd_flops + last.fwd_flops
    assert (first.fwd_macs * 2, last.fwd_macs * 2) == (ahead, ahead)
    assert seq.bwd_macs * 2 == 4 * ahead  # weight and input gradients of both
    children = [m for n, m in profile.modules.items() if n.startswith("seq.")]
    assert seq.recompute_flops == sum(m.recompute_flops for m in children)
    assert (seq.recompute_latency > 0) == checkpointed  # its first layer ran again
    assert profile.fwd_flops == profile.modules["layers"].fwd_flops + seq.fwd_flops  # the model owns none
    assert profile.bwd_flops == profile.modules["layers"].bwd_flops + seq.bwd_flops
    assert seq.calls == 0


class SparseUp(Mlp):
    """``up`` as a sparse matrix times the input (a pruned weight): its bytes are not its shape's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(self.up.weight.to_sparse(), x.t()).t()
        return self.down(self.act(h))


def forward_counted(model: nn.Module, backward: bool) -> tuple[CountingEngine, bool]:
    """The engine over one forward (and its backward), and whether the forward's output is the one the
    same model gives uncounted."""
    torch.manual_seed(0)
    x = torch.randn(B, D_IN)
    expected = model(x).detach()
    tracer = CountingEngine(model)
    tracer.start()
    try:
        out = model(x)
        if backward:
            out.sum().backward()
    finally:
        tracer.stop()
    return tracer, torch.equal(out.detach(), expected)


def test_a_sparse_tensor_goes_through_the_count_and_the_dense_layers_are_counted() -> None:
    tracer, same = forward_counted(SparseUp(), backward=True)
    assert same and tracer.failure is None
    assert tracer.profile().modules["down"].fwd_macs * 2 == DOWN


def test_a_failure_of_the_count_itself_is_kept_and_the_op_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from flops_callbacks.counting import engine as engine_module

    def broken(func: object) -> object:
        return lambda args, kwargs, out: 1 // 0  # a bytes rule that raises

    monkeypatch.setattr(engine_module, "bytes_rule", broken)
    tracer, same = forward_counted(Mlp(), backward=False)
    assert same
    assert tracer.failure is not None and isinstance(tracer.failure[1], ZeroDivisionError)
    assert tracer.failure[0].endswith(" with its bytes")


def test_totals_equal_the_profile_without_building_it() -> None:
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(B, D_IN)
    tracer = CountingEngine(model)
    tracer.start()
    model(x).sum().backward()
    counts, seconds = tracer.totals()  # while running: from the sums
    tracer.stop()
    profile = tracer.profile()
    assert (counts.fwd_flops, counts.bwd_flops, counts.fwd_macs, counts.calls) == (
        profile.fwd_flops,
        profile.bwd_flops,
        profile.fwd_macs,
        1,
    )
    assert seconds == pytest.approx(profile.fwd_latency)
    assert tracer.totals()[0] is profile.model  # once built, read from the profile


def test_stop_leaves_no_hook_mode_or_tag_and_reset_forgets_counts() -> None:
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(B, D_IN, requires_grad=True)
    hooks = (len(module_globals._global_forward_pre_hooks), len(module_globals._global_forward_hooks))
    tracer = CountingEngine(model)
    tracer.start()
    assert tracer.running
    out = model(x)
    tracer.stop()
    assert not tracer.running
    assert (len(module_globals._global_forward_pre_hooks), len(module_globals._global_forward_hooks)) == hooks
    assert _get_current_dispatch_mode_stack() == []
    node, seen = out.grad_fn, []
    while node is not None:  # every autograd node of the graph, none tagged any more
        seen.append(dict(node.metadata))
        node = next((n for n, _ in node.next_functions if n is not None), None)
    assert seen and all(meta == {} for meta in seen)
    assert tracer.profile().fwd_macs * 2 == UP + DOWN
    tracer.reset()
    assert tracer.profile().fwd_flops == 0


def test_recompute_under_activation_checkpointing_is_apart() -> None:
    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.mlp, x, use_reentrant=False)

    profile = traced(Checkpointed(), torch.randn(B, D_IN, requires_grad=True)).profile()
    assert 2 * profile.fwd_macs == UP + DOWN
    # non-reentrant checkpointing re-runs the forward only as far as the backward needs saved
    # tensors: up and its ReLU (down's weight gradient reads the ReLU's output); down's own output
    # is needed by nobody
    assert 2 * profile.recompute_macs == UP
    assert 2 * profile.bwd_macs == 2 * (UP + DOWN)
    assert profile.modules["mlp.up"].recompute_macs * 2 == UP


class CheckpointedCore(nn.Module):
    """q, k, v from one Linear, then attention checkpointed as a function (no module of its own):
    ``use_reentrant`` None is the same model unchecked."""

    HEADS, LENGTH, DIM = 2, 8, 8

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.qkv = nn.Linear(self.HEADS * self.DIM, 3 * self.HEADS * self.DIM)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.LENGTH, 3, self.HEADS, self.DIM)
        q, k, v = self.qkv(x).view(shape).permute(2, 0, 3, 1, 4)
        if self.use_reentrant is None:
            return F.scaled_dot_product_attention(q, k, v)
        return checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_functional_is_recomputed_apart_and_its_backward_is_the_models(
    use_reentrant: bool,
) -> None:
    """Checkpointing changes no backward flop: it adds the attention's forward again, as recompute, to the
    module that called it (QK^T and AV: 2 x 2 x B x heads x L x L x dim). The reentrant checkpoint's
    backward of its recomputed graph is the model's backward too, not work outside the model."""
    batch, c = 2, CheckpointedCore
    x = torch.randn(batch, c.LENGTH, c.HEADS * c.DIM)
    torch.manual_seed(0)
    plain = traced(CheckpointedCore(None), x).profile()
    torch.manual_seed(0)
    checkpointed = traced(CheckpointedCore(use_reentrant), x).profile()
    attention = 2 * 2 * batch * c.HEADS * c.LENGTH * c.LENGTH * c.DIM
    assert (checkpointed.fwd_flops, checkpointed.bwd_flops) == (plain.fwd_flops, plain.bwd_flops)
    assert checkpointed.recompute_flops == plain.recompute_flops + attention
    assert checkpointed.modules[""].recompute_flops == checkpointed.recompute_flops
    assert checkpointed.modules["qkv"].recompute_flops == 0


class NestedCheckpoints(nn.Module):
    """h @ w1, GELU, then a checkpointed method (h @ w2, GELU) inside a checkpointed method, then h @ w3:
    weights used as functions, no module but the root."""

    ROWS, WIDTH = 32, 64

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(self.WIDTH, self.WIDTH)) for _ in range(3))
        self.use_reentrant = use_reentrant

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h @ self.w2)

    def outer(self, h: torch.Tensor) -> torch.Tensor:
        h = F.gelu(h @ self.w1)
        h = (
            self.inner(h)
            if self.use_reentrant is None
            else checkpoint(self.inner, h, use_reentrant=self.use_reentrant)
        )
        return h @ self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reentrant is None:
            return self.outer(x)
        return checkpoint(self.outer, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoints_nested_in_plain_functions_recompute_apart(use_reentrant: bool) -> None:
    """The outer checkpoint recomputes the whole forward: three matmuls (2 x 32 x 64 x 64 each) and two GELUs
    (one flop an element); the reentrant inner one, run with grad off inside it, recomputes its own matmul
    and GELU once more for its backward. The backward is the unchecked model's, but for one elementwise add
    of an activation's gradient (32 x 64) the checkpoint makes."""
    n = NestedCheckpoints
    matmul, gelu = 2 * n.ROWS * n.WIDTH * n.WIDTH, n.ROWS * n.WIDTH
    x = torch.randn(n.ROWS, n.WIDTH, requires_grad=True)
    torch.manual_seed(0)
    plain = traced(NestedCheckpoints(None), x).profile()
    torch.manual_seed(0)
    nested = traced(NestedCheckpoints(use_reentrant), x).profile()
    assert plain.fwd_flops == nested.fwd_flops == 3 * matmul + 2 * gelu
    assert 0 <= nested.bwd_flops - plain.bwd_flops <= gelu
    again = matmul + gelu if use_reentrant else 0
    assert nested.recompute_flops == 3 * matmul + 2 * gelu + again
    assert nested.modules[""].bwd_flops == nested.bwd_flops  # none outside the model


def test_a_convolution_on_an_input_that_needs_no_grad_is_counted() -> None:
    """The first layer of a CNN: its backward returns no input gradient (None beside the weight's and the
    bias's), which the count of what the matmuls ran in once read as a tensor, failing the whole count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))
    tracer = traced(model, torch.randn(4, 3, 8, 8))
    assert tracer.failure is None
    conv = 2 * 4 * 8 * 6 * 6 * 3 * 3 * 3  # 2 x batch x out channels x output positions x kernel volume
    assert tracer.profile().modules["0"].fwd_macs * 2 == conv
    assert tracer.matmul_dtype() == torch.float32


def test_a_backward_that_makes_a_graph_is_backward_not_recompute() -> None:
    """A gradient penalty (``create_graph=True``) runs its backward with grad on, as a recompute does."""
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(B, D_IN, requires_grad=True)
    tracer = CountingEngine(model)
    tracer.start()
    try:
        (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        grad.pow(2).sum().backward()
    finally:
        tracer.stop()
    profile = tracer.profile()
    assert profile.recompute_flops == 0 and 2 * profile.fwd_macs == UP + DOWN
    assert profile.bwd_flops > 2 * (UP + DOWN)  # the first backward, then the backward of that backward


def test_the_tracer_holds_no_activation_a_graph_frees_and_its_recompute_is_freed_too() -> None:
    torch.manual_seed(0)
    model = Mlp()
    activations: list[weakref.ref[torch.Tensor]] = []  # each ReLU output: saved by its node for the backward
    handle = model.act.register_forward_hook(lambda m, args, out: activations.append(weakref.ref(out)))
    tracer = CountingEngine(model)
    tracer.start()
    try:
        out = model(torch.randn(B, D_IN, requires_grad=True))
        assert activations[0]() is not None  # the graph holds it
        del out  # the graph goes: so does what its nodes saved, while the tracer still runs
        assert activations[0]() is None
        # checkpointed: the recompute's nodes hold the recomputed ReLU output; torch drops them once the
        # backward has read it, and the tracer must not keep them to the end
        checkpoint(model, torch.randn(B, D_IN, requires_grad=True), use_reentrant=False).sum().backward()
        assert len(activations) == 3 and all(ref() is None for ref in activations)
    finally:
        tracer.stop()
        handle.remove()
    assert 2 * tracer.profile().recompute_macs == UP  # the recompute ran (up and its ReLU), and was counted


def test_ignored_types_count_towards_their_parent() -> None:
    torch.manual_seed(0)
    profile = traced(Mlp(), torch.randn(B, D_IN), ignore_types=(nn.Linear,)).profile()
    assert set(profile.modules) == {"", "act"}
    assert profile.model.fwd_macs * 2 == UP + DOWN


def test_work_in_another_thread_is_not_counted() -> None:
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(B, D_IN)
    tracer = CountingEngine(model)
    tracer.start()
    try:
        worker = threading.Thread(target=lambda: model(x))
        worker.start()
        worker.join()
    finally:
        tracer.stop()
    assert tracer.profile().fwd_flops == 0


def test_causal_half_counts_the_kept_part_of_causal_attention() -> None:
    q = torch.randn(1, 2, 8, 4)

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    def attention_flops(causal_attention: CausalAttention) -> int:
        tracer = CountingEngine(Attention(), causal_attention=causal_attention)
        tracer.start()
        try:
            tracer.model(q)
        finally:
            tracer.stop()
        return tracer.profile().model.functionals["scaled_dot_product_attention"].fwd_flops

    full = 2 * 2 * 8 * 8 * (4 + 4)
    assert attention_flops("full") == full
    assert attention_flops("half") == full * sum(range(1, 9)) // 64  # row i keeps i + 1 of 8 keys


def test_the_running_sums_are_laid_out_as_counts() -> None:
    assert tuple(f.name for f in fields(Counts)) == SLOTS
    ctx = Site(("",), "linear")
    ctx.add(1, "linear", OpCount(flops=10, macs=4, recompute_flops=3, recompute_macs=1), 0)
    ctx.sums_of("linear")[CALLS] += 1
    assert Counts(*ctx.sums["linear"]) == Counts(
        bwd_flops=10, bwd_macs=4, recompute_flops=3, recompute_macs=1, calls=1
    )


def test_no_tag_stays_on_a_parameters_gradient_accumulator_that_outlives_the_step() -> None:
    # DDP's reducer holds every parameter's AccumulateGrad node: a tag left on one after stop() would
    # attribute a later step's backward ops (and is something of the profiler's left behind)
    from flops_callbacks.counting.node_tags import TAG

    model = nn.Linear(3, 2)
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(torch.ones(4, 3)).sum().backward()
    finally:
        tracer.stop()
    assert all(TAG not in node.metadata for node in accumulators)


DDP_WORKER = """
import json, sys, torch, torch.nn as nn
from flops_callbacks import FlopsProfiler
from tests.support import end_process
torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
x = torch.randn(4, 8)
hooked = nn.parallel.DistributedDataParallel(model)
hooked.register_comm_hook(None, default_hooks.allreduce_hook)  # divides each bucket itself
runs = {
    "plain": model,
    "ddp": nn.parallel.DistributedDataParallel(model),
    "bucket view": nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True),
    "comm hook": hooked,
}
counts = {}
for name, run in runs.items():
    run(x).sum().backward()  # the reducer's first backward builds its buckets
    model.zero_grad(set_to_none=True)  # no accumulation into earlier gradients
    with FlopsProfiler(model) as prof:
        run(x).sum().backward()
    counts[name] = prof.get_profile().bwd_flops
rank = torch.distributed.get_rank()
open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps(counts))
end_process()
"""


def test_ddps_averaging_of_the_gradients_is_no_model_backward_work(tmp_path: Path) -> None:
    """DDP's reducer copies each gradient into its bucket scaled by 1 / world size (``mul.out`` in the
    parameter's AccumulateGrad), or divides it there (``gradient_as_bucket_view``, a communication hook):
    it counted as the model's backward, one flop per parameter more than an unsharded copy of the model
    does, so the flops per device depended on the job's size."""
    import os
    import sys

    from tests.support import run_bounded

    worker = tmp_path / "ddp_worker.py"
    worker.write_text(DDP_WORKER)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(worker), str(tmp_path)]  # fmt: skip
    done = run_bounded(command, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    # backward by hand: each Linear's weight and bias gradients (dW = dY^T X, db = sum dY: one add per
    # element), the second's input gradient (the first's input needs none), relu's mask (one per element)
    weights = 2 * 4 * 8 * 16 + 4 * 16 + 2 * 4 * 16 * 2 + 4 * 2
    expected = weights + 2 * 4 * 16 * 2 + 4 * 16
    for rank in range(2):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == dict.fromkeys(("plain", "ddp", "bucket view", "comm hook"), expected), counts


def test_under_inference_mode_an_op_autograd_would_split_is_counted_as_its_parts() -> None:
    """``aten.linear``, ``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` reach the dispatch
    mode whole under inference_mode: Llama's count fell from 5.5 M flops to 88 K, its attention to 0 with
    no word. Counted as their parts, the count is no_grad's."""
    import transformers

    from flops_callbacks import FlopsProfiler

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 16))
    counts = []
    for mode in (torch.no_grad, torch.inference_mode):
        with FlopsProfiler(model) as prof, mode():
            model(ids)
        profile = prof.get_profile()
        assert not profile.coverage.uncounted
        counts.append(
            (profile.fwd_flops, profile.fwd_macs, profile.modules["model.layers.0.self_attn"].fwd_macs)
        )
    assert counts[1] == counts[0]
    # attention's MACs by hand: q k^T and p v, 4 heads of 16 over 16 x 16 positions, batch 2
    projections = 16 * 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)  # q, k and v (2 KV heads), o
    assert counts[1][2] == projections + 2 * 2 * 4 * 16 * 16 * 16


def test_an_op_on_nested_tensors_runs_their_own_kernel_under_inference_mode() -> None:
    """A composite op reaching the mode whole is counted as its parts on plain tensors only: a nested
    tensor's own kernel runs as without the profiler (decomposed, it raised "NestedTensorImpl doesn't
    support sizes", or recursed)."""
    from flops_callbacks import FlopsProfiler

    linear = nn.Linear(8, 4).eval()
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout)
        with torch.inference_mode():
            expected = linear(nested)
            with FlopsProfiler(linear):
                out = linear(nested)
        assert all(torch.equal(a, b) for a, b in zip(out.unbind(), expected.unbind(), strict=True))


def test_a_model_of_inference_tensors_is_counted_as_its_parts_outside_inference_mode() -> None:
    """Tensors made under inference_mode have no autograd keys: ``aten.linear`` reaches the mode whole
    under no_grad too."""
    from flops_callbacks import FlopsProfiler

    with torch.inference_mode():
        linear, x = nn.Linear(8, 4), torch.randn(2, 8)
    with FlopsProfiler(linear) as prof, torch.no_grad():
        linear(x)
    profile = prof.get_profile()
    assert (profile.fwd_macs, profile.coverage.uncounted) == (2 * 8 * 4, [])
