"""Argument checks shared by every entry point, in one place: each raises a ``ValueError`` that names
the argument and the values it accepts, at construction time."""

from __future__ import annotations

import os
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
    "check_output_file",
    "check_report_args",
    "Options",
    "Report",
    "REPORTS",
]

CausalAttention = Literal["full", "half"]
CAUSAL_ATTENTION: tuple[str, ...] = get_args(CausalAttention)
Report = Literal["summary", "full"]
REPORTS: tuple[str, ...] = get_args(Report)


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


def check_output_file(output_file: Any) -> None:
    """A report's file: a path (str or ``os.PathLike``) or None; checked before any pass runs."""
    if output_file is not None and not isinstance(output_file, (str, os.PathLike)):
        raise ValueError(f"output_file must be a path (str or os.PathLike) or None, got {output_file!r}")


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
    """The options of every entry point (the callbacks, ``StepProfiler``): each described here, once,
    and checked here, once. The docs' options page is generated from this docstring and the fields.

    The window's steps (counting, module timing, the check, clean steps) are laid out in the docs' "How
    counting and timing work" page.

    Attributes:
        profile_step: The window starts at the first optimizer step at or after this global step
            (DeepSpeed's convention: ``global_step == profile_step``) whose model has no lazy parameter
            left (``LazyLinear``'s are made by its first forward).
        clean_steps: Steps timed with nothing else on the clock, after the counting, module-timing and
            check steps: ``"auto"`` runs them until the median iter latency is known within +-3%
            (from 5 steps, at most 20; a run that ends first keeps those it ran, and one leaving fewer
            than 3 is told at its start); an int fixes the count; 0 runs none (the latencies are then a
            module-timing step's, inflated by its hooks, and ``flops_profiler/clean_steps`` logs 0).
        module_depth: Depth of the aggregated profile and the module tree in the full report (-1: all).
        top_modules: Modules shown per depth in the full report's aggregated profile.
        detailed: With ``report="full"``, print the module tree on the console too (the report file
            always has it).
        print_profile: Print the report on the logging rank (it is written to the log dir either way).
        output_file: Write the full report to this file and print nothing, not even the summary (the log
            dir's files are written as well).
        batch_size_fn: Samples in a micro-batch, from the batch (default: the leading dimension of its
            first tensor).
        tokens_fn: Tokens in a micro-batch, from the batch: adds ``tokens_per_sec`` (default: none on
            Lightning; ``input_ids.numel()`` of a dict batch on the HF Trainer and ``StepProfiler``).
        causal_attention: ``"full"`` counts all of QK^T and AV for causal attention (FlopCounterMode,
            DeepSpeed, PaLM's MFU); ``"half"`` only the unmasked part of kernels called with
            ``is_causal=True``.
        throughput: Log ``throughput/*`` at every logging step after the window.
        peak_flops: Dense peak FLOPS of one device, for MFU and HFU: a number, or ``"measure"``, the
            device's dense matmul rate in the compute dtype, measured in at most 2 s at the window's end
            (for a CPU or a device the table lacks; the report says "measured"). Default: the
            ``FLOPS_CALLBACKS_PEAK_FLOPS`` environment variable (a number or ``measure``), else the
            datasheet's figure from the peak table for the GPU and the compute dtype.
        peak_bandwidth: Peak memory bandwidth of one device in bytes/s, for the per-module roofline
            (default: ``FLOPS_CALLBACKS_PEAK_BANDWIDTH``, else the peak table for the GPU).
        flops_audit: After the window, count one step every N steps and compare it with the shape table
            (a mismatch is said once and ``throughput/*`` follows the count); ``"auto"``: as rarely as
            keeps the counting's cost within 1% of the run's time; 0: never.
        profile_every: After the first window, another every N steps, at the first step of
            ``profile_step + k*N`` after the previous window: a lead-in step and its clean steps only
            (the first window's counts and module tree reused, and said); each window's files are
            ``flops_profile_step{first step}.*`` and its metrics are logged at the step it ended; one
            the run would cut short (its length known) is not started. A run resumed past
            ``profile_step`` has a whole window (its own counts) at the first step of
            ``profile_step + k*N`` from where it resumed. Needs ``clean_steps`` of 1 or more (or
            "auto"). None: the first window only.
        report: What the console shows: ``"summary"``, the figures read in ten seconds (rates, the
            step's split, what bounds it, the top modules, the sizes), or ``"full"``, DeepSpeed's layout
            (all its summary rows, DeepSpeed's and ours, the aggregated profile, the coverage). The report
            file is always full.
        comm_steps: With several ranks, window steps after the module-timing ones under
            ``torch.profiler`` on every rank: where the step's time goes (compute, communication hidden
            under it, exposed, idle) and each collective's bytes and bus bandwidth, from their median
            step (by exposed time, the ranks' mean; the same step on every rank). ``"auto"`` stops once at
            least 3 agree (each exposed time within the larger of +-10% of their median and 1% of the
            step's time), else at 25; an int fixes the count; 0 runs none.
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
    peak_flops: float | Literal["measure"] | None = None
    peak_bandwidth: float | None = None
    flops_audit: int | Literal["auto"] = "auto"
    profile_every: int | None = None
    report: Report = "summary"
    comm_steps: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        check_int("profile_step", self.profile_step, 0)
        for name in ("clean_steps", "comm_steps"):
            value = getattr(self, name)
            if value != "auto":
                try:
                    check_int(name, value, 0)
                except ValueError:
                    raise ValueError(f"{name} must be 'auto' or an int >= 0, got {value!r}") from None
        if self.flops_audit != "auto" and (
            isinstance(self.flops_audit, bool)
            or not isinstance(self.flops_audit, int)
            or self.flops_audit < 0
        ):
            raise ValueError(f"flops_audit must be 'auto' or an int >= 0, got {self.flops_audit!r}")
        every = self.profile_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"profile_every must be an int >= 1 or None, got {every!r}")
        if every is not None and self.clean_steps == 0:
            raise ValueError(
                "profile_every needs clean_steps 'auto' or an int >= 1, got clean_steps=0: a re-profile "
                "window times its clean steps only (with none it would time nothing)"
            )
        check_report_args(self.module_depth, self.top_modules)
        for name in ("detailed", "print_profile", "throughput"):
            check_flag(name, getattr(self, name))
        check_causal_attention(self.causal_attention)
        if self.report not in REPORTS:
            raise ValueError(f"report must be one of {REPORTS}, got {self.report!r}")
        check_callable("batch_size_fn", self.batch_size_fn)
        check_callable("tokens_fn", self.tokens_fn)
        if self.output_file is not None and not isinstance(self.output_file, (str, Path)):
            raise ValueError(f"output_file must be a path (str or Path) or None, got {self.output_file!r}")
        if self.output_file is not None and (str(self.output_file) == "" or os.path.isdir(self.output_file)):
            got = "an empty path" if str(self.output_file) == "" else f"a folder: {self.output_file!r}"
            raise ValueError(f"output_file must be a file's path or None, got {got}")
        check_peak_flops(self.peak_flops)
        check_peak_bandwidth(self.peak_bandwidth)
