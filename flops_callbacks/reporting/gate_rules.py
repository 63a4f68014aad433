"""The gate's rules (``--fail-on figure:+N%``) on the figures of two sides' runs: a rule fails only when its
figure got worse beyond its limit and beyond the base's range (:func:`~.compare.is_noise`), so that a
gate in CI does not fail on the noise of a shared machine."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flops_callbacks import metrics as names
from flops_callbacks.reporting.compare import (
    COUNTS,
    NAMING,
    Change,
    better_up,
    figure_text,
    figures,
    percent_text,
    range_text,
    run_figures,
    short,
)
from flops_callbacks.reporting.profile_file import SavedProfile
from flops_callbacks.reporting.run_notes import work_note

__all__ = ["BATCH_COUNTS", "Check", "Rule", "gate", "judge", "one_configuration"]

# the counts of one batch, the counting step's: with batches of changing lengths, that batch's, not the run's
BATCH_COUNTS = frozenset(
    short(n)
    for n in (
        names.FWD_FLOPS, names.BWD_FLOPS, names.RECOMPUTE_FLOPS, names.FWD_MACS, names.FWD_BYTES,
        names.BWD_BYTES, names.SAVED_ACTIVATION_BYTES,
    )
)  # fmt: skip

_RULE = re.compile(r"^([A-Za-z0-9_/]+):([+-])(\d+(?:\.\d*)?|\.\d+)%$")


@dataclass(frozen=True)
class Rule:
    """``figure:+N%`` fails when the figure grows by more than N percent, ``figure:-N%`` when it falls
    by more; either way only when it also lies beyond the base run's range (:func:`is_noise`)."""

    figure: str  # without the prefix
    limit: float  # a fraction, >= 0: 0.10 for 10%
    grows: bool  # the rule calls a rise worse (+), else a fall (-): its own field, so that -0% keeps it

    @classmethod
    def parse(cls, text: str) -> Rule:
        """The rule ``text`` says; ValueError naming it and the syntax.

        Args:
            text: the rule as the command line takes it (``figure:+N%``, ``figure:-N%``).
        """
        found = _RULE.match(text.strip())
        if found is None:
            raise ValueError(
                f"--fail-on {text!r}: expected FIGURE:+N% (worse when it grows, e.g. fwd_latency:+10%) "
                "or FIGURE:-N% (worse when it falls, e.g. mfu:-5%)"
            )
        return cls(short(found[1]), float(found[3]) / 100, grows=found[2] == "+")

    def __str__(self) -> str:
        return f"{self.figure}:{'+' if self.grows else '-'}{100 * self.limit:g}%"


@dataclass(frozen=True)
class Check:
    """A rule applied: whether it failed, and why, in one line."""

    rule: Rule
    change: Change
    failed: bool
    reason: str

    def data(self) -> dict[str, Any]:
        """As JSON data (what ``gate --json`` prints of it)."""
        relative = self.change.relative
        return {
            "rule": str(self.rule),
            "figure": self.rule.figure,
            "limit": self.rule.limit,  # a fraction: 0.1 for 10%
            "worse_when": "grows" if self.rule.grows else "falls",
            "base": self.change.a.data(),
            "new": self.change.b.data(),
            "relative": relative if math.isfinite(relative) else None,  # JSON has no infinity
            "noise": self.change.noise,
            "failed": self.failed,
            "reason": self.reason,
        }


def one_configuration(runs: Sequence[SavedProfile]) -> None:
    """ValueError naming the first of ``runs`` that did other work than the first run (another model or
    batch: :func:`~.run_notes.work_note`): runs of one configuration, or their median means nothing.

    Args:
        runs: the runs of one side of a gate.
    """
    for saved in runs[1:]:
        note = work_note(runs[0], saved)
        if note is not None:
            raise ValueError(f"{saved.source} is not a run of {runs[0].source}'s configuration: {note}")


