"""The model's work on a batch's real tokens: each of its sequences counted as if run alone.

Model flops are what the model does on its real tokens: padding positions left out, attention within
each sequence only (causal attention whole, or halved under ``causal_attention="half"``, as a count of
the sequence alone gives it). One definition holds for every attention kernel (a fused one given a mask
or ``is_causal``, flash's sequence boundaries, eager matmuls under an added mask): the literal one. A
sequence's counts come from a table of one-sequence batches (a :class:`ShapeFlops`, keyed by the cut
batch's signature), counted under fake tensors (the adapter's step on the sequence cut out of its batch:
:func:`~flops_callbacks.session.token_layout.one_sequence`) or predicted from counted lengths (a model's
flops are a polynomial in the length, verified by one more count); a batch's model work is the sum over
its sequences. Why not the counted batch scaled by its real tokens: attention is quadratic in the length,
so a packed row's masked-out pairs and a padded row's padding cost differently. Why not a formula of the
model's config: the sequence's own count is measured, whatever the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from flops_callbacks.counting.estimate import is_encoder_decoder
from flops_callbacks.session.batch import Signature, shape_signature
from flops_callbacks.session.off_clock import OffClock, Replay
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops, extremes_first
from flops_callbacks.session.token_layout import Layout, Unit, one_sequence
from flops_callbacks.session.window_steps import WindowStep

__all__ = ["LaidOut", "SequenceFlops"]


class LaidOut(NamedTuple):
    """A micro-batch whose sequences' work is wanted: its layout, the batch and its signature, and how
    the adapter's step runs it again (for a count of one of its sequences)."""

    layout: Layout
    batch: Any
    signature: Signature
    replay: Replay | str | None


def _kind(signature: Signature, rows: int, length: int) -> tuple:
    """A batch's signature with what :func:`one_sequence` cuts named instead of sized: its token tensors'
    rows and length, its per-row tensors' rows."""
    kinds: list[tuple] = []
    for shape, dtype in signature:
        if len(shape) >= 2 and shape[1] == length and shape[0] in (rows, 1):
            kinds.append(("tokens", shape[0] == rows, shape[2:], dtype))
        elif len(shape) >= 1 and shape[0] == rows and rows > 1:
            kinds.append(("row", shape[1:], dtype))
        else:
            kinds.append((shape, dtype))
    return tuple(kinds)


