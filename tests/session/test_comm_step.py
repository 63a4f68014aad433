"""The communication steps' place in the window and their figures for the job, as pure logic."""

from __future__ import annotations

import pytest

from flops_callbacks.options import Options
from flops_callbacks.reporting.comm_report import comm_data, comm_from_data, verdict
from flops_callbacks.session.builder import median_comm
from flops_callbacks.session.comm_step import comm_figures
from flops_callbacks.session.ranks import Ranks
from flops_callbacks.session.window_plan import Kind, WindowPlan, before_clean
from flops_callbacks.session.window_steps import WindowStep
from flops_callbacks.timing.comm_breakdown import Collective, CommBreakdown, TimeSplit

MT, COMM = Kind.MODULE_TIMING, Kind.COMMUNICATION


def kinds(world: int, **options: object) -> tuple[list[str | None], int]:
    """The kinds of a window's first steps by their place, and its steps before the first clean one."""
    ranks = Ranks()
    ranks.world = world  # only start_step is called: no collective runs
    plan = WindowPlan(Options(**options), ranks)  # type: ignore[arg-type]
    return [plan.start_step() for _ in range(8)], plan.before_clean


def test_one_process_has_no_communication_step_and_the_layout_it_had() -> None:
    assert kinds(1) == ([Kind.COUNTING, MT, MT, MT, None, None, None, None], before_clean())


def test_several_ranks_time_communication_on_three_steps_after_the_module_timing_steps() -> None:
    assert kinds(2) == ([Kind.COUNTING, MT, MT, MT, COMM, COMM, COMM, None], before_clean() + 3)


def test_the_option_turns_the_communication_steps_off() -> None:
    assert kinds(2, comm_step=False) == ([Kind.COUNTING, MT, MT, MT, None, None, None, None], before_clean())


def comm_step(number: int, exposed_ms: float | None) -> WindowStep:
    """A communication step whose trace split as :func:`rank` (None: its trace could not be read)."""
    split = None if exposed_ms is None else rank(exposed_ms, 0.004)
    return WindowStep(COMM, number, phases=None, comm=split)  # type: ignore[arg-type]  # no clock read


def test_each_rank_keeps_its_median_communication_step_by_exposed_time() -> None:
    steps = [comm_step(5, 4.0), comm_step(6, 1.0), comm_step(7, 2.5)]
    assert median_comm(steps) is steps[2]
    # a step whose trace could not be read is not a candidate; of two, the lower
    assert median_comm([comm_step(5, None), comm_step(6, 3.0), comm_step(7, 1.0)]).number == 7  # type: ignore[union-attr]
    # none read: the first (its number still says where the window was), none ran: none
    assert median_comm([comm_step(5, None), comm_step(6, None)]).number == 5  # type: ignore[union-attr]
    assert median_comm([]) is None


def test_comm_step_is_a_flag() -> None:
    with pytest.raises(ValueError, match="comm_step must be True or False"):
        Options(comm_step="yes")  # type: ignore[arg-type]


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
        verdict(figures)
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


def test_no_rank_with_a_split_is_no_figures():
    assert comm_figures([None, None], None, (5, 6, 7), 7, 0.01) is None


def test_a_file_of_one_communication_step_reads_back_as_that_step() -> None:
    figures = comm_figures([rank(2, 0.004), rank(4, 0.002)], None, (5, 6, 7), 7, iter_seconds=0.011)
    data = comm_data(figures)
    assert data is not None and data["steps"] == [5, 6, 7]
    assert comm_from_data(data).steps == (5, 6, 7)
    del data["steps"]
    data["step"] = 5  # as a file of the one-step window wrote it
    assert comm_from_data(data).steps == (5,)
