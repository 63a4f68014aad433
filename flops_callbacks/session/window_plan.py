"""The profile window's layout: its step kinds, its constants, and every decision that shapes it, agreed
by every rank.

A first window is its fixed head (:func:`head`: the counting step, the module-timing steps, and with
several ranks the communication steps under ``torch.profiler``; under ``comm_steps="auto"`` more of them
while their exposed times disagree: :meth:`WindowPlan.comm_settled`), the check (a step counted again so that
work depending on the batch's content shows), then clean steps until ``clean_steps`` are timed
(``"auto"``: until their median is known). A batch shape the flops table cannot give is counted off the
clock where a fake count runs, so its step stays clean; where none runs, its step is a shape-counting one
(at most :data:`MAX_SHAPE_COUNTS`, then skipped). Once the table finds flops that depend on the content,
every other step is counted. A re-profile window (``profile_every``) reuses the first one's counts, check
and module tree: a lead-in step (its end starts the first clean step's wall), then clean steps (between
windows the meter's audits count known shapes again). To add a kind: a :class:`Kind` member, and its
place in :func:`head` or in :meth:`WindowPlan.batch_kind`.

Every decision is taken here from every rank's :class:`Wish`, at points all ranks reach in lock step
(each micro-batch of a step whose batches decide its kind, and each window step's end), so every rank
runs the same kind of step on the same global step and the window ends on the same step everywhere.
Why a vote at the micro-batch and not only at the step's end: a step's kind depends on its batches'
shapes, which no rank knows before they arrive. Why the check is a step of its own rather than the
table's wish: the table says what it knows; where the window spends a step is the layout's to say.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Literal, NamedTuple

from flops_callbacks.communication.figures import ranks_mean
from flops_callbacks.options import Options
from flops_callbacks.session.ranks import RankFailure, Ranks
from flops_callbacks.session.vote_times import VoteMarks, rank_waits, vote_seconds
from flops_callbacks.timing.clock import Clock, CpuClock

__all__ = [
    "CLEAN_MAX",
    "CLEAN_MIN",
    "COMM_MAX",
    "COMM_MIN",
    "MAX_SHAPE_COUNTS",
    "MODULE_TIMING_STEPS",
    "Decision",
    "Kind",
    "WindowPlan",
    "VOTES_MAX",
    "Wish",
    "before_clean",
    "head",
    "median_interval",
    "median_known",
    "resumed_window",
]

# clean_steps="auto": the fewest clean steps a run must leave it (fewer is told at the run's start; its median
# needs 5, median_known), and the most it runs
CLEAN_MIN, CLEAN_MAX = 3, 20
# the tree is one of theirs (session.builder: on a CPU the one nearest the clean steps' own forward, else
# the median by the model's time): a pause in one drops out; of batches of other shapes than the counting
# step's, the one of the median batch size (session.rank_part)
MODULE_TIMING_STEPS = 3
# The communication figures are the median step's (by exposed time, the ranks' mean), of three steps that
# agree within 10%, else of up to 25: on a GPU NCCL's steps agree and three suffice; on a CPU gloo's
# threads share the cores with the compute and the steps scatter (single steps 0.5-3x the truth, the
# 10-90% of a 2.7 ms all-reduce 1.1-5.5 ms: benchmarks/README.md, "Exposed communication"): three
# agreed within 25% by chance in 14 of 23 runs of three in a row, within 10% in 4; a median of nine
# lands within [0.75, 1.33] of a 100-step truth in 63% of windows, of 25 in 80%.
COMM_MIN, COMM_MAX = 3, 25
COMM_AGREE = 0.10  # the steps agree when each exposed time is within +-10% of their median...
COMM_FLOOR = 0.01  # ...or within 1% of the step's time of it (a few microseconds of a long step)
MAX_SHAPE_COUNTS = 8  # shape-counting steps a window may add (where no fake count runs)
CONFIDENCE = 0.90  # of the median's interval for clean_steps="auto"


class Kind(str, Enum):
    """The job of a window step (its value: the name the report and JSON say)."""

    COUNTING = "counting"  # every op counted: the profile's flops and tree
    MODULE_TIMING = "module timing"  # module calls marked: the tree's latencies
    CHECK = "check"  # counted again: the table's flops for its shapes checked against the content's
    CLEAN = "clean"  # timed: the window's latencies and rates
    SHAPE_COUNTING = "shape counting"  # counted, not timed: its shapes' flops had no other source
    SKIPPED = "skipped"  # timed, but its shapes' flops are unknown (no shape counting left)
    COMPILED = "compiled"  # a clean step torch.compile compiled in (dynamo's frames): timed, left out
    LEAD_IN = "lead-in"  # a re-profile window's first: its end is where the first clean step's wall starts
    COMMUNICATION = "communication"  # under torch.profiler: where the step's time goes between ranks

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def counted(self) -> bool:
        """Whether the counting engine runs on it (its time is no figure's)."""
        return self in (Kind.COUNTING, Kind.CHECK, Kind.SHAPE_COUNTING)


def head(reprofile: bool = False, comm: int = 0) -> tuple[Kind, ...]:
    """The kinds of the window's first steps, given by their place (``comm``: its communication steps
    by place, :attr:`WindowPlan.comm_steps`)."""
    if reprofile:
        return (Kind.LEAD_IN,)
    timing = tuple(Kind.MODULE_TIMING for _ in range(MODULE_TIMING_STEPS))
    return (Kind.COUNTING, *timing, *((Kind.COMMUNICATION,) * comm))


def before_clean(reprofile: bool = False, comm: int = 0) -> int:
    """Window steps before the first clean one when every shape is known or counted off the clock."""
    return len(head(reprofile, comm)) + (0 if reprofile else 1)  # the check


FAILED, RAISED = 1, 2  # why a rank wishes the window dropped: its own work failed; a step of it raised
# the votes' seconds a wish holds, at most: every rank's row has one length (gloo aborts the process where
# two ranks' rows differ, as when one rank casts a vote another rank skipped); more are summed into the last
VOTES_MAX = 8


class Wish(NamedTuple):
    """What one rank wants at a vote."""

    drop: int = 0  # drop the window (FAILED or RAISED: why); 0: not
    new_shape: bool = False  # its micro-batch's flops are unknown and no fake count can give them
    checkable: bool = False  # a count of its micro-batch can check the table (known, or fake-countable)
    content: bool = False  # its table found flops that depend on the batch's content
    done: bool = False  # the window has what it needs here (``clean_steps="auto"``'s median)
    comm: tuple[float, float] | None = None  # its communication step's (exposed, span) seconds, if read
    # at a communication step's end, its seconds in each vote in the step's wall (every rank took part in
    # the same votes, so every rank's row has one length); the plan fills them in (:meth:`WindowPlan.vote`)
    votes: tuple[float, ...] = ()

    def numbers(self) -> tuple[float, ...]:
        """As the ranks gather it (:meth:`~flops_callbacks.session.ranks.Ranks.gather`), one length on
        every rank: each flag 0 or 1, the communication step's two seconds (NaN for none), how many votes
        follow, and their seconds (at most :data:`VOTES_MAX`, NaN after them)."""
        comm = self.comm if self.comm is not None else (math.nan, math.nan)
        flags = (self.drop, self.new_shape, self.checkable, self.content, self.done)
        head, rest = self.votes[: VOTES_MAX - 1], self.votes[VOTES_MAX - 1 :]
        votes = (*head, sum(rest)) if rest else head
        padding = (math.nan,) * (VOTES_MAX - len(votes))
        return (*(float(f) for f in flags), *comm, float(len(votes)), *votes, *padding)

    @classmethod
    def of(cls, numbers: Sequence[float]) -> Wish:
        """The wish :meth:`numbers` gave."""
        drop, new_shape, checkable, content, done, exposed, span, count, *votes = numbers
        comm = None if math.isnan(exposed) else (exposed, span)
        flags = (int(drop), new_shape != 0, checkable != 0, content != 0, done != 0)
        return cls(*flags, comm, tuple(votes[: int(count)]))


class Decision(NamedTuple):
    """What every rank does after a vote; ``why`` says a drop's cause in words ("" for none)."""

    drop: bool
    new_shape: bool  # some rank's micro-batch must be counted on this step
    checkable: bool  # some rank's micro-batch can check the table
    content: bool  # some rank's table found content-dependent flops
    done: bool
    why: str = ""
    raised: bool = False  # dropped because a step of a rank raised (not the profiler's own failure)

    @classmethod
    def dropped(cls, why: str, raised: bool = False) -> Decision:
        return cls(True, False, False, False, False, why, raised)


def resumed_window(options: Options, global_step: int) -> int | None:
    """Where a run resumed at ``global_step`` past ``profile_step`` has its first window with
    ``profile_every``: the grid's first step at or after it (None: not resumed past it, or no grid)."""
    every, first = options.profile_every, options.profile_step
    if every is None or global_step <= first:
        return None
    return first + every * -(-(global_step - first) // every)


class WindowPlan:
    """The window's agreed state: its steps' kinds so far, whether it is open, and whether this rank
    failed in it (then it wishes a drop at the next vote)."""

    def __init__(self, options: Options, ranks: Ranks) -> None:
        self.options = options
        self.ranks = ranks
        self.kinds: list[Kind | None] = []  # the agreed kind of each window step (None: not yet)
        self.open = False
        self.failed = 0  # this rank wishes a drop (FAILED or RAISED: why)
        self.reprofile = False  # the open window reuses the previous one's profile (module doc)
        self.next_window: int | None = None  # where the next re-profile window starts (None: none)
        self.profiled = False  # a window of this run ended: the next ones reuse its profile
        self.owed: Literal["", "next step", "step end"] = ""  # the end vote a raise left owed (raised)
        self.run_end: tuple[int | None, int] = (None, 1)  # the run's max_steps (if known), steps per batch
        self._lined_up = 0  # the window step whose ranks last lined up (lines_up)
        self.comm_seen: list[tuple[float, float]] = []  # each read communication step's, the ranks' mean
        self.clock: Clock = CpuClock()  # the window steps' clock, on which the votes are marked
        # each window step's votes in its wall (:meth:`vote`; :func:`vote_seconds`), and the last end vote
        self.marks: list[list[VoteMarks]] = []
        self._end_vote: VoteMarks | None = None
        self.own_work: Callable[[], float] = float  # this rank's own seconds since its last vote (float: 0)

    def reset(self, run: bool = False) -> None:
        """The window ended (or was dropped); with ``run`` no other window starts in this run."""
        self.kinds, self.open, self.failed, self.reprofile, self._lined_up = [], False, 0, False, 0
        self.comm_seen, self.marks, self._end_vote, self.clock, self.owed = [], [], None, CpuClock(), ""
        if run:
            self.next_window, self.profiled = None, False

    def new_run(self, global_step: int, max_steps: int | None = None, steps_per_batch: int = 1) -> None:
        """A run of ``max_steps`` (if known) starts at ``global_step``: no window yet. Resumed past
        ``profile_step`` with ``profile_every``, its first window is a whole one at the grid's next step."""
        self.reset(run=True)
        self.next_window = resumed_window(self.options, global_step)
        self.run_end = (max_steps, steps_per_batch)

    def drop(self, again: bool) -> int | None:
        """The window is dropped: no other starts in this run, unless ``again`` (a step raised in it) and
        it is a re-profile window: then the next starts on the grid. Returns that step (None: none)."""
        start, every, reprofile = self.next_window, self.options.profile_every, self.reprofile
        self.reset(run=True)
        if again and reprofile and start is not None and every is not None:
            self.next_window, self.profiled = start + every, True
        return self.next_window

    def ended(self, last_step: int) -> None:
        """The window whose last step started at ``last_step`` ended (agreed): the next one's start."""
        every, first = self.options.profile_every, self.options.profile_step
        self.next_window = None if every is None else first + every * ((last_step - first) // every + 1)
        self.profiled = True
        clean = CLEAN_MIN if self.options.clean_steps == "auto" else self.options.clean_steps
        (max_steps, per), start = self.run_end, self.next_window
        if start is not None:  # the first step it can start at: the run's optimizer steps go by ``per``
            start = last_step + -(-(start - last_step) // per) * per
        last = (
            None if start is None else start + (before_clean(True) + clean - 1) * per
        )  # its last clean step
        if last is not None and max_steps is not None and max_steps <= last:
            self.next_window = None  # a window the run would cut short is not started

    def due(self, global_step: int) -> bool:
        """Whether a window of the grid starts at this step (the same on every rank: module doc): a
        re-profile window, or a resumed run's first."""
        self.reprofile = self.starts_at(global_step) and self.profiled
        return self.starts_at(global_step)

    def starts_at(self, global_step: int) -> bool:
        """Whether the step numbered ``global_step`` would start a re-profile window (nothing changes)."""
        return self.next_window is not None and global_step >= self.next_window

    @property
    def before_clean(self) -> int:
        more = max(self.kinds.count(Kind.COMMUNICATION) - self.comm_steps, 0)  # "auto"'s, past its head
        return before_clean(self.reprofile, self.comm_steps) + more

    @property
    def comm_steps(self) -> int:
        """The communication steps the window's head holds: with several ranks, ``comm_steps`` (``"auto"``:
        :data:`COMM_MIN`); a re-profile window has none."""
        wanted = self.options.comm_steps
        if not self.ranks.several or self.reprofile:
            return 0
        return COMM_MIN if wanted == "auto" else wanted

    def comm_settled(self) -> bool:
        """Under ``comm_steps="auto"``, whether the communication steps so far are enough: :data:`COMM_MAX`
        of them, or at least :data:`COMM_MIN` read ones whose exposed times (the ranks' mean) agree
        within :data:`COMM_AGREE` of their median, or :data:`COMM_FLOOR` of the step's time. Every rank
        answers the same: the figures are the votes' (:meth:`vote`)."""
        if self.options.comm_steps != "auto" or self.kinds.count(Kind.COMMUNICATION) >= COMM_MAX:
            return True
        if len(self.comm_seen) < COMM_MIN:
            return False
        exposed = [e for e, _ in self.comm_seen]
        median = statistics.median(exposed)
        near = max(COMM_AGREE * median, COMM_FLOOR * statistics.median(s for _, s in self.comm_seen))
        return all(abs(e - median) <= near for e in exposed)

    def lines_up(self) -> bool:
        """Whether the ranks vote before this micro-batch: a communication step's first (once a step),
        so that its split starts with every rank at one point, after each read its batch."""
        if self.kind != Kind.COMMUNICATION or self._lined_up == len(self.kinds) or self.owed == "step end":
            return False
        self._lined_up = len(self.kinds)
        return True

    def start_step(self) -> Kind | None:
        """A window step starts: its kind by its place (:func:`head`), another communication step while
        they disagree, or None when its batches decide."""
        self.open = True
        fixed = head(self.reprofile, self.comm_steps)
        kind = fixed[len(self.kinds)] if len(self.kinds) < len(fixed) else None
        if kind is None and self.kind == Kind.COMMUNICATION and not self.comm_settled():
            kind = Kind.COMMUNICATION
        self.kinds.append(kind)
        self.marks.append([self._end_vote] if self._end_vote is not None else [])
        self._end_vote = None
        return kind

    @property
    def kind(self) -> Kind | None:
        return self.kinds[-1] if self.kinds else None

    @property
    def checked(self) -> bool:
        """Whether this window has had its check step (a re-profile window has the first one's)."""
        return self.reprofile or Kind.CHECK in self.kinds

    @property
    def batch_decides(self) -> bool:
        """Whether the current step's micro-batches vote on its kind (every rank answers the same)."""
        return self.open and bool(self.kinds) and self.kind in (None, Kind.CLEAN) and self.owed != "step end"

    def raised(self, at_end: bool = False) -> None:
        """A window step's user code raised and the loop may go on: this rank wishes a drop, and owes the
        step's end vote, in which the other ranks wait: at the next step's start (:meth:`owed_vote`), or
        (``at_end``: the step goes on here, its next block giving the step's collectives the others wait
        in) at its end, casting no other vote till then."""
        if self.open:
            self.failed, self.owed = self.failed or RAISED, "step end" if at_end else "next step"

    def owed_vote(self) -> Decision | None:
        """At the next step's start, before its own votes: the end vote the step that raised did not take
        (the other ranks' end vote, or their first vote of the next step; a drop), or None."""
        if self.owed != "next step":
            return None
        return self.vote(Wish(drop=self.failed), ended=True)

    def vote(self, wish: Wish, ended: bool = False) -> Decision:
        """Every rank's wishes, agreed: a drop if any rank wants one (or a rank does not answer), a
        count, a check or the content's rhythm if any rank's batch asks, the end only when every rank
        is done. ``ended``: the vote at a window step's end (else a micro-batch's); it is marked on the
        steps' clock (:attr:`marks`)."""
        clock, self.owed = self.clock, "" if ended else self.owed  # an end vote cast is owed no more
        if ended and self.kind == Kind.COMMUNICATION and self.marks:  # its figures count the rank's waits
            wish = wish._replace(votes=tuple(v.seconds + v.own for v in vote_seconds(self.marks[-1:])[0]))
        start = clock.mark()
        try:
            wishes = [Wish.of(numbers) for numbers in self.ranks.gather(wish.numbers())]
        except RankFailure as failure:
            return Decision.dropped(f"the ranks' vote failed ({failure})")
        self._marked(clock, start, clock.mark(), ended)
        failed = [(rank, w.drop) for rank, w in enumerate(wishes) if w.drop]
        if failed:
            rank, code = failed[0]
            where = f" on rank {rank}" if self.ranks.several else ""
            if code == RAISED:
                return Decision.dropped(
                    f"a window step raised{where} (the exception your loop went on after)", raised=True
                )
            return Decision.dropped(f"rank {rank}'s profiler failed" if where else "the profiler failed")
        # a communication step's figures as the window's end gives them: each rank's with its wait for a
        # slower rank in the votes before the step (session.builder), so that the steps judged to agree
        # are the steps reported
        waits = rank_waits([w.votes for w in wishes])
        read = [w.comm for w in wishes]
        exposed = ranks_mean([r[0] + wait if r else None for r, wait in zip(read, waits, strict=True)])
        span = ranks_mean([r[1] + wait if r else None for r, wait in zip(read, waits, strict=True)])
        if exposed is not None and span is not None:  # a communication step's end: the same on every rank
            self.comm_seen.append((exposed, span))
        return Decision(
            False,
            any(w.new_shape for w in wishes),
            any(w.checkable for w in wishes),
            any(w.content for w in wishes),
            all(w.done for w in wishes),
        )

    def _marked(self, clock: Clock, start: Any, end: Any, ended: bool) -> None:
        """A vote's marks, kept in the step whose wall holds it: a step's end vote lies in the next step's,
        before its forward, as does the step's first micro-batch vote; a later micro-batch's lies between
        its micro-batches (in its data time too: the phases stop before it)."""
        marks = VoteMarks(clock, start, end, self.own_work())
        if ended:
            self._end_vote = marks
        elif self.marks:
            self.marks[-1].append(marks)

    def batch_kind(self, decision: Decision) -> Kind:
        """The current step's agreed kind after a micro-batch's vote. At its first micro-batch: the check
        while a first window has none and a batch can check; a shape count where a batch needs one (skipped
        once none is left); every other step counted once the content decides the flops; else clean. A
        later micro-batch of a clean step turns it into a shape count where a batch needs one."""
        before = self.kinds[:-1]
        left = sum(k == Kind.SHAPE_COUNTING for k in before) < MAX_SHAPE_COUNTS
        kind: Kind | None = self.kind
        if kind is None:
            counted_last = bool(before) and before[-1] is not None and before[-1].counted
            if decision.checkable and not self.checked:
                kind = Kind.CHECK
            elif decision.new_shape:
                kind = Kind.SHAPE_COUNTING if left else Kind.SKIPPED
            elif decision.content and not counted_last and left:
                kind = Kind.SHAPE_COUNTING
            else:
                kind = Kind.CLEAN
        elif decision.new_shape:
            kind = Kind.SHAPE_COUNTING if left else Kind.SKIPPED
        self.kinds[-1] = kind
        return kind or Kind.CLEAN

    def wants_iters(self, clean_steps: int) -> bool:
        """Whether this rank's wish at a step's end reads its finished clean steps' iter seconds:
        only under ``clean_steps="auto"`` with enough of them for a median."""
        return self.options.clean_steps == "auto" and clean_steps >= CLEAN_MIN

    def done_here(self, clean_iters: Callable[[], list[float]]) -> bool:
        """This rank's wish at a step's end where :meth:`wants_iters`: ``"auto"``'s median is known from
        its finished clean steps (``clean_iters``: their iter seconds). An int ``clean_steps`` ends the
        window by :meth:`capped`."""
        if len(self.kinds) < self.before_clean:
            return False
        iters = clean_iters()
        return len(iters) >= CLEAN_MIN and median_known(iters)

    def capped(self) -> bool:
        """Whether the window has grown as long as it may (agreed kinds: the same on every rank)."""
        wanted = self.options.clean_steps
        most = CLEAN_MAX if wanted == "auto" else wanted
        clean = sum(k == Kind.CLEAN for k in self.kinds)
        after = len(self.kinds) - self.before_clean
        return len(self.kinds) >= self.before_clean and (
            clean >= most or after >= most + 2 * MAX_SHAPE_COUNTS
        )


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The distribution-free interval for the median from order statistics: ``(x_(k), x_(n+1-k))`` with
    the largest ``k`` such that ``P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2``; it holds the
    true median with probability at least ``confidence`` whatever the distribution. None when ``n`` is
    too small for any such interval (below 5 steps at 90%)."""
    n = len(values)
    k = 0
    while k + 1 <= n // 2 and _binomial_cdf(k, n) <= (1 - confidence) / 2:
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def median_known(values: list[float], tolerance: float = 0.03) -> bool:
    """Whether the median of ``values`` is known within +-``tolerance`` (its interval lies inside): the
    ``"auto"`` window's stop. Why not ``statistics.quantiles`` or scipy: two order statistics and the
    binomial distribution are a few lines, and the core depends on torch only."""
    interval = median_interval(values)
    if interval is None:
        return False
    median = statistics.median(values)
    return interval[0] >= median * (1 - tolerance) and interval[1] <= median * (1 + tolerance)
