"""Warnings that point at the user's line (``trainer.fit(...)``, ``trainer.train()``), not at a frame
inside the frameworks that called the callback: a fixed ``stacklevel`` lands in transformers' or
Lightning's callback dispatch, which tells the user nothing."""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__ = ["warn"]

# Packages whose frames sit between the user's call and ours.
_FRAMEWORKS = ("flops_callbacks", "transformers", "lightning", "pytorch_lightning", "accelerate", "torch")


def _outside_frameworks(module: str) -> bool:
    return not any(module == name or module.startswith(name + ".") for name in _FRAMEWORKS)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the nearest caller outside the frameworks.

    Args:
        message: the warning's text.
        category: the warning's class.
    """
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and not _outside_frameworks(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
