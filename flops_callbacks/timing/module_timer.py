"""Per-module forward and backward latencies, on a step where nothing counts.

The counting engine runs every op through Python, so the module latencies it sees are inflated (5x on
an op-bound model). This timer runs on its own step of the profile window with only clock marks:

* forward: two global module hooks mark each call of a module of the profiled model (CUDA events on
  a GPU, ``perf_counter`` on a CPU) and note the autograd nodes the call received and produced;
* backward: when the backward starts (:meth:`ModuleTimer.arm`, between the phase marks), each node a
  call produced is given to that module (the innermost first, stopping at the nodes it received), and
  a pre-hook and a hook on each such node mark its execution. A module's backward latency is the sum
  of its nodes' executions, its submodules' included: the gradient kernels of its ops and the
  accumulation of its parameters' gradients, not the autograd engine's scheduling between nodes.

What the marks themselves cost is taken out: a module's forward span holds the hooks of every module
called inside it (and torch's slower call path while global hooks exist), a few microseconds each,
which on a model of small ops is from a third of the forward to more than all of it. On a CPU clock
the cost of one call's hooks is calibrated on a one-op module when the timer first starts (a few ms,
before any phase mark), and each mark is moved back by
that cost times the calls started before it (:func:`hook_cost`); on a GPU the marks are CUDA events,
and the hooks' host time hides behind the kernels unless the model is launch-bound. The garbage
collector is off while the timer runs (and on again at :meth:`ModuleTimer.stop`): a collection, of the
timer's own marks or of what earlier steps left, would land in whichever module happened to run.

Why not ``register_full_backward_hook``: it wraps a module's inputs and outputs in extra autograd
nodes and never fires when no input needs a gradient (a first layer, frozen embeddings). Nothing is
written onto the modules or the nodes: names live in this object, and every hook is removed by
:meth:`ModuleTimer.stop` (or when the backward's hooks are released).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from flops_callbacks.module_tree import ModuleTree, ancestors, depth_of, eager_compiled_code
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clock import Clock, CpuClock
from flops_callbacks.timing.spans import BACKWARD, FORWARD, RECOMPUTE, ModuleSpan, Phase

__all__ = ["BACKWARD", "FORWARD", "hook_cost", "ModuleTimer", "ModuleTimes", "RECOMPUTE"]

_current_autograd_node = torch._C._current_autograd_node


@dataclasses.dataclass(frozen=True)
class ModuleTimes:
    """Latencies per module name ("" is the model): forward, recompute (checkpointing) and backward."""

    fwd: dict[str, float]
    bwd: dict[str, float]
    recompute: dict[str, float]
    spans: list[ModuleSpan]  # each forward / recompute call; each module's backward (first .. last node)

    def applied_to(self, profile: Profile) -> Profile:
        """``profile`` with these latencies on its modules (a module never timed gets 0)."""
        modules = {
            name: dataclasses.replace(
                m,
                fwd_latency=self.fwd.get(name, 0.0),
                bwd_latency=self.bwd.get(name, 0.0),
                recompute_latency=self.recompute.get(name, 0.0),
            )
            for name, m in profile.modules.items()
        }
        return dataclasses.replace(profile, modules=modules)


def _grad_fns(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value.grad_fn] if value.grad_fn is not None else []
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):  # most calls' args:
        return [v.grad_fn for v in value if v.grad_fn is not None]  # no pytree walk (a few us a call)
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class ModuleTimer:
    """Marks module calls in the forward and their autograd nodes in the backward (module doc)."""

    def __init__(self, model: torch.nn.Module, clock: Clock, calibrate: bool = True) -> None:
        self.clock = clock
        self._names = ModuleTree(model).names  # the counting engine's names: one record per module
        # seconds one call's hooks add around it; calibrated at the first start (CPU clock only)
        self.hook_cost: float | None = None if calibrate and isinstance(clock, CpuClock) else 0.0
        self._started = 0  # module calls started so far: the marks before which hooks ran
        # name, start mark, calls started at it, recompute, inputs
        self._stack: list[tuple[str, Any, int, bool, list[Any]]] = []
        self._calls: list[tuple[str, list[Any], set[int]]] = []  # name, output nodes, input node ids
        # name, start mark, calls started by it, end mark, calls started by it, recompute
        self._fwd_spans: list[tuple[str, Any, int, Any, int, bool]] = []
        self._node_spans: list[tuple[str, Any, Any, int]] = []  # name, start, end, calls started
        self._node_start: dict[int, Any] = {}
        self._owner: dict[int, str] = {}  # node id -> module name, for the nodes armed
        self._armed: list[Any] = []  # node hook handles of the current backward
        self._exit: contextlib.ExitStack | None = None
        self._thread: int | None = None
        self._origin: Any = None

    @property
    def running(self) -> bool:
        return self._exit is not None

    def calibrate(self) -> None:
        """Measure the hooks' cost now (a few ms), if not done: the session does it between the counting
        step and the module-timing step, outside every step's clock."""
        if self.hook_cost is None:
            self.hook_cost = hook_cost()

    def start(self) -> None:
        if self.running:
            return
        self.calibrate()
        stack = contextlib.ExitStack()
        try:
            if gc.isenabled():
                gc.disable()
                stack.callback(gc.enable)
            # a compiled graph has no module boundaries, and dynamo would recompile it for the hooks:
            # compiled modules are timed eagerly, as they are counted
            stack.enter_context(eager_compiled_code())
            stack.callback(register_module_forward_pre_hook(self._pre_hook).remove)
            stack.callback(register_module_forward_hook(self._post_hook, always_call=True).remove)
        except BaseException:
            stack.close()  # half-started: nothing stays (the collector on again, no hook)
            raise
        self._exit, self._thread = stack, threading.get_ident()
        if self._origin is None:
            self._origin = self.clock.mark()

    def stop(self) -> None:
        """Remove the module hooks and any node hooks; what was marked stays readable."""
        exit_stack, self._exit = self._exit, None
        try:
            if exit_stack is not None:
                exit_stack.close()
        finally:
            self.release()
            self._stack.clear()
            self._calls.clear()

    # --- forward -----------------------------------------------------------------------------------

    def _mine(self) -> bool:
        """The thread that started, or an autograd thread serving its backward (recompute on a GPU)."""
        return threading.get_ident() == self._thread or _current_autograd_node() is not None

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None or not self._mine():
            return
        recompute = _current_autograd_node() is not None or bool(self._stack and self._stack[-1][3])
        inputs = [] if recompute or not torch.is_grad_enabled() else _grad_fns(args)
        self._started += 1
        self._stack.append((name, self.clock.mark(), self._started, recompute, inputs))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is None or not self._mine():
            return
        end = self.clock.mark()
        while self._stack:  # children whose post hook did not run (an exception) close here too
            frame_name, start, started, recompute, inputs = self._stack.pop()
            self._fwd_spans.append((frame_name, start, started, end, self._started, recompute))
            if frame_name == name:
                break
        else:
            return
        if not recompute and torch.is_grad_enabled():
            self._calls.append((name, _grad_fns(output), {id(n) for n in inputs}))

    # --- backward ----------------------------------------------------------------------------------

    def arm(self) -> None:
        """Give the nodes of the calls so far to their modules and hook them (call before the backward
        phase's mark: the walk is not part of any module's time)."""
        calls, self._calls = self._calls, []
        for name, outputs, received in calls:  # post-hook order: the innermost module claims first
            pending = list(outputs)
            while pending:
                node = pending.pop()
                key = id(node)
                if key in self._owner or key in received:
                    continue
                self._owner[key] = name
                if type(node).__name__ != "AccumulateGrad":  # a leaf: no execution of its own to hook
                    self._armed.append(node.register_prehook(self._node_pre(key)))
                    self._armed.append(node.register_hook(self._node_post(key, name)))
                pending.extend(n for n, _ in node.next_functions if n is not None)

    def _node_pre(self, key: int) -> Any:
        def pre(grad_outputs: Any) -> None:
            self._node_start[key] = self.clock.mark()

        return pre

    def _node_post(self, key: int, name: str) -> Any:
        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            start = self._node_start.pop(key, None)
            if start is not None:
                self._node_spans.append((name, start, self.clock.mark(), self._started))

        return post

    def release(self) -> None:
        """Remove the node hooks of the backward(s) armed so far (their marks stay)."""
        armed, self._armed = self._armed, []
        for handle in armed:
            handle.remove()
        self._owner.clear()
        self._node_start.clear()

    # --- result ------------------------------------------------------------------------------------

    def times(self) -> ModuleTimes:
        """Latencies per module, the hooks' calibrated cost taken out (synchronizes once: call after
        the step)."""
        self.clock.synchronize()
        clock_seconds, cost = self.clock.seconds, self.hook_cost or 0.0

        def seconds(start: Any, end: Any, calls: int = 0) -> float:
            """From ``start`` to ``end`` less the hooks of ``calls`` module calls started between."""
            return max(clock_seconds(start, end) - calls * cost, 0.0)

        fwd: dict[str, float] = {}
        recompute: dict[str, float] = {}
        bwd: dict[str, float] = {}
        spans: list[ModuleSpan] = []
        origin = self._origin
        durations = self._forward_durations(seconds)
        for span, duration in zip(self._fwd_spans, durations, strict=True):
            name, start, started, _, _, is_recompute = span
            table = recompute if is_recompute else fwd
            table[name] = table.get(name, 0.0) + duration
            phase: Phase = RECOMPUTE if is_recompute else FORWARD
            spans.append(ModuleSpan(name, phase, seconds(origin, start, started), duration, depth_of(name)))
        extent: dict[str, tuple[float, float]] = {}
        for name, start, end, started in self._node_spans:
            begin, duration = seconds(origin, start, started), seconds(start, end)
            for owner in (*ancestors(name), name):
                bwd[owner] = bwd.get(owner, 0.0) + duration
                first, last = extent.get(owner, (begin, begin + duration))
                extent[owner] = (min(first, begin), max(last, begin + duration))
        spans += [ModuleSpan(name, BACKWARD, a, b - a, depth_of(name)) for name, (a, b) in extent.items()]
        spans.sort(key=lambda s: (s.start, -s.duration))
        _fill_containers(fwd)
        _fill_containers(recompute)
        return ModuleTimes(fwd, bwd, recompute, spans)

    def _forward_durations(self, seconds: Any) -> list[float]:
        """Each forward span less its calls' hooks, and never less than its children's (a calibration
        taken while another process ran may overstate the hooks' cost; a parent still holds its
        children). Children are the spans whose first call falls inside their parent's calls."""
        spans = self._fwd_spans
        order = sorted(range(len(spans)), key=lambda i: spans[i][2])  # by the call that opened them
        parent: dict[int, int] = {}
        open_spans: list[int] = []
        for i in order:
            while open_spans and spans[open_spans[-1]][4] < spans[i][2]:
                open_spans.pop()
            if open_spans:
                parent[i] = open_spans[-1]
            open_spans.append(i)
        durations = [0.0] * len(spans)
        children = [0.0] * len(spans)
        for i in reversed(order):  # children before their parents
            _, start, started, end, ended, _ = spans[i]
            durations[i] = max(seconds(start, end, ended - started), children[i])
            if i in parent:
                children[parent[i]] += durations[i]
        return durations


