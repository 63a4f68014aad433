"""A profile's full report in DeepSpeed's layout: its head (DeepSpeed's "Profile Summary" rows, then ours),
then the sections of :mod:`.profile_sections` (aggregated per depth, detailed tree, roofline, coverage).

Pure functions of a :class:`~flops_callbacks.profile.Profile` and a :class:`EngineRows`: they return
strings and print nothing. DeepSpeed users grep its report, so every row DeepSpeed prints comes first,
with DeepSpeed's label, order and row format (labels say "per GPU" whatever the device; a ``device``
row says when it is not one); our own rows (measured backward, recompute, callers' rows) follow.
Where DeepSpeed's label states its ``2 * fwd flops`` backward estimate and ours was measured, the
label keeps DeepSpeed's words up to the ``=`` and then says what was divided.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from flops_callbacks import units
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.profile_sections import (
    render_aggregated,
    render_coverage,
    render_detailed,
    rule,
)
from flops_callbacks.session.result import phase_rates
from flops_callbacks.session.shape_flops import BatchCounts

__all__ = [
    "NOTATIONS",
    "render_profile",
    "render_head",
    "EngineRows",
    "TITLE",
]

TITLE = "flops_callbacks Flops Profiler"
NOTATIONS = (
    "Notations:",
    "data parallel size (dp_size), model parallel size(mp_size),",
    "number of parameters (params), number of multiply-accumulate operations(MACs),",
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
    "Flops are measured op by op, in the backward too (not estimated as 2 x fwd) when it was profiled;",
    "recompute = forward work re-run in the backward (activation checkpointing, fused attention).",
)


@dataclass(frozen=True)
class EngineRows:
    """What the report knows of the run beyond the profile: the rows DeepSpeed prints from its engine.

    ``parallel`` gives the world / data / model parallel size rows and scales the "of model" rows by
    its model-parallel size (``None``: no size rows, mp_size 1). Latencies given here were timed around
    the model (DeepSpeed's engine timers, a callback's phase clock) and replace the profile's own;
    ``step_latency`` adds the step, iter and samples/second rows. ``model_params`` overrides
    params per GPU x mp_size (e.g. the global size of sharded DTensors). ``recompute_fwd_factor`` is
    DeepSpeed's: it enters the backward estimate only when the backward was not profiled.
    ``step_counts``: the flops of one step the rates divide (the clean steps' median) where they are not
    the profile's (batches of other shapes): then printed, and named in the rates' labels.
    ``samples_per_step`` (per GPU, all micro-batches) names samples/second's formula.
    """

    parallel: ParallelSizes | None = None
    batch_size: int | float | None = None  # per GPU and micro-batch (train_micro_batch_size_per_gpu)
    model_params: int | None = None
    fwd_latency: float | None = None
    bwd_latency: float | None = None
    step_latency: float | None = None
    samples_per_second: float | None = None
    recompute_fwd_factor: float = 0.0
    step_counts: BatchCounts | None = None
    micro_batches: int = 1
    samples_per_step: int | float | None = None


def _row(label: str, value: object) -> str:
    """DeepSpeed's head row: the label and ': ' padded to 70, two spaces, the value padded to 8."""
    return f"{label + ': ':<70}  {value!s:<8}"


def _rate(flops_per_second: float, seconds: float) -> str:
    return units.flops_to_string(flops_per_second) if seconds > 0 else "n/a"


def _deepspeed_rows(p: Profile, run: EngineRows) -> list[tuple[str, object]]:
    """DeepSpeed's head rows, in its order and words."""
    rows: list[tuple[str, object]] = []
    mp = run.parallel.model_parallel if run.parallel else 1
    if run.parallel:
        rows += [
            ("world size", run.parallel.world_size),
            ("data parallel size", run.parallel.data_parallel),
            ("model parallel size", mp),
        ]
    if run.batch_size is not None:
        rows.append(("batch size per GPU", run.batch_size))
    if run.micro_batches > 1:
        rows.append(("micro-batches per step (gradient accumulation)", run.micro_batches))
    per_step = "batch size per GPU"  # what samples/second divides: the micro-batch, unless a step has more
    if run.samples_per_step is not None and (run.micro_batches > 1 or run.samples_per_step != run.batch_size):
        rows.append(("samples per step per GPU", run.samples_per_step))
        per_step = "samples per step per GPU"
    model_params = run.model_params if run.model_params is not None else p.params * mp
    fwd_latency = p.fwd_latency if run.fwd_latency is None else run.fwd_latency
    bwd_latency = p.bwd_latency if run.bwd_latency is None else run.bwd_latency
    measured = p.bwd_flops > 0
    if measured:  # the backward's own ops, recompute included: the work the device did
        counted = p
    else:  # only timed (DeepSpeed's engine profiles the forward): DeepSpeed's estimate of the backward
        factor = 2 + run.recompute_fwd_factor
        root = dataclasses.replace(p.model, bwd_flops=int(factor * p.fwd_flops), recompute_flops=0)
        counted = dataclasses.replace(p, modules={**p.modules, "": root})
    other = measured and run.step_counts is not None and run.step_counts != BatchCounts.of(p)
    step = run.step_counts if other and run.step_counts is not None else BatchCounts.of(counted)
    rates = phase_rates(step, fwd_latency, bwd_latency, run.step_latency or 0.0)
    of = "clean step's " if other else ""  # the rates' flops: a clean step's (median), printed below
    padded = step.model_flops != step.run_flops  # padding or packing: the model's work is less than run
    model = "model " if padded else ""
    rows += [
        ("params per GPU", units.params_to_string(p.params)),
        ("params of model = params per GPU * mp_size", units.params_to_string(model_params)),
        ("fwd MACs per GPU", units.macs_to_string(p.fwd_macs)),
        ("fwd flops per GPU", units.number_to_string(p.fwd_flops)),
        ("fwd flops of model = fwd flops per GPU * mp_size", units.number_to_string(p.fwd_flops * mp)),
        ("fwd latency", units.duration_to_string(fwd_latency)),
    ]
    if other:
        rows.append(
            (
                "clean step's fwd / bwd / recompute flops per GPU (their median; batches of other shapes)",
                " / ".join(
                    units.number_to_string(n) for n in (step.fwd_flops, step.bwd_flops, step.recompute_flops)
                ),
            )
        )
    if padded:
        rows.append(
            (
                f"{of}model fwd / bwd flops per GPU (real tokens, each sequence alone)",
                " / ".join(units.number_to_string(n) for n in (step.model_fwd_flops, step.model_bwd_flops)),
            )
        )
    rows.append(
        (f"fwd FLOPS per GPU = {of}{model}fwd flops per GPU / fwd latency", _rate(rates.fwd, fwd_latency))
    )
    if not measured and run.bwd_latency is None:
        return rows  # no backward was profiled or timed: DeepSpeed prints none of its rows either
    if measured:  # model flops: recompute and padding apart (hardware FLOPS)
        bwd_label = f"bwd FLOPS per GPU = {of}{model}bwd flops per GPU / bwd latency"
        both_label = f"fwd+bwd FLOPS per GPU = {of}{model}fwd+bwd flops per GPU / (fwd+bwd latency)"
        iter_label = f"FLOPS per GPU = {of}{model}fwd+bwd flops per GPU / iter latency"
    else:  # DeepSpeed's estimate, in its words
        bwd_label = f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency"
        both_label = f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency)"
        iter_label = f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency"
    rows += [
        ("bwd latency", units.duration_to_string(bwd_latency)),
        (bwd_label, _rate(rates.bwd, bwd_latency)),
        (both_label, _rate(rates.fwd_bwd, fwd_latency + bwd_latency)),
    ]
    if run.step_latency is not None:
        iter_latency = fwd_latency + bwd_latency + run.step_latency
        rows += [
            ("step latency", units.duration_to_string(run.step_latency)),
            ("iter latency", units.duration_to_string(iter_latency)),  # fwd + bwd + step (the notations)
            (iter_label, _rate(rates.iter, iter_latency)),
        ]
        if measured and (step.recompute_flops or padded):  # else FLOPS per GPU (the metric is logged)
            rows.append(
                (
                    f"hardware FLOPS per GPU = {of}fwd+bwd+recompute flops per GPU / iter latency",
                    _rate(rates.hardware, iter_latency),
                )
            )
        if run.samples_per_second is not None:
            label = "samples/second"
            if run.samples_per_step is not None:
                dp = " * dp_size" if run.parallel else ""
                label = f"samples/second = {per_step}{dp} / iter latency"
            rows.append((label, round(run.samples_per_second, 2)))
    return rows


