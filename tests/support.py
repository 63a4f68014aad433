"""Support shared by the tests: the snapshot of everything the profiler could leave behind."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def _hook_dicts(obj: object) -> dict[str, dict]:
    return {k: dict(v) for k, v in vars(obj).items() if "hook" in k and isinstance(v, dict)}


def leftovers(model: torch.nn.Module, *others: object) -> dict[str, Any]:
    """torch's global hook dicts (modules, optimizers), both mode stacks, and the hook dicts and
    attribute names of every module of ``model`` and of ``others`` (optimizers, a Trainer): equal before
    and after a run when nothing of the profiler stays."""
    state: dict[str, Any] = {}
    for namespace in (torch.nn.modules.module, importlib.import_module("torch.optim.optimizer")):
        for name, value in vars(namespace).items():
            if name.startswith("_global_") and isinstance(value, dict):
                state[f"{namespace.__name__}.{name}"] = dict(value)
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    state["function modes"] = list(_get_current_function_mode_stack())
    for name, module in model.named_modules():
        state[f"module {name!r} hooks"] = _hook_dicts(module)
        if name:  # Lightning and the Trainer add attributes to the top module itself
            state[f"module {name!r} attributes"] = set(vars(module))
    for i, other in enumerate(others):
        state[f"other {i} hooks"] = _hook_dicts(other)
    return state
