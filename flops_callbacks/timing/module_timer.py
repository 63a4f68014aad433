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
called inside it (and torch's slower call path while global hooks exist), 10-60 microseconds each on a
CPU, which on a model of small ops is from a third of the forward to more than all of it. The cost of
one call's hooks is given to :meth:`ModuleTimer.times`, which takes it out of each span once per call
inside it (and the share of a call's own hooks that falls between its marks). It is best measured in
place (:mod:`flops_callbacks.timing.outer_calls`: the outermost calls on clean steps against the same
calls here, over the calls inside them); a synthetic probe (:mod:`flops_callbacks.timing.hook_probe`)
reads about half of it (its hooks run hot in a tight loop) and serves where no such measure exists. On
a GPU the marks are CUDA events, and the hooks' host time hides behind the kernels unless the model is
launch-bound. The garbage collector is off while the timer runs (and on again at
:meth:`ModuleTimer.stop`): a collection, of the timer's own marks or of what earlier steps left, would
land in whichever module happened to run.

Why not ``register_full_backward_hook``: it wraps a module's inputs and outputs in extra autograd
nodes and never fires when no input needs a gradient (a first layer, frozen embeddings). Nothing is
written onto the modules or the nodes: names live in this object, and every hook is removed by
:meth:`ModuleTimer.stop` (or when the backward's hooks are released).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from flops_callbacks.module_tree import ModuleTree, depth_of, eager_compiled_code, fill_uncalled
from flops_callbacks.phase_names import BACKWARD, FORWARD, RECOMPUTE
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clock import Clock
from flops_callbacks.timing.collector import collector_off
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.spans import ModuleSpan, Phase

__all__ = ["median_step", "ModuleTimer", "ModuleTimes", "nearest_step"]

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


def median_step(of: list[ModuleTimes]) -> ModuleTimes:
    """The times of the step whose model forward + backward is the median of several steps': a pause in
    another step drops out with that step, and the tree is one real step's, whose children fit in their
    parents as they ran and whose spans the timeline shows (each module's own median would mix steps: a
    parent from a fast one, its children from slow ones, wider than it)."""
    totals = [t.fwd.get("", 0.0) + t.bwd.get("", 0.0) for t in of]
    return of[sorted(range(len(of)), key=totals.__getitem__)[len(of) // 2]]


def nearest_step(of: list[ModuleTimes], forwards: list[float], reference: float) -> ModuleTimes | None:
    """The times of the step whose model forward is nearest ``reference`` by ratio (of equals, the earlier
    step), or None where no forward (or the reference) is positive: the tree then describes a step that
    ran as the clean steps did, whose phases the report shows, and a pause drops out as from a median. On
    a busy CPU one of three module-timing steps runs 10-25% slow as often as not (the demo, one thread),
    and a median of three lands on a slow one about one run in three.

    Args:
        of: the module-timing steps' times.
        forwards: each step's outermost module calls, seconds, the hooks' cost taken out.
        reference: the clean steps' median of the same calls, seconds, no hook.
    """

    def distance(i: int) -> float:
        return abs(math.log(forwards[i] / reference)) if forwards[i] > 0 else math.inf

    nearest = min(range(len(of)), key=distance, default=None) if reference > 0 else None
    return None if nearest is None or distance(nearest) == math.inf else of[nearest]


def _grad_fns(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value.grad_fn] if value.grad_fn is not None else []
    if type(value) is tuple and all(isinstance(v, torch.Tensor) for v in value):  # most calls' args:
        return [v.grad_fn for v in value if v.grad_fn is not None]  # no pytree walk (a few us a call)
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _next_node_number() -> int:
    """The sequence number autograd gives the next node made on this thread (-1: torch has no such
    counter): a call's nodes are numbered from it, what it received is older."""
    found = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return found() if found is not None else -1


def _reentrant_recompute() -> bool:
    """Whether a recompute runs in reentrant checkpointing's node, which backpropagates the recomputed
    graph next (non-reentrant checkpointing keeps only its tensors: the nodes never run)."""
    node = _current_autograd_node()
    return node is not None and node.name() == "CheckpointFunctionBackward"


def _made_before(node: Any, first: int) -> bool:
    """Whether ``node`` was made before the call whose first node would have been numbered ``first``
    (a leaf's ``AccumulateGrad`` is numbered past every other: never before)."""
    return first >= 0 and hasattr(node, "_sequence_nr") and node._sequence_nr() < first


class ModuleTimer:
    """Marks module calls in the forward and their autograd nodes in the backward (module doc)."""

    def __init__(self, model: torch.nn.Module, clock: Clock) -> None:
        self.clock = clock
        tree = ModuleTree(model)
        self._names = tree.names  # the counting engine's names: one record per module
        self._modules = tree.modules
        self._tree = tree
        self._owned: dict[tuple[bool, tuple[str, ...]], tuple[str, ...]] = {}  # a call's stack -> its owners
        self._started = 0  # module calls started so far: the marks before which hooks ran
        self.model_calls = 0  # the model's own calls started so far (a generation's steps are read by them)
        # name, start mark, calls started at it, recompute, inputs, the first node's sequence number
        self._stack: list[tuple[str, Any, int, bool, list[Any], int]] = []
        # a call's name, the frames open around it (:meth:`_owners` reads them at :meth:`arm`), its output
        # nodes, its input node ids, the sequence number of the first node it could make, recompute
        self._calls: list[tuple[str, tuple[Any, ...], list[Any], set[int], int, bool]] = []
        # name, start mark, calls started by it, end mark, calls started by it, recompute
        self._fwd_spans: list[tuple[str, Any, int, Any, int, bool]] = []
        # the modules a node is given to, its start and end marks, the calls started at its end and its start
        # ``above``: the modules never called above them hold the node too (not a recompute's: see _owners)
        self._node_spans: list[tuple[tuple[str, ...], Any, Any, int, int, bool]] = []
        self._node_start: dict[int, tuple[Any, int]] = {}
        self._given: set[int] = set()  # the ids of the nodes given to their modules (armed)
        self._walked: list[Any] = []  # the nodes walked, kept till released: their ids stay theirs
        self._armed: list[Any] = []  # node hook handles of the current backward
        self._exit: contextlib.ExitStack | None = None
        self._thread: int | None = None
        self._origin: Any = None

    @property
    def running(self) -> bool:
        return self._exit is not None

    def _outermost(self) -> list[int]:
        """The indices of the forward spans no other span holds (not recomputes), in call order."""
        order = sorted(
            (i for i, s in enumerate(self._fwd_spans) if not s[5]), key=lambda i: self._fwd_spans[i][2]
        )
        outer, reach = [], -1
        for i in order:
            if self._fwd_spans[i][2] > reach:  # opened after every earlier outer call had closed
                outer.append(i)
                reach = self._fwd_spans[i][4]
        return outer

    def _outermost_spans(self) -> list[tuple[Any, ...]]:
        """The forward spans no other span holds (not recomputes), in call order."""
        return [self._fwd_spans[i] for i in self._outermost()]

    def outermost(self) -> list[torch.nn.Module]:
        """The modules whose calls no other module call held (the model's, or what the framework's step
        calls directly): what :class:`~flops_callbacks.timing.outer_calls.OuterCalls` marks on clean steps."""
        names = dict.fromkeys(span[0] for span in self._outermost_spans())
        return [self._modules[name] for name in names]

    def outer_calls(self) -> tuple[float, int]:
        """Seconds in the outermost calls as marked (nothing taken out), and the module calls made inside
        them: what :class:`~flops_callbacks.timing.outer_calls.OuterCalls` marks on a clean step, with
        these hooks on (read after the step)."""
        spans = self._outermost_spans()
        seconds = sum(self.clock.seconds(start, end) for _, start, _, end, _, _ in spans)
        return seconds, sum(ended - started for _, _, started, _, ended, _ in spans)

    def start(self) -> None:
        if self.running:
            return
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(collector_off())
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
        try:
            if self._exit is not None:
                self._exit.close()  # forgotten once closed: an interrupt before leaves it to a next stop()
            self._exit = None
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
        self.model_calls += not name and not recompute
        self._stack.append((name, self.clock.mark(), self._started, recompute, inputs, _next_node_number()))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        end = self.clock.mark()  # first: what this hook does next is not the module's time
        name = self._names.get(id(module))
        if name is None or not self._mine():
            return
        while self._stack:  # children whose post hook did not run (an exception) close here too
            frame_name, start, started, recompute, inputs, first = self._stack.pop()
            self._fwd_spans.append((frame_name, start, started, end, self._started, recompute))
            if frame_name == name:
                break
        else:
            return
        if not torch.is_grad_enabled() or (recompute and not _reentrant_recompute()):
            return
        # the frames open around it, as they are: their names are read at arm(), in no module's time
        self._calls.append(
            (name, tuple(self._stack), _grad_fns(output), {id(n) for n in inputs}, first, recompute)
        )
        if recompute and not any(frame[3] for frame in self._stack):  # reentrant: backpropagated next
            self.arm()

    def _owners(self, stack: tuple[str, ...], above: bool = True) -> tuple[str, ...]:
        """The modules a call is inside, as the counting engine gives its work: the calls open around it
        (``stack``, the call itself last) and the containers between two of them (a ``ModuleList``, never
        called); above the outermost call, every module (the model's call holds its work). A shared module
        called from outside its own parent is its caller's, not its first name's parent's: its backward
        time goes where its forward time and its flops go. Not ``above``: a recompute's, from its outermost
        call down: its callers (and containers above it) hold the checkpoint's node around its backward."""
        found = self._owned.get((above, stack))
        if found is not None:
            return found
        path: list[str] = [] if above else [stack[0]]
        outer: str | None = None if above else stack[0]
        for inner in stack if above else stack[1:]:
            path += [*self._tree.between(outer, inner), inner]
            outer = inner
        found = self._owned[above, stack] = tuple(dict.fromkeys(path))
        return found

    # --- backward ----------------------------------------------------------------------------------

    def arm(self) -> None:
        """Give the nodes of the calls so far to their modules and hook them (call before the backward
        phase's mark: the walk is not part of any module's time)."""
        calls, self._calls = self._calls, []
        for name, frames, outputs, received, first, recompute in calls:  # post-hook order: innermost first
            owners = self._owners((*(frame[0] for frame in frames), name), above=not recompute)
            pending, seen = list(outputs), set(received)
            while pending:
                node = pending.pop()
                key = id(node)
                if key in seen or _made_before(node, first):  # the call's inputs (kwargs too), their past
                    continue
                seen.add(key)
                self._walked.append(node)  # alive till released: no later node wrapper takes its id
                # a submodule's nodes are its own; the walk goes on through them to the call's own work
                # before them (a parent's ops between two children's calls)
                if key not in self._given:
                    self._given.add(key)
                    if type(node).__name__ != "AccumulateGrad":  # a leaf: no execution of its own to hook
                        self._armed.append(node.register_prehook(self._node_pre(key)))
                        self._armed.append(node.register_hook(self._node_post(key, owners, not recompute)))
                pending.extend(n for n, _ in node.next_functions if n is not None)

    def _node_pre(self, key: int) -> Any:
        def pre(grad_outputs: Any) -> None:
            self._node_start[key] = (self.clock.mark(), self._started)

        return pre

    def _node_post(self, key: int, owners: tuple[str, ...], above: bool) -> Any:
        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            start = self._node_start.pop(key, None)
            if start is not None:
                self._node_spans.append((owners, start[0], self.clock.mark(), self._started, start[1], above))

        return post

    def release(self) -> None:
        """Remove the node hooks of the backward(s) armed so far (their marks stay)."""
        armed, self._armed = self._armed, []
        for handle in armed:
            handle.remove()
        self._given.clear()
        self._walked.clear()
        self._node_start.clear()

    # --- result ------------------------------------------------------------------------------------

    def times(self, cost: HookCost | None = None) -> ModuleTimes:
        """Latencies per module, the hooks' ``cost`` taken out of each span (synchronizes once: call
        after the step)."""
        self.clock.synchronize()
        seconds = self._seconds(cost.per_call, cost.own) if cost is not None else self._seconds(0.0, 0.0)
        fwd: dict[str, float] = {}
        recompute: dict[str, float] = {}
        bwd: dict[str, float] = {}
        spans: list[ModuleSpan] = []
        origin = self._origin
        durations, parent, _ = self._forward_tree(seconds)
        fwd_spans = self._fwd_spans
        # a recompute that ran inside a node (non-reentrant checkpointing unpacks a saved tensor there) is the
        # recompute's time, not the node's owners' backward: each outermost one, by the call that opened it
        recomputes = [
            (span[2], durations[i])
            for i, span in enumerate(fwd_spans)
            if span[5] and not (i in parent and fwd_spans[parent[i]][5])
        ]
        for i, (span, duration) in enumerate(zip(fwd_spans, durations, strict=True)):
            name, start, started, _, _, is_recompute = span
            if _inside_itself(i, parent, fwd_spans):  # a module calling itself: the outermost call holds it
                continue
            table = recompute if is_recompute else fwd
            table[name] = table.get(name, 0.0) + duration
            phase: Phase = RECOMPUTE if is_recompute else FORWARD
            spans.append(ModuleSpan(name, phase, seconds(origin, start, started), duration, depth_of(name)))
        extent: dict[str, tuple[float, float]] = {}
        called = {span[0] for span in fwd_spans if not span[5]}
        holders = self._tree.holders(called)
        for owners, start, end, started, began, above in self._node_spans:
            inside = sum(d for opened, d in recomputes if began < opened <= started)
            begin = seconds(origin, start, started)
            duration = max(seconds(start, end, started - began) - inside, 0.0)
            for owner in holders(owners) if above else owners:
                bwd[owner] = bwd.get(owner, 0.0) + duration
                first, last = extent.get(owner, (begin, begin + duration))
                extent[owner] = (min(first, begin), max(last, begin + duration))
        spans += [ModuleSpan(name, BACKWARD, a, b - a, depth_of(name)) for name, (a, b) in extent.items()]
        spans.sort(key=lambda s: (s.start, -s.duration))
        fill_uncalled(fwd)
        fill_uncalled(recompute)
        outermost = self._outermost()
        if any(self._fwd_spans[i][0] for i in outermost):  # a submodule called outside the model's call
            # (Lightning's training_step: self.criterion(self(x), y)): the model's forward holds it, as
            # its flops do and as the clean steps' own forward marks it
            fwd[""] = sum(durations[i] for i in outermost)
        return ModuleTimes(fwd, bwd, recompute, spans)

    def fitted(self, cost: HookCost) -> HookCost:
        """``cost`` with the share of a call's own hooks inside its span (``own``, the probe's share)
        raised, by bisection, to the least that fits the outermost calls: their children may not sum to
        more than their parent (whose hooks' cost was measured on these very calls: its own measure
        stays). Every call inside loses the share, not only the children: under HF's one-child loss
        wrapper, the excess divided by its one child took the whole cost off every leaf (40% short).
        Never above ``per_call``: a call's own share is part of its cost."""
        self.clock.synchronize()
        anchors = self._seconds(cost.per_call, cost.own)  # the outer calls' own measure stays as it is

        def excess(own: float) -> float:
            return self._excess(self._seconds(cost.per_call, own), anchors)

        if excess(cost.own) <= 0:
            return cost
        low, high = cost.own, cost.per_call
        for _ in range(30 if excess(high) <= 0 else 0):  # to under a nanosecond
            middle = (low + high) / 2
            low, high = (middle, high) if excess(middle) > 0 else (low, middle)
        fit = f"own share {high * 1e6:.1f} us in place (the outer calls' children)"
        detail = f"{cost.detail}; {fit}" if cost.detail else fit
        return dataclasses.replace(cost, own=high, detail=detail)

    def _excess(self, seconds: Callable[..., float], anchors: Callable[..., float]) -> float:
        """How much the outermost calls' children (``seconds``) exceed their parents (``anchors``)."""
        durations, parent, _ = self._forward_tree(seconds)
        outer = {i: 0.0 for i, span in enumerate(self._fwd_spans) if i not in parent and not span[5]}
        inside = {p for p in parent.values() if p in outer}  # only the outermost calls are anchored
        for child, p in parent.items():
            if p in inside:
                outer[p] += durations[child]
        excess = 0.0
        for i in inside:
            _, start, started, end, ended, _ = self._fwd_spans[i]
            excess += outer[i] - anchors(start, end, ended - started, True)
        return excess

    def _seconds(self, per_call: float, own: float) -> Callable[..., float]:
        clock_seconds = self.clock.seconds

        def seconds(start: Any, end: Any, calls: int = 0, own_hooks: bool = False) -> float:
            """From ``start`` to ``end`` less the hooks of ``calls`` module calls started between (and,
            with ``own_hooks``, the part of a call's own hooks inside its span)."""
            return max(clock_seconds(start, end) - calls * per_call - (own if own_hooks else 0.0), 0.0)

        return seconds

    def _forward_tree(self, seconds: Callable[..., float]) -> tuple[list[float], dict[int, int], list[float]]:
        """Each forward span less its calls' hooks and never less than its children's (a cost that
        another process inflated may overstate the hooks'; a parent still holds its children), each
        span's parent, and its children's sum. Children are the spans whose first call falls inside
        their parent's calls."""
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
            durations[i] = max(seconds(start, end, ended - started, own_hooks=True), children[i])
            if i in parent:
                children[parent[i]] += durations[i]
        return durations, parent, children


def _inside_itself(i: int, parent: dict[int, int], spans: list[Any]) -> bool:
    """Whether forward span ``i`` is inside a span of the same module (a module calling itself: counted
    once, in its outermost call, which holds the inner ones' time)."""
    j = parent.get(i)
    while j is not None:
        if spans[j][0] == spans[i][0]:
            return True
        j = parent.get(j)
    return False
