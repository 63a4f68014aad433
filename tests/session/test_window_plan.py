"""The window's layout as pure logic: each step's kind from its place and its batches' wishes, the check,
shape counts, ``clean_steps="auto"``'s stop, re-profile windows and the ranks' vote, driven as the step
session drives the plan, with no model and no clock."""

from __future__ import annotations

from collections.abc import Callable

from flops_callbacks.options import Options
from flops_callbacks.session.vote_times import vote_seconds
from flops_callbacks.session.window_plan import (
    CLEAN_MAX,
    CLEAN_MIN,
    MAX_SHAPE_COUNTS,
    MODULE_TIMING_STEPS,
    Kind,
    WindowPlan,
    Wish,
    before_clean,
    head,
)
from tests.support import VoteClock

P, M, K, C = Kind.COUNTING, Kind.MODULE_TIMING, Kind.CHECK, Kind.CLEAN
S, X, L = Kind.SHAPE_COUNTING, Kind.SKIPPED, Kind.LEAD_IN
KNOWN = Wish(checkable=True)  # a batch of a shape the table gives (or one a fake count gives)
NEW = Wish(new_shape=True)  # a batch of a new shape no fake count can give
# what a rank wishes at a vote: (global step, "batch" or "end", the plan) -> its wish
Behaviour = Callable[[int, str, WindowPlan], Wish]


class Vote:
    """The vote's current point: every rank's plan reaches it in lock step."""

    step, phase = 0, "batch"


