"""Activations saved for the backward: the bytes of the tensors each autograd node of the forward keeps.

When the counting engine tags a node the forward created, :meth:`SavedActivations.watch` reads its
saved tensors (``node._saved_*``; a custom Function's ``saved_tensors``) and counts each storage once,
parameters excluded, for the module and functional that created it; reading only unpacks them.

Why not ``torch.autograd.graph.saved_tensors_hooks``: thread-wide hooks make ``torch.func.grad`` /
``vmap`` inside a model raise, and replace autograd's check that a saved tensor was not changed in
place; a profile must neither end a run nor hide a user's bug. Nodes created under someone's hooks (a
``torch.utils.checkpoint`` region, ``save_on_cpu``) are not read, since unpacking them would run
those hooks: a checkpointed region shows as the inputs of its first module call
(:meth:`SavedActivations.enter`), counted where the checkpoint is called.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

if TYPE_CHECKING:
    from flops_callbacks.counting.recording import Site

__all__ = ["SAVED_BY", "SavedActivations"]

SAVED_BY = "saved by autograd"  # the functional of a node no named functional created
_NAMES: dict[type, tuple[str, ...]] = {}  # the saved-tensor attributes of each node type
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """Address and bytes of the memory holding ``tensor`` (a DTensor's: its local shard's); (0, 0)
    where there is none to read (other wrapper subclasses, sparse tensors)."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = tensor.untyped_storage()
        if isinstance(tensor, FakeTensor):  # no memory behind it: the storage object stands for it
            return storage._cdata, storage.nbytes()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # e.g. "an invalid python storage" (TP)
        return 0, 0


def _weakly(hook: Any) -> Callable[[], Any]:
    """A weak reference to ``hook``; a strong one for the rare callable that takes none."""
    try:
        return weakref.ref(hook)
    except TypeError:
        return lambda: hook


def _saved_names(node: Any) -> tuple[str, ...]:
    """``_saved_<x>`` for each ``_raw_saved_<x>`` of the node's type (``saved_tensors`` for a custom
    Function's), found once per type."""
    names = _NAMES.get(type(node))
    if names is None:
        raw = [a.removeprefix("_raw") for a in dir(node) if a.startswith("_raw_saved_")]
        names = _NAMES[type(node)] = tuple("saved_tensors" if a == "_saved_tensors" else a for a in raw)
    return names


class SavedActivations:
    """Counts the tensors the forward's nodes save, into each node's context."""

    def __init__(self) -> None:
        self.param_ptrs: set[int] = set()  # storages of the model's parameters: never activations
        self.seen: set[int] = set()  # storages counted since the last backward (addresses are reused)
        # the pack hook of the saved-tensor hooks region last entered, weakly: a checkpoint's hook holds
        # its frame (the region's inputs and recomputed tensors), which must go when the region goes
        self.region: Callable[[], Any] | None = None

    def start(self, model: torch.nn.Module) -> None:
        """Note ``model``'s parameters' storages, which saved tensors never count.

        Args:
            model: the model counted.
        """
        self.param_ptrs = {_storage(p)[0] for p in model.parameters()} - {0}

    def stop(self) -> None:
        """Forget the region last entered."""
        self.region = None

    def enter(self, args: tuple, ctx: Site) -> None:
        """A module is called: when it is the first one inside a new region of saved-tensor hooks (a
        checkpoint), count its tensor arguments, which the checkpoint holds for its recompute, for
        ``ctx``: where the checkpoint is called.

        Args:
            args: the module call's positional arguments.
            ctx: where the call's work goes.
        """
        top = _top_hooks(True)
        if top is None or (self.region is not None and top[0] is self.region()):
            return
        self.region = _weakly(top[0])
        for arg in args:
            for tensor in arg if isinstance(arg, (tuple, list)) else (arg,):
                if isinstance(tensor, torch.Tensor):
                    self._count(tensor, ctx)

    def watch(self, node: Any, ctx: Site) -> None:
        """Count the tensors ``node`` saved (a node the forward created, tagged with ``ctx``). Never
        raises: what cannot be read (a tensor changed in place since: autograd raises in the backward)
        is not counted.

        Args:
            node: an autograd node the forward created.
            ctx: where its work goes.
        """
        names = _saved_names(node)
        if not names or _top_hooks(True) is not None:
            return
        for name in names:
            try:
                value = getattr(node, name)
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        self._count(tensor, ctx)
            except Exception:  # noqa: BLE001, S112  (freed, changed in place: autograd's to raise, not ours)
                continue

    def _count(self, tensor: torch.Tensor, ctx: Site) -> None:
        ptr, nbytes = _storage(tensor)
        if not nbytes or (ptr and (ptr in self.param_ptrs or ptr in self.seen)):
            return
        if ptr:  # a meta tensor has no address: each counts
            self.seen.add(ptr)
        ctx.add_saved(ctx.functional or SAVED_BY, nbytes)
