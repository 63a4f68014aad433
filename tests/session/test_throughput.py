"""ThroughputMeter, framework-free: flops per shape from the window's table (never counted), pauses."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from flops_callbacks import metrics as names
from flops_callbacks.options import Options
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.publish import publish
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.batch import leading_batch_size, shape_signature
from flops_callbacks.session.meter import ThroughputMeter, audit_every
from flops_callbacks.session.step_session import StepSession
from tests.support import first_clean

IN, OUT = 6, 2


def flops(batch: int) -> int:
    """Linear(IN, OUT) on an input that needs no grad: forward, weight and bias gradients."""
    return 2 * batch * IN * OUT + 2 * batch * IN * OUT + batch * OUT


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(batch).sum().backward()
    optimizer.step()


class Quiet:
    """A sink that keeps what it is given: no console, no files."""

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


def window(model: nn.Module, sizes: list[int]) -> StepSession:
    """A real window over steps of one micro-batch of each size in ``sizes`` (counting, module timing,
    then clean steps: new sizes are counted on steps of their own until predicted), dp = 2."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = Options(profile_step=0, clean_steps=1, peak_flops=1e6, throughput=False)
    session = StepSession(options, "test", publish=publish)
    session.train_start(0)
    for step, size in enumerate(sizes):
        session.step_start(step, model, lambda: TrainingContext(ParallelSizes(world_size=2, data_parallel=2)))
        optimizer.zero_grad()
        batch = torch.randn(size, IN)
        session.micro_batch_start(batch)
        loss = model(batch).sum()
        session.phase(BACKWARD)
        loss.backward()
        session.micro_batch_end()
        session.phase(OPTIMIZER_STEP)
        optimizer.step()
        session.step_end(step + 1, Quiet())
    session.train_end(len(sizes), Quiet())
    assert session.result is not None
    return session


def profiled_meter(model: nn.Module, sizes: list[int], audit: int | str = "auto") -> ThroughputMeter:
    """A meter started from a window over ``sizes``, with tokens = numel."""
    session = window(model, sizes)
    meter = ThroughputMeter(leading_batch_size, tokens_fn=lambda b: b.numel(), audit=audit)  # type: ignore[arg-type]
    assert session.result is not None
    meter.start(session.result, model, session.flops)
    return meter


def metered_step(meter: ThroughputMeter, model: nn.Module, batch: torch.Tensor) -> None:
    meter.micro_batch_start(batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, optimizer, batch)
    meter.micro_batch_end()
    meter.step_end()


def test_every_batch_after_the_window_has_its_exact_flops_and_none_is_counted() -> None:
    model = nn.Linear(IN, OUT)
    # sizes 4 (counting, module timing), 9 and 3 (new, outside the counted range: counted on steps of
    # their own), 5 (predicted inside 3 .. 9, counted once to check the table), 6 (predicted)
    meter = profiled_meter(model, [4] * first_clean(0) + [9, 3, 5, 6])
    assert meter.flops.source(shape_signature(torch.randn(7, IN))) == "predicted"
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda *_: seen.append(bool(_get_current_dispatch_mode_stack())))
    outer = time.perf_counter()  # opens before the interval, closes after it
    meter.metrics()  # a fresh interval
    inner = time.perf_counter()  # opens after the interval, closes before it
    for size in (4, 9, 9, 7):
        metered_step(meter, model, torch.randn(size, IN))
    inner = time.perf_counter() - inner
    metrics = meter.metrics()
    outer = time.perf_counter() - outer
    assert seen == [False] * 4  # no counting mode on any step after the window
    rate = metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
    samples = 4 + 9 + 9 + 7
    assert metrics[names.THROUGHPUT_FLOPS_PER_SEC] / rate == pytest.approx(
        (flops(4) + 2 * flops(9) + flops(7)) / samples / 2
    )
    assert metrics[names.THROUGHPUT_TOKENS_PER_SEC] == pytest.approx(IN * rate)
    assert metrics[names.THROUGHPUT_MFU] == pytest.approx(metrics[names.THROUGHPUT_FLOPS_PER_SEC] / 1e6)
    # the interval is the wall time between the two metrics() calls: the stopwatches bound it both sides
    assert samples * 2 / outer <= rate <= samples * 2 / inner


def test_paused_time_and_samples_are_left_out_of_the_interval() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [4, 4, 4])
    meter.metrics()  # a fresh interval
    metered_step(meter, model, torch.randn(4, IN))
    meter.pause()
    time.sleep(0.2)
    metered_step(meter, model, torch.randn(4, IN))  # paused: not counted, and step_end does not resume
    meter.resume()
    metrics = meter.metrics()
    # one step of 4 samples x 2 replicas counted, the 0.2 s sleep and the paused step not
    assert metrics[names.THROUGHPUT_SAMPLES_PER_SEC] > 4 * 2 / 0.2
    assert meter.metrics() == {}  # nothing counted since


def test_a_pause_learned_of_late_starts_at_the_last_steps_end_or_the_last_resume() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [4, 4, 4])
    meter.interval()  # a fresh interval
    metered_step(meter, model, torch.randn(4, IN))  # its end: where the first late pause starts
    time.sleep(0.2)  # a save no event announced
    meter.pause(late=True)
    meter.resume()
    time.sleep(0.05)  # training
    meter.pause()
    time.sleep(0.2)  # an evaluation announced
    meter.resume()
    time.sleep(0.2)  # a save no event announced, after it: from the resume on
    meter.pause(late=True)
    meter.resume()
    seconds = meter.interval().seconds
    assert 0.05 <= seconds < 0.1  # the step and the 0.05 s sleep; none of the 0.6 s paused


