"""ModuleTimer: per-module forward and backward latencies from clock marks alone, nothing left behind."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module
from torch.utils.checkpoint import checkpoint

from flops_callbacks.module_tree import ancestors
from flops_callbacks.phase_names import BACKWARD, FORWARD
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.module_timer import ModuleTimer
from tests.sleepy import SleepInBackward, Sleepy
from tests.support import forward_timed, holds_sleep


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Sleepy(fwd=0.06, bwd=0.1, tiny_ops=2)
        self.rest = nn.ModuleList([Sleepy(fwd=0.1, bwd=0.05, tiny_ops=2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest[0](self.first(x))


def timed(model: nn.Module, x: torch.Tensor) -> tuple[ModuleTimer, object]:
    model(x).sum().backward()  # first-call initialisations (after a compile test: dynamo's) off the clock
    model.zero_grad(set_to_none=True)
    x.grad = None
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    loss = model(x).sum()
    timer.arm()
    loss.backward()
    timer.stop()
    return timer, timer.times()


def test_forward_and_backward_latencies_per_module_match_their_sleeps() -> None:
    _, times = timed(Two(), torch.randn(2, 4))
    assert holds_sleep(times.fwd["first"], 0.06)
    assert holds_sleep(times.fwd["rest.0"], 0.1)
    assert times.fwd["rest"] == times.fwd["rest.0"]  # a ModuleList is never called: its children's sum
    assert holds_sleep(times.fwd[""], 0.16)
    # the input needs no grad: ModuleTracker would never see the first block's backward
    assert holds_sleep(times.bwd["first"], 0.1)
    assert holds_sleep(times.bwd["rest.0"], 0.05)
    assert holds_sleep(times.bwd[""], 0.15)


def test_one_span_per_module_call_and_one_backward_span_per_module() -> None:
    model = Two()
    timer, times = timed(model, torch.randn(2, 4))
    forward = [s.name for s in times.spans if s.phase == FORWARD]
    called = ["", "first", "first.tiny.0", "first.tiny.1", "rest.0", "rest.0.tiny.0", "rest.0.tiny.1"]
    assert sorted(forward) == sorted(called)
    backward = {s.name for s in times.spans if s.phase == BACKWARD}
    assert {"", "first", "rest", "rest.0"} <= backward
    assert all(s.start >= 0 and s.duration >= 0 for s in times.spans)


def test_recompute_under_activation_checkpointing_is_timed_apart_from_the_backward() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Sleepy(fwd=0.05, bwd=0.0, tiny_ops=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    _, times = timed(Checkpointed(), torch.randn(2, 4, requires_grad=True))
    assert holds_sleep(times.fwd["block"], 0.05)
    assert holds_sleep(times.recompute["block"], 0.05)
    # the recompute ran inside the backward node that unpacked a saved tensor: it is not that node's time
    # (its owners read the 0.05 s twice, as backward and as recompute)
    assert times.bwd["block"] < 0.01 and times.bwd[""] < 0.01


def test_reentrant_checkpointing_gives_the_recomputed_graphs_backward_to_its_modules() -> None:
    """Reentrant checkpointing backpropagates the graph its recompute built, inside its own node: that
    backward is the checkpointed modules' (it read 0 in each, the node's whole time its caller's)."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Sleepy(fwd=0.02, bwd=0.05, tiny_ops=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=True)

    _, times = timed(Checkpointed(), torch.randn(2, 4, requires_grad=True))
    assert holds_sleep(times.recompute["block"], 0.02)
    assert holds_sleep(times.bwd["block"], 0.05)
    assert holds_sleep(times.bwd[""], 0.05)  # the caller holds its block's backward once


