"""Measured forward+backward flops, per-module timing and DeepSpeed-style profiles for training, and
prefill / decode profiles of generation.

The core needs only torch. The framework callbacks are imported lazily, so ``import flops_callbacks``
works without Lightning or transformers installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# torch.Tag.reduction (the counting's rule for reductions) and the saved-tensor hooks' stack came in 2.10;
# an older torch would fail later, inside a user's run, so it is said here
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 10):
    raise ImportError(f"flops_callbacks needs torch >= 2.10, found {torch.__version__}")

from flops_callbacks.counting.registry import OpKind, register_formula, register_op_kind
from flops_callbacks.generation.profiling import GenerationProfile, profile_decode_loop, profile_generation
from flops_callbacks.generation.run import GenerationRun
from flops_callbacks.integrations.deepspeed_api import (
    FlopsProfiler,
    get_module_duration,
    get_module_flops,
    get_module_macs,
)
from flops_callbacks.integrations.model_profile import get_model_profile
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile, UncountedOp
from flops_callbacks.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

if TYPE_CHECKING:
    from flops_callbacks.integrations.hf import HFFlopsCallback
    from flops_callbacks.integrations.lightning import FlopsProfilerCallback
    from flops_callbacks.integrations.step_profiler import StepProfiler

__version__ = "0.1.0"

_LAZY = {
    "FlopsProfilerCallback": "flops_callbacks.integrations.lightning",
    "HFFlopsCallback": "flops_callbacks.integrations.hf",
    "StepProfiler": "flops_callbacks.integrations.step_profiler",
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
    "GenerationProfile",
    "GenerationRun",
    "HFFlopsCallback",
    "ModuleProfile",
    "OpKind",
    "Profile",
    "UncountedOp",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "get_module_duration",
    "get_module_flops",
    "get_module_macs",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "profile_decode_loop",
    "profile_generation",
    "register_formula",
    "register_op_kind",
    "StepProfiler",
]
