"""What a fake count's replay of the user's step could change, saved before it and put back after.

A fake count runs the adapter's step function (the user's ``training_step``, the Trainer's
``compute_loss``) once more: any state that code touches besides the tensors would differ from a run
without the profiler. Put back: Python's and NumPy's global random state (torch's is forked by the
caller), every attribute of the model's modules and of the step function's owner (the trainer), and of
their classes but torch's own (``Model.calls += 1``, a class-level list), the contents of the lists,
dicts (their order too), sets and deques they hold included (``self.outputs.append(loss)``), so that no
fake tensor stays behind in them, and the state of the random generators among them (``random.Random``,
NumPy's, ``torch.Generator``). Not put back: what the step writes elsewhere (a file, a global, an object
reached through something other than a list, dict, set, deque or tuple), which the docs say.

Bounded, since a trainer may hold its whole dataset as lists: a container's items are copied (pointers),
but looked into only when it has at most :data:`LOOK_INSIDE` of them, level by level (every attribute's
own containers first), and the copies stop at :data:`BUDGET` items in all: then ``incomplete`` says so,
and the caller runs no replay (a container left out could keep a fake tensor).
"""

from __future__ import annotations

import functools
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Kept"]

DEPTH = 4  # containers inside an attribute this deep have their contents put back
LOOK_INSIDE = 1000  # a container with more items is copied, its items not looked into (a dataset's rows)
BUDGET = 1_000_000  # items copied in all, at most: beyond, the state is too large to keep (``incomplete``)


class Kept:
    """The random state and the attributes of ``objects`` and of their classes (containers' contents
    included, :data:`DEPTH` deep) as they were when made; :meth:`restore` puts them back, ``unrestored``
    says what it could not."""

    def __init__(self, objects: Iterable[Any]) -> None:
        self.unrestored: list[str] = []
        self.incomplete = ""  # why not every container could be kept ("": all were)
        self._items = 0
        objects = list(objects)
        # an object's own namespace, and those of the objects' classes (a class given as an object is
        # passed over: the model's modules and the trainer are the objects, never a class)
        namespaces = [getattr(obj, "__dict__", None) for obj in objects]
        self._namespaces = [(ns, list(ns.items())) for ns in namespaces if type(ns) is dict]
        self._classes = [(cls, list(vars(cls).items())) for cls in _classes_of(objects)]
        self._contents: list[tuple[Any, Any]] = []
        self._generators: list[Callable[[], object]] = []  # each puts a generator of the user's own back
        held = [*self._namespaces, *self._classes]
        self._walk([value for _, before in held for _, value in before])
        self._python = random.getstate()
        numpy_random = sys.modules.get("numpy.random")  # imported where the user's code draws from it
        self._numpy = (numpy_random, numpy_random.get_state()) if numpy_random is not None else None

    def _walk(self, attributes: list[Any]) -> None:
        """Each list, dict, set and deque in ``attributes`` (themselves, and within their items to
        :data:`DEPTH`, level by level) with a copy of its contents, walked on the copy; tuples are looked
        into (they may hold lists)."""
        seen: set[int] = set()
        level = attributes
        for _ in range(DEPTH):
            inside: list[Any] = []
            for value in level:
                if id(value) in seen:
                    continue
                seen.add(id(value))
                items = self._keep(value)
                if self._items > BUDGET:
                    self.incomplete = f"the model and trainer hold over {BUDGET:,} items in containers"
                    return
                if items is not None and len(items) <= LOOK_INSIDE:
                    inside += items
            level = inside

    def _keep(self, value: Any) -> list[Any] | None:
        """``value``'s contents copied and kept, if it is a container (its items, to look into), else None;
        a random generator's state kept."""
        items: list[Any]
        put_back = _generator_put_back(value)
        if put_back is not None:
            self._generators.append(put_back)
            return None
        if isinstance(value, tuple):  # immutable, but it may hold lists
            items = list(value)
        elif isinstance(value, list):
            items = list.copy(value)
            self._contents.append((value, items))
        elif isinstance(value, dict):
            pairs = list(_dict_base(value).items(value))  # in its own order (an OrderedDict's)
            self._contents.append((value, pairs))
            items = [item for _, item in pairs]
        elif isinstance(value, set):
            kept_set = set.copy(value)
            self._contents.append((value, kept_set))
            items = list(kept_set)
        elif isinstance(value, deque):  # a running window of losses: append(loss) drops its oldest
            items = list(deque.__iter__(value))
            self._contents.append((value, items))
        else:
            return None
        self._items += len(items)
        return items

    def restore(self) -> None:
        """Everything saved put back; what fails to is named in ``unrestored``, the rest still done."""
        random.setstate(self._python)
        if self._numpy is not None:
            self._numpy[0].set_state(self._numpy[1])
        for put_back in self._generators:
            put_back()
        for value, before in [*self._namespaces, *self._contents]:
            try:
                if _changed(value, before):
                    _put_back(value, before)
            except Exception as error:  # noqa: BLE001  (a container of a type that refuses it)
                self.unrestored.append(f"a {type(value).__name__} ({type(error).__name__}: {error})")
        for cls, attributes in self._classes:
            for name, write in _class_writes(cls, attributes):
                try:
                    write()
                except Exception as error:  # noqa: BLE001  (a class that refuses a write: the others still go)
                    self.unrestored.append(f"{cls.__name__}.{name} ({type(error).__name__}: {error})")


