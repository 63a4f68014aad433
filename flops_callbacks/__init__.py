"""Measured forward+backward flops, per-module timing and DeepSpeed-style profiles for training.

The core needs only torch. The framework callbacks are imported lazily, so ``import flops_callbacks``
works without Lightning or transformers installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile, UncountedOp
from flops_callbacks.profiler import FlopsProfiler, get_model_profile

if TYPE_CHECKING:
    from flops_callbacks.hf import HFFlopsCallback
    from flops_callbacks.lightning import FlopsProfilerCallback

__version__ = "0.1.0"

_LAZY = {
    "FlopsProfilerCallback": "flops_callbacks.lightning",
    "HFFlopsCallback": "flops_callbacks.hf",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flops_callbacks' has no attribute {name!r}")


__all__ = [
    "Counts",
    "Coverage",
    "FlopsProfiler",
    "FlopsProfilerCallback",
    "HFFlopsCallback",
    "ModuleProfile",
    "Profile",
    "UncountedOp",
    "get_model_profile",
]
