"""The two modes that route a counted model's work to the counting engine: a ``TorchFunctionMode`` for
the functionals (named and tagged) and a ``TorchDispatchMode`` for the aten ops (counted).

They decide which tensors' ops are counted at all: DTensor's ops are counted on their local shards, fake
tensors' only in a fake count (:mod:`.fake_count`), where an op on the batch's real tensors alone (or a
range, as position ids are made) runs for real, as on the real step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if types and _is_subclass_of(types, "torch.distributed.tensor", "DTensor"):
            # DTensor (tensor parallelism, FSDP2) runs the op as ops on its local shards, which come
            # back here: counted there, flops are this device's, not the global tensor's.
            return NotImplemented
        fake = bool(types) and _is_subclass_of(types, "torch._subclasses.fake_tensor", "FakeTensor")
        if fake and not self.engine.fake:
            return func(*args, **(kwargs or {}))  # DTensor's shape propagation: runs nothing
        if self.engine.fake and not fake and (_real_inputs(args, kwargs) or func.overloadpacket in _RANGES):
            # a fake count (:mod:`.fake_count`): an op on the batch's real tensors alone runs for real,
            # as on the real step (a model's check of its mask's content takes the same branch), and so
            # does a range (the positions a model makes when the batch gives none: the same check)
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return self.engine.run_op(func, args, kwargs or {})
        return self.engine.run_op(func, args, kwargs or {})


_RANGES = (torch.ops.aten.arange,)  # factories a fake count runs for real: small, and read by models


def _real_inputs(args: tuple, kwargs: dict | None) -> bool:
    """Whether an op reads tensors and none of them is fake (a fake count's op on the batch alone)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(isinstance(t, FakeTensor) for t in tensors)


def _is_subclass_of(types: Any, module: str, name: str) -> bool:
    """Whether a tensor subclass in ``types`` is ``module.name`` (never imported: if the module is not
    loaded, no such tensor exists)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and any(issubclass(t, cls) for t in types)