class FakeRanks:
    """The ranks' exchange: every rank's wish at this point, from each rank's behaviour (this rank's own
    wish as it made it)."""

    def __init__(self, rank: int, behaviours: list[Behaviour], vote: Vote) -> None:
        self.rank, self.behaviours, self.vote = rank, behaviours, vote

    @property
    def several(self) -> bool:
        return len(self.behaviours) > 1

    def gather(self, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        wishes = [b(self.vote.step, self.vote.phase, self.plan).numbers() for b in self.behaviours]
        wishes[self.rank] = mine
        return wishes

    plan: WindowPlan


def plan_of(options: Options, behaviours: list[Behaviour] | None = None, rank: int = 0) -> WindowPlan:
    behaviours = behaviours or [lambda step, phase, plan: KNOWN]
    ranks = FakeRanks(rank, behaviours, Vote())
    plan = WindowPlan(options, ranks)  # type: ignore[arg-type]
    ranks.plan = plan
    return plan


def window(
    plan: WindowPlan, first: int, iters: Callable[[int], float] = lambda n: 1.0, last: int = 200
) -> dict[int, Kind | None]:
    """Each window step's kind, the plan driven as the step session drives it from ``first`` on:
    ``iters(n)``: the iter seconds of the n-th clean step."""
    ranks: FakeRanks = plan.ranks  # type: ignore[assignment]
    behaviour = ranks.behaviours[ranks.rank]
    kinds: dict[int, Kind | None] = {}
    for step in range(first, last):
        if not plan.open and step < plan.options.profile_step and not plan.due(step):
            continue
        if not plan.open and kinds and not plan.due(step):
            continue
        ranks.vote.step = step
        plan.start_step()
        if plan.batch_decides:
            ranks.vote.phase = "batch"
            plan.batch_kind(plan.vote(behaviour(step, "batch", plan)))
        kinds[step] = plan.kind
        clean = sum(k == Kind.CLEAN for k in plan.kinds)
        timed = [iters(n) for n in range(clean)]
        done = plan.wants_iters(clean) and plan.done_here(timed.copy)
        done = done or behaviour(step, "end", plan).done
        ranks.vote.phase = "end"
        decision = plan.vote(Wish(done=done))
        if decision.done or plan.capped():
            plan.reset()
            plan.ended(step)
            if plan.next_window is None:
                break
    return kinds


def batches(wishes: dict[int, Wish]) -> Behaviour:
    """A rank whose batch at a step wishes ``wishes[step]`` (KNOWN elsewhere), done when the plan says."""

    def behaviour(step: int, phase: str, plan: WindowPlan) -> Wish:
        return wishes.get(step, KNOWN) if phase == "batch" else Wish()

    return behaviour


def test_the_head_is_the_counting_step_then_the_module_timing_steps() -> None:
    assert head() == (P,) + (M,) * MODULE_TIMING_STEPS and head(reprofile=True) == (L,)
    assert before_clean() == 1 + MODULE_TIMING_STEPS + 1 and before_clean(reprofile=True) == 1
    assert [str(k) for k in (P, M, K, C, S, X, L)] == [
        "counting", "module timing", "check", "clean", "shape counting", "skipped", "lead-in",
    ]  # fmt: skip
    assert [k.counted for k in (P, M, K, C, S, X, L)] == [True, False, True, False, True, False, False]


def test_profile_step_10_with_5_clean_steps_lays_out_steps_10_to_19() -> None:
    kinds = window(plan_of(Options(profile_step=10, clean_steps=5)), 0)
    assert kinds == {10: P, 11: M, 12: M, 13: M, 14: K, 15: C, 16: C, 17: C, 18: C, 19: C}


def test_a_new_shape_no_fake_count_gives_adds_a_count_and_the_check_waits_for_a_known_shape() -> None:
    plan = plan_of(Options(profile_step=10, clean_steps=5), [batches({14: NEW, 17: NEW})])
    kinds = window(plan, 10)
    assert kinds == {10: P, 11: M, 12: M, 13: M, 14: S, 15: K, 16: C, 17: S, 18: C, 19: C, 20: C, 21: C}


def test_a_new_shape_a_fake_count_gives_stays_clean() -> None:
    # a fake count gives it: no count wished, and it can check the table (counted at once on the check)
    fake = Wish(checkable=True)
    plan = plan_of(Options(profile_step=10, clean_steps=5), [batches({14: fake, 16: fake, 17: fake})])
    assert window(plan, 10) == {10: P, 11: M, 12: M, 13: M, 14: K, 15: C, 16: C, 17: C, 18: C, 19: C}


def test_a_later_micro_batch_of_a_new_shape_turns_a_clean_step_into_a_count() -> None:
    plan = plan_of(Options(profile_step=0, clean_steps=2))
    for _ in range(before_clean()):
        plan.start_step()
        if plan.batch_decides:
            plan.batch_kind(plan.vote(KNOWN))
    plan.start_step()
    assert plan.batch_kind(plan.vote(KNOWN)) == C  # its first micro-batch
    assert plan.batch_kind(plan.vote(KNOWN)) == C
    assert plan.batch_kind(plan.vote(NEW)) == S  # a later one


def test_shape_counts_stop_at_their_cap_then_steps_are_skipped_and_the_window_is_capped() -> None:
    plan = plan_of(Options(profile_step=0, clean_steps=3), [lambda step, phase, plan: NEW])
    kinds = list(window(plan, 0).values())
    assert kinds[: before_clean() - 1] == list(head())
    after = kinds[before_clean() - 1 :]
    assert after == [S] * MAX_SHAPE_COUNTS + [X] * (len(after) - MAX_SHAPE_COUNTS)
    assert len(kinds) == before_clean() + 3 + 2 * MAX_SHAPE_COUNTS  # clean_steps + twice the counts


def test_content_dependent_flops_count_every_other_step() -> None:
    content = Wish(checkable=True, content=True)
    plan = plan_of(Options(profile_step=0, clean_steps=3), [lambda step, phase, plan: content])
    assert list(window(plan, 0).values()) == [P, M, M, M, K, C, S, C, S, C]


def test_auto_stops_when_the_median_is_known_and_at_most_at_clean_max() -> None:
    plan = plan_of(Options(profile_step=0, clean_steps="auto"))
    kinds = list(window(plan, 0).values())  # every step 1 s: known at the 5 steps a 90% interval needs
    assert kinds == [P, M, M, M, K] + [C] * 5 and CLEAN_MIN < 5
    plan = plan_of(Options(profile_step=0, clean_steps="auto"))
    kinds = list(window(plan, 0, iters=lambda n: 1.0 + 0.5 * (n % 2)).values())  # never within 3%
    assert kinds == [P, M, M, M, K] + [C] * CLEAN_MAX


def test_re_profile_windows_are_a_lead_in_and_clean_steps_on_the_grid() -> None:
    # the first window's counts, check and module tree are reused; a new shape is still counted
    plan = plan_of(Options(profile_step=10, clean_steps=2, profile_every=15), [batches({41: NEW})])
    kinds = window(plan, 0, last=50)
    first = {10: P, 11: M, 12: M, 13: M, 14: K, 15: C, 16: C}
    assert kinds == {**first, 25: L, 26: C, 27: C, 40: L, 41: S, 42: C, 43: C}
    plan = plan_of(Options(profile_step=10, clean_steps=2, profile_every=5))
    assert list(window(plan, 0, last=30))[:10] == [10, 11, 12, 13, 14, 15, 16, 20, 21, 22]


def test_every_ranks_vote_ends_the_window_on_the_same_step_with_the_same_kinds() -> None:
    def rank(new_at: int, done_from: int) -> Behaviour:
        def behaviour(step: int, phase: str, plan: WindowPlan) -> Wish:
            if phase == "end":
                return Wish(done=step >= done_from)
            return NEW if step == new_at else KNOWN

        return behaviour

    behaviours = [rank(16, 17), rank(18, 20)]
    laid_out = []
    for r in range(2):
        # the communication step's place is tested in test_figures.py: this test is the vote's
        plan = plan_of(Options(profile_step=10, clean_steps="auto", comm_steps=0), behaviours, rank=r)
        laid_out.append(window(plan, 10))
    assert laid_out[0] == laid_out[1]
    assert laid_out[0] == {10: P, 11: M, 12: M, 13: M, 14: K, 15: C, 16: S, 17: C, 18: S, 19: C, 20: C}


def test_a_rank_that_failed_drops_the_window_on_every_rank() -> None:
    behaviours: list[Behaviour] = [batches({}), lambda step, phase, plan: Wish(drop=step == 12)]
    plan = plan_of(Options(profile_step=10, clean_steps=2), behaviours)
    plan.start_step()
    assert not plan.vote(Wish()).drop
    plan.ranks.vote.step = 12  # type: ignore[attr-defined]
    decision = plan.vote(Wish())
    assert decision.drop and decision.why == "rank 1's profiler failed"


class WaitingRanks(VoteClock):
    """One rank among two whose exchanges take the seconds ``waits`` lists, one per vote, on a clock of its
    own (:class:`~tests.support.VoteClock`)."""

    several, world = True, 2

    def gather(self, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        self.vote()
        return [mine, Wish().numbers()]


def test_each_steps_votes_are_those_in_its_wall_on_the_steps_clock() -> None:
    """The counting step and the module-timing steps have no micro-batch vote; a step's wall holds the
    previous step's end vote and its own micro-batches' votes (before its forward, or between its
    micro-batches: in its data time either way)."""
    ranks = WaitingRanks([0.5, 0.25, 0.5, 0.125, 1.0, 2.0, 0.25, 4.0, 8.0])
    plan = WindowPlan(Options(profile_step=10, clean_steps=2, comm_steps=0), ranks)  # type: ignore[arg-type]
    plan.clock = ranks  # type: ignore[assignment]
    for _ in range(3):  # counting, module timing, module timing: their end votes
        plan.start_step()
        plan.vote(
            Wish(),
            ended=True,
        )  # 0.5, 0.25, 0.5
    plan.start_step()  # the last module-timing step
    plan.vote(
        Wish(),
        ended=True,
    )  # 0.125
    plan.start_step()  # the check: its first micro-batch's vote
    plan.batch_kind(
        plan.vote(
            KNOWN,
        )
    )  # 1.0
    plan.vote(
        Wish(),
        ended=True,
    )  # 2.0
    plan.start_step()  # a clean step: two micro-batches
    plan.batch_kind(
        plan.vote(
            KNOWN,
        )
    )  # 0.25
    plan.batch_kind(
        plan.vote(
            KNOWN,
        )
    )  # 4.0: between its micro-batches
    plan.vote(
        Wish(),
        ended=True,
    )  # 8.0
    assert plan.kinds == [P, M, M, M, K, C]
    seconds = [tuple(v.seconds for v in step) for step in vote_seconds(plan.marks)]
    assert seconds == [(), (0.5,), (0.25,), (0.5,), (0.125, 1.0), (2.0, 0.25, 4.0)]
    plan.reset()
    assert vote_seconds(plan.marks) == []


def test_a_wish_is_gathered_as_numbers_and_read_back_as_it_was() -> None:
    """Every flag, the communication step's two seconds and its votes survive the float64 row the ranks
    gather."""
    for wish in (
        Wish(),
        Wish(True, False, True, False, True, (0.25, 1.5)),
        Wish(comm=(0.0, 0.0)),
        Wish(comm=(0.25, 1.5), votes=(0.001, 0.03)),  # a communication step's end, with its votes
        NEW,
        KNOWN,
    ):
        assert Wish.of(wish.numbers()) == wish
