"""The two modes that route a counted model's work to the counting engine: a ``TorchFunctionMode`` for
the functionals (named and tagged) and a ``TorchDispatchMode`` for the aten ops (counted).

They decide which tensors' ops are counted at all: DTensor's ops are counted on their local shards, fake
tensors' only in a fake count (:mod:`.fake_count`), where an op on the batch's real tensors alone runs for
real, as on the real step, and so does a small factory (a mask, a range of positions): what a model
caches per length (``functools.lru_cache``) is then a real tensor, right for the real steps that read it
later, never a fake one. An op that writes to a real tensor the count did not make (a metric's running
sum, a counter on the model) runs on a fake stand-in instead: the user's state is left as it was.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from flops_callbacks.counting.registry import decomposes

__all__ = ["DispatchMode", "FunctionMode"]


class FunctionMode(TorchFunctionMode):
    """Hands each functional call to the counting engine (``run_functional``)."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.engine.run_functional(func, args, kwargs or {})


class DispatchMode(TorchDispatchMode):
    """Hands each aten op to the counting engine (``run_op``), unless a tensor subclass dispatches it."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self.made = Made()  # a fake count's own real tensors: the batch's copies, and what its real ops made

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if types and _is_subclass_of(types, "torch.distributed.tensor", "DTensor"):
            # DTensor (tensor parallelism, FSDP2) runs the op as ops on its local shards, which come
            # back here: counted there, flops are this device's, not the global tensor's.
            return NotImplemented
        if not self.engine.fake and decomposes(func) and _plain(types, args, kwargs):
            with self:  # its parts, through this mode again
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        fake = bool(types) and _is_subclass_of(types, "torch._subclasses.fake_tensor", "FakeTensor")
        if fake and not self.engine.fake:
            return func(*args, **(kwargs or {}))  # DTensor's shape propagation: runs nothing
        if self.engine.fake and not fake:  # a fake count (:mod:`.fake_count`), an op on no fake tensor
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if self._for_real(func, args, kwargs, tensors):
                # on the batch's real tensors alone, as on the real step (a model's check of its mask's
                # content takes the same branch), or a small factory (module doc)
                with unset_fake_temporarily():
                    out = self.engine.run_op(func, args, kwargs or {})
                self.made.add(out)
                return out
            if tensors and self.made.fake_mode is not None:  # a write to the user's state: on stand-ins
                # (the fake mode itself would run an op of real tensors alone for real)
                args, kwargs = tree_map_only(torch.Tensor, self.made.fake_mode.from_tensor, (args, kwargs))
        return self.engine.run_op(func, args, kwargs or {})

    def _for_real(self, func: Any, args: tuple, kwargs: dict | None, tensors: list[torch.Tensor]) -> bool:
        """Whether a fake count runs an op of no fake tensor (its tensors: ``tensors``) for real: a small
        factory, or an op that writes to none but the count's own tensors (module doc)."""
        if not tensors:  # a factory
            small = _factory_numel(func, args, kwargs) <= FACTORY_MAX
            return small or func.overloadpacket is torch.ops.aten.arange
        return all(t in self.made for t in _written(func, args, kwargs))


def _plain(types: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether an op that reached the mode whole (:func:`~.registry.decomposes`: under inference_mode, or
    on inference tensors) is on plain dense tensors, which its generic parts serve: a subclass's own
    handler or a nested tensor's kernel must run instead (decomposed, they raised or recursed)."""
    if any(t is not torch.Tensor for t in types):
        return False
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return not any(t.is_nested for t in tensors) and (
        torch.is_inference_mode_enabled() or any(t.is_inference() for t in tensors)
    )


FACTORY_MAX = 2**24  # elements of a factory a fake count runs for real: a 4096 x 4096 mask


class Made:
    """Real tensors a fake count made, by identity, held weakly (a view counts as its base): what its real
    ops may write to. Not a ``WeakSet``: it compares tensors with ``==``, elementwise."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.fake_mode: Any = None  # the count's FakeTensorMode: the user's tensors' stand-ins come from it

    def add(self, made: Any) -> None:
        for t in tree_leaves(made):
            if isinstance(t, torch.Tensor) and t._base is None:
                self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        base = tensor if tensor._base is None else tensor._base
        ref = self._refs.get(id(base))
        return ref is not None and ref() is base


_RUNNING_STATS = ("running_mean", "running_var")  # batch norm updates them where its schema does not say


def _written(func: Any, args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors an op writes to: its schema's mutable arguments (``self`` of an in-place op, ``out=``),
    and a batch norm's running statistics (``native_batch_norm`` writes them unannotated)."""
    written: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        mutable = argument.alias_info is not None and argument.alias_info.is_write
        if mutable or argument.name in _RUNNING_STATS:
            value = args[i] if i < len(args) else (kwargs or {}).get(argument.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _factory_numel(func: Any, args: tuple, kwargs: dict | None) -> float:
    """The elements a factory (an op of no tensor) makes, from its ``size`` (or ``n`` x ``m``, ``steps``)
    argument; infinite where its schema has none of them (it stays fake)."""
    given = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | (kwargs or {})
    if isinstance(given.get("size"), (list, tuple)) and all(isinstance(d, int) for d in given["size"]):
        return math.prod(given["size"])
    if isinstance(given.get("n"), int):
        m = given.get("m")
        return given["n"] * (m if isinstance(m, int) else given["n"])
    if isinstance(given.get("steps"), int):
        return given["steps"]
    return math.inf


def _is_subclass_of(types: Any, module: str, name: str) -> bool:
    """Whether a tensor subclass in ``types`` is ``module.name`` (never imported: if the module is not
    loaded, no such tensor exists)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and any(issubclass(t, cls) for t in types)
