"""The window's result from its steps: which clean steps the model's own forward and the hooks' in-place
cost are read from."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from flops_callbacks.session import builder
from flops_callbacks.session.rank_part import RankRow, local_part, without_votes
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops
from flops_callbacks.session.vote_times import Vote, VoteMarks
from flops_callbacks.session.window_plan import Kind
from flops_callbacks.session.window_steps import CleanStep, StepSeconds, StepWork, WindowStep
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.module_timer import ModuleTimer
from flops_callbacks.timing.outer_calls import OuterCalls
from flops_callbacks.timing.phases import StepPhases
from tests.sleepy import Sleepy

SIGNATURE = [(((2, 4), torch.float32),)]  # the same batch shapes on every step


def marked_step(number: int, model: nn.Module, x: torch.Tensor, *, runs: bool) -> WindowStep:
    """A clean step whose marks of the model's outermost calls saw one forward, or none."""
    clock = CpuClock()
    outer = OuterCalls([model], clock)
    outer.start()
    if runs:
        model(x)
    outer.stop()
    return WindowStep(Kind.CLEAN, number, StepPhases(clock), signatures=SIGNATURE, outer=outer)


def test_a_clean_step_that_caught_no_model_call_is_left_out_of_the_hook_cost_and_the_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a step whose marks caught no call reads 0 seconds: in the clean steps' median it would lower the
    # clean side of the in-place cost (and raise the cost taken out of every module)
    model, x = Sleepy(fwd=0.0, bwd=0.0, tiny_ops=30), torch.randn(2, 4)
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    model(x)
    timer.stop()
    module_step = WindowStep(Kind.MODULE_TIMING, 3, StepPhases(CpuClock()), signatures=SIGNATURE, timer=timer)
    clean = [marked_step(4, model, x, runs=True), marked_step(5, model, x, runs=False)]
    clean.append(marked_step(6, model, x, runs=True))
    assert [s.outer.calls() for s in clean if s.outer is not None] == [1, 0, 1]
    # a probe dear enough that no step's noise outweighs it: the in-place measure is always taken
    probe = HookCost(per_call=1e-3, own=5e-4, source="probe")
    monkeypatch.setattr(builder, "hook_cost", lambda: probe)
    cost = builder._hook_cost([module_step], clean, builder._same_shapes([module_step], clean))
    assert cost is not None and cost.source.startswith("measured in place")
    assert "less on 2 clean step(s), over 30 calls inside" in cost.detail
    forward, steps, shapes_match = builder._model_forward(clean, SIGNATURE)
    ran = [s.outer.seconds() for s in clean if s.outer is not None and s.outer.calls()]
    assert steps == (4, 6) and shapes_match
    assert forward == (sum(ran) / 2, max(ran)) and min(ran) > 0


def _row(seconds: list[tuple[float, float]], votes: list[tuple[Vote, ...]]) -> RankRow:
    """A rank's row of clean steps of ``(data, wall)`` seconds (fwd, bwd, step 1 s each) and their votes."""
    work = StepWork(BatchCounts.zero(), 4, None)
    steps = tuple(CleanStep(work, StepSeconds(1.0, 1.0, 1.0, data, wall)) for data, wall in seconds)
    return RankRow(steps, {}, 4, None, 0.0, votes=tuple(votes))


def test_each_votes_least_time_over_the_ranks_comes_out_of_every_ranks_data_wait_and_wall_step() -> None:
    """Rank 1 reaches the first clean step's micro-batch vote 0.5 s late: rank 0 waits there for it, a
    wait that stays; what both spend in each vote at the least (the exchange itself) comes out of the data
    wait and of the wall step, for every vote: before the forward or between micro-batches, a vote lies
    where the phases are stopped."""
    rank0 = _row(
        [(0.75, 4.0), (0.5, 3.5)],
        [(Vote(0.125), Vote(0.625)), (Vote(0.125), Vote(0.125), Vote(0.25))],
    )
    rank1 = _row(
        [(0.75, 4.0), (0.5, 3.5)],
        [(Vote(0.25), Vote(0.125)), (Vote(0.125), Vote(0.0625), Vote(0.5))],
    )
    kept = without_votes([rank0, rank1])
    # own: step 0 (0.125, 0.125) -> 0.25; step 1 (0.125, 0.0625, 0.25) -> 0.4375
    assert [s.seconds for s in kept[0].steps] == [
        StepSeconds(1.0, 1.0, 1.0, 0.5, 3.75),
        StepSeconds(1.0, 1.0, 1.0, 0.0625, 3.0625),
    ]
    assert [s.seconds for s in kept[1].steps] == [s.seconds for s in kept[0].steps]  # the same times here
    assert kept[0].waits == rank0.waits == (0.75, 0.5)  # the slow rank reads the votes as timed
    assert without_votes([rank0]) == [rank0]  # one rank: no vote is exchanged


def test_a_vote_before_the_steps_data_time_comes_out_of_its_wall_not_its_data() -> None:
    """Lightning's data time starts at its fetch, after our batch end, where the previous step's end vote
    ran: that vote came out of a data time that never held it (0 s of data under DDP, a collate of 4 ms)."""
    outside = (Vote(0.25, in_data=False), Vote(0.125))  # the previous step's end vote, the micro-batch's
    kept = without_votes([_row([(0.5, 4.0)], [outside]), _row([(0.5, 4.0)], [outside])])
    assert [s.seconds for s in kept[0].steps] == [StepSeconds(1.0, 1.0, 1.0, 0.375, 3.625)]