def _own_rows(p: Profile, micro_batches: int) -> list[tuple[str, object]]:
    """Our rows that DeepSpeed has no equivalent of (activations saved per micro-batch: each one's are
    freed by its backward)."""
    rows: list[tuple[str, object]] = []
    if not p.device.startswith("cuda"):
        rows.append(("device", p.device))
    rows.append(("trainable params per GPU", units.params_to_string(p.trainable_params)))
    if p.bwd_flops:
        rows += [
            ("bwd MACs per GPU", units.macs_to_string(p.bwd_macs)),
            ("bwd flops per GPU (measured)", units.number_to_string(p.bwd_flops)),
            ("bwd / fwd flops", f"{p.bwd_flops / p.fwd_flops:.2f}" if p.fwd_flops else "n/a"),
        ]
    if p.recompute_flops:
        rows.append(("recompute flops per GPU", units.number_to_string(p.recompute_flops)))
    # what the ops read and write, unfused and uncached (flops_callbacks.counting.bytes_moved)
    if p.fwd_bytes:
        passes = [("fwd", p.fwd_bytes), ("bwd", p.bwd_bytes), ("recompute", p.recompute_bytes)]
        shown = [(name, moved) for name, moved in passes if moved or name == "fwd"]
        label = " / ".join(name for name, _ in shown)
        rows += [
            (f"{label} bytes moved per GPU", " / ".join(units.bytes_to_string(moved) for _, moved in shown)),
        ]
        saved = "activations saved for bwd per GPU (params excluded)"
        if micro_batches > 1:
            saved = (
                f"activations saved for bwd per GPU per micro-batch (params excluded; {micro_batches}'s mean)"
            )
        rows.append((saved, units.bytes_to_string(p.saved_bytes / micro_batches)))
    return rows


