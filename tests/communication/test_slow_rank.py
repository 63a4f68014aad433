"""The rank the others wait for, told from every rank's own time in each part of its step, as pure logic
with numbers worked out by hand; its rows, line, JSON and metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.communication.breakdown import Collective, CommBreakdown, TimeSplit
from flops_callbacks.communication.slow_rank import (
    MAD_TO_SD,
    NOISE_TIMES,
    RankTimes,
    SlowRank,
    find_slow_rank,
)
from flops_callbacks.communication.slow_rank_report import (
    slow_rank_data,
    slow_rank_from_data,
    slow_rank_lines,
    slow_rank_text,
    waited_for,
)

MS = 1e-3


def split(span: float, comm: float = 0.0) -> TimeSplit:
    """``span`` ms of a phase: ``comm`` ms of it communication with no compute beside it, the rest compute."""
    return TimeSplit(span * MS, (span - comm) * MS, comm * MS, 0.0)


def comm_step(fwd: float, bwd: float, exposed: float, step: float = 1.0) -> CommBreakdown:
    """A DDP step on the host's timeline: its gradient all-reduce ``exposed`` ms alone in the backward."""
    phases = {"forward": split(fwd), "backward": split(bwd, exposed), "optimizer_step": split(step)}
    whole = split(fwd + bwd + step, exposed)
    return CommBreakdown(whole, phases, (Collective("all_reduce", 1, 4096, exposed * MS),), device=False)


def rank(
    data: list[float],
    waits: list[float],
    fwd: list[float],
    bwd: list[float],
    comm: list[CommBreakdown] | None = None,
    step: float = 1.0,
) -> RankTimes:
    """One rank's clean steps (ms: each step's data, votes, fwd and bwd) and communication steps."""
    seconds = lambda values: tuple(v * MS for v in values)  # noqa: E731
    phases = {"forward": seconds(fwd), "backward": seconds(bwd), "optimizer_step": seconds([step] * len(fwd))}
    return RankTimes(seconds(data), phases, seconds(waits), tuple(comm or ()))


def forward_sleep() -> list[RankTimes]:
    """Rank 1 sleeps 20 ms in its forward; rank 0 waits for it in the backward's all-reduce (its exposed
    22 ms against rank 1's 2 ms). Both ranks' clean steps last 1 + 3 + 26 + 1 = 31 ms."""
    return [
        rank(
            [1.0, 1.1, 0.9], [0.2] * 3, [3.0] * 3, [26.0] * 3,
            [comm_step(3.0, 26.0, 22.0), comm_step(3.1, 26.0, 22.0), comm_step(2.9, 26.0, 22.0)],
        ),
        rank(
            [1.0] * 3, [0.2] * 3, [23.0] * 3, [6.0] * 3,
            [comm_step(23.0, 6.0, 2.0), comm_step(23.2, 6.0, 2.0), comm_step(22.8, 6.0, 2.0)],
        ),
    ]  # fmt: skip


def test_a_rank_asleep_in_its_forward_is_named_with_its_extra_and_the_wait_of_the_other() -> None:
    found = find_slow_rank(forward_sleep())
    assert found is not None and found.stands_out
    assert (found.rank, found.part, found.comm, found.collective) == (1, "forward", True, "all_reduce")
    assert found.extra == pytest.approx(
        20 * MS
    )  # own forward 23 ms (the median of 23.0 / 23.2 / 22.8) - 3 ms
    # rank 0: votes 0.2 + exposed 22 ms, against rank 1's 0.2 + 2 ms
    assert found.waits == pytest.approx((20 * MS, 0.0)) and found.wait == pytest.approx(20 * MS)
    # the forward's noise is the other rank's: rank 0's steps lie 0.1 ms from their median (rank 1's own
    # 0.2 ms left out), 4 x 1.4826 x 0.1 = 0.59 ms, under the floor of 2% of the 31-ms step
    assert NOISE_TIMES * MAD_TO_SD * 0.1 * MS < 0.02 * 31 * MS
    assert found.threshold == pytest.approx(0.02 * 31 * MS)
    assert found.ranks[0].own == pytest.approx({"data": 0.8 * MS, "forward": 3 * MS, "backward": 4 * MS,
                                                "optimizer_step": 1 * MS})  # fmt: skip
    assert (found.ranks[0].exposed, found.ranks[1].exposed) == pytest.approx((22 * MS, 2 * MS))
    assert found.metrics() == pytest.approx(
        {names.SLOW_RANK: 1.0, names.SLOW_RANK_EXTRA_LATENCY: 20 * MS, names.SLOW_RANK_WAIT_LATENCY: 20 * MS}
    )
    assert (
        slow_rank_text(found)
        == "1 of 2, fwd +20 ms over the median; the others wait 20 ms a step in all_reduce"
    )


