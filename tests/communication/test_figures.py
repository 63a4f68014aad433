"""The communication steps' place in the window and their figures for the job, as pure logic."""

from __future__ import annotations

import warnings as warnings_module

import pytest

from flops_callbacks.communication.breakdown import Collective, CommBreakdown, TimeSplit
from flops_callbacks.communication.figures import comm_figures, comm_means, median_comm, ranks_mean
from flops_callbacks.communication.report import (
    _split_text,
    beyond_compute,
    comm_data,
    comm_from_data,
    waited_words,
)
from flops_callbacks.options import Options
from flops_callbacks.session.ranks import Ranks
from flops_callbacks.session.run_plan import RunPlan
from flops_callbacks.session.window_plan import COMM_MAX, COMM_MIN, Kind, WindowPlan, Wish, before_clean
from tests.support import VoteClock

MT, COMM = Kind.MODULE_TIMING, Kind.COMMUNICATION


def kinds(world: int, **options: object) -> tuple[list[str | None], int]:
    """The kinds of a window's first steps by their place, and its steps before the first clean one."""
    ranks = Ranks()
    ranks.world = world  # only start_step is called: no collective runs
    plan = WindowPlan(Options(**options), ranks)  # type: ignore[arg-type]
    return [plan.start_step() for _ in range(8)], plan.before_clean


def test_one_process_has_no_communication_step_and_the_layout_it_had() -> None:
    assert kinds(1) == ([Kind.COUNTING, MT, MT, MT, None, None, None, None], before_clean())


MS = 1e-3
SPAN = 20 * MS  # each communication step's time