def render_head(
    profile: Profile,
    profile_step: int = 1,
    timing_lines: Sequence[tuple[str, str]] = (),
    run: EngineRows | None = None,
) -> str:
    """The report's head (DeepSpeed's "Profile Summary"): DeepSpeed's rows, ours, then ``timing_lines``.

    Args:
        profile: the profile whose totals the rows print.
        profile_step: the step the rows say was profiled.
        timing_lines: (label, value) rows after the others; a caller that gives ``run`` leaves its rows
            (sizes, batch size, "of model", step latencies) out of them.
        run: the engine's rows: sizes, micro-batches, latencies (none known by default).
    """
    run = run or EngineRows()
    rows = [*_deepspeed_rows(profile, run), *_own_rows(profile, run.micro_batches), *timing_lines]
    lines = [
        rule(TITLE, 78),
        f"Profile Summary at step {profile_step}:",
        *NOTATIONS,
        "",
        *(_row(label, value) for label, value in rows),
    ]
    if profile.causal_attention == "half":
        lines.append("Causal attention kernels are counted for their unmasked half only.")
    return "\n".join(lines)


def render_profile(
    profile: Profile,
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    timing_lines: Sequence[tuple[str, str]] = (),
    run: EngineRows | None = None,
    roofline: str = "",
    totals: Profile | None = None,
    tree_depth: int | None = None,
) -> str:
    """The whole report, as ``print_model_profile`` prints it: the head, the aggregated profile, then
    the detailed tree (as DeepSpeed).

    Args:
        profile: the profile the sections print.
        profile_step: the step the head says was profiled.
        module_depth: the deepest depth the sections show (-1: all).
        top_modules: how many modules the aggregated profile names per depth.
        detailed: whether the detailed tree is printed.
        timing_lines: (label, value) rows at the head's end.
        run: the engine's rows (see :func:`render_head`).
        roofline: the roofline section (:func:`render_roofline`), printed after the head.
        totals: the profile whose totals the head prints (per GPU over several ranks), if not
            ``profile``'s.
        tree_depth: the deepest depth the detailed tree shows (-1: all; None: ``module_depth``).
    """
    parts = [render_head(totals or profile, profile_step, timing_lines, run)]
    if roofline:
        parts.append(roofline)
    parts.append(render_aggregated(profile, module_depth, top_modules))
    if detailed:
        parts.append(render_detailed(profile, module_depth if tree_depth is None else tree_depth))
    parts += [render_coverage(profile), "-" * 78]
    return "\n\n".join(parts)