def test_a_steps_votes_lie_in_its_data_time_from_where_its_fetch_starts() -> None:
    """The marks decide: a vote that started before the step's fetch mark is not in its data time."""
    clock = CpuClock()
    step = WindowStep(Kind.CLEAN, 7, StepPhases(clock), start_mark=1.0, fetch=2.0)
    marks = [VoteMarks(clock, 1.5, 1.75), VoteMarks(clock, 2.5, 2.625)]  # the end vote, then the batch's
    local_part([step], ShapeFlops(), None, None, votes=[marks])
    assert step.votes == (Vote(0.25, in_data=False), Vote(0.125, in_data=True))


def test_votes_that_do_not_line_up_leave_the_rows_as_they_are() -> None:
    rank0 = _row([(0.75, 4.0)], [(Vote(0.125), Vote(0.625))])
    rank1 = _row([(0.75, 4.0)], [(Vote(0.125),)])
    assert without_votes([rank0, rank1]) == [rank0, rank1]
    assert without_votes([rank0, _row([(0.75, 4.0)], [])]) == [rank0, _row([(0.75, 4.0)], [])]


def test_a_ranks_wait_for_a_slower_one_in_the_votes_before_a_communication_step_is_its_exposed_time() -> None:
    """Rank 1 ends the step before a communication step 30 ms late (its optimizer step): rank 0 waits for it
    in the profiler's votes there, where without them it would wait in the step's all-reduce. Rank 0's
    split of that step adds the 30 ms as exposed communication (and to its span), said apart; rank 1's is
    as read; votes that do not line up add nothing."""
    from flops_callbacks.communication.breakdown import CommBreakdown, TimeSplit
    from flops_callbacks.communication.report import waited_words
    from flops_callbacks.session.builder import _with_vote_waits
    from flops_callbacks.session.rank_part import vote_waits

    votes = [
        [(Vote(0.031), Vote(0.001)), (Vote(0.002),)],  # rank 0: steps 5 and 6
        [(Vote(0.001), Vote(0.001)), (Vote(0.003),)],  # rank 1
    ]
    waits = vote_waits(votes)
    assert waits == [[pytest.approx(0.030), 0.0], [0.0, pytest.approx(0.001)]]
    assert vote_waits([votes[0], votes[1][:1]]) == [[0.0, 0.0], [0.0]]  # not lined up
    assert vote_waits([votes[0]]) == [[0.0, 0.0]]  # one rank: no one to wait for
    split = TimeSplit(0.050, 0.030, 0.020, 0.005)  # 15 ms exposed
    mine = CommBreakdown(split, {"backward": split}, (), device=False)
    step5, step6 = _with_vote_waits([mine, None], waits[0])
    assert step6 is None and step5 is not None and step5.phases == mine.phases
    assert (step5.step.span, step5.step.exposed, step5.step.idle) == pytest.approx((0.080, 0.045, 0.005))
    assert (step5.step.rank_wait, step5.step.compute) == (pytest.approx(0.030), 0.030)
    assert waited_words(step5.step) == " (30 ms waiting for a slower rank before the step)"
    assert _with_vote_waits([mine], []) == [mine]  # no votes read: as it was


def test_the_slow_ranks_wait_is_read_with_the_ranks_lined_up_after_the_profilers_own_work() -> None:
    """Rank 1's data takes 0.3 s longer each step; rank 0 spent 0.2 s of the profiler's own work (its trace)
    before the step's vote, so it waited there 0.1 s, not 0.3: read from the votes' seconds alone, the wait
    for rank 1 (0.1 s, under half its extra) named no rank (and more own work on the slow rank inflated it
    past the step). Lined up after that work, rank 0 waits 0.3 s for it."""
    rank0 = _row([(0.111, 3.4)] * 3, [(Vote(0.101, own=0.2),)] * 3)
    rank1 = _row([(0.311, 3.4)] * 3, [(Vote(0.001),)] * 3)
    found = builder.slow_rank([rank0, rank1], nn.Linear(1, 1))
    assert found is not None and (found.rank, found.part) == (1, "data")
    assert found.extra == pytest.approx(0.3) and found.waits == pytest.approx((0.3, 0.0))


def test_a_wait_at_a_vote_for_a_rank_made_late_by_the_profilers_own_work_is_no_wait() -> None:
    """Rank 1's communication profiler took 10 ms longer to start (its own work before the step's first
    vote): rank 0 waited those 10 ms in the vote, which were booked as its exposed communication. Its
    data came 20 ms later too, in the next step: that wait stays."""
    from flops_callbacks.session.rank_part import vote_waits

    votes = [
        [(Vote(0.001), Vote(0.011, own=0.005)), (Vote(0.021, own=0.005),)],  # rank 0: steps 5 and 6
        [(Vote(0.001), Vote(0.001, own=0.015)), (Vote(0.001, own=0.005),)],  # rank 1
    ]
    assert vote_waits(votes) == [[0.0, pytest.approx(0.020)], [0.0, 0.0]]
