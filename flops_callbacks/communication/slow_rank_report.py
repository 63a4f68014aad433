"""The slow rank in the console summary, the full report and the JSON: who the others wait for, where its
extra time is and what it costs them, each rank's parts of its step, and what could not be told.
Every figure is the :class:`~flops_callbacks.communication.slow_rank.SlowRank`'s own, computed once.
"""

from __future__ import annotations

from typing import Any

from flops_callbacks.communication.slow_rank import (
    COMMUNICATION,
    DATA,
    NOISE_TIMES,
    PARTS,
    WAIT_SHARE,
    RankParts,
    SlowRank,
)
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.units import duration_to_string

__all__ = [
    "MAX_RANK_ROWS",
    "PART_WORDS",
    "slow_rank_data",
    "slow_rank_from_data",
    "slow_rank_lines",
    "slow_rank_text",
    "waited_for",
]

PART_WORDS = {
    DATA: "data",
    FORWARD: "fwd",
    BACKWARD: "bwd",
    OPTIMIZER_STEP: "step",
    COMMUNICATION: "own communication",
}
MAX_RANK_ROWS = 16  # ranks in the report's table; the JSON holds every rank


def _ms(seconds: float) -> str:
    return duration_to_string(seconds)


def slow_rank_text(slow: SlowRank) -> str:
    """The verdict in one line, as the console says it after ``slow rank``: ``"1 of 2, fwd +20.39 ms over
    the median; the others wait 19.03 ms a step in all_reduce"``, or that no rank stands out."""
    if not slow.stands_out:
        if slow.unwaited is not None:
            return (
                f"none stands out: rank {slow.rank}'s {PART_WORDS[slow.part]} is +{_ms(slow.extra)} over the "
                f"median, but the others wait only {_ms(slow.unwaited)} a step for it"
            )
        if not slow.untold:
            return "none stands out (the ranks agree within their step-to-step noise)"
        told = " / ".join(PART_WORDS[p] for p in slow.told)
        untold = " / ".join(PART_WORDS[p] for p in slow.untold)
        return f"none stands out in {told} ({untold} not told: no communication step)"
    where = f" in {slow.collective}" if slow.collective else ""
    return (
        f"{slow.rank} of {slow.world}, {PART_WORDS[slow.part]} +{_ms(slow.extra)} over the median; "
        f"the others wait {_ms(slow.wait)} a step{where}"
    )


def waited_for(slow: SlowRank | None, exposed: float) -> str:
    """The rank the others wait for, in words, where their wait is most of a step's ``exposed``
    communication: what that time is spent on (""; no rank stands out, or the wait is elsewhere)."""
    if slow is None or not slow.stands_out or slow.wait < WAIT_SHARE * exposed:
        return ""
    return f"rank {slow.rank}'s {PART_WORDS[slow.part]} (+{_ms(slow.extra)} a step: slow rank)"


def _told_words(slow: SlowRank) -> str:
    """Where each part's figures come from, in words."""
    data = "data: the clean steps' wait for data less the profiler's votes"
    if slow.comm:
        phases = "fwd / bwd / step: each communication step's phase less its exposed communication"
    else:
        phases = "fwd / step: the clean steps' phases" if FORWARD in slow.told else "no phase"
    return f"{data}; {phases}; a part stands out beyond {NOISE_TIMES:g}x the ranks' step-to-step spread"


def _untold_words(slow: SlowRank) -> str:
    """What could not be told, and why ("" where every part was)."""
    if not slow.untold:
        return ""
    parts = " / ".join(PART_WORDS[p] for p in slow.untold)
    why = "no communication step (comm_steps=0, or a re-profile window)"
    if FORWARD in slow.untold:
        why += ", and sharded parameters gather in the forward"
    return (
        f"{parts}: {why}; the phase latencies hold the waits (DDP's all-reduce evens the ranks' backward "
        "out), so a rank slow there shows only in the others' waiting"
    )


