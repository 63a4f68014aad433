"""Turns a trace's :class:`~flops_callbacks.counting.recording.Recording` into a :class:`Profile`: each
context's sums spread over the modules on its stack, clock marks made seconds (one synchronization),
parameters counted.

Why not in the trace: this runs once per profile, the trace once per op, so the trace only adds to one
context's sums and appends clock marks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from flops_callbacks.counting.recording import Recording, Sums, as_counts, plus, total
from flops_callbacks.module_tree import ModuleTree, depth_of, fill_uncalled, parent_in
from flops_callbacks.parallel import stored_numel
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile, UncountedOp
from flops_callbacks.timing.clock import Clock

__all__ = ["build_profile", "model_totals"]


def model_totals(recording: Recording, clock: Clock) -> tuple[Counts, float]:
    """The model's flops, MACs and forward seconds, without the per-module profile.

    Args:
        recording: what the counting step recorded.
        clock: the clock its marks were made on.
    """
    sums = total(
        part
        for key, by_functional in recording.contexts.items()
        if key  # the model is on every stack inside it
        for ctx in by_functional.values()
        for part in ctx.sums.values()
    )
    clock.synchronize()
    seconds = sum(clock.seconds(a, b) for a, b in recording.top_spans)
    return Counts(**as_counts(sums, calls=recording.module_calls[""])), seconds


def build_profile(
    recording: Recording, tree: ModuleTree, clock: Clock, device: torch.device, causal_attention: str
) -> Profile:
    """Everything ``recording`` holds, per module, with latencies resolved (synchronizes once).

    Args:
        recording: what the counting step recorded.
        tree: the model's module names.
        clock: the clock its marks were made on.
        device: the device the step ran on.
        causal_attention: how attention calls were counted, as the profile says it.
    """
    seconds = clock.seconds
    clock.synchronize()
    called = {name for name, calls in recording.module_calls.items() if calls}
    holders = tree.holders(called)
    per_module, outside = _spread(recording, tree, holders)

    fwd: dict[str, float] = {}
    rec: dict[str, float] = {}
    for name, start, end, recompute in recording.module_spans:
        table = rec if recompute else fwd
        table[name] = table.get(name, 0.0) + seconds(start, end)
    fill_uncalled(fwd)
    fill_uncalled(rec)
    fwd_latency = {name: fwd.get(name, 0.0) for name in tree.modules}
    rec_latency = {name: rec.get(name, 0.0) for name in tree.modules}
    bwd_latency = dict.fromkeys(tree.modules, 0.0)
    for ctx, start, end in recording.bwd_op_spans:
        s = seconds(start, end)
        for name in holders(ctx.names):
            bwd_latency[name] += s
    total_fwd = sum(seconds(a, b) for a, b in recording.top_spans)
    total_bwd = sum(seconds(a, b) for a, b in recording.bwd_spans)

    params, trainable = tree.param_counts()
    modules = {
        name: ModuleProfile(
            **as_counts(total(per_module[name].values()), calls=recording.module_calls[name]),
            name=name,
            class_name=type(module).__name__,
            extra_repr=module.extra_repr(),  # its own settings (in_features=...), on its report line
            depth=depth_of(name),
            params=params[name],
            trainable_params=trainable[name],
            fwd_latency=fwd_latency[name],
            bwd_latency=bwd_latency[name],
            recompute_latency=rec_latency[name],
            functionals={functional: Counts(*sums) for functional, sums in per_module[name].items()},
        )
        for name, module in tree.modules.items()
    }
    _add_ignored(modules, tree)
    return Profile(
        fwd_latency=total_fwd,
        bwd_latency=total_bwd,
        device=str(device),
        modules=modules,
        outside_model=Counts(**as_counts(outside, calls=0)) if outside else Counts(),
        coverage=_coverage(recording, clock, total_fwd + total_bwd),
        causal_attention=causal_attention,
    )


def _add_ignored(modules: dict[str, ModuleProfile], tree: ModuleTree) -> None:
    """A record for each module of an ignored type with profiled modules below it, its numbers its
    children's sums (its own work is its parent's), so that the tree keeps its shape: DeepSpeed's
    ``ignore_list`` skips a module's own hooks and still shows it, with its children's numbers."""
    counted = [f.name for f in dataclasses.fields(Counts) if f.name != "calls"]  # it was never called itself
    added = False
    for name, module in reversed(list(tree.ignored.items())):  # the deepest first: nested ones sum up
        known = modules.keys() | {name}
        children = [m for n, m in modules.items() if parent_in(n, known) == name]
        if not children:
            continue
        sums = {key: sum(getattr(child, key) for child in children) for key in counted}
        params, added = list(module.parameters()), True
        modules[name] = ModuleProfile(
            **sums,
            name=name,
            class_name=type(module).__name__,
            extra_repr=module.extra_repr(),
            depth=depth_of(name),
            params=sum(stored_numel(p) for p in params),
            trainable_params=sum(stored_numel(p) for p in params if p.requires_grad),
            fwd_latency=sum(child.fwd_latency for child in children),
            bwd_latency=sum(child.bwd_latency for child in children),
            recompute_latency=sum(child.recompute_latency for child in children),
        )
    if not added:
        return
    order = {name: i for i, (name, _) in enumerate(tree.paths)}
    ranked = sorted(modules.items(), key=lambda item: order.get(item[0], len(order)))
    modules.clear()
    modules.update(ranked)  # the model's walk order: parents before their children


def _spread(
    recording: Recording, tree: ModuleTree, holders: Callable[[tuple[str, ...]], tuple[str, ...]]
) -> tuple[dict[str, dict[str, Sums]], Sums | None]:
    """Sums per module and functional (given to a context's ``holders``: a module never called holds its
    submodules'), and the sums of work outside the model's modules."""
    per_module: dict[str, dict[str, Sums]] = {name: {} for name in tree.modules}
    outside: Sums | None = None
    for key, by_functional in recording.contexts.items():  # a stack's contexts merged, then spread
        merged: dict[str, Sums] = {}
        for ctx in by_functional.values():
            for functional, sums in ctx.sums.items():
                merged[functional] = plus(merged.get(functional), sums)
        names = holders(key)
        for functional, sums in merged.items():
            for name in names:
                mine = per_module[name]
                mine[functional] = plus(mine.get(functional), sums)
            if not key:
                outside = plus(outside, sums)
    return per_module, outside


def _coverage(recording: Recording, clock: Clock, measured: float) -> Coverage:
    uncounted = []
    for op, spans in recording.uncounted.items():
        secs = sum(clock.seconds(a, b) for a, b in spans)
        share = secs / measured if measured > 0 else 0.0
        uncounted.append(UncountedOp(op=op, calls=len(spans), seconds=secs, time_share=share))
    uncounted.sort(key=lambda u: (-u.seconds, -u.calls, u.op))
    return Coverage(recording.counted_calls, recording.free_calls, uncounted)
