"""The one owner of what shapes the profile window, agreed by every rank.

Each decision that shapes the window (a step's kind, the window's end, dropping it after a failure) is
taken here, from every rank's wish, at points every rank reaches in lock step: each micro-batch of a
step whose batches decide its kind, and each window step's end. So every rank runs the same kind of
step on the same global step (a rank counting a new batch shape would slow the others' "clean" step
through the gradient all-reduce), and the window ends on the same step everywhere, where the figures
are exchanged. A rank whose own work failed keeps voting, for a drop, until every rank has dropped.

Why a vote at the micro-batch and not only at the step's end: a step's kind depends on its batches'
shapes, which no rank knows before they arrive.

With ``profile_every=N`` a window ends by naming the next one's start: the first step of the grid
``profile_step + k*N`` after its last step (:meth:`WindowPlan.ended`), from the agreed steps and the
options alone, so every rank opens it on the same global step. Such a *re-profile* window has no
counting and no module-timing step (the previous window's counts and module tree are reused): a lead-in
step, run as it is (its end is where the first clean step's wall and data time start), then steps
decided by their batches, clean unless a shape is new (or the table asks for a count).
"""

from __future__ import annotations

from typing import NamedTuple

from flops_callbacks.options import Options
from flops_callbacks.session import run_plan
from flops_callbacks.session.ranks import RankFailure, Ranks
from flops_callbacks.session.window_steps import Kind, median_known

__all__ = ["Decision", "MAX_SHAPE_COUNTS", "WindowPlan", "Wish"]

MAX_SHAPE_COUNTS = 8  # shape-counting steps a window may add


class Wish(NamedTuple):
    """What one rank wants at a vote."""

    drop: bool = False  # its own work failed: drop the window
    new_shape: bool = False  # its micro-batch's flops are neither counted nor predictable
    check: bool = False  # its shape table asks for a count of a known shape (ShapeFlops.needs_count)
    done: bool = False  # the window has what it needs here (``clean_steps="auto"``'s median)


class Decision(NamedTuple):
    """What every rank does after a vote; ``why`` says a drop's cause in words ("" for none)."""

    drop: bool
    new_shape: bool  # some rank's micro-batch is new: the step counts it
    check: bool  # some rank's table asks for a count
    done: bool
    why: str = ""

    @classmethod
    def dropped(cls, why: str) -> Decision:
        return cls(True, False, False, False, why)


