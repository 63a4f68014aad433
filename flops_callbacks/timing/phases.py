"""The phases of one optimizer step (forward, backward, optimizer step) on a synchronized clock.

Phases are contiguous: starting one ends the previous on the same clock mark, so ``fwd + bwd + step``
is exactly the time the step's events cover, less what the adapter leaves to no phase: the framework's
work before the user's code (a forward :meth:`~StepPhases.restart` at it) and after it (a stop).
Where the framework says a phase *ended* but not what comes next (Lightning's ``on_after_backward``,
the end of a manual ``optimizer.step()``), the time up to the next event is held open and given to the
phase that event reveals: a backward starting next means a new forward ran (a GAN's second model, a
second manual chunk); anything else continues the phase that ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flops_callbacks.phase_names import BACKWARD, FORWARD, STEP_PHASES
from flops_callbacks.timing.clock import Clock
from flops_callbacks.timing.phase_memory import PhaseMemory

__all__ = ["check_phase", "StepPhases"]


def check_phase(name: str) -> None:
    """Raise ValueError unless ``name`` is one of :data:`~flops_callbacks.phase_names.STEP_PHASES`.

    Args:
        name: the phase a caller asked for.
    """
    if name not in STEP_PHASES:
        raise ValueError(f"phase must be one of {STEP_PHASES}, got {name!r}")


class StepPhases:
    """Marks the phases of one step; :meth:`seconds` reads them (after the step: reading CUDA events
    synchronizes, so it is left until the profile window has ended).

    Args:
        clock: the clock the phases are marked on.
        memory: the peak allocated bytes per phase, read on clean steps (CUDA only); None: not read.
    """

    def __init__(self, clock: Clock, memory: PhaseMemory | None = None) -> None:
        self.clock = clock
        self.memory = memory  # peak allocated bytes per phase (CUDA, clean steps only)
        self.current: str | None = None
        self._since: Any = None
        self._ended: str | None = None  # a phase that ended with its successor unknown (held open)
        self._spans: dict[str, list[tuple[Any, Any]]] = {}
        self.first_mark: Any = None  # the step's first mark: the start of its first forward
        self._stopped: Any = None  # where timing last stopped (a wait for the next micro-batch may follow)
        self.waits: list[tuple[Any, Any]] = []  # from a stop to a later micro-batch's forward: its data wait

    def start(self, name: str) -> None:
        """End whatever runs (resolving a held-open gap) and start ``name`` on one mark.

        Args:
            name: the phase that starts.
        """
        check_phase(name)
        if name == self.current and self._ended is None:
            return
        mark = self.clock.mark()
        if self.first_mark is None:
            self.first_mark = mark
        elif self.current is None and self._stopped is not None and name == FORWARD:
            self.waits.append((self._stopped, mark))  # a later micro-batch: fetched since the last stop
        self._stopped = None
        if self._ended is not None:
            ended = self._ended
            self._close(FORWARD if name == BACKWARD else ended, mark)
        elif self.current is not None:
            self._close(self.current, mark)
        elif self.memory is not None:
            self.memory.reset()  # the first phase since a stop
        self.current, self._since, self._ended = name, mark, None

    def restart(self, name: str) -> bool:
        """``name`` runs and really starts now (the user's code after the framework's own work): its span
        starts again on a new mark. False when ``name`` is not the running phase.

        Args:
            name: the phase that really starts now.
        """
        if name != self.current or self._ended is not None:
            return False
        self._since = self.clock.mark()
        return True

    def end(self) -> None:
        """The running phase ended; what follows is decided by the next :meth:`start` or :meth:`stop`."""
        if self.current is None or self._ended is not None:
            return
        mark = self.clock.mark()
        self._close(self.current, mark)
        self._ended, self._since = self.current, mark

    def fetching(self, mark: Any) -> None:
        """The framework starts fetching the next micro-batch at ``mark``: the wait for it starts there, and
        what ran since timing stopped (other callbacks' work after the last micro-batch) is no wait."""
        if self.current is None and self._stopped is not None:
            self._stopped = mark

    def stop(self) -> None:
        """Stop timing (between micro-batches, at the end of the step); a held-open gap continues the
        phase that ended."""
        if self.current is None:
            return
        self._stopped = self.clock.mark()
        self._close(self._ended or self.current, self._stopped)
        self.current = self._ended = self._since = None

    def _close(self, name: str, mark: Any) -> None:
        self._spans.setdefault(name, []).append((self._since, mark))
        self._since = mark
        if self.memory is not None:
            self.memory.close(name)

    def wait_seconds(self, length: Callable[[Any, Any], float] | None = None) -> float:
        """Seconds between a micro-batch's end and a later one's forward (the loader's fetch of it);
        ``length``: how a span between two marks is measured (the clock's seconds by default)."""
        return sum((length or self.clock.seconds)(a, b) for a, b in self.waits)

    def seconds(self, length: Callable[[Any, Any], float] | None = None) -> tuple[float, float, float]:
        """Seconds in (forward, backward, optimizer step); ``length`` as for :meth:`wait_seconds`."""
        measure = length or self.clock.seconds
        return tuple(  # type: ignore[return-value]
            sum(measure(a, b) for a, b in self._spans.get(name, ())) for name in STEP_PHASES
        )
