"""The boundary between the profiler's own work and the training it measures.

A profiler must never be the reason a run ends. Everything the profiler does for itself (reading a
batch, building and rendering the profile, writing files, gathering across ranks, counting with a
formula) runs inside :meth:`Guard.own_work`: an exception there is said once, as a warning naming what
failed and what was kept, and training goes on. Code of the user's that the profiler calls on the way
(``batch_size_fn``, ``tokens_fn``, the run's loggers) runs through :meth:`Guard.user`: its exceptions
pass through unchanged, as do the training's own (forward, backward, optimizer), which never run inside
a guard. ``KeyboardInterrupt`` and other ``BaseException``\\ s are never caught.

Why one class and not a try/except wherever something can fail: the rule (what is caught, what passes,
how it is said) lives in one place, and a new piece of own work cannot forget it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from flops_callbacks.user_warning import warn

__all__ = ["F", "Guard", "guarded_event"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Guard:
    """Runs the profiler's own work of one callback (``owner`` names it in warnings); see the module doc.

    Args:
        owner: the callback's name, as warnings say it.
        goes_on: what a failure's warning ends with (what carries on after it).
    """

    def __init__(self, owner: str, goes_on: str = "Training goes on.") -> None:
        self.owner = owner
        self.goes_on = goes_on
        self._passing: BaseException | None = None  # the user's exception on its way out
        self._said: set[str] = set()

    def user(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, the user's code: an exception it raises passes every guard unchanged.

        Args:
            fn: the user's function.
            *args: its arguments.
        """
        try:
            return fn(*args)
        except BaseException as error:
            self._passing = error
            raise

    @contextmanager
    def own_work(self, what: str, kept: str, on_failure: Callable[[], None] | None = None) -> Iterator[None]:
        """Run the body as the profiler's own work: if it raises, warn (once per ``what``) that ``what``
        failed and ``kept`` is what remains, call ``on_failure``, and carry on after the ``with``.

        Args:
            what: the work, as the warning names it.
            kept: what remains after a failure, as the warning says it.
            on_failure: what cleans up after a failure; None: nothing.
        """
        try:
            yield
        except Exception as error:
            if error is self._passing:  # kept: an outer guard lets it pass too
                raise
            self.fail(what, error, kept)
            if on_failure is not None:
                try:
                    on_failure()
                except Exception as again:  # cleaning up after our own failure must not end the run
                    self.fail("cleaning up", again, "what remains of the profiler may stay")

    def attempt(self, fn: Callable[[], object]) -> Exception | None:
        """Run own work ``fn`` and return its exception instead of saying it (the caller says several
        failures as one); the user's exceptions pass.

        Args:
            fn: the own work to run.
        """
        try:
            fn()
        except Exception as error:
            if error is self._passing:
                raise
            return error
        return None

    def fail(self, what: str, error: BaseException, kept: str) -> None:
        """Say that ``what`` failed with ``error`` (once per ``what``), and what goes on.

        Args:
            what: the work that failed.
            error: its exception.
            kept: what remains, as the warning says it.
        """
        if what in self._said:
            return
        self._said.add(what)
        said = f"{self.owner}: {what} failed ({type(error).__name__}: {error}); {kept}. {self.goes_on}"
        warn(said.rstrip())

    def closing(self, close: Callable[[], None]) -> None:
        """Run an adapter's ``close`` as the user's exception passes (every door closes its window so): a
        failure of the profiler's own there is said, never raised in the user's error's place.

        Args:
            close: what drops the window and removes every hook and mode.
        """
        try:
            close()
        except Exception as error:
            said = f"{type(error).__name__}: {error}"
            warn(f"{self.owner}: closing the profile window failed ({said}); your error follows.")

    def forget(self) -> None:
        """A new run: its failures are said again."""
        self._said.clear()
        self._passing = None


def guarded_event(what: str, kept: str, on_failure: str | None = None) -> Callable[[F], F]:
    """A method of an object with a ``guard`` (a :class:`Guard`), run as the profiler's own work: a
    failure is said with ``kept``, the object's method named ``on_failure`` cleans up, and the call
    returns None.

    Args:
        what: the event, as the warning names it.
        kept: what remains after a failure, as the warning says it.
        on_failure: the name of the object's method that cleans up after a failure; None: none.
    """

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            cleanup = getattr(self, on_failure) if on_failure is not None else None
            with self.guard.own_work(what, kept, cleanup):
                return method(self, *args, **kwargs)
            return None

        return guarded  # type: ignore[return-value]

    return wrap