class WindowPlan:
    """The window's agreed state: its steps' kinds so far, whether it is open, and whether this rank
    failed in it (then it wishes a drop at the next vote)."""

    def __init__(self, options: Options, ranks: Ranks) -> None:
        self.options = options
        self.ranks = ranks
        self.kinds: list[str | None] = []  # the agreed kind of each window step (None: not yet)
        self.open = False
        self.failed = False
        self.reprofile = False  # the open window reuses the previous one's profile (module doc)
        self.next_window: int | None = None  # where the next re-profile window starts (None: none)
        self._lined_up = 0  # the window step whose ranks last lined up (lines_up)

    def reset(self, run: bool = False) -> None:
        """The window ended (or was dropped); with ``run`` no other window starts in this run."""
        self.kinds, self.open, self.failed, self.reprofile, self._lined_up = [], False, False, False, 0
        if run:
            self.next_window = None

    def ended(self, last_step: int) -> None:
        """The window whose last step started at ``last_step`` ended (agreed): the next one's start."""
        every, first = self.options.profile_every, self.options.profile_step
        self.next_window = None if every is None else first + every * ((last_step - first) // every + 1)

    def due(self, global_step: int) -> bool:
        """Whether a re-profile window starts at this step (the same on every rank: module doc)."""
        self.reprofile = self.next_window is not None and global_step >= self.next_window
        return self.reprofile

    @property
    def before_clean(self) -> int:
        """Window steps before the first clean one: counting, module timing and the check, or the lead-in."""
        return 1 if self.reprofile else run_plan.BEFORE_CLEAN + self.comm_step

    @property
    def comm_step(self) -> bool:
        """Whether the window has a communication step (the one after the module-timing steps): with
        several ranks, unless the options turn it off; a re-profile window has none."""
        return self.options.comm_step and self.ranks.several and not self.reprofile

    @property
    def comm_next(self) -> bool:
        """Whether the next step is the communication step: its profiler starts at this step's end,
        before the vote, so that the vote lines the ranks up after the profiler's start-up."""
        return self.comm_step and len(self.kinds) == run_plan.MODULE_TIMING_STEPS + 1

    def start_step(self) -> str | None:
        """A window step starts: its kind by its place (counting, module timing, communication), or None
        when its batches decide (a clean step, or a shape-counting or skipped one)."""
        self.open = True
        n = len(self.kinds)
        kind = Kind.COUNTING if n == 0 else Kind.MODULE_TIMING if n <= run_plan.MODULE_TIMING_STEPS else None
        if self.comm_step and n == 1 + run_plan.MODULE_TIMING_STEPS:
            kind = Kind.COMMUNICATION
        if self.reprofile:
            kind = Kind.LEAD_IN if n == 0 else None
        self.kinds.append(kind)
        return kind

    def lines_up(self) -> bool:
        """Whether the ranks vote before this micro-batch: the communication step's first (once a step),
        so that its split starts with every rank at one point, after each read its batch."""
        if self.kind != Kind.COMMUNICATION or self._lined_up == len(self.kinds):
            return False
        self._lined_up = len(self.kinds)
        return True

    @property
    def kind(self) -> str | None:
        return self.kinds[-1] if self.kinds else None

    @property
    def batch_decides(self) -> bool:
        """Whether the current step's micro-batches vote on its kind (every rank answers the same)."""
        return self.open and bool(self.kinds) and self.kind in (None, Kind.CLEAN)

    def vote(self, wish: Wish) -> Decision:
        """Every rank's wishes, agreed: a drop if any rank wants one (or a rank does not answer), a
        count if any rank's batch is new, the end only when every rank is done."""
        try:
            wishes = self.ranks.exchange(wish)
        except RankFailure as failure:
            return Decision.dropped(f"the ranks' vote failed ({failure})")
        failed = [rank for rank, w in enumerate(wishes) if w is None or w.drop]
        if failed:
            why = f"rank {failed[0]}'s profiler failed" if self.ranks.several else "the profiler failed"
            return Decision.dropped(why)
        new, check = any(w.new_shape for w in wishes), any(w.check for w in wishes)
        return Decision(False, new, check, all(w.done for w in wishes))

    def batch_kind(self, new_shape: bool, check: bool = False) -> str:
        """The current step's agreed kind after a micro-batch's vote said whether some rank's batch is
        new (a shape-counting step while those are left, else skipped) or its table asks for a count (a
        shape-counting step while those are left, else it stays clean); else clean."""
        left = sum(k == Kind.SHAPE_COUNTING for k in self.kinds[:-1]) < MAX_SHAPE_COUNTS
        if new_shape:
            kind = Kind.SHAPE_COUNTING if left else Kind.SKIPPED
        elif check and left:
            kind = Kind.SHAPE_COUNTING
        else:
            kind = self.kind or Kind.CLEAN
        self.kinds[-1] = kind
        return kind

    def done_here(self, clean_iters: list[float]) -> bool:
        """This rank's wish at a step's end: ``clean_iters`` (its clean steps' iter seconds) meet
        ``clean_steps``, or ``"auto"``'s median is known."""
        wanted = self.options.clean_steps
        if len(self.kinds) < self.before_clean:
            return False
        if wanted != "auto":
            return len(clean_iters) >= wanted
        return len(clean_iters) >= run_plan.CLEAN_MIN and median_known(clean_iters)

    def capped(self) -> bool:
        """Whether the window has grown as long as it may (agreed kinds: the same on every rank)."""
        wanted = self.options.clean_steps
        most = run_plan.CLEAN_MAX if wanted == "auto" else wanted
        clean = sum(k == Kind.CLEAN for k in self.kinds)
        after = len(self.kinds) - self.before_clean
        return len(self.kinds) >= self.before_clean and (
            clean >= most or after >= most + 2 * MAX_SHAPE_COUNTS
        )
