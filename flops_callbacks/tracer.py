"""The measuring engine: counts and times every aten op of a model's forward, backward and recompute.

Three pieces work together while a profile is on, only in the thread that started it, and all are
removed by ``stop()``:

* two global module hooks (they check the thread; the modes are thread-local) keep the stack of the
  profiled model's modules being run and time each call, passing over other modules;
* a ``TorchFunctionMode`` names the functional being run (``linear``, ``softmax``, ...) and tags
  every autograd node that functional creates with the module stack and its name;
* a ``TorchDispatchMode`` sees every aten op, forward and backward, counts it with
  :mod:`flops_callbacks.formulas`, and attributes it: forward ops to the current module stack,
  backward ops to the tag of ``torch._C._current_autograd_node()``.

Why not ``torch.utils.module_tracker.ModuleTracker`` (FlopCounterMode's tracker): it finds a
module's backward through grad hooks on the module's inputs, which never fire when the input needs
no grad (the first layer, frozen embeddings), so it mis-attributes exactly the fine-tuning cases
this package exists for. Tagging the autograd nodes is exact, and survives shared modules and
activation checkpointing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from flops_callbacks.clock import Clock, clock_for, module_device
from flops_callbacks.formulas import OpKind, count_flops, recomputed_share, rule
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile, UncountedOp

_TAG = "flops_callbacks.context"  # key in autograd Node.metadata, removed on stop()

_FWD, _BWD, _REC = 0, 1, 2  # phases, in the order of Counts' flops fields
_CALLS = 6  # index of the calls count in a sums list (Counts' field order)

_current_autograd_node = torch._C._current_autograd_node


class _Context:
    """Where work goes: the modules on the stack (each once) and the functional being run.

    An op adds to its context only, one list update whatever the stack depth; :meth:`Tracer.profile`
    spreads each context's sums over its modules once. Contexts are interned, so identity is equality.
    """

    __slots__ = ("names", "functional", "sums")

    def __init__(self, names: tuple[str, ...], functional: str | None) -> None:
        self.names = names  # () is outside the model's modules
        self.functional = functional
        # functional -> Counts' fields in order: flops of fwd, bwd, recompute; their MACs; forward
        # calls that did flops
        self.sums: dict[str, list[int]] = {}

    def sums_of(self, functional: str) -> list[int]:
        sums = self.sums.get(functional)
        if sums is None:
            sums = self.sums[functional] = [0] * (_CALLS + 1)
        return sums

    def add(self, phase: int, functional: str, flops: int, macs: int) -> None:
        sums = self.sums_of(functional)
        sums[phase] += flops
        sums[3 + phase] += macs


def _plus(a: list[int] | None, b: list[int]) -> list[int]:
    """Elementwise sum as a new list (sum lists are shared between modules, never changed in place)."""
    return b if a is None else [x + y for x, y in zip(a, b, strict=True)]


@dataclass(slots=True)
class _Frame:
    name: str
    start: Any
    recompute: bool
    virtual: bool  # an ancestor the call did not enter (a ModuleList, or above a direct call)
    key: tuple[str, ...]  # the distinct module names of the stack up to this frame


_ARITHMETIC_DUNDERS = frozenset({"add", "sub", "mul", "truediv", "matmul", "pow", "floordiv"})


# A backward is no functional. torch switches a mode off inside its handler and these functions
# re-check for modes, so the mode cannot stay on inside them: functionals that activation
# checkpointing re-runs in the backward go unnamed (their aten ops name them) and their autograd
# nodes are tagged by the module hooks instead.
_AUTOGRAD_ENTRIES = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

# Reads of a tensor's metadata: no arithmetic, no autograd node, so nothing to name or tag. A
# quarter of a transformer's torch-function calls are these; they pass straight through.
_READ = "<metadata read>"
_METADATA_READS = [
    getattr(torch._C.TensorBase, attribute).__get__
    for attribute in (
        "shape", "dtype", "device", "ndim", "layout", "requires_grad", "grad_fn", "is_leaf", "grad",
        "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "output_nr", "_version",
    )
    if hasattr(torch._C.TensorBase, attribute)
] + [
    getattr(torch._C.TensorBase, method)
    for method in (
        "size", "dim", "stride", "numel", "nelement", "is_contiguous", "is_floating_point",
        "is_complex", "element_size", "storage_offset", "data_ptr", "get_device",
    )
]  # fmt: skip

_NAME_CACHE: dict[Any, str | None] = {
    **dict.fromkeys(_AUTOGRAD_ENTRIES, None),
    **dict.fromkeys(_METADATA_READS, _READ),
}


def _functional_name(func: Any) -> str | None:
    """``F.linear`` -> "linear", ``Tensor.__rmul__`` -> "mul", ``Tensor.add_`` -> "add"; None for
    a backward, ``_READ`` for a metadata read (cached)."""
    try:
        return _NAME_CACHE[func]
    except (KeyError, TypeError):
        pass
    name = _derive_name(func)
    with contextlib.suppress(TypeError):  # unhashable callables are named every time
        _NAME_CACHE[func] = name
    return name


def _derive_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _ARITHMETIC_DUNDERS:
            name = name[1:]
    name = name.rstrip("_") or name
    return {"truediv": "div"}.get(name, name)


def _module_paths(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (qualified name, module) of ``model``, parents first, a shared module under each of its
    names; ``torch.compile``'s ``_orig_mod`` wrapper level is left out of the names.

    ``named_modules(remove_duplicate=False)`` yields the same through one generator per level; this
    walk costs a fraction of that, and a profiler is set up for every profiled step.
    """
    paths: list[tuple[str, torch.nn.Module]] = []
    pending = [("", model)]
    while pending:
        name, module = pending.pop()
        paths.append((name, module))
        children = [
            (name if child == "_orig_mod" else f"{name}.{child}" if name else child, sub)
            for child, sub in module._modules.items()
            if sub is not None
        ]
        pending.extend(reversed(children))
    return paths


