"""Warnings name the user's line, not a frame inside the frameworks that called the callback."""

from __future__ import annotations

import pytest

from flops_callbacks.user_warning import warn


def test_a_warning_from_the_package_points_at_its_first_caller_outside_the_frameworks() -> None:
    with pytest.warns(UserWarning, match="said here") as said:
        warn("said here")  # called from this file: outside every framework
    assert said[0].filename == __file__


def test_frames_of_the_frameworks_are_walked_past() -> None:
    namespace = {"__name__": "transformers.trainer_callback", "warn": warn}
    exec("def dispatch():\n    warn('from a callback event')", namespace)  # a frame "inside transformers"
    with pytest.warns(UserWarning, match="from a callback event") as said:
        namespace["dispatch"]()  # this line is the user's
    assert said[0].filename == __file__
