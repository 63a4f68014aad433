"""A framework method wrapped where the framework has no event to mark: for its next call only, or for
every call until removed (``once=False``, a scope the caller closes in its ``finally``).

The wrapper is an instance attribute; removing it (at the next call's start when ``once``, and at
:meth:`WrappedMethod.remove` on any other exit) puts back what the instance held before (a user's own
instance-level method), so nothing of it outlives its scope, whatever the call raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["WrappedMethod", "silenced"]

# around(original, args, kwargs): runs the call the framework made, with the profiler's marks around it
Around = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


class WrappedMethod:
    """``owner.name`` wrapped by ``around`` for the next call (every call until removed: ``once=False``).

    Args:
        owner: the object whose method is wrapped.
        name: the method's name.
        around: ``around(original, args, kwargs)``: runs the call with the profiler's marks around it.
        once: whether only the next call is wrapped (False: every call until removed).
    """

    def __init__(self, owner: Any, name: str, around: Around, once: bool = True) -> None:
        self.owner, self.name = owner, name
        original = getattr(owner, name)
        self.shadowed = owner.__dict__.get(name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if once:
                self.remove()
            return around(original, args, kwargs)

        self.wrapper = wrapper
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        """Put back what ``owner.name`` was, unless the call already did (idempotent)."""
        if self.owner.__dict__.get(self.name) is not self.wrapper:
            return
        if self.shadowed is None:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.shadowed)


def silenced(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An ``around`` that runs nothing: the call silenced (a step's logging while a fake count replays it)."""
    return None
