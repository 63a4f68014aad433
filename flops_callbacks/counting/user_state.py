"""What a fake count's replay of the user's step could change, saved before it and put back after.

A fake count runs the adapter's step function (the user's ``training_step``, the Trainer's
``compute_loss``) once more: any state that code touches besides the tensors would differ from a run
without the profiler. Put back: Python's and NumPy's global random state (torch's is forked by the
caller), and every attribute of the model's modules and of the step function's owner (the trainer), the
contents of the lists, dicts and sets they hold included (``self.outputs.append(loss)``), so that no fake
tensor stays behind in them. Not put back: what the step writes elsewhere (a file, a global, an object
reached through something other than a container), which the docs say.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["kept"]

DEPTH = 4  # containers inside an attribute this deep have their contents put back


def _containers(value: Any, depth: int, seen: set[int], saved: list[tuple[Any, Any]]) -> None:
    """Each list, dict and set in ``value`` (itself, and within its items to ``depth``), with a copy of
    its contents; tuples are looked into (they may hold lists), nothing else is."""
    if depth == 0 or id(value) in seen:
        return
    items: Iterable[Any]
    if isinstance(value, list):
        saved.append((value, list(value)))
        items = value
    elif isinstance(value, dict):
        saved.append((value, dict(value)))
        items = value.values()
    elif isinstance(value, set):
        saved.append((value, set(value)))
        items = value
    elif isinstance(value, tuple):
        items = value
    else:
        return
    seen.add(id(value))
    for item in items:
        _containers(item, depth - 1, seen, saved)


def _changed(value: Any, before: Any) -> bool:
    """Whether a container holds other objects than ``before`` (by identity: a tensor has no ``==``)."""
    if len(value) != len(before):
        return True
    if isinstance(value, dict):
        return any(k not in before or before[k] is not v for k, v in value.items())
    if isinstance(value, set):
        return any(item not in before for item in value)
    return any(a is not b for a, b in zip(value, before, strict=True))


def _put_back(value: Any, before: Any) -> None:
    if isinstance(value, list):
        value[:] = before
    else:  # a dict or a set, of whatever subclass: emptied and filled again, its order kept
        value.clear()
        value.update(before)


@contextmanager
def kept(objects: Iterable[Any]) -> Iterator[None]:
    """Python's and NumPy's random state and the attributes of ``objects`` (containers' contents
    included, :data:`DEPTH` deep) as they were before the block, on every exit path."""
    attributes = [(obj.__dict__, dict(obj.__dict__)) for obj in objects if hasattr(obj, "__dict__")]
    seen: set[int] = set()
    contents: list[tuple[Any, Any]] = []
    for _, values in attributes:
        for value in values.values():
            _containers(value, DEPTH, seen, contents)
    python_random = random.getstate()
    numpy = sys.modules.get("numpy")  # only where the user imported it: the core needs no NumPy
    numpy_random = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python_random)
        if numpy is not None:
            numpy.random.set_state(numpy_random)
        for namespace, before in attributes:
            if _changed(namespace, before):
                _put_back(namespace, before)
        for value, before in contents:
            if _changed(value, before):
                _put_back(value, before)
