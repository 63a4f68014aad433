"""The clean steps' figures: the median's distribution-free interval and clean_steps="auto"."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from flops_callbacks.options import Options
from flops_callbacks.session.step_session import StepSession
from flops_callbacks.session.window_plan import CLEAN_MAX, CLEAN_MIN, median_interval, median_known
from tests.support import B, Sink, run, window_end


def test_the_medians_interval_is_the_order_statistics_binomial_tables_give() -> None:
    # n = 5: P(X <= 0) = 1/32 <= 5%, P(X <= 1) = 6/32 > 5%: (x_(1), x_(5)), 93.75% confidence
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # P(X <= 0) = 1/16 > 5%: no 90% interval
    # n = 20: P(X <= 5) = 21700/2^20 = 2.07% <= 5%, P(X <= 6) = 5.77% > 5%: (x_(6), x_(15))
    assert sum(math.comb(20, i) for i in range(6)) == 21700
    assert median_interval([float(i) for i in range(1, 21)]) == (6.0, 15.0)


def test_the_median_is_known_when_its_interval_lies_within_3_percent() -> None:
    assert median_known([1.0, 1.01, 0.99, 1.02, 0.98])
    assert not median_known([1.0, 1.01, 0.99, 1.02, 0.9])  # x_(1) is 10% below the median
    assert not median_known([1.0, 1.0, 1.0])  # too few steps for a 90% interval


def test_auto_clean_steps_stop_when_the_median_is_known_or_at_20() -> None:
    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0), "test")
    assert session.options.clean_steps == "auto"
    session.train_start(0)
    sink = Sink()
    step = 0
    while session.result is None and step < window_end(0, CLEAN_MAX):
        run(session, model, optimizer, range(step, step + 1), sink, batch=torch.randn(B, 6))
        step += 1
    r = session.result
    assert r is not None
    clean = r.figures().spreads["iter"].steps
    assert CLEAN_MIN <= clean <= CLEAN_MAX and len(r.steps.clean) == clean
    # it stopped at the first step count whose median's interval was within +-3%, or at 20
    iters = list(r.figures().iters)
    assert len(iters) == clean
    assert median_known(iters) or clean == CLEAN_MAX
    assert not any(median_known(iters[:n]) for n in range(CLEAN_MIN, clean))