def _rank_value(parts: RankParts, comm: bool) -> str:
    own = ", ".join(f"{PART_WORDS[p]} {_ms(parts.own[p])}" for p in PARTS if p in parts.own)
    text = f"{own}; votes {_ms(parts.votes)}"
    if comm and parts.exposed is not None and parts.idle is not None:
        text += f"; exposed communication {_ms(parts.exposed)}, idle {_ms(parts.idle)}"
    return text


def slow_rank_lines(slow: SlowRank | None) -> list[tuple[str, str]]:
    """The full report's rows: the verdict (with the nearest rank where none stands out), where it comes
    from, what could not be told, and each rank's step part by part ([] with one rank)."""
    if slow is None:
        return []
    part, extra, noise = PART_WORDS[slow.part], _ms(slow.extra), _ms(slow.threshold)
    if slow.stands_out:
        where = f" (in {slow.collective})" if slow.collective else ""
        verdict = (
            f"rank {slow.rank} of {slow.world}: {part} +{extra} a step over the other ranks' median (beyond "
            f"the noise: {noise}); the others wait {_ms(slow.wait)} a step{where}"
        )
    elif slow.unwaited is not None:
        verdict = (
            f"no rank stands out: rank {slow.rank}'s {part} +{extra} over the other ranks' median is beyond "
            f"the noise ({noise}), but the others wait only {_ms(slow.unwaited)} a step for it (under "
            f"{WAIT_SHARE:.0%} of it: they spend it on work of their own)"
        )
    else:
        verdict = (
            f"no rank stands out: the nearest, rank {slow.rank}'s {part} +{extra} over the other ranks' "
            f"median, is within the noise ({noise})"
        )
    lines = [("slow rank: the rank the others wait for", verdict), ("slow rank told from", _told_words(slow))]
    untold = _untold_words(slow)
    if untold:
        lines.append(("slow rank: not told", untold))
    own = "own time (less waiting)" if slow.comm else "data less votes; phases as timed, waits in"
    label = f"each rank's step (its steps' mean less the highest and lowest): {own}; the profiler's votes"
    if slow.comm:
        label += "; exposed communication, idle"
    lines.append((label, ""))
    shown = [r for r in range(slow.world) if r < MAX_RANK_ROWS or (slow.stands_out and r == slow.rank)]
    for r in shown:
        mark = " (slow)" if slow.stands_out and r == slow.rank else ""
        lines.append((f"  rank {r}{mark}", _rank_value(slow.ranks[r], slow.comm)))
    if len(shown) < slow.world:
        lines.append((f"  {slow.world - len(shown)} more rank(s)", "in the JSON's slow_rank.ranks"))
    return lines


def slow_rank_data(slow: SlowRank | None) -> dict[str, Any] | None:
    """The slow rank as JSON-ready data (seconds)."""
    if slow is None:
        return None
    return {
        "rank": slow.rank if slow.stands_out else None,
        "stands_out": slow.stands_out,
        "nearest": slow.rank,  # the rank named, or the nearest to standing out
        "part": slow.part,
        "extra": slow.extra,
        "threshold": slow.threshold,
        "wait": slow.wait,
        "waits": list(slow.waits),
        "collective": slow.collective,
        "comm": slow.comm,
        "told": list(slow.told),
        "untold": list(slow.untold),
        "unwaited": slow.unwaited,
        "ranks": [
            {"own": r.own, "spread": r.spread, "votes": r.votes, "exposed": r.exposed, "idle": r.idle}
            for r in slow.ranks
        ],
        "verdict": slow_rank_text(slow),
    }


def slow_rank_from_data(data: dict[str, Any]) -> SlowRank:
    """The slow rank :func:`slow_rank_data` wrote, read back from a profile file."""
    return SlowRank(
        ranks=tuple(
            RankParts(dict(r["own"]), dict(r["spread"]), r["votes"], r["exposed"], r["idle"])
            for r in data["ranks"]
        ),
        told=tuple(data["told"]),
        comm=data["comm"],
        rank=data["nearest"],
        part=data["part"],
        extra=data["extra"],
        threshold=data["threshold"],
        stands_out=data["stands_out"],
        waits=tuple(data["waits"]),
        collective=data["collective"],
        untold=tuple(data["untold"]),
        unwaited=data.get("unwaited"),
    )
