"""The interval algebra of the communication step, on intervals written by hand."""

from flops_callbacks.communication.intervals import clip, intersect, merge, subtract, total


def test_merge_joins_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (8, 8)]) == [(0, 4), (5, 7)]


def test_total_counts_time_covered_twice_once():
    assert total([(0, 10), (5, 15), (20, 21)]) == 16


def test_intersect_is_the_time_in_both_unions():
    compute = [(0, 4), (6, 10)]
    comm = [(3, 7), (9, 12)]
    assert intersect(compute, comm) == [(3, 4), (6, 7), (9, 10)]
    assert total(intersect(compute, comm)) == 3


def test_subtract_leaves_the_time_of_the_first_alone():
    comm = [(3, 7), (9, 12)]
    compute = [(0, 4), (6, 10)]
    assert subtract(comm, compute) == [(4, 6), (10, 12)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 10)], [(-1, 11)]) == []
    assert subtract([(0, 10)], []) == [(0, 10)]


def test_clip_keeps_the_part_inside_a_window():
    assert clip([(0, 5), (8, 12)], (3, 10)) == [(3, 5), (8, 10)]