def test_with_gradient_accumulation_the_wait_is_told_from_one_kind_of_steps_votes_and_exposed_time() -> None:
    """Rank 1 sleeps 25 ms in each of 2 micro-batches' forward. A clean step votes at each micro-batch:
    rank 0 waits 25 ms in the second's vote and 25 in the all-reduce; a communication step votes at its
    first only: rank 0 waits all 50 ms in the all-reduce. The wait is 50 ms (it read 25 + 50 = 75)."""
    ranks = [
        rank([1.0] * 3, [25.2] * 3, [6.0] * 3, [31.0] * 3, [comm_step(6.0, 58.0, 52.0)] * 3),
        rank([1.0] * 3, [0.2] * 3, [56.0] * 3, [6.0] * 3, [comm_step(56.0, 8.0, 2.0)] * 3),
    ]
    ranks = [r._replace(comm_waits=(0.2 * MS,) * 3) for r in ranks]
    found = find_slow_rank(ranks)
    assert found is not None and (found.rank, found.part, found.comm) == (1, "forward", True)
    assert found.extra == pytest.approx(50 * MS) and found.waits == pytest.approx((50 * MS, 0.0))


def test_the_same_steps_without_the_sleep_name_no_rank() -> None:
    """Both ranks' forward 3 ms give or take their noise, both wait 2 ms in the all-reduce."""
    ranks = [
        rank([1.0] * 3, [0.2] * 3, [3.0] * 3, [6.0] * 3, [comm_step(f, 6.0, 2.0) for f in (3.0, 3.3, 2.9)]),
        rank([1.0] * 3, [0.2] * 3, [3.1] * 3, [6.0] * 3, [comm_step(f, 6.0, 2.0) for f in (3.1, 3.0, 3.2)]),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and not found.stands_out
    assert found.metrics() == {names.SLOW_RANK: -1.0, names.SLOW_RANK_EXTRA_LATENCY: 0.0,
                               names.SLOW_RANK_WAIT_LATENCY: 0.0}  # fmt: skip
    assert slow_rank_text(found) == "none stands out (the ranks agree within their step-to-step noise)"
    assert slow_rank_lines(found)[0][1] == (
        "no rank stands out: the nearest, rank 1's fwd +100 us over the other ranks' median, is within the "
        "noise (593.04 us)"  # each rank's steps lie 0.1 ms from its median
    )


def test_a_slow_backward_that_the_all_reduce_evens_out_is_told_by_the_others_waiting() -> None:
    """Four ranks; rank 2's backward compute takes 15 ms more. Every rank's backward phase lasts 20 ms (the
    all-reduce ends it on every rank at once): the phase latencies cannot tell, the exposed times can."""
    waiting = [comm_step(3.0, 20.0, 17.0 + d) for d in (0, 0.1, -0.1)]
    ranks = [rank([1.0] * 3, [0.2] * 3, [3.0] * 3, [20.0] * 3, waiting) for _ in range(4)]
    ranks[2] = rank(
        [1.0] * 3, [0.2] * 3, [3.0] * 3, [20.0] * 3, [comm_step(3.0, 20.0, e) for e in (2, 2.1, 1.9)]
    )
    found = find_slow_rank(ranks)
    assert found is not None and (found.rank, found.part) == (2, "backward")
    assert found.extra == pytest.approx(15 * MS) and found.wait == pytest.approx(15 * MS)
    assert found.waits == pytest.approx((15 * MS, 15 * MS, 0.0, 15 * MS))


def test_a_rank_slow_with_its_batches_is_told_from_the_clean_steps_alone_by_the_votes() -> None:
    """A re-profile window (no communication step): rank 1 reads its batch 20 ms longer, and rank 0 waits
    for it in the profiler's vote before the forward, so both ranks' data times are 21 ms."""
    ranks = [
        rank([21.1, 21.3, 21.0], [20.2, 20.3, 20.1], [3.0] * 3, [6.0] * 3),
        rank([21.0, 21.2, 20.9], [0.3] * 3, [3.0] * 3, [6.0] * 3),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and (found.rank, found.part, found.comm) == (1, "data", False)
    assert found.extra == pytest.approx(19.8 * MS)  # own data 20.9 - 0.3 against 21.1 - 20.2 ms (medians)
    assert found.wait == pytest.approx(19.9 * MS)  # votes 20.2 against 0.3 ms; the backward alike
    assert found.told == ("data", "forward", "optimizer_step") and found.untold == ("backward",)
    assert find_slow_rank(ranks, unsharded=False).told == ("data",)  # type: ignore[union-attr]


def test_without_a_communication_step_a_slow_forward_is_told_and_the_wait_read_from_the_backward() -> None:
    ranks = [
        rank([1.0] * 3, [0.2] * 3, [3.0] * 3, [26.0] * 3),
        rank([1.0] * 3, [0.2] * 3, [23.0] * 3, [6.0] * 3),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and (found.rank, found.part) == (1, "forward")
    assert (found.extra, found.wait) == pytest.approx((20 * MS, 20 * MS))
    lines = dict(slow_rank_lines(found))
    assert lines["slow rank: not told"].startswith("bwd: no communication step (comm_steps=0, or a ")


def test_an_extra_within_the_other_ranks_scatter_or_that_nobody_waits_for_names_no_rank() -> None:
    scattered = [
        rank([1.0] * 3, [0.2] * 3, [8.0] * 3, [11.0] * 3),
        rank([1.0] * 3, [0.2] * 3, [1.0, 3.0, 9.0], [16.0] * 3),
    ]
    # rank 0 +5 ms over rank 1's 3 ms, against 4 x 1.4826 x 2 ms (rank 1's steps lie 2 ms from their
    # median, their median absolute deviation) = 11.9 ms
    found = find_slow_rank(scattered)
    assert found is not None and not found.stands_out and (found.rank, found.part) == (0, "forward")
    assert (found.extra, found.threshold) == pytest.approx((5 * MS, NOISE_TIMES * MAD_TO_SD * 2 * MS))
    assert found.unwaited is None
    assert (
        slow_rank_text(found) == "none stands out in data / fwd / step (bwd not told: no communication step)"
    )
    # rank 1's forward +5 ms beyond any noise, but rank 0 spends those 5 ms in its own backward compute:
    # neither waits for the other
    busy = [
        rank([1.0] * 3, [0.2] * 3, [3.0] * 3, [11.0] * 3, [comm_step(3.0, 11.0, 0.5)] * 3),
        rank([1.0] * 3, [0.2] * 3, [8.0] * 3, [6.0] * 3, [comm_step(8.0, 6.0, 0.5)] * 3),
    ]
    found = find_slow_rank(busy)
    assert found is not None and not found.stands_out and found.extra == pytest.approx(5 * MS)
    # said as such, not as noise: rank 0 waits 0 s for it (its votes and exposed time are rank 1's)
    assert found.unwaited == pytest.approx(0.0) and found.metrics()[names.SLOW_RANK] == -1
    assert slow_rank_text(found) == (
        "none stands out: rank 1's fwd is +5 ms over the median, but the others wait only 0 s a step for it"
    )
    assert slow_rank_lines(found)[0][1] == (
        "no rank stands out: rank 1's fwd +5 ms over the other ranks' median is beyond the noise (320 us), "
        "but the others wait only 0 s a step for it (under 50% of it: they spend it on work of their own)"
    )
    assert slow_rank_from_data(json.loads(json.dumps(slow_rank_data(found)))) == found


def test_a_rank_that_stalls_every_other_step_is_named_with_its_stalls_share() -> None:
    """Rank 1 sleeps 100 ms in its forward on every other step; rank 0 waits for it in its backward's
    all-reduce on those steps. Rank 1's own scatter (its stalls) is no noise: rank 0's steps are even."""
    stalls = [1.0, 101.0] * 3
    ranks = [
        rank([1.0] * 6, [0.2] * 6, [1.0] * 6, [6.0 + s - 1.0 for s in stalls]),
        rank([1.0] * 6, [0.2] * 6, stalls, [6.0] * 6),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and found.stands_out and (found.rank, found.part) == (1, "forward")
    # its 6 forwards less the highest and lowest: 1, 1, 101, 101 ms, 51 ms; rank 0's 1 ms
    assert found.extra == pytest.approx(50 * MS)
    # rank 0's backward beyond rank 1's, step by step: 100, 0, 100, 0, 100, 0 ms: 50 ms as one
    assert found.wait == pytest.approx(50 * MS)


def test_without_a_communication_step_a_slow_optimizer_step_is_told_and_the_others_wait_in_the_votes() -> (
    None
):
    """Rank 1's optimizer step takes 50 ms more (no collective in DDP's step); rank 0 waits for it in the
    profiler's votes before its next forward."""
    waits = [50.2, 50.3, 50.1, 50.2, 50.2]  # the votes lie in the data time: 0.8 ms of its own each step
    ranks = [
        rank([w + 0.8 for w in waits], waits, [3.0] * 5, [6.0] * 5),
        rank([1.0] * 5, [0.2] * 5, [3.0] * 5, [6.0] * 5, step=51.0),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and found.stands_out and (found.rank, found.part) == (1, "optimizer_step")
    assert (found.extra, found.wait) == pytest.approx((50 * MS, 50 * MS))
    assert slow_rank_text(found) == "1 of 2, step +50 ms over the median; the others wait 50 ms a step"
    assert found.untold == ("backward",)
    # sharded parameters: neither the forward nor the step is told, and the verdict says what was
    sharded = find_slow_rank(ranks, unsharded=False)
    assert sharded is not None and not sharded.stands_out
    assert (
        slow_rank_text(sharded)
        == "none stands out in data (fwd / bwd / step not told: no communication step)"
    )


def test_one_rank_or_a_rank_without_clean_steps_has_no_slow_rank() -> None:
    assert find_slow_rank(forward_sleep()[:1]) is None
    assert find_slow_rank([forward_sleep()[0], RankTimes((), {}, ())]) is None


def found_slow() -> SlowRank:
    found = find_slow_rank(forward_sleep())
    assert found is not None
    return found


def test_the_report_rows_say_the_verdict_where_it_comes_from_and_each_ranks_parts() -> None:
    rows = slow_rank_lines(found_slow())
    assert rows[0] == (
        "slow rank: the rank the others wait for",
        "rank 1 of 2: fwd +20 ms a step over the other ranks' median (beyond the noise: 620 us); the others "
        "wait 20 ms a step (in all_reduce)",
    )
    assert rows[1][0] == "slow rank told from" and rows[1][1].startswith(
        "data: the clean steps' wait for data"
    )
    assert rows[2] == (
        "each rank's step (its steps' mean less the highest and lowest): own time (less waiting); the "
        "profiler's votes; exposed communication, idle",
        "",
    )
    exposed = "votes 200 us; exposed communication"
    assert rows[3:] == [
        ("  rank 0", f"data 800 us, fwd 3 ms, bwd 4 ms, step 1 ms; {exposed} 22 ms, idle 0 s"),
        ("  rank 1 (slow)", f"data 800 us, fwd 23 ms, bwd 4 ms, step 1 ms; {exposed} 2 ms, idle 0 s"),
    ]
    assert slow_rank_lines(None) == []


def test_the_json_block_reads_back_into_the_same_figures() -> None:
    found = found_slow()
    data = json.loads(json.dumps(slow_rank_data(found)))
    assert (data["rank"], data["part"], data["collective"]) == (1, "forward", "all_reduce")
    assert data["verdict"] == slow_rank_text(found)
    assert slow_rank_from_data(data) == found
    none = find_slow_rank([forward_sleep()[0], forward_sleep()[0]])
    assert none is not None and json.loads(json.dumps(slow_rank_data(none)))["rank"] is None
    assert slow_rank_from_data(json.loads(json.dumps(slow_rank_data(none)))) == none


def test_the_docs_console_line_is_the_ones_the_console_prints() -> None:
    """docs/several-processes.md shows a run's line (its numbers a 2-process loop's): the console's words."""
    page = (Path(__file__).parents[2] / "docs" / "several-processes.md").read_text()
    ran = dataclasses.replace(found_slow(), extra=20.39 * MS, waits=(19.03 * MS, 0.0))
    assert f"\nslow rank     {slow_rank_text(ran)}\n" in page


def test_two_ranks_slow_in_different_parts_are_not_one_ranks_own_communication() -> None:
    """Rank 0 30 ms slow in its forward, rank 1 30 ms slow in its data: the vote before the forward lines
    them up (rank 0 waits there for rank 1's data), and rank 1 then waits 30 ms in the all-reduce for rank
    0's forward. Its exposed time is that wait, not its own communication: own work stands out on both
    ranks, so no rank's communication is named (it was, as the slow rank's)."""
    ranks = [
        rank(
            [1.0, 1.1, 0.9], [30.2] * 3, [33.0] * 3, [6.0] * 3,
            [comm_step(33.0, 6.0, e) for e in (2.0, 2.1, 1.9)],
        ),
        rank(
            [31.0, 31.1, 30.9], [0.2] * 3, [3.0] * 3, [36.0] * 3,
            [comm_step(3.0, 36.0, e) for e in (32.0, 32.1, 31.9)],
        ),
    ]  # fmt: skip
    found = find_slow_rank(ranks)
    assert found is not None and found.part != "communication" and not found.stands_out
    assert slow_rank_text(found).startswith("none stands out")


def test_a_rank_whose_own_communication_is_slow_is_named_where_the_others_wait_for_it_in_the_votes() -> None:
    """Rank 1's collectives take 10 ms more on their own (its compute as rank 0's), and rank 0 waits for it
    in the profiler's vote at the next step's start: 10.2 against 0.2 ms."""
    ranks = [
        rank([11.0] * 3, [10.2] * 3, [3.0] * 3, [6.0] * 3, [comm_step(3.0, 6.0, e) for e in (2.0, 2.1, 1.9)]),
        rank(
            [1.0] * 3, [0.2] * 3, [3.0] * 3, [16.0] * 3, [comm_step(3.0, 16.0, e) for e in (12, 12.1, 11.9)]
        ),
    ]
    found = find_slow_rank(ranks)
    assert found is not None and (found.rank, found.part, found.collective) == (1, "communication", None)
    assert (found.extra, found.wait) == pytest.approx((10 * MS, 10 * MS))
    assert (
        slow_rank_text(found)
        == "1 of 2, own communication +10 ms over the median; the others wait 10 ms a step"
    )
    # "rank 1's its own communication" where the verdict names the rank before its part
    assert waited_for(found, 10 * MS) == "rank 1's own communication (+10 ms a step: slow rank)"
