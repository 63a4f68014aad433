"""The full report's sections below its head, in DeepSpeed's layout: the aggregated profile per depth,
the detailed module tree, then ours: the roofline and the coverage. Pure functions of a
:class:`~flops_callbacks.profile.Profile`: they return strings and print nothing
(:func:`~flops_callbacks.reporting.profile_report.render_profile` puts them together).
"""

from __future__ import annotations

from collections.abc import Mapping

from flops_callbacks import units
from flops_callbacks.profile import Counts, ModuleProfile, Profile
from flops_callbacks.roofline import OVERHEAD_FRACTION, Roofline

__all__ = ["render_aggregated", "render_coverage", "render_detailed", "render_roofline", "rule"]


def rule(title: str, width: int) -> str:
    """A section's rule: ``title`` centred in dashes, ``width`` wide (DeepSpeed's).

    Args:
        title: the section's title.
        width: the rule's width in characters.
    """
    return f"{' ' + title + ' ':-^{width}}"


def render_aggregated(profile: Profile, module_depth: int = -1, top_modules: int = 1) -> str:
    """Top modules by params, MACs and fwd latency at each depth (the deepest one included).

    Args:
        profile: the profile to rank.
        module_depth: the deepest depth shown (-1: all).
        top_modules: how many modules are named per depth.
    """
    max_depth = profile.max_depth
    last = max_depth if module_depth == -1 else min(module_depth, max_depth)
    lines = [
        rule("Aggregated Profile per GPU", 86),
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:",
    ]
    for depth in range(last + 1):
        by_class = list(profile.aggregate_by_class(depth).values())

        def top(key: str, fmt: object, modules: list[ModuleProfile] = by_class) -> str:
            ranked = sorted(modules, key=lambda m: getattr(m, key), reverse=True)[:top_modules]
            return str({m.class_name: fmt(getattr(m, key)) for m in ranked})  # type: ignore[operator]

        lines += [
            f"depth {depth}:",
            f"    params      - {top('params', units.params_to_string)}",
            f"    MACs        - {top('fwd_macs', units.macs_to_string)}",
            f"    fwd latency - {top('fwd_latency', units.duration_to_string)}",
        ]
        if profile.bwd_flops:
            lines.append(f"    bwd flops   - {top('bwd_flops', units.number_to_string)}")
    return "\n".join(lines)


def _module_items(m: ModuleProfile, root: ModuleProfile) -> str:
    """DeepSpeed's four items, our measured backward, then the module's own settings."""
    items = [
        f"{units.params_to_string(m.params)} = {units.percent(m.params, root.params)} Params",
        f"{units.macs_to_string(m.fwd_macs)} = {units.percent(m.fwd_macs, root.fwd_macs)} MACs",
        f"{units.duration_to_string(m.fwd_latency)} = "
        f"{units.percent(m.fwd_latency, root.fwd_latency)} latency",
        units.flops_to_string(round(m.fwd_flops / m.fwd_latency, 2) if m.fwd_latency else 0),
    ]
    if root.bwd_flops or root.bwd_latency:
        items += [
            f"bwd {units.number_to_string(m.bwd_flops)}flops",
            f"bwd {units.duration_to_string(m.bwd_latency)}",
        ]
    if m.recompute_flops:
        items.append(f"recompute {units.number_to_string(m.recompute_flops)}flops")
    if m.fwd_bytes:
        items.append(
            f"fwd {units.bytes_to_string(m.fwd_bytes)} moved, {units.bytes_to_string(m.saved_bytes)} saved"
        )
    if m.extra_repr:
        items.append(m.extra_repr)
    return ", ".join(items)


def _functional(name: str, c: Counts) -> str:
    """``linear 1.2 Mfwd/2.4 Mbwd x2``, ``relu 64 flops x1``, with a recompute's ``/... rec`` (a call made
    only in the recompute has no forward call: ``x0``)."""
    if not c.bwd_flops and not c.recompute_flops:
        return f"{name} {units.number_to_string(c.fwd_flops)}flops x{c.calls}"
    flops = f"{units.number_to_string(c.fwd_flops)}fwd/{units.number_to_string(c.bwd_flops)}bwd"
    if c.recompute_flops:
        flops += f"/{units.number_to_string(c.recompute_flops)}rec"
    return f"{name} {flops} x{c.calls}"


def _functionals_line(m: ModuleProfile) -> str:
    ranked = sorted(m.functionals.items(), key=lambda kv: kv[1].hardware_flops, reverse=True)
    shown = [_functional(name, c) for name, c in ranked if c.hardware_flops]
    return "functionals: " + "; ".join(shown) if shown else ""


