"""Whether the module tree's latencies can be believed: checked against the phases, said out loud.

The tree's latencies come from one module-timing step (on a CPU the one nearest the clean steps' own
forward); the phase latencies from
the median of the clean steps. On a true tree the model's forward fits inside the forward phase (and
matches the model's own forward, where the clean steps marked its outermost calls) and no module outlasts
its parent. When one does not (a pause on the module-timing step: a collection, another
process, a recompile; module calls made from outside their parent), the report and the picture say so, and
where the excess lies, instead of drawing widths nobody should believe. One owner: the report and the
picture both read :func:`check_tree`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.step_lists import steps_named
from flops_callbacks.units import duration_to_string

__all__ = ["TreeCheck", "check_tree"]

PHASE_SLACK = 1.1  # the model's time may exceed its phase's median by this factor (one step vs a median)
# ... and its own forward's median by as much as the slowest clean step did, up to this factor (one step
# of a machine whose clean steps spread 15-20% is as likely to be that slow)
OWN_SLACK_CAP = 1.25
PARENT_SLACK = 1.05  # a child may exceed its parent by this factor (marks of its own hooks)
ABSOLUTE_SLACK = 50e-6  # and by this many seconds (a clock's resolution, a few hooks)
SHOWN = 3  # modules named per kind of note


@dataclass(frozen=True)
class TreeCheck:
    """``notes``: sentences for the report and the picture; ``flagged``: module name -> why (short)."""

    notes: list[str] = field(default_factory=list)
    flagged: dict[str, str] = field(default_factory=dict)


def check_tree(
    profile: Profile,
    fwd_phase: float,
    bwd_phase: float,
    module_steps: tuple[int, ...],
    model_forward: float | None = None,
    model_forward_high: float | None = None,
    trace: int | None = None,
    flops_ratio: float = 1.0,
    eager: bool = False,
) -> TreeCheck:
    """The notes on ``profile``'s module latencies against the phases' (seconds, clean steps; scaled up by
    ``flops_ratio`` where the tree's batch did more work); the model's forward against ``model_forward``
    instead where the clean steps marked it (the same calls without the loss and the framework's work
    around them: a check both ways; longer than the slowest clean step's, ``model_forward_high``, or 1.1x
    the median, whichever is more, up to 1.25x).

    Args:
        profile: the profile whose module latencies are checked.
        fwd_phase: the forward phase's median, seconds, clean steps.
        bwd_phase: the backward phase's median, seconds, clean steps.
        module_steps: the module-timing steps the latencies come from.
        model_forward: the model's own forward marked on the clean steps, seconds (None: not marked).
        model_forward_high: the slowest clean step's model forward, seconds.
        trace: the module-timing step whose tree ``profile`` holds (None: unknown).
        flops_ratio: the tree's batch's flops (fwd + bwd as run) over the median clean step's.
        eager: the modules were timed eagerly beside compiled clean steps (``torch.compile``): a longer
            tree is the eager model's, said as such, not a slowed step.
    """
    check = TreeCheck()
    if not module_steps:
        return check
    several = trace is not None and len(module_steps) > 1
    which = f"step {trace} of {steps_named(module_steps)}" if several else steps_named(module_steps)
    # NB: the phases are scaled up to a batch of more flops, never down to one of fewer: a step's time grows
    # no faster than its flops (costs fixed per step, the same kernels launched), so the scaled phase is a
    # ceiling on it, while a smaller batch's time shrinks less than its flops (the same fixed costs)
    scale = max(flops_ratio, 1.0)
    scaled = f" scaled by its batch's {scale:.2f}x flops" if scale > 1.0 else ""
    for kind, phase in (("fwd", fwd_phase), ("bwd", bwd_phase)):
        if kind == "fwd" and model_forward:
            own = (model_forward, "the model's own forward")
            spread = (model_forward_high or model_forward) / model_forward
            slack = min(max(PHASE_SLACK, spread), OWN_SLACK_CAP)
            _check_root(profile, kind, own, which, check, both_ways=True, slack=slack, eager=eager)
        else:
            against = (phase * scale, f"the {_words(kind)} phase{scaled}")
            _check_root(profile, kind, against, which, check, eager=eager)
        _check_parents(profile, kind, check)
    return check


def _latency(m: ModuleProfile, kind: str) -> float:
    return m.fwd_latency if kind == "fwd" else m.bwd_latency


def _words(kind: str) -> str:
    return "forward" if kind == "fwd" else "backward"


def _check_root(
    profile: Profile,
    kind: str,
    reference: tuple[float, str],
    which: str,
    check: TreeCheck,
    both_ways: bool = False,
    slack: float = PHASE_SLACK,
    eager: bool = False,
) -> None:
    """The model's latency against ``reference`` (seconds, words): longer is a slowed module-timing step;
    shorter (``both_ways``: the same calls, not a phase with more in it) a slowed clean step, or too much
    taken out for the hooks."""
    root, (seconds, against) = _latency(profile.model, kind), reference
    low = seconds / PHASE_SLACK - ABSOLUTE_SLACK if both_ways else 0.0
    if seconds <= 0 or low <= root <= seconds * slack + ABSOLUTE_SLACK:
        return
    words, ratio = _words(kind), root / seconds
    note = (
        f"module tree: the model's {words} on {which} ({duration_to_string(root)}) is "
        f"{ratio:.2f}x {against} ({duration_to_string(seconds)}, clean steps): "
    )
    if ratio < 1:
        note += f"a slowed clean step, or too much taken out for the hooks: the {words} widths read short"
    elif eager:
        note += (
            f"the modules ran eagerly there and compiled on the clean steps (torch.compile), so the "
            f"{words} widths are the eager model's, not the compiled code's"
        )
    else:
        hooks = ", or their hooks cost more than was taken out" if both_ways else ""
        note += f"the steps that timed the modules were slowed{hooks}, so their {words} widths "
        note += "are not to be trusted"
        culprit = _largest_own_time(profile, kind)
        if culprit is not None and culprit[1] >= 0.5 * (root - seconds):
            name, own = culprit
            note += f"; most of the excess lies in {name} ({duration_to_string(own)} of its own)"
            check.flagged.setdefault(name, f"{words}: {duration_to_string(own)} of its own, a slowed step")
    check.notes.append(note)
    check.flagged.setdefault("", f"{words} {ratio:.2f}x {against}")


def _largest_own_time(profile: Profile, kind: str) -> tuple[str, float] | None:
    """The module (not the model) whose time less its children's is largest."""
    best: tuple[str, float] | None = None
    for name in profile.modules:
        if not name:
            continue
        own = profile.own_latency(name, (kind,))
        if best is None or own > best[1]:
            best = (name, own)
    return best


def _check_parents(profile: Profile, kind: str, check: TreeCheck) -> None:
    longer = []
    for name, parent in profile.modules.items():
        limit = _latency(parent, kind) * PARENT_SLACK + ABSOLUTE_SLACK
        longer += [(c, parent) for c in profile.children(name) if _latency(c, kind) > limit]
    if not longer:
        return
    words = _words(kind)
    shown = ", ".join(
        f"{c.name} ({duration_to_string(_latency(c, kind))}) > {p.name or 'the model'} "
        f"({duration_to_string(_latency(p, kind))})"
        for c, p in longer[:SHOWN]
    )
    more = f" and {len(longer) - SHOWN} more" if len(longer) > SHOWN else ""
    check.notes.append(
        f"module tree: {len(longer)} module(s) took longer in the {words} than their parent: {shown}{more} "
        "(called from outside their parent, or a slowed call)"
    )
    for c, p in longer:
        check.flagged.setdefault(c.name, f"{words} longer than its parent {p.name or '(model)'}")