def test_reentrant_checkpointing_of_each_layer_gives_every_layer_its_own_backward() -> None:
    """Eight layers each checkpointed (reentrant), each recomputed graph armed in its own node: a node's
    id taken by an earlier, freed node's wrapper read as already armed (layers at 0); a block that
    checkpoints its own body inside a ``ModuleList`` had the list hold its backward twice."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Sleepy(fwd=0.0, bwd=0.01, tiny_ops=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self._body, x, use_reentrant=True)  # its own body (transformers' layers)

        def _body(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.inner(x)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    _, times = timed(Stack(), torch.randn(2, 4, requires_grad=True))
    for i in range(8):
        assert holds_sleep(times.bwd[f"layers.{i}.inner"], 0.01), times.bwd
        assert holds_sleep(times.bwd[f"layers.{i}"], 0.01), times.bwd
    assert holds_sleep(times.bwd["layers"], 0.08) and holds_sleep(times.bwd[""], 0.08)


class Between(nn.Module):
    """The model's own op (a backward of ``own`` seconds) between its two children's calls (``b`` called
    with a keyword: no forward hook sees its input)."""

    def __init__(self, own: float) -> None:
        super().__init__()
        self.own = own
        self.a = Sleepy(fwd=0.0, bwd=0.02, tiny_ops=1)
        self.b = Sleepy(fwd=0.0, bwd=0.01, tiny_ops=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x=SleepInBackward.apply(self.a(x) * 2, self.own))


def test_a_parents_own_work_between_its_childrens_calls_is_its_backward_alone() -> None:
    """The model's walk of its graph stopped at its children's nodes: its own op before ``b``'s call was no
    module's backward, the model's too (a root reading a tenth of its backward phase); ``b``, called with a
    keyword, took it as its own."""
    _, times = timed(Between(own=0.05), torch.randn(2, 4))
    assert holds_sleep(times.bwd["a"], 0.02) and holds_sleep(times.bwd["b"], 0.01)
    assert holds_sleep(times.bwd[""], 0.08)


def test_a_sequential_looped_over_holds_its_layers_backward_as_its_forward() -> None:
    """An ``nn.Sequential`` iterated, never called: its forward and backward are its layers' (its backward
    read 0, under its layers' 0.08 s: "longer in the backward than their parent" in the report)."""

    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(
                Sleepy(fwd=0.02, bwd=0.05, tiny_ops=1), Sleepy(fwd=0.01, bwd=0.03, tiny_ops=1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.seq:
                x = layer(x)
            return x

    _, times = timed(Looped(), torch.randn(2, 4))
    assert holds_sleep(times.fwd["seq"], 0.03) and holds_sleep(times.bwd["seq"], 0.08)
    assert times.bwd["seq"] <= times.bwd[""]


def test_a_module_shared_by_two_parents_gives_each_caller_its_calls_backward() -> None:
    """One block inside ``a`` and ``b`` (named ``a.shared``, its first name): each parent's backward holds
    its own call's, as its forward and its flops do, and the block's holds both. ``b`` read none of its
    call's backward and ``a`` both calls' (a child twice its parent, and 1.5 TFLOPS on one CPU thread)."""

    class Block(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = Sleepy(fwd=0.02, bwd=0.05, tiny_ops=1)
            self.a, self.b = Block(shared), Block(shared)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    _, times = timed(Net(), torch.randn(2, 4))
    for parent in ("a", "b"):
        assert holds_sleep(times.fwd[parent], 0.02) and holds_sleep(times.bwd[parent], 0.05), parent
    assert holds_sleep(times.fwd["a.shared"], 0.04) and holds_sleep(times.bwd["a.shared"], 0.1)
    assert holds_sleep(times.bwd[""], 0.1)


class CalledPast(nn.Module):
    """``vgg.features(x)``: the backbone's own forward never runs, its ``features`` is called from the
    model; a ModuleDict's entry is called from a sibling (a router calling its experts)."""

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = Sleepy(fwd=0.02, bwd=0.05, tiny_ops=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("called past")

    class Router(nn.Module):
        def __init__(self, experts: nn.ModuleDict) -> None:
            super().__init__()
            self.experts = [experts]  # not a submodule: the model's ``experts`` is the one

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts[0]["first"](x)

    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.Backbone()
        self.experts = nn.ModuleDict({"first": Sleepy(fwd=0.01, bwd=0.03, tiny_ops=1)})
        self.router = self.Router(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(self.backbone.features(x))


def test_a_module_never_called_holds_the_forward_and_backward_of_its_submodules_called_past_it() -> None:
    """Its forward time was its submodules' and its backward none (the report's row: time, no flops)."""
    _, times = timed(CalledPast(), torch.randn(2, 4))
    assert holds_sleep(times.fwd["backbone"], 0.02) and holds_sleep(times.bwd["backbone"], 0.05)
    assert times.fwd["backbone"] == times.fwd["backbone.features"]
    assert holds_sleep(times.fwd["experts"], 0.01) and holds_sleep(times.bwd["experts"], 0.03)
    assert holds_sleep(times.bwd["router"], 0.03)  # its call's, as its forward


class Recursive(nn.Module):
    """A module that calls itself ``depth`` times more, 20 ms of work at each level."""

    def __init__(self) -> None:
        super().__init__()
        self.work = Sleepy(fwd=0.02, bwd=0.0, tiny_ops=1)

    def forward(self, x: torch.Tensor, depth: int = 3) -> torch.Tensor:
        x = self.work(x)
        return self(x, depth - 1) if depth else x


def test_a_module_calling_itself_is_timed_once_by_its_outermost_call() -> None:
    """Its inner calls lie inside its outer one: each nesting level added them again (0.2 s of 0.08 s)."""
    model = nn.Sequential(Recursive())
    _, times = timed(model, torch.randn(2, 4))
    assert holds_sleep(times.fwd["0"], 0.08) and holds_sleep(times.fwd["0.work"], 0.08)
    assert times.fwd["0"] <= times.fwd[""]
    assert sum(s.name == "0" for s in times.spans if s.phase == FORWARD) == 1


def test_nothing_stays_on_torch_the_modules_or_the_nodes() -> None:
    model = Two()
    x = torch.randn(2, 4)
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    out = model(x)
    timer.arm()
    timer.stop()  # stopped before the backward ran: the node hooks go too
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not out.grad_fn.metadata
    out.sum().backward()  # runs as if never timed
    assert timer.times().bwd == {}


def test_ancestors_list_the_model_first() -> None:
    assert ancestors("a.b.c") == ["", "a", "a.b"]
    assert ancestors("") == []


def test_a_compiled_model_is_timed_eagerly_and_runs_its_compiled_graph_again_after() -> None:
    stats = {"compiles": 0, "calls": 0}

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        stats["compiles"] += 1

        def run(*args: object) -> object:
            stats["calls"] += 1
            return graph.forward(*args)

        return run

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 4)
    compiled(x).sum().backward()
    assert stats == {"compiles": 1, "calls": 1}
    timer = ModuleTimer(compiled, CpuClock())
    timer.start()
    loss = compiled(x).sum()
    timer.arm()
    loss.backward()
    timer.stop()
    assert stats == {"compiles": 1, "calls": 1}  # eager while timed: no recompile for the hooks
    assert {"0", "1", "2"} <= set(timer.times().fwd)  # every module's own call was marked
    compiled(x)
    assert stats == {"compiles": 1, "calls": 2}  # and compiled again afterwards


def test_the_hooks_cost_comes_off_each_call_inside_a_span_and_a_parent_keeps_its_children() -> None:
    model = Two()  # "" > first (2 tiny calls) and rest.0 (2 tiny calls): 6 calls inside the model's span
    timer = forward_timed(model, torch.randn(2, 4))
    times = timer.times(HookCost(0.01, 0.0, "given"))  # say each call's hooks cost 10 ms (not us)
    assert times.fwd["first"] == pytest.approx(0.06 - 2 * 0.01, rel=0.15)
    assert times.fwd["rest.0"] == pytest.approx(0.1 - 2 * 0.01, rel=0.15)
    # 0.16 - 6 x 0.01 = 0.10 would be less than its children's 0.04 + 0.08: it keeps their sum
    assert times.fwd[""] == pytest.approx(times.fwd["first"] + times.fwd["rest.0"], rel=1e-9)
    starts = {s.name: s.start for s in times.spans}
    # rest.0's mark moves back by the 4 calls before it (first, its 2 tiny, rest.0): ~0.06 - 0.04
    assert starts["rest.0"] == pytest.approx(0.06 - 4 * 0.01, abs=0.01)


def test_the_collector_is_off_while_modules_are_timed_and_on_again_after() -> None:
    import gc

    timer = ModuleTimer(Two(), CpuClock())
    assert gc.isenabled()
    timer.start()
    try:
        assert not gc.isenabled()
    finally:
        timer.stop()
    assert gc.isenabled()
