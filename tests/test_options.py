"""Options: every argument of the callbacks checked once, here, with a message naming the argument and
what it accepts; the callbacks only pass their arguments through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flops_callbacks.options import CAUSAL_ATTENTION, REPORTS, Options


def test_the_defaults_are_the_documented_ones() -> None:
    o = Options()
    assert (o.profile_step, o.clean_steps, o.module_depth, o.top_modules) == (10, "auto", -1, 1)
    assert (o.detailed, o.print_profile, o.throughput, o.causal_attention) == (False, True, True, "full")
    assert (o.output_file, o.batch_size_fn, o.tokens_fn, o.peak_flops) == (None, None, None, None)
    assert o.peak_bandwidth is None and o.profile_every is None
    assert o.report == "summary" and REPORTS == ("summary", "full")
    assert CAUSAL_ATTENTION == ("full", "half")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"profile_step": -1}, "profile_step must be an int >= 0, got -1"),
        ({"profile_step": 2.0}, "profile_step must be an int >= 0, got 2.0"),
        ({"profile_step": True}, "profile_step must be an int >= 0, got True"),
        ({"clean_steps": -1}, "clean_steps must be 'auto' or an int >= 0, got -1"),
        ({"clean_steps": "many"}, "clean_steps must be 'auto' or an int >= 0, got 'many'"),
        ({"comm_steps": False}, "comm_steps must be 'auto' or an int >= 0, got False"),
        ({"comm_steps": -2}, "comm_steps must be 'auto' or an int >= 0, got -2"),
        ({"module_depth": -2}, "module_depth must be an int >= -1 (-1 means all depths), got -2"),
        ({"top_modules": 0}, "top_modules must be an int >= 1, got 0"),
        ({"detailed": "yes"}, "detailed must be True or False, got 'yes'"),
        ({"print_profile": 1}, "print_profile must be True or False, got 1"),
        ({"throughput": None}, "throughput must be True or False, got None"),
        ({"causal_attention": "quarter"}, "causal_attention must be one of ('full', 'half'), got 'quarter'"),
        ({"batch_size_fn": 3}, "batch_size_fn must be a callable taking the batch, got 3"),
        ({"tokens_fn": "tokens"}, "tokens_fn must be a callable taking the batch, got 'tokens'"),
        ({"output_file": 3}, "output_file must be a path (str or Path) or None, got 3"),
        ({"output_file": ""}, "output_file must be a file's path or None, got an empty path"),
        ({"output_file": Path(__file__).parent}, "output_file must be a file's path or None, got a folder"),
        ({"peak_flops": 0}, "peak_flops must be the dense peak FLOPS of one device"),
        ({"peak_flops": "312e12"}, "peak_flops must be the dense peak FLOPS of one device"),
        (
            {"peak_bandwidth": -1.0},
            "peak_bandwidth must be the peak memory bandwidth of one device in bytes/s",
        ),
        (
            {"peak_bandwidth": "3e12"},
            "peak_bandwidth must be the peak memory bandwidth of one device in bytes/s",
        ),
        ({"peak_bandwidth": float("inf")}, "peak_bandwidth must be the peak memory bandwidth"),
        ({"profile_every": 0}, "profile_every must be an int >= 1 or None, got 0"),
        ({"profile_every": 20.0}, "profile_every must be an int >= 1 or None, got 20.0"),
        (  # a re-profile window times its clean steps only: with none it ran nothing, silently
            {"profile_every": 20, "clean_steps": 0},
            "profile_every needs clean_steps 'auto' or an int >= 1, got clean_steps=0",
        ),
        ({"report": "short"}, "report must be one of ('summary', 'full'), got 'short'"),
        ({"report": None}, "report must be one of ('summary', 'full'), got None"),
    ],
)
def test_a_bad_value_is_refused_naming_the_argument_and_what_it_accepts(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Options(**kwargs)


def test_good_values_are_kept_as_given() -> None:
    o = Options(profile_step=0, clean_steps=0, output_file=Path("r.txt"), peak_flops=989e12)
    assert (o.profile_step, o.clean_steps, o.output_file, o.peak_flops) == (0, 0, Path("r.txt"), 989e12)


def test_options_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Options().profile_step = 3  # type: ignore[misc]
