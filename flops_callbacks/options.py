"""Argument checks shared by every entry point, in one place: each raises a ``ValueError`` that names
the argument and the values it accepts, at construction time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from flops_callbacks.peaks import check_peak_bandwidth, check_peak_flops

__all__ = [
    "CAUSAL_ATTENTION",
    "CausalAttention",
    "check_callable",
    "check_causal_attention",
    "check_flag",
    "check_int",
    "check_report_args",
    "Options",
]

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


def check_callable(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise ValueError(f"{name} must be a callable taking the batch, got {fn!r}")


@dataclass(frozen=True)
class Options:
    """Everything a profile window is configured with, checked once, here (the callbacks' arguments).

    The window starts at the first optimizer step at or after ``profile_step``: that step counts, the
    next times modules, and ``clean_steps`` more time the phases with nothing else on the clock
    (``"auto"``: 3 to 20, until the median iter latency is known within +-3%). With ``profile_every=N``,
    after the first window, another starts every ``N`` steps (at ``profile_step + k*N``, the first such
    step after the previous window): its clean steps only, the first window's counts and module tree
    reused (:mod:`flops_callbacks.session.window_plan`).
    """

    profile_step: int = 10
    clean_steps: int | Literal["auto"] = "auto"
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = False
    print_profile: bool = True
    output_file: str | Path | None = None
    batch_size_fn: Callable[[Any], int] | None = None
    tokens_fn: Callable[[Any], int | None] | None = None
    causal_attention: CausalAttention = "full"
    throughput: bool = True
    peak_flops: float | None = None
    peak_bandwidth: float | None = None  # bytes/s
    # after the window, count one step in a while and compare with the shape table: every N steps, or
    # "auto" (as often as keeps the counting's cost <= 1% of the run's time), or 0 (never)
    flops_audit: int | Literal["auto"] = "auto"
    profile_every: int | None = None  # after the first window, re-profile every N steps (None: never)
    # with several ranks, one more window step after the module-timing ones, under torch.profiler: where
    # the step's time goes (compute, communication hidden under it, exposed, idle) and each collective's
    # bytes and bus bandwidth (flops_callbacks.session.comm_step)
    comm_step: bool = True

    def __post_init__(self) -> None:
        check_int("profile_step", self.profile_step, 0)
        if self.clean_steps != "auto":
            try:
                check_int("clean_steps", self.clean_steps, 0)
            except ValueError:
                raise ValueError(
                    f"clean_steps must be 'auto' or an int >= 0, got {self.clean_steps!r}"
                ) from None
        if self.flops_audit != "auto" and (
            isinstance(self.flops_audit, bool)
            or not isinstance(self.flops_audit, int)
            or self.flops_audit < 0
        ):
            raise ValueError(f"flops_audit must be 'auto' or an int >= 0, got {self.flops_audit!r}")
        every = self.profile_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"profile_every must be an int >= 1 or None, got {every!r}")
        check_report_args(self.module_depth, self.top_modules)
        for name in ("detailed", "print_profile", "throughput", "comm_step"):
            check_flag(name, getattr(self, name))
        check_causal_attention(self.causal_attention)
        check_callable("batch_size_fn", self.batch_size_fn)
        check_callable("tokens_fn", self.tokens_fn)
        if self.output_file is not None and not isinstance(self.output_file, (str, Path)):
            raise ValueError(f"output_file must be a path (str or Path) or None, got {self.output_file!r}")
        check_peak_flops(self.peak_flops)
        check_peak_bandwidth(self.peak_bandwidth)
