"""Names of the torch functions a trace sees: ``F.linear`` -> "linear", ``Tensor.__rmul__`` -> "mul".

A profile breaks each module's work down by the functional that did it, as DeepSpeed's does; the
trace's ``TorchFunctionMode`` names every call here, once per function (cached). Reads of a tensor's
metadata are named ``READ`` so that the trace passes them straight through: a quarter of a
transformer's torch-function calls are these, and they do no arithmetic and create no autograd node.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["functional_name", "READ"]

READ = "<metadata read>"

_ARITHMETIC_DUNDERS = frozenset({"add", "sub", "mul", "truediv", "matmul", "pow", "floordiv"})

# A backward is no functional. torch switches a mode off inside its handler and these functions
# re-check for modes, so the mode cannot stay on inside them: functionals that activation
# checkpointing re-runs in the backward go unnamed (their aten ops name them) and their autograd
# nodes are tagged by the module hooks instead.
_AUTOGRAD_ENTRIES = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

_METADATA_READS = [
    getattr(torch._C.TensorBase, attribute).__get__
    for attribute in (
        "shape", "dtype", "device", "ndim", "layout", "requires_grad", "grad_fn", "is_leaf", "grad",
        "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "output_nr", "_version",
    )
    if hasattr(torch._C.TensorBase, attribute)
] + [
    getattr(torch._C.TensorBase, method)
    for method in (
        "size", "dim", "stride", "numel", "nelement", "is_contiguous", "is_floating_point",
        "is_complex", "element_size", "storage_offset", "data_ptr", "get_device",
    )
]  # fmt: skip

_NAME_CACHE: dict[Any, str | None] = {
    **dict.fromkeys(_AUTOGRAD_ENTRIES, None),
    **dict.fromkeys(_METADATA_READS, READ),
}


def functional_name(func: Any) -> str | None:
    """The functional's name; None for a backward, ``READ`` for a metadata read (cached).

    Args:
        func: the Python function or op running.
    """
    try:
        return _NAME_CACHE[func]
    except (KeyError, TypeError):
        pass
    name = _derive_name(func)
    with contextlib.suppress(TypeError):  # unhashable callables are named every time
        _NAME_CACHE[func] = name
    return name


def _derive_name(func: Any) -> str:
    if isinstance(func, torch._ops.OpOverload):  # a torch.library op called directly: "mylib::op"
        return func._opname
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _ARITHMETIC_DUNDERS:
            name = name[1:]
    name = name.rstrip("_") or name
    return {"truediv": "div"}.get(name, name)
