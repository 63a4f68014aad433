"""What both callbacks share: their session built from their arguments, and the constructor from a
DeepSpeed config's flops_profiler block (both callbacks inherit this code)."""

from __future__ import annotations

import inspect
import warnings

import pytest

from flops_callbacks.integrations.callback_base import SessionCallback
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.options import Options


@pytest.mark.parametrize("callback_class", [FlopsProfilerCallback, HFFlopsCallback])
def test_both_callbacks_hand_every_argument_to_the_options_which_check_them(callback_class: type) -> None:
    """Every argument is checked once, in flops_callbacks.options (tests/test_options.py); each
    callback hands them all over, so a bad one fails when the callback is built."""
    kwargs = dict(
        profile_step=4, clean_steps=2, module_depth=1, top_modules=2, detailed=True, print_profile=False,
        output_file="report.txt", batch_size_fn=len, tokens_fn=len, causal_attention="half",
        throughput=False, peak_flops=1e12, peak_bandwidth=3.35e12, report="full",
    )  # fmt: skip
    assert callback_class(**kwargs).session.options == Options(**kwargs)
    name = callback_class.__name__
    with pytest.raises(ValueError, match=f"^{name}: clean_steps must be 'auto' or an int >= 0, got -1"):
        callback_class(clean_steps=-1)
    with pytest.raises(ValueError, match=rf"^{name}: report must be one of \('summary', 'full'\), got 'all'"):
        callback_class(report="all")


@pytest.mark.parametrize("callback_class", [FlopsProfilerCallback, HFFlopsCallback])
def test_argument_errors_name_the_class_the_user_called(callback_class: type) -> None:
    name = callback_class.__name__
    with pytest.raises(
        TypeError, match=rf"^{name}\.__init__\(\) got an unexpected keyword argument 'profile_stepp'"
    ):
        callback_class(profile_stepp=3)
    arguments = len(inspect.signature(callback_class).parameters)
    with pytest.raises(TypeError, match=rf"^{name}\.__init__\(\) takes from 1 to {arguments + 1} positional"):
        callback_class(*range(arguments + 1))


def test_the_session_gets_the_arguments_and_the_class_name_in_its_messages() -> None:
    callback = SessionCallback(profile_step=3, clean_steps=1)
    assert callback.session.options == Options(profile_step=3, clean_steps=1)
    assert callback.session.owner == "SessionCallback" and callback.result is None


def test_a_deepspeed_block_becomes_the_arguments_and_kwargs_override_them() -> None:
    block = {"enabled": True, "profile_step": 5, "module_depth": 2, "top_modules": 3, "detailed": False}
    callback = SessionCallback.from_deepspeed_config({"train_batch_size": 8, "flops_profiler": block})
    assert (callback.session.options.profile_step, callback.session.options.top_modules) == (5, 3)
    assert callback.session.options.report == "full"  # DeepSpeed prints its whole profile
    assert callback.session.enabled
    override = SessionCallback.from_deepspeed_config(block, profile_step=7, clean_steps=1)
    assert (override.session.options.profile_step, override.session.options.clean_steps) == (7, 1)


def test_a_disabled_block_gives_a_callback_that_profiles_and_meters_nothing() -> None:
    callback = SessionCallback.from_deepspeed_config({"flops_profiler": {"enabled": False}})
    assert not callback.session.enabled and callback.session.meter is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even the "never reached" warning
        callback.session.train_start(0, max_steps=1)


def test_recompute_fwd_factor_is_accepted_and_said_to_be_measured() -> None:
    with pytest.warns(UserWarning, match="recompute_fwd_factor is ignored: recompute is measured"):
        SessionCallback.from_deepspeed_config({"enabled": True, "recompute_fwd_factor": 1.0})


def test_a_bad_value_in_the_block_fails_naming_it() -> None:
    with pytest.raises(ValueError, match="top_modules must be an int >= 1, got 0"):
        SessionCallback.from_deepspeed_config({"enabled": True, "top_modules": 0})
