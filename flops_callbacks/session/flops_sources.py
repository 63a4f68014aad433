"""Where each clean step's flops come from, and how sure the window's total is.

A clean step is timed, not counted: its flops are the shape table's
(:class:`~flops_callbacks.session.shape_flops.ShapeFlops`), *counted* for its shapes or *predicted*
inside a range that counted points verified, and exact as long as a second count of a known shape
matched the table. Where a second count differed (the model's work depends on the batch's content:
padding-free layers on ``h[attention_mask]``, MoE routing with capacity, a mode the model keeps),
the table is stale for every batch, so the window counts every other step and a clean step's flops
are *estimated* from its counted neighbours (the nearest counted step before and after it, per
sample). How sure: the largest error of that estimate on the counted steps themselves (each one
estimated from its own neighbours, itself left out), over the estimated share of the total.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.window_steps import WindowStep

__all__ = ["COUNTED", "ESTIMATED", "PREDICTED", "FlopsSources", "clean_step_flops", "on_steps_line"]

COUNTED, PREDICTED, ESTIMATED = "counted", "predicted", "estimated"


@dataclass(frozen=True)
class FlopsSources:
    """How the clean steps' flops were obtained, for the report and the JSON.

    ``sources``: per clean step, in order: "counted" (its shapes were counted), "predicted" (inside the
    verified range) or "estimated" (from counted neighbours). ``uncertainty``: a bound on the relative
    error of the clean steps' total model flops (0: exact). ``checked``: whether a second count checked
    the table. ``content``: the finding that the flops depend on the batch's content ("" if none), with
    ``counted_steps`` and the spread of their model flops per sample (median, lowest, highest).
    ``on_steps``: one line naming the shapes counted on training steps rather than off the clock, and why.
    """

    sources: tuple[str, ...]
    uncertainty: float
    checked: bool
    check_step: int | None = None  # the step whose count checked the table
    content: str = ""
    counted_steps: tuple[int, ...] = ()
    spread: tuple[float, float, float] | None = None
    on_steps: str = ""  # the shapes counted on training steps, as no fake count could give them, and why

    def in_words(self) -> str:
        """One line: what is exact, what is estimated, and how sure."""
        kinds = {k: self.sources.count(k) for k in (COUNTED, PREDICTED, ESTIMATED) if k in self.sources}
        parts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        if self.uncertainty == 0:
            check = (
                "a second count matched the table" if self.checked else "no second count checked the table"
            )
            return f"exact ({parts}; {check})"
        return f"within +-{self.uncertainty:.1%} ({parts} from counted neighbours)"


def _per_sample(step: WindowStep, counts: BatchCounts) -> float:
    return counts.model_flops / step.samples if step.samples else float(counts.model_flops)


def _neighbours(number: int, counted: list[int]) -> list[int]:
    """The nearest counted step before ``number`` and the nearest after it (those there are)."""
    before = [n for n in counted if n < number]
    after = [n for n in counted if n > number]
    return before[-1:] + after[:1]


def _estimate(step: WindowStep, around: list[tuple[WindowStep, BatchCounts]]) -> BatchCounts:
    """The mean of the neighbours' counts, each scaled to this step's samples."""
    scaled = []
    for other, counts in around:
        factor = step.samples / other.samples if step.samples and other.samples else 1.0
        scaled.append([v * factor for v in counts])
    return BatchCounts(*(round(sum(col) / len(col)) for col in zip(*scaled, strict=True)))


def _corrected(said: BatchCounts, ratios: list[float]) -> BatchCounts:
    """What the table says of a step's shapes, times the neighbours' mean count / table ratio: the
    shapes' work (lengths differ) with the content's share of it measured next door."""
    factor = sum(ratios) / len(ratios)
    return BatchCounts(*(round(v * factor) for v in said))


def _model_share(estimate: BatchCounts, own: BatchCounts | None) -> BatchCounts:
    """An estimate as run, its model slots in the share of the step's own (its padding and packing:
    the table's counts are of batches as run)."""
    if own is None or own.model_flops == own.run_flops:
        return estimate
    fwd = estimate.fwd_flops * own.model_fwd_flops // own.fwd_flops if own.fwd_flops else 0
    bwd = estimate.bwd_flops * own.model_bwd_flops // own.bwd_flops if own.bwd_flops else 0
    return estimate.with_model(fwd, bwd)