def render_detailed(profile: Profile, module_depth: int = -1) -> str:
    """The module tree down to ``module_depth`` as ``print(model)`` shows it, each module's numbers
    first inside its parentheses (as DeepSpeed prints it), then the functionals that did its flops.

    Args:
        profile: the profile to print.
        module_depth: the deepest depth shown (-1: all).
    """
    root = profile.model
    lines = [
        rule("Detailed Profile per GPU", 86),
        "Each module profile is listed after its name in the following order: ",
        "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
        "percentage of total fwd latency, fwd FLOPS, then the measured bwd flops and bwd latency, the "
        "fwd bytes moved and the activations saved for bwd, and the module's own settings;",
        "a module with children or several functionals lists its functionals (torch ops that did "
        "flops: fwd/bwd and call count).",
        "",
        "Note: a module's totals include its children and its own functional calls (e.g. a loss), so "
        "they can exceed the sum of its submodules'. Latencies are measured on a synchronized clock "
        "(CUDA events on GPU); bwd latency is the time of the module's backward ops.",
        "",
    ]

    def walk(m: ModuleProfile, pad: str, label: str) -> None:
        children = profile.children(m.name) if module_depth == -1 or m.depth < module_depth else []
        functionals = _functionals_line(m)
        if not children and (len(m.functionals) <= 1 or not functionals):
            lines.append(f"{pad}{label}{m.class_name}({_module_items(m, root)})")
            return
        lines.extend([f"{pad}{label}{m.class_name}(", f"{pad}  {_module_items(m, root)}"])
        if functionals:
            lines.append(f"{pad}  {functionals}")
        for child in children:
            walk(child, pad + "  ", f"({child.name.rsplit('.', 1)[-1]}): ")
        lines.append(f"{pad})")

    walk(root, "", "")
    return "\n".join(lines)


def render_roofline(
    profile: Profile, rooflines: Mapping[str, Mapping[str, Roofline]], roofs: str, top: int = 10
) -> str:
    """The modules (those without children) that take the most time, each pass against the roofline,
    then those far below both roofs: where a performance engineer fuses, compiles or checkpoints next.

    Args:
        profile: the profile whose modules' time is ranked.
        rooflines: module name -> pass -> roofline (:func:`~flops_callbacks.roofline.module_rooflines`).
        roofs: the line that names the two roofs and their sources.
        top: how many of the slowest modules are listed.
    """
    parents = {""} | {name[:i] for name in profile.modules for i, c in enumerate(name) if c == "."}
    leaves = [m for m in profile.modules.values() if m.name in rooflines and m.name not in parents]
    leaves.sort(key=lambda m: m.fwd_latency + m.bwd_latency, reverse=True)
    whole = profile.model.fwd_latency + profile.model.bwd_latency
    lines = [
        rule("Roofline per GPU", 86),
        roofs,
        "Modules taking the most time (module-timing steps), each pass against the roofline:",
        "bound = max(flops / peak FLOPS, bytes / peak bandwidth), the larger term the limiter, bound / "
        "latency the fraction of the roofline achieved.",
    ]
    for m in leaves[:top]:
        passes = [
            f"{phase} {units.duration_to_string(r.seconds)}, {_intensity(r)}, {r.verdict()}"
            for phase, r in rooflines[m.name].items()
        ]
        share = units.percent(m.fwd_latency + m.bwd_latency, whole)
        lines.append(f"    {m.name} ({m.class_name}), {share} of the time: {'; '.join(passes)}")
    overhead = [m.name for m in leaves if all(r.overhead_bound for r in rooflines[m.name].values())]
    if overhead:
        shown = ", ".join(overhead[:8]) + (f" and {len(overhead) - 8} more" if len(overhead) > 8 else "")
        lines.append(
            f"Overhead-bound (under {OVERHEAD_FRACTION:.0%} of the roofline in every pass: kernel launch and "
            f"Python overhead, not arithmetic or memory; fuse them or torch.compile them): {shown}"
        )
    return "\n".join(lines)


def _intensity(r: Roofline) -> str:
    return f"{r.intensity:.3g} flops/B" if r.intensity is not None else "no bytes"


def render_coverage(profile: Profile, outside: str | None = None) -> str:
    """What was counted, what had no arithmetic, and every op that had no formula (never hidden).

    Args:
        profile: the profile whose coverage is printed.
        outside: what the work outside the model's modules is, where not a training step's (its loss and
            optimizer step): generation's token choice.
    """
    c = profile.coverage
    lines = [
        rule("Coverage", 86),
        f"{c.counted_calls} op calls counted with a formula, {c.free_calls} op calls do no arithmetic "
        "(views, copies, indexing, creation).",
    ]
    if c.uncounted:
        lines.append("Ops with no flop formula (NOT in the flops above), calls and share of measured time:")
        lines += [
            f"    {u.op:<48}{u.calls:>8} calls  {units.duration_to_string(u.seconds):>10}  "
            f"{100 * u.time_share:6.2f}%"
            for u in c.uncounted
        ]
    else:
        lines.append("Every op that does arithmetic was counted.")
    o = profile.outside_model
    if o.hardware_flops and outside is not None:
        total = units.number_to_string(o.hardware_flops)
        lines.append(f"Outside the model's modules (not in the model totals): {total}flops ({outside}).")
    elif o.hardware_flops:
        ahead, back = units.number_to_string(o.fwd_flops), units.number_to_string(o.bwd_flops)
        lines.append(  # its "fwd" is all work outside the backward: the loss's forward and the optimizer step
            f"Outside the model's modules (not in the model totals): {ahead}flops outside the backward (the "
            f"loss, the optimizer step), {back}flops in it (the loss's backward)."
        )
    return "\n".join(lines)