class TwoRanks(Ranks):
    """Rank 0 of two; at each communication step's end the other rank tells ``theirs[i]`` (exposed ms,
    None: its trace unread)."""

    def __init__(self, theirs: list[float | None]) -> None:
        super().__init__()
        self.world, self.theirs, self.ended = 2, theirs, 0
        self.plan: WindowPlan | None = None

    def gather(self, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        if self.plan is None or self.plan.kind != COMM:
            return [mine, Wish().numbers()]
        theirs = self.theirs[self.ended] if self.ended < len(self.theirs) else None
        self.ended += 1
        return [mine, Wish(comm=None if theirs is None else (theirs * MS, SPAN)).numbers()]


def comm_window(
    mine: list[float | None], theirs: list[float | None] | None = None, **options: object
) -> list[Kind | None]:
    """The kinds of a two-rank window's steps, as the session drives the plan: this rank's communication
    steps read ``mine[i]`` ms of exposed time (None: unread), the other rank's ``theirs[i]`` (as mine
    when not given); every step's end is a vote."""
    ranks = TwoRanks(list(mine if theirs is None else theirs))
    plan = ranks.plan = WindowPlan(Options(**options), ranks)  # type: ignore[arg-type]
    seen = 0
    for _ in range(40):
        kind = plan.start_step()
        comm = None
        if kind == COMM:
            exposed, seen = mine[seen] if seen < len(mine) else None, seen + 1
            comm = None if exposed is None else (exposed * MS, SPAN)
        plan.vote(Wish(comm=comm))
        if kind is None:
            break
    return plan.kinds


HEAD = [Kind.COUNTING, MT, MT, MT]


def test_several_ranks_time_communication_on_three_steps_when_their_exposed_times_agree() -> None:
    # 3.0, 3.25 and 2.75 ms: each within 10% of their median
    assert comm_window([3.0, 3.25, 2.75]) == [*HEAD, COMM, COMM, COMM, None]
    # 3.0, 3.5 and 2.5 ms: 17% apart, as three steps of a loaded CPU's scatter agree by chance: on to 25
    assert comm_window([3.0, 3.5, 2.5] + [3.0] * 22) == [*HEAD, *[COMM] * COMM_MAX, None]
    assert COMM_MIN == 3 and kinds(2)[0][: len(HEAD) + COMM_MIN] == [*HEAD, *[COMM] * COMM_MIN]


def test_communication_steps_that_disagree_go_on_to_twenty_five() -> None:
    steps = [3.0, 3.0, 6.0] + [3.0] * 23  # 6 ms is 100% off the median of 3, and stays among the steps
    assert comm_window(steps) == [*HEAD, *[COMM] * COMM_MAX, None] and COMM_MAX == 25


def test_an_int_fixes_the_count_of_communication_steps() -> None:
    assert comm_window([3.0, 9.0, 1.0, 7.0, 3.0], comm_steps=5) == [*HEAD, *[COMM] * 5, None]
    assert comm_window([3.0, 3.0], comm_steps=2) == [*HEAD, COMM, COMM, None]
    assert comm_window([], comm_steps=0) == [*HEAD, None]


def test_the_steps_agree_by_the_ranks_mean_and_a_step_no_rank_read_is_no_figure() -> None:
    # rank 0 reads 3 ms each time; rank 1 reads 5 on the third: the means 3, 3, 4 ms are 33% apart
    theirs = [3.0, 3.0, 5.0] + [3.0] * (COMM_MAX - 3)
    assert comm_window([3.0] * COMM_MAX, theirs) == [*HEAD, *[COMM] * COMM_MAX, None]
    # rank 0 reads 3, 1, 3; rank 1 reads 3, 5, 3: each step's mean is 3 ms
    assert comm_window([3.0, 1.0, 3.0], [3.0, 5.0, 3.0]) == [*HEAD, COMM, COMM, COMM, None]
    # the second step read by neither rank: one more step, so that three agree
    assert comm_window([3.0, None, 3.0, 3.0], [3.0, None, 3.0, 3.0]) == [*HEAD, *[COMM] * 4, None]


class VotingRanks(TwoRanks, VoteClock):
    """:class:`TwoRanks` whose votes take ``waits[i]`` seconds of rank 0's steps' clock at its i-th vote
    (0.1 ms past the list's end: :class:`~tests.support.VoteClock`); the other rank's take 0.1 ms each."""

    def __init__(self, theirs: list[float | None], waits: list[float]) -> None:
        TwoRanks.__init__(self, theirs)
        VoteClock.__init__(self, waits, rest=0.1 * MS)

    def gather(self, mine: tuple[float, ...]) -> list[tuple[float, ...]]:
        self.vote()
        ours, theirs = super().gather(mine)
        votes = (0.1 * MS,) * len(Wish.of(mine).votes)
        return [ours, Wish.of(theirs)._replace(votes=votes).numbers()]


def test_the_steps_agree_by_the_figures_they_report_with_a_ranks_wait_for_a_slower_one() -> None:
    """Both ranks read 3 ms exposed on every communication step, but rank 0 waits 1.5 ms for rank 1 in the
    vote before the third (rank 1's slow optimizer step): the window's end adds that wait to rank 0's
    split of the step (session.builder), so the step reads 3.75 ms, the ranks' mean, 25% off the median,
    and the steps go on as they do for any such step. Judged without the wait, the three steps would
    agree, and the report would show three steps it says agree that do not."""
    waits = [0.1 * MS] * 5 + [1.6 * MS]  # the end votes of the counting, module-timing and 2 comm steps
    ranks = VotingRanks([3.0] * COMM_MAX, waits)
    plan = ranks.plan = WindowPlan(Options(), ranks)  # type: ignore[arg-type]
    plan.clock = ranks  # type: ignore[assignment]
    for _ in range(40):
        kind = plan.start_step()
        plan.vote(Wish(comm=(3 * MS, SPAN) if kind == COMM else None), ended=True)
        if kind is None:
            break
    assert plan.kinds == [*HEAD, *[COMM] * COMM_MAX, None]
    exposed, span = plan.comm_seen[2]
    assert (exposed, span) == pytest.approx((3.75 * MS, SPAN + 0.75 * MS))
    assert plan.comm_seen[:2] == [pytest.approx((3 * MS, SPAN))] * 2
    # the figures the window's end gives that step: rank 0's split with its wait (as the plan judged)
    from flops_callbacks.session.rank_part import vote_waits
    from flops_callbacks.session.window_plan import vote_seconds

    mine = vote_seconds(plan.marks[len(HEAD) : len(HEAD) + 3])
    theirs = [tuple(v._replace(seconds=0.1 * MS) for v in step) for step in mine]
    waited, not_waited = vote_waits([mine, theirs])
    assert waited == pytest.approx([0.0, 0.0, 1.5 * MS]) and not_waited == pytest.approx([0.0] * 3)


def test_exposed_times_of_a_few_microseconds_agree_within_a_hundredth_of_the_step() -> None:
    # 10, 40 and 150 us: far apart from their median, but all within 1% of a 20 ms step (200 us) of it
    assert comm_window([0.01, 0.04, 0.15]) == [*HEAD, COMM, COMM, COMM, None]
    # 300 us is 260 us from the median: beyond it, so the steps go on to 25
    assert comm_window([0.01, 0.04, 0.30] + [0.04] * (COMM_MAX - 3)) == [*HEAD, *[COMM] * COMM_MAX, None]


def clean_after_comm(clean_steps: object) -> tuple[WindowPlan, list[tuple[Kind | None, int, bool, bool]]]:
    """A two-rank window whose communication steps disagree (so run to 25), then its batch-decided
    steps (the check, then clean ones); at each step's end from the communication steps on: (its kind,
    before_clean, capped, done_here with five equal clean iters offered)."""
    ranks = TwoRanks([3.0, 9.0] * 13)  # the ranks' means 3, 6, 3, 6 ms: never within 10%
    plan = ranks.plan = WindowPlan(Options(clean_steps=clean_steps), ranks)  # type: ignore[arg-type]
    seen = []
    for _ in range(40):
        kind = plan.start_step()
        if kind is None:
            plan.batch_kind(plan.vote(Wish(checkable=True)))
        plan.vote(Wish(comm=(3 * MS, SPAN) if kind == COMM else None))
        if plan.kind not in HEAD:
            seen.append((plan.kind, plan.before_clean, plan.capped(), plan.done_here(lambda: [0.01] * 5)))
        if plan.capped():
            break
    return plan, seen


def test_the_steps_after_more_communication_steps_are_counted_from_the_last_of_them() -> None:
    plan, seen = clean_after_comm(clean_steps=2)
    assert plan.kinds == [*HEAD, *[COMM] * COMM_MAX, Kind.CHECK, Kind.CLEAN, Kind.CLEAN]
    # at each communication step's end the window's steps before the clean ones reach past it: no end
    comm = [(b, c, d) for k, b, c, d in seen if k == COMM]
    # 4 head steps, the communication steps so far (three at least), the check
    assert [b for b, _, _ in comm] == [len(HEAD) + max(k, COMM_MIN) + 1 for k in range(1, COMM_MAX + 1)]
    assert [b for b, _, _ in comm][:5] == [8, 8, 8, 9, 10]
    assert not any(c or d for _, c, d in comm)
    # then counted from the last of the 25: capped after the check and two clean steps
    assert [(k, b, c) for k, b, c, _ in seen[COMM_MAX:]] == [
        (Kind.CHECK, len(HEAD) + COMM_MAX + 1, False),
        (Kind.CLEAN, len(HEAD) + COMM_MAX + 1, False),
        (Kind.CLEAN, len(HEAD) + COMM_MAX + 1, True),
    ]


def test_a_re_profile_window_has_no_communication_step_under_auto() -> None:
    ranks = TwoRanks([])  # no communication step runs: the other rank never tells one
    plan = ranks.plan = WindowPlan(Options(profile_step=1, profile_every=20), ranks)
    plan.comm_seen = [(3 * MS, SPAN)]  # a first window's figures: not carried over
    plan.ended(last_step=15)
    plan.reset()
    assert plan.comm_seen == [] and plan.next_window == 21 and plan.due(21) and plan.comm_steps == 0
    assert [plan.start_step() for _ in range(3)] == [Kind.LEAD_IN, None, None]
    assert plan.before_clean == before_clean(reprofile=True) and Kind.COMMUNICATION not in plan.kinds


def test_a_run_too_short_for_all_communication_steps_is_told_at_its_start() -> None:
    def warnings(max_steps: int, comm_steps: object = "auto", comm: int = 3, per: int = 1) -> list[str]:
        options = Options(profile_step=1, clean_steps=2, comm_steps=comm_steps)  # type: ignore[arg-type]
        plan = RunPlan.of(options, 0, max_steps, per, comm=comm)  # steps 1 .. 10: 8 before the clean ones
        with warnings_module.catch_warnings(record=True) as seen:
            warnings_module.simplefilter("always")
            plan.warn("test", profiled_before=False)
        return [str(w.message) for w in seen]

    assert warnings(33) == [] and warnings(14, comm_steps=3) == []
    assert warnings(14, comm=0) == []  # one process: no communication step, a window of steps 1 .. 7
    # 25 communication steps make the window 22 steps longer: it ends at step 32
    (sure,) = warnings(32)
    assert "needs steps 1 .. 10, or up to 32 if its first 3 communication steps disagree" in sure
    assert "then rest on 1 clean step(s). comm_steps=3 fixes the count" in sure
    assert "then rest on 0 clean step(s)" in warnings(30)[0]
    # two global steps per optimizer step: the window from step 2, 10 of its steps up to step 20, 32 to 64
    (manual,) = warnings(64, per=2)
    assert "needs steps 2 .. 20, or up to 64" in manual and "rest on 1 clean step(s)" in manual
    assert warnings(66, per=2) == []
    (short,) = warnings(10)  # too short for three: the warning it had
    assert "needs steps 1 .. 10 (counting, 3 x module timing, 3-25 x communication, a check" in short
    assert "the latencies will rest on 1 clean step(s)" in short


def test_the_option_turns_the_communication_steps_off() -> None:
    assert kinds(2, comm_steps=0) == ([Kind.COUNTING, MT, MT, MT, None, None, None, None], before_clean())


def test_the_job_keeps_one_communication_step_on_every_rank_the_median_by_the_ranks_mean() -> None:
    ms = 1e-3
    # the ranks' means per step: 3, 1, 2 ms (rank 0's own median would be step 0, rank 1's step 2)
    assert median_comm([[2 * ms, 1.5 * ms, 1 * ms], [4 * ms, 0.5 * ms, 3 * ms]]) == 2
    # a trace one rank could not read: the other's figure stands for the step; of two, the lower
    assert median_comm([[None, 3 * ms, 1 * ms], [None, 3 * ms, 1 * ms]]) == 2
    assert median_comm([[5 * ms, None, 1 * ms], [None, None, 1 * ms]]) == 2
    # none read: the first (its number still says where the window was)
    assert median_comm([[None, None, None], [None, None, None]]) == 0
    assert comm_means([[2 * ms, None, None], [4 * ms, 1 * ms, None]]) == [pytest.approx(3 * ms), 1 * ms, None]
    # the vote's figure and the window end's are one function's: the ranks that read their trace
    assert ranks_mean([2 * ms, None, 5 * ms]) == pytest.approx(3.5 * ms)
    assert ranks_mean([None, None]) is None


def rank(exposed_ms: float, seconds: float) -> CommBreakdown:
    """A rank's 10 ms step with 6 ms of compute and 5 ms of communication, ``exposed_ms`` of it alone."""
    ms = 1e-3
    split = TimeSplit(10 * ms, 6 * ms, 5 * ms, (5 - exposed_ms) * ms)
    table = (Collective("all_reduce", 2, 4_000_000, seconds), Collective("broadcast", 1, 400, 1e-5))
    return CommBreakdown(split, {"backward": split}, table, device=False)


def test_the_jobs_figures_are_the_ranks_mean_with_the_exposed_range_and_the_verdict_names_the_collective():
    figures = comm_figures([rank(2, 0.004), rank(4, 0.002)], None, (5, 6, 7), 7, iter_seconds=0.011)
    assert figures is not None
    assert figures.step.exposed == pytest.approx(3e-3)
    assert figures.exposed_range == (pytest.approx(2e-3), pytest.approx(4e-3))
    assert figures.step.idle == pytest.approx(10e-3 - (6e-3 + 5e-3 - figures.step.overlapped))
    assert figures.responsible() is not None and figures.responsible().op == "all_reduce"
    # exposed 3 ms against idle 10 - (6 + 2) = 2 ms: exposed communication is the larger
    assert (
        beyond_compute(figures)
        == "exposed communication: 3 ms (30% of the step), mostly all_reduce (2 call(s), 4 ms)"
    )
    data = comm_data(figures)
    assert data is not None
    assert data["collectives"][0] == {
        "op": "all_reduce", "calls": 2, "bytes": 4_000_000, "seconds": [0.002, 0.004],
        # bytes / seconds x 2(n-1)/n with n = 2: 1 GB/s and 2 GB/s
        "bus_bandwidth": [pytest.approx(1e9), pytest.approx(2e9)],
    }  # fmt: skip
    assert data["whole_step"]["overlap"] == pytest.approx(2 / 5)


def test_exposed_time_most_of_which_the_ranks_wait_for_a_slow_rank_is_said_as_that_wait():
    """A slow rank's forward (+20 ms a step, the others waiting 20 ms) against 3 ms of exposed time: the
    exposed time is the wait for it, not the all-reduce's own; against 60 ms it is mostly the collective."""
    from flops_callbacks.communication.slow_rank_report import waited_for
    from tests.communication.test_slow_rank import found_slow

    figures = comm_figures([rank(2, 0.004), rank(4, 0.002)], None, (5, 6, 7), 7, iter_seconds=0.011)
    assert figures is not None
    slow = found_slow()
    assert slow.wait == pytest.approx(20e-3)
    assert beyond_compute(figures, waited_for(slow, figures.step.exposed)) == (
        "exposed communication: 3 ms (30% of the step), mostly waiting for rank 1's fwd (+20 ms a step: "
        "slow rank)"
    )
    assert waited_for(slow, 60e-3) == "" and waited_for(None, 3e-3) == ""


def test_the_full_report_and_the_json_say_the_wait_for_the_slow_rank_as_the_summary_does():
    """The window's verdict on its exposed time is one sentence wherever it is read: the summary's
    "beyond compute" words, the full report's row and the JSON's ``verdict`` (they said the all-reduce)."""
    import dataclasses

    from flops_callbacks.options import Options
    from flops_callbacks.reporting.console_summary import render_console_summary
    from flops_callbacks.reporting.profile_file import json_data
    from flops_callbacks.reporting.tree_check import TreeCheck
    from flops_callbacks.reporting.window_rows import report_text
    from tests.communication.test_slow_rank import found_slow
    from tests.reporting.test_console_summary import window

    figures = comm_figures([rank(2, 0.004), rank(4, 0.002)], None, (5, 6, 7), 7, iter_seconds=0.011)
    result = dataclasses.replace(window(), comm=figures, slow_rank=found_slow())
    said = "mostly waiting for rank 1's fwd (+20 ms a step: slow rank)"
    assert said in render_console_summary(result, TreeCheck(), "")
    (row,) = [line for line in report_text(result, Options(), True).splitlines() if "spends most on" in line]
    assert row.endswith(f"exposed communication: 3 ms (30% of the step), {said}")
    assert json_data(result)["communication"]["verdict"].endswith(said)


def test_no_rank_with_a_split_is_no_figures():
    assert comm_figures([None, None], None, (5, 6, 7), 7, 0.01) is None


def test_a_file_reads_back_its_communication_steps_and_their_median() -> None:
    figures = comm_figures([rank(2, 0.004), rank(4, 0.002)], None, (5, 6, 7), 6, iter_seconds=0.011)
    data = comm_data(figures)
    assert data is not None and (data["steps"], data["median_step"]) == ([5, 6, 7], 6)
    back = comm_from_data(data)
    assert (back.steps, back.median_step) == ((5, 6, 7), 6)


def test_a_cpus_wait_for_a_core_is_said_beside_the_exposed_time_and_kept_in_the_file() -> None:
    """Two ranks whose backward's compute waited 1 and 3 ms for a core under overlapped communication:
    the job's exposed time holds their mean, 2 ms, and says so (idle stays 10 - (6 + 5 - 4) = 3 ms: the
    wait was the ops', never idle); a file of before the field reads 0."""
    ms = 1e-3
    ranks = []
    for waited in (1 * ms, 3 * ms):
        split = TimeSplit(10 * ms, 6 * ms, 5 * ms, 4 * ms).charged(waited)
        table = (Collective("all_reduce", 1, 4_000_000, 0.004),)
        ranks.append(CommBreakdown(split, {"backward": split}, table, device=False))
    figures = comm_figures(ranks, None, (5,), 5, iter_seconds=0.011)
    assert figures is not None
    assert figures.step.exposed == pytest.approx(3 * ms) and figures.step.core_wait == pytest.approx(2 * ms)
    assert figures.step.compute == pytest.approx(4 * ms)  # 6 less the 2 it did not run
    data = comm_data(figures)
    assert data is not None and data["whole_step"]["core_wait"] == pytest.approx(2 * ms)
    assert comm_from_data(data).step == figures.step
    del data["whole_step"]["core_wait"]
    assert comm_from_data(data).step.core_wait == 0.0
    assert _split_text(figures.phases["backward"]) == (
        "5 ms comm, 3 ms exposed (2 ms of it compute waiting for a core), 3 ms idle of 10 ms"
    )
    assert waited_words(figures.step) == " (2 ms of it compute waiting for a core)"
    assert waited_words(TimeSplit(10 * ms, 6 * ms, 5 * ms, 4 * ms)) == ""  # none waited: nothing said