class _FunctionMode(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.tracer._run_functional(func, args, kwargs or {})


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if types and _is_subclass_of(types, "torch.distributed.tensor", "DTensor"):
            # DTensor (tensor parallelism, FSDP2) runs the op as ops on its local shards, which come
            # back here: counted there, flops are this device's, not the global tensor's.
            return NotImplemented
        if types and _is_subclass_of(types, "torch._subclasses.fake_tensor", "FakeTensor"):
            return func(*args, **(kwargs or {}))  # DTensor's shape propagation: runs nothing
        return self.tracer._run_op(func, args, kwargs or {})


def _is_subclass_of(types: Any, module: str, name: str) -> bool:
    """Whether a tensor subclass in ``types`` is ``module.name`` (never imported: if the module is not
    loaded, no such tensor exists)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and any(issubclass(t, cls) for t in types)


def _stored_numel(param: torch.Tensor) -> int:
    """Elements this device stores: a DTensor's local shard, not its global size."""
    local = getattr(param, "_local_tensor", None)
    return local.numel() if isinstance(local, torch.Tensor) else param.numel()


class Tracer:
    """Counts and times one model while started; produces a :class:`Profile`.

    Only work in the thread that called :meth:`start` (and autograd's threads serving it) is seen:
    the modes are thread-local and the hooks check for them, so a model run in another thread is
    not counted.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ignore_types: tuple[type, ...] = (),
        causal_half: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.model = model
        self.causal_half = causal_half
        self.device = module_device(model)
        self.clock = clock or clock_for(self.device)
        self._modules: dict[str, torch.nn.Module] = {}
        self._names: dict[int, str] = {}
        self._paths = _module_paths(model)
        for name, module in self._paths:
            if name and isinstance(module, ignore_types):
                continue
            if id(module) in self._names or name in self._modules:
                continue  # the _orig_mod wrapper level, or a module seen under an earlier name
            self._names[id(module)] = name
            self._modules[name] = module
        self._ancestors: dict[str, list[str]] = {}
        for name in self._modules:  # walk order: every parent before its children
            self._ancestors[name] = self._ancestors_of(name)
        self._param_holders: list[tuple[torch.nn.Parameter, tuple[str, ...]]] | None = None  # when read
        containers = {name for name, m in self._modules.items() if type(m).forward is torch.nn.Module.forward}
        self._container_ancestors = {
            name: [a for a in ancestors if a in containers] for name, ancestors in self._ancestors.items()
        }
        self._thread: int | None = None
        self._exit: contextlib.ExitStack | None = None
        self._dispatch = _DispatchMode(self)
        self.reset()

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._exit is not None

    def reset(self) -> None:
        """Forget everything counted so far (hooks and modes stay as they are)."""
        self._profile: Profile | None = None
        self._calls = dict.fromkeys(self._modules, 0)
        self._contexts: dict[tuple[str, ...], dict[str | None, _Context]] = {}  # by stack, functional
        self._stack: list[_Frame] = []
        self._here = self._contexts.setdefault((), {})
        self._functional: str | None = None
        self._ctx: _Context | None = None
        self._flops_in_call = False
        self._counted_calls = 0
        self._free_calls = 0
        self._uncounted: dict[str, list] = {}  # op name -> [calls, [(start, end), ...]]
        self._module_spans: list[tuple[str, Any, Any, bool]] = []
        self._top_spans: list[tuple[Any, Any]] = []
        self._bwd_op_spans: list[tuple[_Context, Any, Any]] = []
        self._bwd_spans: list[tuple[Any, Any]] = []
        self._bwd_start: Any = None
        self._in_backward = False

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
            if _has_compiled(module for _, module in self._paths):
                warnings.warn(
                    "flops_callbacks: torch.compile'd code runs eagerly while the profiler is on, so "
                    "that every op is seen and counted; it stays compiled and runs compiled afterwards.",
                    stacklevel=3,
                )
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            # Two global hooks, not two per module: registering and removing hundreds of handles
            # was a tenth of a forward profile's cost. Modules of other models are passed over.
            stack.callback(register_module_forward_pre_hook(self._pre_hook).remove)
            stack.callback(register_module_forward_hook(self._post_hook, always_call=True).remove)
            stack.enter_context(self._dispatch)
            stack.enter_context(_FunctionMode(self))
        except BaseException:
            stack.close()
            raise
        self._exit = stack
        self._thread = threading.get_ident()
        self._tagged: list[Any] = []

    def stop(self) -> None:
        """Remove every hook, mode and tag; counts are kept for :meth:`profile`."""
        if not self.running:
            return
        exit_stack, self._exit = self._exit, None
        try:
            exit_stack.close()
        finally:
            for node in self._tagged:
                node.metadata.pop(_TAG, None)
            self._tagged = []
            self._stack.clear()
            self._stack_changed()
            if self._in_backward:  # a backward that raised never reached its end callback
                self._in_backward = False

    # --- module stack ------------------------------------------------------------------------------

    def _holders_of_params(self) -> list[tuple[torch.nn.Parameter, tuple[str, ...]]]:
        """Each parameter with the profiled modules that hold it (its owners and their ancestors)."""
        holders: dict[int, tuple[torch.nn.Parameter, dict[str, None]]] = {}
        for owner, module in self._paths:
            params = [p for p in module._parameters.values() if p is not None]
            if not params:
                continue
            names = [n for n in (*self._ancestors_of(owner), owner) if n in self._modules]
            for param in params:
                holders.setdefault(id(param), (param, {}))[1].update(dict.fromkeys(names))
        return [(param, tuple(names)) for param, names in holders.values()]

    def _ancestors_of(self, name: str) -> list[str]:
        """Profiled modules above ``name``, outermost first (each derived from its parent's, once)."""
        found = self._ancestors.get(name)
        if found is not None:
            return found
        if not name:
            return []
        parent = name.rpartition(".")[0]
        above = self._ancestors_of(parent)
        return above + [parent] if parent in self._modules else above

    def _owns_thread(self) -> bool:
        """Whether this thread is profiled: the one that started, or one our (thread-local) mode
        was propagated to, as autograd's device threads are."""
        return threading.get_ident() == self._thread or self._dispatch in _get_current_dispatch_mode_stack()

    def _virtual_ancestors(self, name: str) -> list[str]:
        """Ancestors of ``name`` its caller did not enter that still own its work: containers that
        cannot be called (``ModuleList``, ``ModuleDict``) between the caller and ``name``, or, for a
        submodule called from outside the model, everything above it."""
        if not self._stack:
            return self._ancestors[name]
        containers = self._container_ancestors[name]
        if not containers:
            return containers
        top = self._stack[-1].name
        if top and not name.startswith(top + "."):
            return []  # a shared module called from outside its own parent: no static path
        return [a for a in containers if a.startswith(top + ".") or (not top and a)]

    def _push(self, name: str, start: Any, recompute: bool, virtual: bool) -> None:
        key = self._stack[-1].key if self._stack else ()
        self._stack.append(_Frame(name, start, recompute, virtual, key if name in key else (*key, name)))

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None or not self._owns_thread():
            return
        recompute = bool(self._stack and self._stack[-1].recompute)
        recompute = recompute or _current_autograd_node() is not None
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
            self._tag(output, self._module_context())
        while True:  # children whose post hook did not run are closed too
            frame = stack.pop()
            if frame.name == name and not frame.virtual:
                break
        self._close(frame, end)
        if not frame.recompute:
            self._calls[name] += 1
        while stack and stack[-1].virtual:
            self._close(stack.pop(), end)
        if not stack and not frame.recompute:
            self._top_spans.append((frame.start, end))
        self._stack_changed()

    def _stack_changed(self) -> None:
        key = self._stack[-1].key if self._stack else ()
        self._here = self._contexts.setdefault(key, {})  # this stack's contexts, by functional
        self._ctx = None

    def _close(self, frame: _Frame, end: Any) -> None:
        self._module_spans.append((frame.name, frame.start, end, frame.recompute))

    def _context(self) -> _Context:
        """Where work goes now: the module stack and the functional being run (cached)."""
        if self._ctx is None:
            self._ctx = self._context_for(self._functional)
        return self._ctx

    def _module_context(self) -> _Context:
        """The module stack alone: for work no functional names."""
        return self._context_for(None)

    def _context_for(self, functional: str | None) -> _Context:
        ctx = self._here.get(functional)
        if ctx is None:
            names = self._stack[-1].key if self._stack else ()
            ctx = self._here[functional] = _Context(names, functional)
        return ctx

    # --- functionals: naming and tagging autograd nodes --------------------------------------------

    def _run_functional(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = _functional_name(func)
        if name is _READ:
            return func(*args, **kwargs)
        outer, outer_flag = self._functional, self._flops_in_call
        ctx = self._context_for(name)
        self._functional, self._ctx, self._flops_in_call = name, ctx, False
        try:
            out = func(*args, **kwargs)
        finally:
            counted = self._flops_in_call
            self._functional, self._ctx, self._flops_in_call = outer, None, outer_flag
        if counted and name is not None:
            ctx.sums_of(name)[_CALLS] += 1
        if torch.is_grad_enabled():
            self._tag(out, ctx)
        return out

    def _tag(self, out: Any, ctx: _Context) -> None:
        """Mark the autograd nodes this call created (those not marked yet) with its context."""
        if isinstance(out, torch.Tensor):
            pending = [out.grad_fn] if out.grad_fn is not None else []
        else:
            pending = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn]
        while pending:
            node = pending.pop()
            metadata = node.metadata
            if _TAG in metadata:
                continue
            metadata[_TAG] = ctx
            self._tagged.append(node)
            pending.extend(n for n, _ in node.next_functions if n is not None)

    # --- ops -----------------------------------------------------------------------------------------

    def _run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        kind = rule(func).kind
        if kind is OpKind.METADATA:
            return func(*args, **kwargs)
        node = _current_autograd_node()
        if node is None and kind is OpKind.FREE:  # views and copies: most forward ops
            self._free_calls += 1
            return func(*args, **kwargs)
        if self._stack and self._stack[-1].recompute:
            phase, ctx = _REC, self._ctx or self._context()
        elif node is not None:
            phase, ctx = _BWD, node.metadata.get(_TAG) or self._ctx or self._context()
        else:
            phase, ctx = _FWD, self._ctx or self._context()
        timed = phase == _BWD or kind is OpKind.UNCOUNTED
        if timed:
            start = self.clock.mark()
            if phase == _BWD and not self._in_backward:
                self._begin_backward(start)
        out = func(*args, **kwargs)
        if timed:
            end = self.clock.mark()
            if phase == _BWD:
                self._bwd_op_spans.append((ctx, start, end))
        if kind is OpKind.FREE:
            self._free_calls += 1
        elif kind is OpKind.UNCOUNTED:
            entry = self._uncounted.setdefault(str(func._overloadpacket), [0, []])
            entry[0] += 1
            entry[1].append((start, end))
        else:
            flops = count_flops(func, args, kwargs, out, self.causal_half)
            macs = flops // 2 if kind is OpKind.DENSE else 0
            functional = ctx.functional or func._overloadpacket.__name__
            if phase == _BWD and (share := recomputed_share(func, args)):
                rec_flops = round(flops * share)
                rec_macs = rec_flops // 2 if kind is OpKind.DENSE else 0
                flops, macs = flops - rec_flops, macs - rec_macs
                ctx.add(_REC, functional, rec_flops, rec_macs)
            ctx.add(phase, functional, flops, macs)
            self._counted_calls += 1
            self._flops_in_call = True
        return out

    def _begin_backward(self, start: Any) -> None:
        self._in_backward = True
        self._bwd_start = start
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        if self._in_backward:
            self._bwd_spans.append((self._bwd_start, self.clock.mark()))
            self._in_backward = False

    # --- result ------------------------------------------------------------------------------------

    def _param_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Parameters (all, trainable) under each module, each tensor once per module (tied ones
        count in every module that holds them)."""
        params = dict.fromkeys(self._modules, 0)
        trainable = dict.fromkeys(self._modules, 0)
        if self._param_holders is None:
            self._param_holders = self._holders_of_params()
        for param, holders in self._param_holders:
            numel = _stored_numel(param)
            for name in holders:
                params[name] += numel
                if param.requires_grad:
                    trainable[name] += numel
        return params, trainable

    def totals(self) -> tuple[Counts, float]:
        """The model's flops, MACs and forward seconds so far, without the per-module profile:
        DeepSpeed's getters read one number at a time, and a total needs none of the rest."""
        if self._profile is not None and not self.running:
            return self._profile.model, self._profile.fwd_latency
        sums = [0] * (_CALLS + 1)
        for key, by_functional in self._contexts.items():
            if key:  # the model is on every stack inside it
                for ctx in by_functional.values():
                    for part in ctx.sums.values():
                        sums = _plus(sums, part)
        self.clock.synchronize()
        seconds = sum(self.clock.seconds(a, b) for a, b in self._top_spans)
        return Counts(*sums[:_CALLS], calls=self._calls[""]), seconds

    def profile(self, causal_attention: str = "full") -> Profile:
        """Everything counted since the last reset, with latencies resolved (synchronizes once).

        Built once per stop: DeepSpeed's API reads totals one getter at a time.
        """
        if self._profile is not None and not self.running:
            return self._profile
        self._profile = self._build_profile(causal_attention)
        return self._profile

    def _build_profile(self, causal_attention: str) -> Profile:
        seconds = self.clock.seconds
        self.clock.synchronize()
        per_module: dict[str, dict[str, list[int]]] = {name: {} for name in self._modules}
        outside: list[int] | None = None
        for key, by_functional in self._contexts.items():  # a stack's contexts merged, then spread
            merged: dict[str, list[int]] = {}
            for ctx in by_functional.values():
                for functional, sums in ctx.sums.items():
                    merged[functional] = _plus(merged.get(functional), sums)
            for functional, sums in merged.items():
                for name in key:
                    mine = per_module[name]
                    mine[functional] = _plus(mine.get(functional), sums)
                if not key:
                    outside = _plus(outside, sums)

        fwd_latency = dict.fromkeys(self._modules, 0.0)
        rec_latency = dict.fromkeys(self._modules, 0.0)
        bwd_latency = dict.fromkeys(self._modules, 0.0)
        for name, start, end, recompute in self._module_spans:
            (rec_latency if recompute else fwd_latency)[name] += seconds(start, end)
        for ctx, start, end in self._bwd_op_spans:
            s = seconds(start, end)
            for name in ctx.names:
                bwd_latency[name] += s
        total_fwd = sum(seconds(a, b) for a, b in self._top_spans)
        total_bwd = sum(seconds(a, b) for a, b in self._bwd_spans)
        measured = total_fwd + total_bwd

        params, trainable = self._param_counts()
        modules: dict[str, ModuleProfile] = {}
        for name, module in self._modules.items():
            functionals = {functional: Counts(*sums) for functional, sums in per_module[name].items()}
            totals = [sum(column) for column in zip(*per_module[name].values(), strict=True)][:_CALLS]
            modules[name] = ModuleProfile(
                *(totals or [0] * _CALLS),
                calls=self._calls[name],
                name=name,
                class_name=type(module).__name__,
                depth=name.count(".") + 1 if name else 0,
                params=params[name],
                trainable_params=trainable[name],
                fwd_latency=fwd_latency[name],
                bwd_latency=bwd_latency[name],
                recompute_latency=rec_latency[name],
                functionals=functionals,
            )
        uncounted = [
            UncountedOp(
                op=op,
                calls=calls,
                seconds=(secs := sum(seconds(a, b) for a, b in spans)),
                time_share=secs / measured if measured > 0 else 0.0,
            )
            for op, (calls, spans) in self._uncounted.items()
        ]
        uncounted.sort(key=lambda u: (-u.seconds, -u.calls, u.op))
        root = modules[""]
        return Profile(
            fwd_flops=root.fwd_flops,
            bwd_flops=root.bwd_flops,
            recompute_flops=root.recompute_flops,
            fwd_macs=root.fwd_macs,
            bwd_macs=root.bwd_macs,
            recompute_macs=root.recompute_macs,
            params=root.params,
            trainable_params=root.trainable_params,
            fwd_latency=total_fwd,
            bwd_latency=total_bwd,
            device=str(self.device),
            modules=modules,
            outside_model=Counts(*outside[:_CALLS]) if outside else Counts(),
            coverage=Coverage(self._counted_calls, self._free_calls, uncounted),
            causal_attention=causal_attention,
        )


def _has_compiled(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether any of ``modules`` was ``torch.compile``d (without importing dynamo if unused)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False  # dynamo never loaded: nothing can be compiled
    return any(
        isinstance(m, eval_frame.OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
        for m in modules
    )