def gate(base: Sequence[SavedProfile], new: Sequence[SavedProfile], rules: list[Rule]) -> list[Check]:
    """Each rule applied to the ``new`` runs against the ``base`` runs (one or more of each, every run
    of a side of one configuration); ValueError naming a figure a file does not have, a run of a side
    that did other work than its first, or a run with no clean step for a figure a clock makes (its
    latencies are its counting or module-timing step's, inflated by the profiler's own work).

    A rule fails when the new figure is worse than the base's by more than the rule's limit and lies
    beyond the base's range on the worse side (above its slowest clean step for a latency of one run,
    above its slowest run's for several; below the matching rate for a rate): both, or it passes.

    Args:
        base: the runs compared against.
        new: the runs the rules judge.
        rules: the rules, as the command line parsed them.
    """
    one_configuration(base)
    one_configuration(new)
    fa, fb = run_figures(base), run_figures(new)
    checks = []
    for rule in rules:
        for side, found in ((base, fa), (new, fb)):
            if rule.figure not in found:
                saved = next(s for s in side if rule.figure not in figures(s))
                known = ", ".join(figures(saved))
                why = saved.why_absent(rule.figure)
                raise ValueError(
                    f"--fail-on {rule}: {saved.source} has no figure {rule.figure!r}"
                    + (f": {why}" if why else "")
                    + f" (it has: {known})"
                )
        if rule.figure in NAMING:
            raise ValueError(
                f"--fail-on {rule}: {rule.figure} names a rank, not a quantity: gate how long the others "
                "wait for it, slow_rank_wait_latency (or exposed_comm_latency)"
            )
        if better_up(rule.figure) == (1 if rule.grows else -1):
            better, worse = ("higher", "-") if rule.grows else ("lower", "+")
            raise ValueError(
                f"--fail-on {rule}: {rule.figure} is better {better}, so the rule would fail on an "
                f"improvement; a gate fails on it getting worse: {rule.figure}:{worse}{100 * rule.limit:g}%"
            )
        varying = next((s for s in (*base, *new) if s.varies()), None)
        if varying is not None and rule.figure in BATCH_COUNTS:
            raise ValueError(
                f"--fail-on {rule}: {varying.source}'s batches vary in length (dynamic padding, packing), so "
                f"its {rule.figure} is its counting step's one batch's, not the run's: gate params:+0% for "
                "the model's size, or a rate (flops_per_sec, mfu)"
            )
        cut = next((s for s in (*base, *new) if not s.result.steps.clean), None)
        if cut is not None and rule.figure not in COUNTS:
            raise ValueError(
                f"--fail-on {rule}: {cut.source} has no clean step (clean_steps 0: the run ended before "
                f"them), so its {rule.figure} is its counting or module-timing step's, inflated by the "
                "profiler's own work, not the configuration's: gate a run long enough for its clean steps, "
                f"or a count ({', '.join(sorted(COUNTS))})"
            )
        checks.append(judge(rule, Change(fa[rule.figure], fb[rule.figure])))
    return checks


def judge(rule: Rule, change: Change) -> Check:
    """One rule on one change: failed when worse beyond the limit and beyond the base's range (a count of
    one run has none: it is exact).

    Args:
        rule: the rule.
        change: the rule's figure from the base run (``a``) to the new run (``b``).
    """
    a, b = change.a, change.b
    grows = rule.grows
    over = (1 if grows else -1) * change.relative > rule.limit
    beyond = b.value > a.high if grows else b.value < a.low
    moved = f"{figure_text(a)} -> {figure_text(b)} ({percent_text(change.relative)})"
    side = "above" if grows else "below"
    if a.runs > 1:
        base_range = f"the base's range over its {a.runs} runs (A {range_text(a)})"
    elif rule.figure in COUNTS:
        base_range = ""
    else:
        base_range = f"the base run's range over its clean steps (A {range_text(a)})"
    if over and beyond:
        reason = f"{rule.figure} got worse: {moved}, beyond {rule}" + (
            f" and {side} {base_range}" if base_range else " (a count: exact, no range)"
        )
    elif over:
        reason = f"{rule.figure}: {moved}, beyond {rule} but within {base_range}: noise"
    else:
        reason = f"{rule.figure}: {moved}, within {rule}"
    return Check(rule, change, over and beyond, reason)
