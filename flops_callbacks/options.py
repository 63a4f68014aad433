"""Argument checks shared by every entry point, in one place: each raises a ``ValueError`` that names
the argument and the values it accepts, at construction time."""

from __future__ import annotations

from typing import Any, Literal, get_args

CausalAttention = Literal["full", "half"]
CAUSAL_ATTENTION: tuple[str, ...] = get_args(CausalAttention)


def check_report_args(module_depth: Any, top_modules: Any) -> None:
    """The report arguments every entry point shares (DeepSpeed's meanings)."""
    if isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < -1:
        raise ValueError(f"module_depth must be an int >= -1 (-1 means all depths), got {module_depth!r}")
    if isinstance(top_modules, bool) or not isinstance(top_modules, int) or top_modules < 1:
        raise ValueError(f"top_modules must be an int >= 1, got {top_modules!r}")


def check_flag(name: str, value: Any) -> None:
    """A switch argument: exactly True or False (a truthy string is a mistake, not a yes)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_int(name: str, value: Any, minimum: int) -> None:
    """A count argument: an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_causal_attention(causal_attention: Any) -> None:
    if causal_attention not in CAUSAL_ATTENTION:
        raise ValueError(f"causal_attention must be one of {CAUSAL_ATTENTION}, got {causal_attention!r}")