def _fill_containers(table: dict[str, float]) -> None:
    """A module never called itself (a ``ModuleList``) takes the sum of its called submodules."""
    own = set(table)
    for name in sorted(own, key=lambda n: -n.count(".")):
        for above in reversed(ancestors(name)):
            if above in own:
                break
            table[above] = table.get(above, 0.0) + table[name]


class _Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0  # one small op with an autograd node, as a real call makes


def hook_cost(calls: int = 50, rounds: int = 15) -> float:
    """Seconds one module call's timing hooks add to the span of the module that called it: a one-op
    module called ``calls`` times with a timer's hooks on and off (its outputs kept, as a forward keeps
    them), the fastest of ``rounds`` each (what another process takes from a round is not the hooks';
    a few ms in all)."""
    probe = _Probe()
    x = torch.zeros(4, requires_grad=True) * 1.0
    timer = ModuleTimer(probe, CpuClock(), calibrate=False)

    def run() -> float:
        outputs = []
        begin = time.perf_counter()
        for _ in range(calls):
            outputs.append(probe(x))
        return time.perf_counter() - begin

    plain, hooked = [], []
    for _ in range(rounds):
        plain.append(run())
        timer.start()
        try:
            hooked.append(run())
        finally:
            timer.stop()
    return max((min(hooked) - min(plain)) / calls, 0.0)
