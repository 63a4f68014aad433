"""ThroughputMeter, framework-free: flops per shape from the profile or measured once, intervals, pauses."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from flops_callbacks import metrics as names
from flops_callbacks.batch import leading_batch_size, shape_signature
from flops_callbacks.options import Options
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.result import WindowResult
from flops_callbacks.session import BACKWARD, OPTIMIZER_STEP, StepSession, TrainingContext
from flops_callbacks.throughput import ThroughputMeter

IN, OUT = 6, 2


def flops(batch: int) -> int:
    """Linear(IN, OUT) on an input that needs no grad: forward, weight and bias gradients."""
    return 2 * batch * IN * OUT + 2 * batch * IN * OUT + batch * OUT


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(batch).sum().backward()
    optimizer.step()


class Quiet:
    """An outlet that keeps what it is given: no console, no files."""

    is_logging_rank = True

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_dir(self) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))

    def console(self, text: str) -> None:
        pass

    def log_report(self, text: str, html: str, step: int) -> None:
        pass


def profiled_step(model: nn.Module, batches: list[torch.Tensor]) -> WindowResult:
    """A real counting step over ``batches`` (its micro-batches), dp = 2, published as a window of one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=0, peak_flops=1e6, throughput=False), "test")
    session.train_start(0)
    session.step_start(0, model, lambda: TrainingContext(ParallelSizes(world_size=2, data_parallel=2)))
    optimizer.zero_grad()
    for batch in batches:
        session.micro_batch_start(batch)
        loss = model(batch).sum()
        session.phase(BACKWARD)
        loss.backward()
        session.micro_batch_end()
    session.phase(OPTIMIZER_STEP)
    optimizer.step()
    session.step_end(1, Quiet())
    session.train_end(1, Quiet())
    assert session.result is not None
    return session.result


def profiled_meter(model: nn.Module, batches: list[torch.Tensor], **kwargs: object) -> ThroughputMeter:
    """A meter started from a counting step over ``batches``, with tokens = numel."""
    meter = ThroughputMeter(leading_batch_size, tokens_fn=lambda b: b.numel(), **kwargs)  # type: ignore[arg-type]
    meter.start(profiled_step(model, batches), model, [shape_signature(b) for b in batches])
    return meter


def metered_step(meter: ThroughputMeter, model: nn.Module, batch: torch.Tensor) -> None:
    meter.begin_micro_batch(batch, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer, batch)
    meter.end_micro_batch()
    meter.end_step()


def test_the_profiled_shape_needs_no_counting_and_a_new_shape_is_measured_once_exactly() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [torch.randn(4, IN)])
    assert meter.flops_per_micro_batch == {shape_signature(torch.randn(4, IN)): flops(4)}
    start = time.perf_counter()
    metered_step(meter, model, torch.randn(4, IN))
    metered_step(meter, model, torch.randn(3, IN))  # new shape: measured, its step left out
    assert not model._forward_hooks and not torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    metered_step(meter, model, torch.randn(3, IN))
    metrics = meter.metrics()
    elapsed = time.perf_counter() - start
    assert meter.flops_per_micro_batch[shape_signature(torch.randn(3, IN))] == flops(3)
    rate = metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
    assert metrics[names.THROUGHPUT_FLOPS_PER_SEC] / rate == pytest.approx((flops(4) + flops(3)) / 7 / 2)
    assert metrics[names.THROUGHPUT_TOKENS_PER_SEC] == pytest.approx(IN * rate)
    assert metrics[names.THROUGHPUT_MFU] == pytest.approx(metrics[names.THROUGHPUT_FLOPS_PER_SEC] / 1e6)
    assert rate > 7 * 2 / elapsed  # samples of both replicas, over less than the whole time


def test_paused_time_and_samples_are_left_out_of_the_interval() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [torch.randn(4, IN)])
    meter.metrics()  # a fresh interval
    metered_step(meter, model, torch.randn(4, IN))
    meter.pause(evaluating=True)
    time.sleep(0.2)
    metered_step(meter, model, torch.randn(4, IN))  # paused: not counted, and end_step does not resume
    meter.resume()
    metrics = meter.metrics()
    # one step of 4 samples x 2 replicas counted, the 0.2 s sleep and the paused step not
    assert metrics[names.THROUGHPUT_SAMPLES_PER_SEC] > 4 * 2 / 0.2
    assert meter.metrics() == {}  # nothing counted since


def test_past_max_signatures_intervals_log_samples_not_flops_and_warn_once() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [torch.randn(4, IN)], max_signatures=1)
    meter.metrics()
    with pytest.warns(UserWarning, match="more than 1 batch shapes") as warned:
        metered_step(meter, model, torch.randn(3, IN))
        metered_step(meter, model, torch.randn(2, IN))
    assert len(warned) == 1
    metrics = meter.metrics()
    assert set(metrics) == {names.THROUGHPUT_SAMPLES_PER_SEC, names.THROUGHPUT_TOKENS_PER_SEC}
    metered_step(meter, model, torch.randn(4, IN))
    assert names.THROUGHPUT_FLOPS_PER_SEC in meter.metrics()


def test_a_profiled_step_of_mixed_shapes_seeds_nothing_and_close_stops_a_measurement() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [torch.randn(4, IN), torch.randn(3, IN)])
    assert meter.flops_per_micro_batch == {}
    meter.begin_micro_batch(torch.randn(4, IN), model)  # measuring starts: module hooks and modes on
    assert torch.nn.modules.module._global_forward_pre_hooks
    assert torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    meter.close()
    assert not torch.nn.modules.module._global_forward_pre_hooks and not meter.started
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_an_evaluation_before_training_does_not_keep_later_intervals_paused() -> None:
    model, meter = nn.Linear(IN, OUT), ThroughputMeter(leading_batch_size)
    meter.pause(evaluating=True)  # e.g. trainer.predict() before training: no resume event follows
    first = torch.randn(4, IN)
    meter.start(profiled_step(model, [first]), model, [shape_signature(first)])
    metered_step(meter, model, torch.randn(3, IN))  # a measuring step: its pause ends with the step
    metered_step(meter, model, torch.randn(3, IN))
    assert meter.metrics()[names.THROUGHPUT_FLOPS_PER_SEC] > 0
