"""The measuring engine: counts and times every aten op of a model's forward, backward and recompute.

Three pieces work together while a profile is on, only in the thread that started it, and all are
removed by ``stop()``:

* two global module hooks (they check the thread; the modes are thread-local) keep the stack of the
  profiled model's modules being run and time each call, passing over other modules;
* a ``TorchFunctionMode`` names the functional being run (``linear``, ``softmax``, ...) and tags
  every autograd node that functional creates with the module stack and its name
  (:mod:`flops_callbacks.counting.node_tags`, which holds no node: under activation checkpointing the
  recompute's nodes hold the recomputed activations, freed as soon as the backward has read them);
* a ``TorchDispatchMode`` sees every aten op, forward and backward, counts it with its entry in
  :mod:`flops_callbacks.counting.registry` and its bytes with :mod:`flops_callbacks.counting.bytes_moved`, and
  attributes it: forward ops to the current module stack, backward ops to the tag of
  ``torch._C._current_autograd_node()``; the tensors a forward's nodes save for the backward are
  read as they are tagged (:mod:`flops_callbacks.counting.saved_activations`).

This module is the per-op hot path and the module stack; what it records is laid out in
:mod:`flops_callbacks.counting.recording`, the model's names and parameters are read by
:mod:`flops_callbacks.module_tree`, and :mod:`flops_callbacks.counting.profile_builder` makes the profile.

Why not ``torch.utils.module_tracker.ModuleTracker`` (FlopCounterMode's tracker): it finds a
module's backward through grad hooks on the module's inputs, which never fire when the input needs
no grad (the first layer, frozen embeddings), so it mis-attributes exactly the fine-tuning cases
this package exists for. Tagging the autograd nodes is exact, and survives shared modules and
activation checkpointing.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from flops_callbacks.counting import elementwise_formulas, formulas  # noqa: F401  (the built-in entries)
from flops_callbacks.counting.bytes_moved import bytes_rule
from flops_callbacks.counting.functionals import READ, functional_name
from flops_callbacks.counting.modes import DispatchMode, FunctionMode
from flops_callbacks.counting.node_tags import TAG, NodeTags
from flops_callbacks.counting.profile_builder import build_profile, model_totals
from flops_callbacks.counting.recording import BWD, CALLS, FWD, REC, Recording, Site
from flops_callbacks.counting.registry import OpKind, entry_for
from flops_callbacks.counting.saved_activations import SavedActivations
from flops_callbacks.module_tree import ModuleTree, eager_compiled_code
from flops_callbacks.options import CausalAttention
from flops_callbacks.profile import Counts, Profile
from flops_callbacks.timing.clock import Clock, clock_for, module_device
from flops_callbacks.user_warning import warn

__all__ = ["CountingEngine"]

_current_autograd_node = torch._C._current_autograd_node
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_CHECKPOINT_HOOKS = ("_recomputation_hook.", "_checkpoint_hook.")  # torch.utils.checkpoint's hooks
# DDP's reducer copies each gradient into its bucket scaled by 1 / world size (``mul.out``), or divides
# it there (``gradient_as_bucket_view``, a communication hook's ``div_``), in the parameter's
# AccumulateGrad: the all-reduce's averaging, no work of the model's (an unsharded copy does none)
_AVERAGING = frozenset((torch.ops.aten.mul.out, torch.ops.aten.div_.Scalar, torch.ops.aten.div_.Tensor))


def _recomputing(node: Any) -> bool:
    """Whether an op the backward runs is ``torch.utils.checkpoint`` recomputing a forward that is no
    module's call (``checkpoint(F.scaled_dot_product_attention, q, k, v)``; a module's is known from its
    hooks): the reentrant checkpoint's own backward node, or the saved-tensor hooks the non-reentrant one
    recomputes under. Either builds a graph: a backward op runs with grad off (but under create_graph)."""
    if node.name() == "CheckpointFunctionBackward":  # a checkpoint inside its recompute runs with grad off
        return True
    if not torch.is_grad_enabled():
        return False
    hooks = _top_saved_tensors_hooks(True)  # a checkpoint nested in the recompute pushes its own
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(_CHECKPOINT_HOOKS)


@dataclass(slots=True)
class _Frame:
    name: str
    start: Any
    recompute: bool
    virtual: bool  # an ancestor the call did not enter (a ModuleList, or above a direct call)
    key: tuple[str, ...]  # the distinct module names of the stack up to this frame


class CountingEngine:
    """Counts and times one model while started; produces a :class:`Profile`.

    Only work in the thread that called :meth:`start` (and autograd's threads serving it) is seen:
    the modes are thread-local and the hooks check for them, so a model run in another thread is
    not counted. ``causal_attention="half"`` counts attention called with ``is_causal=True`` on the
    unmasked part of the score matrix only (``"full"``: all of it, as FlopCounterMode and DeepSpeed).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ignore_types: tuple[type, ...] = (),
        causal_attention: CausalAttention = "full",
        clock: Clock | None = None,
        compiled: bool | None = None,
        fake: bool = False,
    ) -> None:
        self.model = model
        # ``fake``: the step runs on fake tensors (:mod:`.fake_count`): their ops are the ones counted
        self.fake = fake
        self.causal_attention = causal_attention
        self.causal_half = causal_attention == "half"
        self.device = module_device(model)
        self.clock = clock or clock_for(self.device)
        self.tree = ModuleTree(model, ignore_types)
        self._names = self.tree.names
        # ``compiled``: the caller knows what runs (a Trainer's compiled wrapper of ``model``)
        self.compiled = self.tree.has_compiled() if compiled is None else compiled
        self._thread: int | None = None
        self._elsewhere = False  # a module of the model ran on another thread while started (said once)
        self._exit: contextlib.ExitStack | None = None
        self._dispatch = DispatchMode(self)
        self._function = FunctionMode(self)
        self.made = self._dispatch.made  # a fake count's own real tensors (what its real ops may write to)
        self._tags = NodeTags()
        # A formula that raised (what was being counted, the error): counting stops there, the op's
        # result is handed on, and the owner says it (flops_callbacks.guard): never the user's forward.
        self.failure: tuple[str, Exception] | None = None
        self._saved = SavedActivations()
        self.reset()

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exit is not None

    def reset(self) -> None:
        """Forget everything counted so far (hooks and modes stay as they are)."""
        self._profile: Profile | None = None
        self._rec = Recording(module_calls=dict.fromkeys(self.tree.modules, 0))
        self._stack: list[_Frame] = []
        self._here = self._rec.contexts.setdefault((), {})
        self._functional: str | None = None
        self._ctx: Site | None = None
        self._flops_in_call = False
        self._bwd_start: Any = None
        self._in_backward = False
        self._reentrant: Site | None = None  # where a reentrant checkpoint of a functional was called

    def start(self) -> None:
        if self.running:
            return
        self._profile = None
        # torch wraps every mode's handler in a dynamo "disable" that imports torch._dynamo on its
        # first call (about a second): imported here, before the first clock mark, so that the first
        # profile of a process does not time the import.
        import torch._dynamo  # noqa: F401

        stack = contextlib.ExitStack()
        try:
            if self.compiled:
                warn(
                    "flops_callbacks: torch.compile'd code runs eagerly while the profiler is on (the "
                    "counting and module-timing steps), so that every op is seen and counted; it stays "
                    "compiled and runs compiled on the clean steps and afterwards. Those steps' random "
                    "ops (dropout) draw eager PyTorch's random numbers, not the compiled graph's: from "
                    "there on the run's weights differ from an unprofiled run's (without dropout, by "
                    "float rounding).",
                )
            stack.enter_context(eager_compiled_code())
            # Two global hooks, not two per module: registering and removing hundreds of handles
            # was a tenth of a forward profile's cost. Modules of other models are passed over.
            stack.callback(register_module_forward_pre_hook(self._pre_hook).remove)
            stack.callback(register_module_forward_hook(self._post_hook, always_call=True).remove)
            stack.enter_context(self._dispatch)
            stack.enter_context(self._function)
        except BaseException:
            stack.close()
            raise
        self._exit = stack
        self._saved.start(self.model)
        self._thread = threading.get_ident()

    def entered_after(self) -> list[object]:
        """The modes entered after this engine's that are still on (another profile's, a FlopCounterMode):
        torch's modes leave last in, first out, and stopping now would take theirs off instead of ours."""
        above: list[object] = []
        stacks: list[tuple[object, list[Any]]] = [
            (self._dispatch, _get_current_dispatch_mode_stack()),
            (self._function, _get_current_function_mode_stack()),
        ]
        for mine, stack in stacks:
            if self.running and mine in stack:
                above += stack[stack.index(mine) + 1 :]
        return above

    def stop(self) -> None:
        """Remove every hook, mode and tag; counts are kept for :meth:`profile`."""
        if not self.running:
            return
        exit_stack, self._exit = self._exit, None
        try:
            if exit_stack is not None:
                exit_stack.close()
        finally:
            self._tags.clear()
            self._saved.stop()
            self._stack.clear()
            self._stack_changed()
            self._in_backward = False  # a backward that raised never reached its end callback

    # --- results -----------------------------------------------------------------------------------

    def totals(self) -> tuple[Counts, float]:
        """The model's flops, MACs and forward seconds so far, without the per-module profile:
        DeepSpeed's getters read one number at a time, and a total needs none of the rest."""
        if self._profile is not None and not self.running:
            return self._profile.model, self._profile.fwd_latency
        return model_totals(self._rec, self.clock)

    def profile(self) -> Profile:
        """Everything counted since the last reset, with latencies resolved (synchronizes once).

        Built once per stop: DeepSpeed's API reads totals one getter at a time.
        """
        if self._profile is None or self.running:
            self._profile = build_profile(
                self._rec, self.tree, self.clock, self.device, self.causal_attention
            )
        return self._profile

    # --- module stack ------------------------------------------------------------------------------

    def _owns_thread(self) -> bool:
        """Whether this thread is profiled: the one that started, or one our (thread-local) mode
        was propagated to, as autograd's device threads are."""
        return threading.get_ident() == self._thread or self._dispatch in _get_current_dispatch_mode_stack()

    def _virtual_ancestors(self, name: str) -> list[str]:
        """Ancestors of ``name`` its caller did not enter that still own its work
        (:meth:`~flops_callbacks.module_tree.ModuleTree.between` the top of the stack and it)."""
        return self.tree.between(self._stack[-1].name if self._stack else None, name)

    def _push(self, name: str, start: Any, recompute: bool, virtual: bool) -> None:
        key = self._stack[-1].key if self._stack else ()
        self._stack.append(_Frame(name, start, recompute, virtual, key if name in key else (*key, name)))

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        if not self._owns_thread():
            if not self._elsewhere:
                self._elsewhere = True
                warn(
                    f"flops_callbacks: the model's {name or 'root'!r} ran on a thread other than the one "
                    "that started the profile, where nothing is counted (the counting modes are the "
                    "thread's): start the profile on the thread that runs the model."
                )
            return
        recompute = bool(self._stack and self._stack[-1].recompute)
        recompute = recompute or _current_autograd_node() is not None
        if not recompute and torch.is_grad_enabled():  # a checkpoint holds its inputs
            if self._stack:  # nodes made in the caller that no call tagged (a custom autograd Function's
                self._tag(args, self._context_for(None))  # apply): the caller's, not this module's
            self._saved.enter(args, self._context_for(None))
        start = self.clock.mark()
        for ancestor in self._virtual_ancestors(name):
            self._push(ancestor, start, recompute, True)
        self._push(name, start, recompute, False)
        self._stack_changed()

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is None or not self._owns_thread():
            return
        stack = self._stack
        top = stack[-1] if stack else None
        on_top = top is not None and top.name == name and not top.virtual
        if not on_top and not any(f.name == name and not f.virtual for f in stack):
            return
        end = self.clock.mark()
        if torch.is_grad_enabled():  # nodes no functional tagged (made in a backward, by Function.apply)
            self._tag(output, self._context_for(None))
        while True:  # children whose post hook did not run are closed too
            frame = stack.pop()
            if frame.name == name and not frame.virtual:
                break
        self._close(frame, end)
        if not frame.recompute:
            self._rec.module_calls[name] += 1
        while stack and stack[-1].virtual:
            self._close(stack.pop(), end)
        if not stack and not frame.recompute:
            self._rec.top_spans.append((frame.start, end))
        self._stack_changed()

    def _stack_changed(self) -> None:
        key = self._stack[-1].key if self._stack else ()
        self._here = self._rec.contexts.setdefault(key, {})  # this stack's contexts, by functional
        self._ctx = None

    def _close(self, frame: _Frame, end: Any) -> None:
        if not any(f.name == frame.name for f in self._stack):  # a module calling itself: its outermost call
            self._rec.module_spans.append((frame.name, frame.start, end, frame.recompute))

    def _context(self) -> Site:
        """Where work goes now: the module stack and the functional being run (cached)."""
        if self._ctx is None:
            self._ctx = self._context_for(self._functional)
        return self._ctx

    def _context_for(self, functional: str | None) -> Site:
        ctx = self._here.get(functional)
        if ctx is None:
            names = self._stack[-1].key if self._stack else ()
            ctx = self._here[functional] = Site(names, functional)
        return ctx

    # --- functionals: naming and tagging autograd nodes --------------------------------------------

    def run_functional(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = functional_name(func)
        if name is READ:
            return func(*args, **kwargs)
        outer, outer_flag = self._functional, self._flops_in_call
        ctx = self._context_for(name)
        self._functional, self._ctx, self._flops_in_call = name, ctx, False
        try:
            out = func(*args, **kwargs)
        finally:
            counted = self._flops_in_call
            self._functional, self._ctx, self._flops_in_call = outer, None, outer_flag
        try:
            if counted and name is not None:
                ctx.sums_of(name)[CALLS] += 1
            if torch.is_grad_enabled():
                self._tag(out, ctx)
        except Exception as error:  # the count's failure, not the call's: its result goes on
            if self.failure is None:  # the first failure is the one said
                self.failure = (f"counting {name or func}", error)
        return out

    def _tag(self, out: Any, ctx: Site) -> None:
        """Tag the autograd nodes this call created with its context, and count what a forward's nodes
        save for the backward (a recompute's and a backward's are freed in it)."""
        forward = _current_autograd_node() is None and not (self._stack and self._stack[-1].recompute)
        self._tags.tag(out, ctx, self._saved.watch if forward else None)

    def _backward_site(self, node: Any) -> tuple[int, Site]:
        """The phase and the place of an op the backward runs: its node's tag. A checkpointed functional
        (no module's call) recomputes under the tag of the node whose backward recomputes it; with the
        reentrant checkpoint, the recomputed graph's backward runs next, its nodes untagged (no torch
        function mode runs in an autograd Function's backward): its work goes where the checkpoint was."""
        tag = cast(dict, node.metadata).get(TAG)
        if _recomputing(node):  # (a reentrant checkpoint nested in another's recompute: its node untagged)
            ctx = tag or self._reentrant or self._ctx or self._context()
            self._reentrant = ctx if node.name() == "CheckpointFunctionBackward" else None
            return REC, ctx
        if tag is not None:
            self._reentrant = None
        return BWD, tag or self._reentrant or self._ctx or self._context()

    def _matmul_ran(self, out: Any, macs: int) -> None:
        """A forward op's MACs, by the dtype of its first output tensor (an op may return several)."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        first = next((t for t in outs if isinstance(t, torch.Tensor)), None)
        if first is not None:
            self._rec.macs_by_dtype[first.dtype] = self._rec.macs_by_dtype.get(first.dtype, 0) + macs

    def matmul_dtype(self) -> torch.dtype | None:
        """The dtype most of the counted MACs (matmuls, convolutions, attention) produced, None before any:
        under ``torch.autocast`` the autocast dtype, which the parameters do not say."""
        found = self._rec.macs_by_dtype
        return max(found, key=found.__getitem__) if found else None

    # --- ops: the hot path ---------------------------------------------------------------------------

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.failure is not None:
            return func(*args, **kwargs)
        entry = entry_for(func)
        kind = entry.kind
        if kind is OpKind.METADATA:
            return func(*args, **kwargs)
        moves = bytes_rule(func)
        node = _current_autograd_node()
        if moves is None and node is None and kind is OpKind.FREE:  # views: most forward ops
            self._rec.free_calls += 1
            return func(*args, **kwargs)
        if node is not None and func in _AVERAGING and node.name().endswith("AccumulateGrad"):
            kind = OpKind.FREE  # its bytes are moved; its multiply is the gradients' averaging
        if self._stack and self._stack[-1].recompute:
            phase, ctx = REC, self._ctx or self._context()
        elif node is not None:
            phase, ctx = self._backward_site(node)
        else:
            phase, ctx = FWD, self._ctx or self._context()
        timed = phase == BWD or kind is OpKind.UNCOUNTED
        if timed:
            start = self.clock.mark()
            if phase == BWD and not self._in_backward:
                self._begin_backward(start)
        out = func(*args, **kwargs)
        if timed:
            end = self.clock.mark()
            if phase == BWD:
                self._rec.bwd_op_spans.append((ctx, start, end))
        counted = "its bytes"  # what the count was doing, for the failure's words
        try:
            moved = moves(args, kwargs, out) if moves is not None else 0
            if kind is OpKind.FREE or kind is OpKind.UNCOUNTED:
                if kind is OpKind.FREE:
                    self._rec.free_calls += 1
                else:
                    self._rec.uncounted.setdefault(str(func._overloadpacket), []).append((start, end))
                if moved:
                    ctx.add_bytes(phase, ctx.functional or func._overloadpacket.__name__, moved)
            else:
                counted = "its formula"
                count = entry.count(func, args, kwargs, out, self.causal_half)
                ctx.add(phase, ctx.functional or func._overloadpacket.__name__, count, moved)
                if count.macs and phase == FWD:  # what the matmuls ran in: autocast's dtype, not the params'
                    self._matmul_ran(out, count.macs)
                self._rec.counted_calls += 1
                self._flops_in_call = True
        except Exception as error:  # the count's failure, not the op's: the op's result goes on
            self.failure = (f"counting {func} with {counted}", error)
        return out

    def _begin_backward(self, start: Any) -> None:
        self._saved.seen.clear()  # the forward's saved storages are freed by this backward: ptrs reused
        self._in_backward = True
        self._bwd_start = start
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        if self._in_backward:
            self._rec.bwd_spans.append((self._bwd_start, self.clock.mark()))
            self._in_backward = False