_MISSING = object()


def _classes_of(objects: list[Any]) -> list[type]:
    """The classes of ``objects`` and their bases whose attributes a user's step may write: all but
    Python's and torch's own (``nn.Linear``'s hold no state of a run)."""
    seen: dict[type, None] = {}
    for obj in objects:
        for cls in type(obj).__mro__:
            module = getattr(cls, "__module__", "") or ""
            if module != "builtins" and module != "torch" and not module.startswith("torch."):
                seen.setdefault(cls)
    return list(seen)


def _class_writes(cls: type, attributes: list[tuple[str, Any]]) -> list[tuple[str, Callable[[], None]]]:
    """The writes that make ``cls``'s attributes those of ``attributes`` again (by identity), each by
    name: those added since deleted, those replaced set back."""
    before = dict(attributes)
    now = vars(cls)
    writes: list[tuple[str, Callable[[], None]]] = [
        (name, functools.partial(delattr, cls, name)) for name in now if name not in before
    ]
    for name, value in attributes:
        if now.get(name, _MISSING) is not value:
            writes.append((name, functools.partial(setattr, cls, name, value)))
    return writes


def _generator_put_back(value: Any) -> Callable[[], object] | None:
    """A call that puts a random generator object (Python's, NumPy's, torch's) back in its state of now;
    None for anything else."""
    if isinstance(value, random.Random):
        state = value.getstate()
        return lambda: value.setstate(state)
    if isinstance(value, torch.Generator):
        seeded = value.get_state()
        return lambda: value.set_state(seeded)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and isinstance(value, numpy_random.Generator):
        bits = value.bit_generator
        kept = bits.state
        return lambda: setattr(bits, "state", kept)
    if numpy_random is not None and isinstance(value, numpy_random.RandomState):
        legacy = value.get_state()
        return lambda: value.set_state(legacy)
    return None


def _dict_base(value: dict) -> type[dict]:
    """The base type whose methods read and write ``value``: an OrderedDict keeps its order apart from
    the dict's (``move_to_end``, a hook registered with ``prepend=True``); the dict's methods break it."""
    return OrderedDict if isinstance(value, OrderedDict) else dict


def _changed(value: Any, before: Any) -> bool:
    """Whether a container holds other objects than ``before``, or a dict its keys in another order (by
    identity: a tensor has no ``==``)."""
    if len(value) != len(before):
        return True
    if isinstance(value, dict):
        pairs = _dict_base(value).items(value)
        return any(k is not b or v is not w for (k, v), (b, w) in zip(pairs, before, strict=True))
    if isinstance(value, set):
        return any(item not in before for item in set.__iter__(value))
    iterate = deque.__iter__ if isinstance(value, deque) else list.__iter__
    return any(a is not b for a, b in zip(iterate(value), before, strict=True))


def _put_back(value: Any, before: Any) -> None:
    """``before``'s items into ``value`` through the base type's methods (a subclass's own ``update`` or
    ``__setitem__`` may refuse or do more)."""
    if isinstance(value, list):
        list.__setitem__(value, slice(None), before)
    elif isinstance(value, dict):
        base = _dict_base(value)
        base.clear(value)
        for key, item in before:
            base.__setitem__(value, key, item)
    elif isinstance(value, deque):
        deque.clear(value)
        deque.extend(value, before)
    else:
        set.clear(value)
        set.update(value, before)
