"""Models whose forward, backward and optimizer step take known times: sleeps, plus many tiny ops that
the counting engine would slow down (so a figure taken while counting would miss its sleep)."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

TINY_OPS = 60  # tiny Linear calls per forward: cheap alone, slow under counting


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]
        return grad, None


class Sleepy(nn.Module):
    """A block whose forward sleeps ``fwd`` and whose backward sleeps ``bwd``, around tiny ops."""

    def __init__(self, fwd: float, bwd: float, tiny_ops: int = TINY_OPS) -> None:
        super().__init__()
        self.fwd, self.bwd = fwd, bwd
        self.tiny = nn.ModuleList(nn.Linear(4, 4) for _ in range(tiny_ops))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fwd)
        for layer in self.tiny:
            x = layer(x)
        return SleepInBackward.apply(x, self.bwd)


class SleepySGD(torch.optim.SGD):
    """SGD whose step sleeps ``seconds`` first."""

    def __init__(self, params: object, seconds: float) -> None:
        super().__init__(params, lr=1e-3)
        self.seconds = seconds

    def step(self, closure: object = None) -> object:  # type: ignore[override]
        loss = closure() if closure is not None else None  # type: ignore[operator]
        time.sleep(self.seconds)
        super().step()
        return loss