def test_a_shape_the_window_cannot_predict_logs_samples_not_flops_and_warns_once() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [4, 4, 4], audit=0)  # one counted shape, no audit: nothing to predict from
    meter.metrics()
    with pytest.warns(UserWarning, match="neither counted nor can predict") as warned:
        metered_step(meter, model, torch.randn(3, IN))
        metered_step(meter, model, torch.randn(2, IN))
    assert len(warned) == 1
    metrics = meter.metrics()
    assert set(metrics) == {
        names.THROUGHPUT_SAMPLES_PER_SEC,
        names.THROUGHPUT_TOKENS_PER_SEC,
        names.THROUGHPUT_PROFILER_SECONDS,
    }
    assert metrics[names.THROUGHPUT_PROFILER_SECONDS] == 0.0  # no count off the clock: no fake counts here
    metered_step(meter, model, torch.randn(4, IN))
    assert names.THROUGHPUT_FLOPS_PER_SEC in meter.metrics()


def test_a_later_micro_batch_of_a_step_is_looked_up_as_one_and_close_stops_metering() -> None:
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [4, 4, 4], audit=0)
    meter.metrics()
    meter.micro_batch_start(torch.randn(4, IN))
    with pytest.warns(UserWarning, match="neither counted nor can predict"):
        meter.micro_batch_start(torch.randn(4, IN))  # no window step had two micro-batches
    meter.step_end()
    assert names.THROUGHPUT_FLOPS_PER_SEC not in meter.metrics()
    meter.close()
    assert meter.metrics() == {}


def test_an_evaluation_before_training_does_not_keep_later_intervals_paused() -> None:
    model, meter = nn.Linear(IN, OUT), ThroughputMeter(leading_batch_size)
    meter.pause()  # e.g. trainer.predict() before training: no resume event follows
    session = window(model, [4, 4, 4])
    assert session.result is not None
    meter.start(session.result, model, session.flops)
    metered_step(meter, model, torch.randn(4, IN))
    assert meter.metrics()[names.THROUGHPUT_FLOPS_PER_SEC] > 0


class EveryOtherStep(nn.Module):
    """Linear(IN, OUT) after a 20 ms sleep (a step's time the count barely adds to: audits come at their
    closest spacing), and on every other call four more of it: work of a 2-step cycle, as a GAN's
    generator stepping every other batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN, OUT)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        self.calls += 1
        y = self.linear(x)
        for _ in range(4 if self.calls % 2 else 0):
            y = y + self.linear(x)
        return y


@pytest.mark.parametrize("cost", [(1.0, 1.0), (1.0, 1.05), (0.01, 0.0125), (0.002, 0.1)])
def test_auto_audits_are_spaced_off_every_short_cycle_and_a_given_spacing_is_kept(cost: tuple) -> None:
    every = audit_every("auto", *cost)
    assert every is not None and every >= 10
    assert all(every % period for period in range(2, 9))  # no cycle of 2 .. 8 steps divides it
    assert audit_every(10, *cost) == 10


def test_work_of_a_two_step_cycle_the_window_saw_one_side_of_is_found_by_the_audits() -> None:
    model = EveryOtherStep()
    meter = profiled_meter(model, [4] * first_clean(0), audit=11)  # odd, as "auto"'s spacings are
    assert meter.every == 11
    with pytest.warns(UserWarning, match=r"did [\d.]+x the flops the shape table gave") as said:
        for _ in range(2 * meter.every + 2):  # the second audit is on the other step of the cycle
            metered_step(meter, model, torch.randn(4, IN))
    ratio = float(re.search(r"did ([\d.]+)x", str(said[0].message)).group(1))  # type: ignore[union-attr]
    assert ratio < 0.25 or ratio > 4  # five Linears' work against one's (and its additions)


def test_a_window_with_no_clean_step_schedules_no_auto_audit_and_counts_a_new_shape_as_it_comes() -> None:
    """The window timed no clean step (its counting step stood in): "auto" has nothing to weigh a count
    against. It weighed the counting step against itself (no extra cost) and audited every 11 steps:
    17-19% of a run's time. A shape the table cannot give is still counted as it comes."""
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [4] * first_clean(0))
    assert meter.every is None
    for _ in range(12):
        metered_step(meter, model, torch.randn(4, IN))
    metered_step(meter, model, torch.randn(7, IN))  # a batch size the window never saw
    flops = meter.metrics()[names.THROUGHPUT_FLOPS_PER_SEC]
    assert flops > 0  # counted: known from then on


def test_an_audited_steps_wait_for_its_batch_is_out_of_the_interval_as_its_time_and_samples() -> None:
    """Six steps after the window, each waiting WAIT for its batch, every third audited (flops_audit=3:
    steps 3 and 6): the interval holds the four others, their waits included, and not the audited steps'
    waits (0.67x a stopwatch over the unaudited steps when it did)."""
    wait, size = 0.03, 4
    model = nn.Linear(IN, OUT)
    meter = profiled_meter(model, [size] * first_clean(0), audit=3)
    counted: list[bool] = []  # each step's forward: under the audit's counting mode or not
    model.register_forward_pre_hook(lambda *_: counted.append(bool(_get_current_dispatch_mode_stack())))
    meter.metrics()  # a fresh interval
    for step in range(6):
        time.sleep(wait)  # the loader's fetch of the next batch
        metered_step(meter, model, torch.randn(size, IN))
        if step == 4:  # an evaluation right before the audited step: its resume keeps the wait out
            meter.pause()
            meter.resume()
    assert counted == [False, False, True, False, False, True]
    rate = meter.metrics()[names.THROUGHPUT_SAMPLES_PER_SEC]
    samples = 4 * size * 2  # the four unaudited steps' samples, over both data-parallel replicas
    assert samples / (5 * wait) < rate <= samples / (4 * wait)  # four waits, not six
