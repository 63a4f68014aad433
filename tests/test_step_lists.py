"""How the reports name steps: a run of more than two as a range, others listed, one in the singular."""

import pytest

from flops_callbacks.step_lists import step_list, steps_named


@pytest.mark.parametrize(
    ("steps", "listed", "named"),
    [
        ((), "none", "no step"),
        ((7,), "7", "step 7"),
        ((11, 12), "11, 12", "steps 11, 12"),  # two: a range would say no less
        ((11, 12, 13), "11-13", "steps 11-13"),
        ((15, 16, 17, 18, 19), "15-19", "steps 15-19"),
        ((12, 14), "12, 14", "steps 12, 14"),
        ((5, 6, 8), "5, 6, 8", "steps 5, 6, 8"),  # not a run: every step named
    ],
)
def test_steps_are_named_as_a_range_only_where_they_run_on(steps, listed, named):
    assert step_list(steps) == listed
    assert steps_named(steps) == named
