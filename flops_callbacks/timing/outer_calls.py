"""The model's outermost module calls, timed on clean steps with hooks on those few modules alone.

The module timer's hooks cost 10-60 microseconds per module call on a CPU, which must come out of each
module's span. Why not a probe outside the model (it reads about half: its hooks run hot) or the
module-timing step's forward less a clean step's (it reads more than all: the loss and the framework
slow down too): the cost is measured where the hooks act. The outermost calls
(:meth:`~flops_callbacks.timing.module_timer.ModuleTimer.outermost`) are marked on the clean steps,
every other module keeping torch's fast call path; the module-timing step's same calls less these,
over the module calls inside them, give the cost per call
(:meth:`~flops_callbacks.timing.module_timer.ModuleTimer.outer_calls`). A compiled model's calls are
not marked (the hooks would make dynamo recompile): the probe stands in.
"""

from __future__ import annotations

from typing import Any

import torch

from flops_callbacks.timing.clock import Clock

__all__ = ["OuterCalls"]

_current_autograd_node = torch._C._current_autograd_node


class OuterCalls:
    """Marks the outermost calls of ``modules`` (not recomputes).

    Args:
        modules: the outermost modules whose calls are marked.
        clock: the clock the marks are made on.
    """

    def __init__(self, modules: list[torch.nn.Module], clock: Clock) -> None:
        self.clock = clock
        self._modules = modules
        self._handles: list[Any] = []
        self._open = 0  # calls entered and not left: only the outermost is marked
        self._start: Any = None
        self._spans: list[tuple[Any, Any]] = []

    def start(self) -> None:
        if self._handles:
            return
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))

    def stop(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._open = 0

    def calls(self) -> int:
        """How many outermost calls were marked."""
        return len(self._spans)

    def seconds(self) -> float:
        """Seconds in the outermost calls marked (read after the step: a CUDA clock synchronizes)."""
        return sum(self.clock.seconds(a, b) for a, b in self._spans)

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if _current_autograd_node() is not None:
            return
        self._open += 1
        if self._open == 1:
            self._start = self.clock.mark()

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        end = self.clock.mark()
        if _current_autograd_node() is not None or self._open == 0:
            return
        self._open -= 1
        if self._open == 0:
            self._spans.append((self._start, end))