class SequenceFlops:
    """The one-sequence table of a session and what its counts cost (module doc)."""

    def __init__(self) -> None:
        self.table = ShapeFlops()
        self.why_not = ""  # why a batch's model work could not be told apart from its run ("": it could)
        self.counts = 0  # one-sequence fake counts run
        self.encoder_decoder = False  # the window's model is one: its rows are read as pairs
        self._alone: dict[tuple[tuple, Unit], Signature] = {}

    def forget(self) -> None:
        """A new run: nothing counted yet."""
        self.table, self.why_not, self.counts, self._alone = ShapeFlops(), "", 0, {}
        self.encoder_decoder = False

    def alone_signature(self, item: LaidOut, n: Unit, kind: tuple | None = None) -> Signature:
        """The signature of one sequence of ``n`` (its tokens, or an encoder-decoder's pair) cut out of
        ``item``'s batch (found once for batches alike but for their rows and length, ``kind``: a padded
        batch's length changes every step)."""
        key = (kind or _kind(item.signature, item.layout.rows, item.layout.length), n)
        found = self._alone.get(key)
        if found is None:
            found = self._alone[key] = shape_signature(one_sequence(item.batch, item.layout, n))
        return found

    def lookup(
        self, item: LaidOut, n: Unit, beyond: bool = False, kind: tuple | None = None
    ) -> BatchCounts | None:
        """A sequence's counts from the table (counted or predicted; ``beyond``: extrapolated too)."""
        return self.table.get(self.alone_signature(item, n, kind), beyond=beyond)

    def count(
        self, model: torch.nn.Module, off_clock: OffClock, item: LaidOut, n: Unit
    ) -> BatchCounts | None:
        """One sequence of ``n`` of ``item`` counted under fake tensors, kept in the table; None (and
        ``why_not`` said) where no fake count runs. One that fails ends this run's one-sequence counts
        (the next would fail alike), not the fake counts of batches as run (module times, new shapes)."""
        replay = item.replay
        if self.why_not:
            return None
        if not isinstance(replay, Replay) or not off_clock.usable(replay, model):
            self.why_not = off_clock.reason(replay)
            return None
        cut = Replay(replay.step, one_sequence(replay.args, item.layout, n))
        counts = off_clock.attempt(model, cut, False)
        self.counts += 1
        if isinstance(counts, str):
            self.why_not = f"one sequence alone could not be counted ({counts})"
            return None
        self.table.record(self.alone_signature(item, n), counts)
        return counts

    def settle(
        self,
        model: torch.nn.Module | None,
        off_clock: OffClock,
        items: Sequence[LaidOut],
        beyond: bool = False,
    ) -> None:
        """Count the sequences the table cannot give for ``items`` (those not laid out plain), the extreme
        lengths of each kind of batch first, so that the fewest counts verify the rest."""
        wanted: dict[Signature, tuple[LaidOut, Unit]] = {}
        for item in items:
            if not item.layout.plain:
                for n, _ in item.layout.units():
                    wanted.setdefault(self.alone_signature(item, n), (item, n))
        for signature in extremes_first(list(wanted)):
            item, n = wanted[signature]
            known = self.table.get(signature, beyond=beyond) is not None
            if not known and (model is None or self.count(model, off_clock, item, n) is None):
                return  # no count runs: the rest would not either

    def model_passes(self, item: LaidOut, beyond: bool = False) -> tuple[int, int] | None:
        """The forward and backward flops of ``item``'s sequences, each alone; None where one's are
        unknown."""
        fwd = bwd = 0
        kind = _kind(item.signature, item.layout.rows, item.layout.length)
        for n, k in item.layout.units():
            alone = self.lookup(item, n, beyond, kind)
            if alone is None:
                return None
            fwd, bwd = fwd + k * alone.fwd_flops, bwd + k * alone.bwd_flops
        return fwd, bwd

    def model_flops(self, item: LaidOut, beyond: bool = False) -> int | None:
        """The forward + backward flops of ``item``'s sequences, each alone (None: one's unknown)."""
        passes = self.model_passes(item, beyond)
        return None if passes is None else sum(passes)

    def model_counts(self, counts: BatchCounts, item: LaidOut) -> BatchCounts | None:
        """``counts`` (the batch as run) with its model slots its sequences' own work; the batch's own
        where it is laid out plain; None where a sequence's counts are unknown."""
        if item.layout.plain:
            return counts
        passes = self.model_passes(item)
        return None if passes is None else counts.with_model(*passes)

    def window_end(self, steps: list[WindowStep], model: torch.nn.Module, off_clock: OffClock) -> None:
        """Each window step's padding and packing read, and its micro-batches' model work: their sequences
        counted alone, off the clock at the window's end; an encoder-decoder's each with its decoder."""
        self.encoder_decoder = is_encoder_decoder(model)
        for step in steps:
            step.read_layouts(self.encoder_decoder)
        self.settle(model, off_clock, [item for step in steps for _, item in self.laid_out(step)])
        for step in steps:
            self.model_work(step)

    def laid_out(self, step: WindowStep) -> list[tuple[int, LaidOut]]:
        """Each micro-batch of ``step`` whose layout is read and not plain, by its place."""
        return [
            (i, LaidOut(lo, step.batches[i], step.signatures[i], step.replays[i]))
            for i, lo in enumerate(step.laid_out)
            if lo is not None and not lo.plain and step.batches[i] is not None
        ]

    def model_work(self, step: WindowStep) -> bool:
        """Each micro-batch's model slots in ``step``, its sequences' work alone (from the table);
        whether every laid-out one's was known."""
        whole = True
        for i, item in self.laid_out(step):
            counts = step.each[i]
            if counts is not None:
                model = self.model_counts(counts, item)
                whole = whole and model is not None
                if model is not None:
                    step.fill(i, model)
        return whole