def on_steps_line(table: ShapeFlops) -> str:
    """The shapes counted on training steps (no fake count could give them), grouped by why."""
    by_why: dict[str, list[str]] = {}
    for (_, signature), why in table.counted_on_steps.items():
        shapes = str([shape for shape, _ in signature])
        if shapes not in by_why.setdefault(why, []):
            by_why[why].append(shapes)
    return "; ".join(f"shapes {', '.join(shapes)}: {why}" for why, shapes in by_why.items())


def clean_step_flops(
    steps: list[WindowStep], clean: list[WindowStep], table: ShapeFlops
) -> tuple[list[BatchCounts], FlopsSources]:
    """Each clean step's counts and where they come from (module doc)."""
    counts, sources = _clean_step_flops(steps, clean, table)
    return counts, dataclasses.replace(sources, on_steps=on_steps_line(table))


def _clean_step_flops(
    steps: list[WindowStep], clean: list[WindowStep], table: ShapeFlops
) -> tuple[list[BatchCounts], FlopsSources]:
    finding = table.content
    if finding is None:
        sources = [
            COUNTED
            if all(table.source(sig, i > 0) == COUNTED for i, sig in enumerate(s.signatures))
            else PREDICTED
            for s in clean
        ]
        return [s.counts or BatchCounts.zero() for s in clean], FlopsSources(
            tuple(sources), 0.0, table.checked is not None, table.checked_step
        )
    by_number = {s.number: s for s in steps if s.kind is not None and s.kind.counted}
    counted = sorted(
        n
        for n, (_, micro, _) in table.by_step.items()
        if n in by_number and micro == len(by_number[n].signatures)
    )
    totals = {n: table.by_step[n][0] for n in counted}
    saids = {n: table.by_step[n][2] for n in counted}
    ratios = {
        n: totals[n].model_flops / said.model_flops
        for n, said in saids.items()
        if said is not None and said.model_flops
    }

    def by_samples(number: int, step: WindowStep, others: list[int]) -> BatchCounts | None:
        around = [(by_number[m], totals[m]) for m in _neighbours(number, others)]
        return _estimate(step, around) if around else None

    def by_table(number: int, said: BatchCounts | None, others: list[int]) -> BatchCounts | None:
        near = [ratios[m] for m in _neighbours(number, [m for m in others if m in ratios])]
        return _corrected(said, near) if said is not None and near else None

    def guess(
        number: int, step: WindowStep, said: BatchCounts | None, others: list[int]
    ) -> BatchCounts | None:
        """Neighbours of the same shapes: their work per sample (other content: padding-free, routing, a
        mode); of other shapes: the table's work for this step's shapes times their count / table ratio
        (the lengths' work from the table, the content's share measured next door)."""
        near = _neighbours(number, others)
        if all(by_number[m].signatures == step.signatures for m in near):
            return by_samples(number, step, others)
        return by_table(number, said, others) or by_samples(number, step, others)

    errors_used = []  # each counted step guessed from its neighbours, itself left out
    for n in counted:
        truth = totals[n].model_flops
        left_out = guess(n, by_number[n], saids[n], [m for m in counted if m != n])
        if truth:
            errors_used.append(abs(left_out.model_flops / truth - 1) if left_out is not None else 1.0)
    estimates = []
    for s in clean:
        estimate = guess(s.number, s, s.counts, counted)
        own = s.counts or BatchCounts.zero()
        estimates.append(_model_share(estimate, s.counts) if estimate is not None else own)
    per_sample = sorted(_per_sample(by_number[n], totals[n]) for n in counted)
    spread = (per_sample[len(per_sample) // 2], per_sample[0], per_sample[-1]) if per_sample else None
    if errors_used:
        error = max(errors_used)
    elif spread is not None and spread[0]:
        error = (spread[2] - spread[1]) / spread[0]
    else:
        error = 1.0
    total = sum(c.model_flops for c in estimates)
    uncertainty = error if total else 0.0
    return estimates, FlopsSources(
        (ESTIMATED,) * len(clean),
        max(uncertainty, 1e-9),  # estimated: never said to be exact
        True,
        table.checked_step,
        finding.text(),
        tuple(counted),
        spread,
    )
