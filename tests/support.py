"""Support shared by the tests: the snapshot of everything the profiler could leave behind, and the
fault the fault suites inject."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def hooks_of(obj: object) -> dict[str, dict]:
    """Copies of an object's hook dicts (every dict attribute with "hook" in its name)."""
    return {k: dict(v) for k, v in vars(obj).items() if "hook" in k and isinstance(v, dict)}


def torch_state() -> dict[str, Any]:
    """torch's global hook dicts (modules, optimizers) and both mode stacks."""
    state: dict[str, Any] = {}
    for namespace in (torch.nn.modules.module, importlib.import_module("torch.optim.optimizer")):
        for name, value in vars(namespace).items():
            if name.startswith("_global_") and isinstance(value, dict):
                state[f"{namespace.__name__}.{name}"] = dict(value)
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    state["function modes"] = list(_get_current_function_mode_stack())
    return state


def torch_namespaces() -> dict[tuple[str, str], Any]:
    """Every attribute of ``torch``, ``torch.nn.functional`` and ``torch.Tensor``: none may be patched."""
    return {(ns.__name__, key): value for ns in (torch, F, torch.Tensor) for key, value in vars(ns).items()}


def patched(before: dict[tuple[str, str], Any], after: dict[tuple[str, str], Any]) -> list[tuple[str, str]]:
    """Attributes of torch's namespaces that changed (torch may import submodules lazily: new modules
    are not changes)."""
    return [key for key, value in before.items() if after.get(key) is not value]


def leftovers(model: torch.nn.Module, *others: object) -> dict[str, Any]:
    """:func:`torch_state`, and the hook dicts and attribute names of every module of ``model`` and the
    hook dicts of ``others`` (optimizers): equal before and after a run when nothing of the profiler
    stays."""
    state = torch_state()
    for name, module in model.named_modules():
        state[f"module {name!r} hooks"] = hooks_of(module)
        if name:  # Lightning and the Trainer add attributes to the top module itself
            state[f"module {name!r} attributes"] = set(vars(module))
    for i, other in enumerate(others):
        state[f"other {i} hooks"] = hooks_of(other)
    return state


@dataclass
class Fault:
    """Raises ``error`` once, at ``point``, in the optimizer step that started at global step ``step``.

    The step being run is ``current`` (set by a test's callback as steps start), or ``step_of()`` when
    given (read from a Trainer), or the ``step`` a check passes.
    """

    point: str | None = None
    step: int = -1
    error: BaseException | None = None
    current: int | None = None
    step_of: Callable[[], int] | None = None
    fired: bool = False
    raised_at: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.error is None:
            self.error = RuntimeError(f"injected in {self.point} at step {self.step}")

    def check(self, point: str, step: int | None = None) -> None:
        if point != self.point or self.fired:
            return
        if step is None:
            step = self.step_of() if self.step_of is not None else self.current
        if step == self.step:
            self.fired = True
            assert self.error is not None
            raise self.error
