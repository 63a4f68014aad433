"""Text reports in DeepSpeed's layout: summary, aggregated profile per depth, detailed tree, coverage.

Pure functions of a :class:`~flops_callbacks.profile.Profile`: they return strings and print nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)

TITLE = "flops_callbacks Flops Profiler"
_WIDTH = 60


def _rule(title: str) -> str:
    return f"{' ' + title + ' ':-^90}"


def _line(label: str, value: str) -> str:
    return f"{label + ':':<{_WIDTH}}{value}"


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds) if seconds > 0 else "n/a"


def render_summary(
    profile: Profile,
    profile_step: int = 1,
    context_lines: Sequence[tuple[str, str]] = (),
    timing_lines: Sequence[tuple[str, str]] = (),
) -> str:
    """The summary block. ``context_lines`` (world size, batch size, ...) come first and
    ``timing_lines`` (step latency, iter latency, samples/second, MFU, ...) last."""
    p = profile
    fwd_bwd_latency = p.fwd_latency + p.bwd_latency
    lines = [
        _rule(TITLE),
        f"Profile Summary at step {profile_step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size (mp_size),",
        "number of parameters (params), number of multiply-accumulate operations (MACs),",
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        "Flops are measured op by op in the forward AND the backward (not estimated as 2 x fwd);",
        "recompute = forward work re-run in the backward (activation checkpointing, fused attention).",
        "",
        *(_line(label, value) for label, value in context_lines),
        _line("device", p.device),
        _line("params per device", params_to_string(p.params)),
        _line("trainable params per device", params_to_string(p.trainable_params)),
        _line("fwd MACs per device", macs_to_string(p.fwd_macs)),
        _line("fwd flops per device", number_to_string(p.fwd_flops)),
    ]
    if p.bwd_flops or p.bwd_latency:
        lines += [
            _line("bwd MACs per device", macs_to_string(p.bwd_macs)),
            _line("bwd flops per device (measured)", number_to_string(p.bwd_flops)),
            _line("bwd / fwd flops", f"{p.bwd_flops / p.fwd_flops:.2f}" if p.fwd_flops else "n/a"),
        ]
    if p.recompute_flops:
        lines.append(_line("recompute flops per device", number_to_string(p.recompute_flops)))
    lines.append(_line("fwd latency", duration_to_string(p.fwd_latency)))
    if p.bwd_flops or p.bwd_latency:
        lines.append(_line("bwd latency", duration_to_string(p.bwd_latency)))
    lines.append(_line("fwd FLOPS per device = fwd flops / fwd latency", _rate(p.fwd_flops, p.fwd_latency)))
    if p.bwd_flops or p.bwd_latency:
        lines += [
            _line(
                "bwd FLOPS per device = bwd flops / bwd latency",
                _rate(p.bwd_flops + p.recompute_flops, p.bwd_latency),
            ),
            _line(
                "fwd+bwd FLOPS per device = flops / (fwd+bwd latency)",
                _rate(p.hardware_flops, fwd_bwd_latency),
            ),
        ]
    lines += [_line(label, value) for label, value in timing_lines]
    if p.causal_attention == "half":
        lines.append("Causal attention kernels are counted for their unmasked half only.")
    return "\n".join(lines)


def render_aggregated(profile: Profile, module_depth: int = -1, top_modules: int = 1) -> str:
    """Top modules by params, MACs and fwd latency at each depth (the deepest one included)."""
    max_depth = profile.max_depth
    last = max_depth if module_depth == -1 else min(module_depth, max_depth)
    lines = [
        _rule("Aggregated Profile per device"),
        "Top modules in terms of params, MACs or fwd latency at different model depths:",
    ]
    for depth in range(last + 1):
        by_class = list(profile.aggregate_by_class(depth).values())

        def top(key: str, fmt: object, modules: list[ModuleProfile] = by_class) -> str:
            ranked = sorted(modules, key=lambda m: getattr(m, key), reverse=True)[:top_modules]
            return str({m.class_name: fmt(getattr(m, key)) for m in ranked})  # type: ignore[operator]

        lines += [
            f"depth {depth}:",
            f"    params      - {top('params', params_to_string)}",
            f"    MACs        - {top('fwd_macs', macs_to_string)}",
            f"    fwd latency - {top('fwd_latency', duration_to_string)}",
        ]
        if profile.bwd_flops:
            lines.append(f"    bwd flops   - {top('bwd_flops', number_to_string)}")
    return "\n".join(lines)


def _module_line(m: ModuleProfile, root: ModuleProfile) -> str:
    parts = [
        f"{params_to_string(m.params)} = {percent(m.params, root.params)} Params",
        f"{macs_to_string(m.fwd_macs)} = {percent(m.fwd_macs, root.fwd_macs)} MACs",
        f"{duration_to_string(m.fwd_latency)} = {percent(m.fwd_latency, root.fwd_latency)} latency",
        _rate(m.fwd_flops, m.fwd_latency),
    ]
    if root.bwd_flops or root.bwd_latency:
        parts += [
            f"bwd {number_to_string(m.bwd_flops)}flops",
            f"bwd {duration_to_string(m.bwd_latency)}",
        ]
    if m.recompute_flops:
        parts.append(f"recompute {number_to_string(m.recompute_flops)}flops")
    return ", ".join(parts)


def _functionals_line(m: ModuleProfile) -> str:
    ranked = sorted(m.functionals.items(), key=lambda kv: kv[1].hardware_flops, reverse=True)
    shown = [
        f"{name} {number_to_string(c.fwd_flops)}fwd/{number_to_string(c.bwd_flops)}bwd x{c.calls}"
        if c.bwd_flops
        else f"{name} {number_to_string(c.fwd_flops)}flops x{c.calls}"
        for name, c in ranked
        if c.hardware_flops
    ]
    return "functionals: " + "; ".join(shown) if shown else ""


def render_detailed(profile: Profile, module_depth: int = -1) -> str:
    """The module tree down to ``module_depth`` with each module's numbers and functionals."""
    root = profile.model
    lines = [
        _rule("Detailed Profile per device"),
        "Each module profile is listed after its name in the following order:",
        "params, percentage of total params, MACs, percentage of total MACs, fwd latency,",
        "percentage of total fwd latency, fwd FLOPS, then the measured bwd flops and bwd latency;",
        "the next line lists the functionals (torch ops) that did the flops, fwd/bwd and call count.",
        "",
        "Note: a module's totals include its children and its own functional calls (e.g. a loss),",
        "so they can exceed the sum of its submodules'. Latencies are measured on a synchronized",
        "clock (CUDA events on GPU); bwd latency is the time of the module's backward ops.",
        "",
    ]

    def walk(m: ModuleProfile, indent: int, label: str) -> None:
        pad = "  " * indent
        lines.append(f"{pad}{label}{m.class_name}(")
        lines.append(f"{pad}  {_module_line(m, root)}")
        functionals = _functionals_line(m)
        if functionals:
            lines.append(f"{pad}  {functionals}")
        if module_depth == -1 or m.depth < module_depth:
            for child in profile.children(m.name):
                walk(child, indent + 1, f"({child.name.rsplit('.', 1)[-1]}): ")
        lines.append(f"{pad})")

    walk(root, 0, "")
    return "\n".join(lines)


