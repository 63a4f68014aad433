"""An autograd Function that runs a test's fault in the backward: the fault matrices of both callbacks
and the adapter tests raise through it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward first calls ``fault`` (which raises when the test wants it to)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fault: Callable[[], None]) -> torch.Tensor:
        ctx.fault = fault
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fault()
        return grad, None
