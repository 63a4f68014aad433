"""The guard between the profiler's own work and training: own failures are said once and contained, the
user's exceptions pass unchanged (identity, traceback, context), interrupts are never caught."""

from __future__ import annotations

import warnings

import pytest

from flops_callbacks.guard import Guard


def test_own_work_that_fails_is_said_once_per_kind_and_the_cleanup_runs() -> None:
    guard, cleaned = Guard("FlopsProfilerCallback"), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with guard.own_work("writing x", "the metrics are logged", on_failure=lambda: cleaned.append(1)):
                raise OSError(28, "No space left on device")
    assert [str(w.message) for w in caught] == [
        "FlopsProfilerCallback: writing x failed (OSError: [Errno 28] No space left on device); "
        "the metrics are logged. Training goes on."
    ]
    assert cleaned == [1, 1, 1]
    guard.forget()  # a new run says it again
    with pytest.warns(UserWarning, match="writing x failed"), guard.own_work("writing x", "kept"):
        raise OSError("again")


def test_the_users_exception_passes_through_own_work_unchanged() -> None:
    guard, error = Guard("HFFlopsCallback"), LookupError("user's")

    def batch_size_fn(batch: object) -> int:
        raise error

    outer, inner = guard.own_work("reading the batch", "kept"), guard.own_work("an inner piece", "kept")
    with pytest.raises(LookupError) as raised, outer, inner:  # guards nest
        guard.user(batch_size_fn, object())
    assert raised.value is error and error.__context__ is None and error.__cause__ is None


def test_interrupts_are_never_caught_and_a_failing_cleanup_is_said_too() -> None:
    guard = Guard("FlopsProfiler")
    with pytest.raises(KeyboardInterrupt), guard.own_work("anything", "kept"):
        raise KeyboardInterrupt

    def cleanup() -> None:
        raise RuntimeError("cleanup broke")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard.own_work("the work", "kept", on_failure=cleanup):
            raise ValueError("work broke")
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "FlopsProfiler: the work failed",
        "FlopsProfiler: cleaning up failed",
    ]


def test_attempt_returns_own_failures_for_the_caller_to_say() -> None:
    guard = Guard("x")
    assert guard.attempt(lambda: None) is None
    assert isinstance(guard.attempt(lambda: 1 / 0), ZeroDivisionError)
