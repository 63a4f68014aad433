"""The window's new batch shapes counted off the clock: fake counts
(:mod:`flops_callbacks.counting.fake_count`) of the adapter's step function, so that a step whose shapes
the flops table cannot give is timed as a clean step like any other.

Whether fake counts run is tried once, the first time one is wanted, at a point no figure's time holds:
a fake count of the counting step's first micro-batch must equal its real count (else, or where it raises,
the reason is kept and such shapes are counted on training steps, as the report says). Why not at once, on
the counting step: the trial runs the user's step function again, and a run whose batches keep one shape
wants no fake count at all; what that function does outside the model (an iterator of its own stepped)
would happen once more for nothing. Where: at the vote of the first window's first step after its head,
which is the check or a shape count (neither timed) whatever the trial finds; after the check, on the
shape-counting step a new shape then makes; at the window's end; in a meter's count, out of its clock.
A clean step's unknown micro-batches are counted at the window's end, before the ranks exchange their
figures: the time after a step's end is the next step's (its wall and data time start there), and with
several ranks one rank's count there would hold the others in their next all-reduce (the waiting
micro-batches' inputs are held until then). The check step's unknown micro-batch is counted at once
(that step is counted, not timed), so that its real count checks it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from flops_callbacks.counting.fake_count import FakeCountUnavailable, StepFunction, fake_count, fake_profile
from flops_callbacks.options import CausalAttention
from flops_callbacks.profile import Profile
from flops_callbacks.session.batch import Signature
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops, extremes_first
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import WindowStep

__all__ = ["NO_REPLAY", "OffClock", "Replay", "TRIED_ON_ITS_STEP"]

NO_REPLAY = "no training step to run again (StepProfiler runs the loop's own code)"
TRIED_ON_ITS_STEP = "the first new shape after the check, whose step tried fake counts"


class Replay(NamedTuple):
    """How an adapter's step runs one micro-batch again: ``step(model, args)`` does its forward, loss
    and backward (``args``: the micro-batch's arguments, tensors included)."""

    step: StepFunction
    args: Any


class _Pending(NamedTuple):
    step: WindowStep
    position: int  # the micro-batch's place in its step
    signature: Signature
    later: bool
    replay: Replay


class OffClock:
    """Fake counts of one session: whether they run (``why_not``), the clean micro-batches waiting for
    one, and the shapes counted on training steps instead, with why (for the report)."""

    def __init__(self, causal_attention: CausalAttention = "full") -> None:
        self.causal_attention = causal_attention
        self.why_not: str | None = None  # None: not tried yet; "": fake counts run; else why they do not
        # the counting step's first micro-batch; then, once its real count is known, that micro-batch held
        # with it and the parameters it ran with (:func:`_parameters`): the trial of fake counts, run where
        # one is first wanted (ready)
        self.first_batch: tuple[Replay, Signature, bool] | None = None
        self._held: tuple[Replay, bool, BatchCounts, tuple[Any, ...]] | None = None
        self._pending: list[_Pending] = []
        self.counts, self.seconds = 0, 0.0  # fake counts run in this run, and their time (the profiler's)

    def forget(self) -> None:
        """A new run: nothing tried yet."""
        self.why_not, self.first_batch, self._held, self._pending = None, None, None, []
        self.counts, self.seconds = 0, 0.0

    def drop(self, ended: bool = False) -> None:
        """The window is dropped: nothing waits for a count (a trial whose real count is known stays for the
        meter's counts, until the run ``ended``: it holds a batch and the trainer)."""
        self.first_batch, self._pending = None, []
        if ended:
            self._held = None

    def usable(self, replay: Replay | str | None, model: torch.nn.Module | None) -> bool:
        """Whether a fake count of ``replay`` runs; tries fake counts first where not yet tried (call
        where no figure's time runs)."""
        if isinstance(replay, Replay) and model is not None:
            self.ready(model)
        return isinstance(replay, Replay) and self.why_not == ""

    def hopeful(self, replay: Replay | str | None) -> bool:
        """Whether a fake count of ``replay`` runs, or may once tried (a meter's, before its clock pauses)."""
        return isinstance(replay, Replay) and (
            self.why_not == "" or (self.why_not is None and bool(self._held))
        )

    def reason(self, replay: Replay | str | None) -> str:
        """Why a micro-batch's unknown shapes are counted on its training step."""
        if not isinstance(replay, Replay):
            return replay or NO_REPLAY
        return self.why_not or "no fake count was tried"

    def micro_batch(
        self,
        model: torch.nn.Module,
        flops: ShapeFlops,
        kind: Kind,
        step: WindowStep,
        signature: Signature,
        later: bool,
        counts: BatchCounts | None,
        replay: Replay | str | None,
    ) -> BatchCounts | None:
        """A window micro-batch of ``kind`` whose table counts are ``counts`` starts: the counting step's
        first is the trial's; a check's new shape is counted now (its real count checks it), a clean
        step's at the window's end; one counted on its step is said with why. Returns its counts now."""
        if kind == Kind.COUNTING and not step.signatures and isinstance(replay, Replay):
            self.first_batch = (replay, signature, later)  # held at the step's end (hold_trial)
        elif counts is None and isinstance(replay, Replay):
            if kind == Kind.CHECK and self.usable(replay, model):  # the check step is no figure's time
                counts = self.count_now(model, replay, signature, later, flops)
            elif kind == Kind.SHAPE_COUNTING and self.why_not is None and self._held is not None:
                if self.usable(replay, model):  # an untimed step: fake counts tried here
                    flops.counted_on_steps.setdefault((later, signature), TRIED_ON_ITS_STEP)
            elif kind == Kind.CLEAN and self.usable(replay, None):
                self.defer(step, signature, later, replay)
        if counts is None and kind in (Kind.CHECK, Kind.SHAPE_COUNTING):
            flops.counted_on_steps.setdefault((later, signature), self.reason(replay))
        return counts

    def hold_trial(self, flops: ShapeFlops, model: torch.nn.Module | None) -> None:
        """The counting step's first micro-batch ended: it is tried when a fake count is first wanted."""
        trial, self.first_batch = self.first_batch, None
        if trial is None or self.why_not is not None or model is None:
            return
        replay, signature, later = trial
        real = flops.counted.get((later, signature))
        if real is not None:
            self._held = (replay, later, real, _parameters(model))

    def ready(self, model: torch.nn.Module) -> None:
        """Try fake counts where not yet tried: the counting step's batch faked must equal its real count."""
        trial, self._held = self._held, None
        if trial is None or self.why_not is not None:
            return
        replay, later, real, parameters = trial
        if _parameters(model) != parameters:  # its count is another model's (a backbone unfrozen since)
            self.why_not = "the model's parameters changed since the counting step: no count checks a fake"
            return
        faked = self.count(model, replay, later)
        if faked is None:
            return  # why_not says why
        if faked != real:
            self.why_not = (
                f"a fake count of the counting step's batch did {faked.model_flops} flops, "
                f"its real count {real.model_flops}"
            )
        else:
            self.why_not = ""

    def count(self, model: torch.nn.Module, replay: Replay, later: bool) -> BatchCounts | None:
        """A micro-batch's fake count; None where it cannot run (then no other is tried: ``why_not``)."""
        counts = self.attempt(model, replay, later)
        if isinstance(counts, str):
            self.why_not = counts
            return None
        return counts

    def attempt(self, model: torch.nn.Module, replay: Replay, later: bool) -> BatchCounts | str:
        """A fake count of ``replay``'s arguments, or why it cannot run (other fake counts still run: a
        batch cut to one sequence may fail where the batches as run count)."""
        start = time.perf_counter()
        try:
            return self._count(model, replay, later)
        except FakeCountUnavailable as error:
            return str(error)
        finally:
            self.counts += 1
            self.seconds += time.perf_counter() - start

    def profile(self, model: torch.nn.Module, replays: list[Any]) -> Profile | None:
        """The module tree of a step's micro-batches (each one's replay) counted under fake tensors; None
        where a fake count cannot run (a micro-batch without its replay, or ``why_not``)."""
        if not replays or not all(self.usable(r, model) for r in replays):
            return None
        start = time.perf_counter()
        try:
            calls = [(r.args, i > 0) for i, r in enumerate(replays)]
            return fake_profile(model, replays[0].step, calls, causal_attention=self.causal_attention)
        except FakeCountUnavailable:
            return None  # this step's batch only: other shapes may still count
        finally:
            self.counts += 1
            self.seconds += time.perf_counter() - start

    def count_now(
        self, model: torch.nn.Module, replay: Replay, signature: Signature, later: bool, flops: ShapeFlops
    ) -> BatchCounts | None:
        """A micro-batch counted at once (the check step's): its fake count, a point of the table."""
        counts = self.count(model, replay, later)
        if counts is not None:
            flops.record(signature, counts, later)
        return counts

    def defer(self, step: WindowStep, signature: Signature, later: bool, replay: Replay) -> None:
        """A clean step's micro-batch the table cannot give: counted at the window's end."""
        self._pending.append(_Pending(step, len(step.signatures), signature, later, replay))

    def finish(self, model: torch.nn.Module | None, flops: ShapeFlops) -> None:
        """The window ends: each waiting micro-batch's counts, from the table (predicted from the points
        counted since) or a fake count; a step whose count fails keeps unknown flops (left out)."""
        pending, self._pending = self._pending, []
        if pending and model is not None:
            self.ready(model)
        first = {(p.later, tuple(d for shape, _ in p.signature for d in shape)): p for p in pending}
        for key in extremes_first(list(first)):  # the fewest counts that verify a fit over the rest
            p = first[key]
            if flops.get(p.signature, p.later) is None and model is not None and self.why_not == "":
                self.count_now(model, p.replay, p.signature, p.later, flops)
        for p in pending:
            counts = flops.get(p.signature, p.later)
            if counts is None:
                flops.counted_on_steps.setdefault((p.later, p.signature), f"not counted: {self.why_not}")
            elif p.step.kind == Kind.CLEAN:
                p.step.fill(p.position, counts)

    def _count(self, model: torch.nn.Module, replay: Replay, later: bool) -> BatchCounts:
        counted = fake_count(
            model, replay.step, replay.args, later=later, causal_attention=self.causal_attention
        )
        return BatchCounts.of(counted)


def _parameters(model: torch.nn.Module) -> tuple[Any, ...]:
    """What of the parameters a step's count depends on besides the batch: which train, their dtypes and
    shapes (a backbone unfrozen, an adapter added, a cast)."""
    return tuple((p.requires_grad, p.dtype, p.shape) for p in model.parameters())