def render_coverage(profile: Profile) -> str:
    """What was counted, what had no arithmetic, and every op that had no formula (never hidden)."""
    c = profile.coverage
    lines = [
        _rule("Coverage"),
        f"{c.counted_calls} op calls counted with a formula, {c.free_calls} op calls do no arithmetic "
        "(views, copies, indexing, creation).",
    ]
    if c.uncounted:
        lines.append("Ops with no flop formula (NOT in the flops above), calls and share of measured time:")
        lines += [
            f"    {u.op:<48}{u.calls:>8} calls  {duration_to_string(u.seconds):>10}  "
            f"{100 * u.time_share:6.2f}%"
            for u in c.uncounted
        ]
    else:
        lines.append("Every op that does arithmetic was counted.")
    o = profile.outside_model
    if o.hardware_flops:
        lines.append(
            f"Outside the model's modules (loss, optimizer): fwd {number_to_string(o.fwd_flops)}flops, "
            f"bwd {number_to_string(o.bwd_flops)}flops (not in the model totals)."
        )
    return "\n".join(lines)


def render_profile(
    profile: Profile,
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    context_lines: Sequence[tuple[str, str]] = (),
    timing_lines: Sequence[tuple[str, str]] = (),
) -> str:
    """The whole report, as ``print_model_profile`` prints it."""
    parts = [render_summary(profile, profile_step, context_lines, timing_lines)]
    if detailed:
        parts += [
            render_aggregated(profile, module_depth, top_modules),
            render_detailed(profile, module_depth),
        ]
    parts += [render_coverage(profile), "-" * 90]
    return "\n\n".join(parts)
