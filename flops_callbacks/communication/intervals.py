"""Time intervals as sorted, disjoint ``(start, end)`` tuples: merge, total, intersect, subtract, clip.

The communication step's breakdown is this algebra over a step's profiler events: the union of each
class's intervals (so that two streams or two worker threads busy at once count once), then
communication under compute (overlapped), communication alone (exposed), and neither (idle). Plain
tuples of floats, no torch: tested with intervals written by hand.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Interval", "clip", "intersect", "merge", "subtract", "total"]

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (touching ones joined; empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: Iterable[Interval]) -> float:
    """The length of the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time in both unions, as sorted, disjoint intervals (a sweep over the two merged lists)."""
    left, right = merge(a), merge(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start, end = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time in ``a``'s union and not in ``b``'s."""
    out: list[Interval] = []
    cuts = merge(b)
    for start, end in merge(a):
        for cut_start, cut_end in cuts:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if end > start:
            out.append((start, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The part of ``intervals``' union inside ``window``."""
    return intersect(intervals, [window])
