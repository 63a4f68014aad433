"""StepProfiler in real loops on CPU: a plain PyTorch loop, a Lightning Fabric loop and an accelerate
loop, each written as the README shows (one ``with prof.step(batch):`` line). Latencies against known
sleeps (tests/sleepy.py: a forward sleeping 30 ms, a backward 20 ms, an optimizer step 10 ms), metrics
read back from TensorBoard files written through ``fabric.log_dict`` and ``accelerator.log``, flops of
two accumulated micro-batches against torch's FlopCounterMode, and nothing left behind on any exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from tests.sleepy import SleepInBackward, Sleepy, SleepySGD
from tests.support import leftovers, run_bounded, window_end

FWD, BWD, STEP = 0.03, 0.02, 0.01  # seconds slept by the forward, the backward, the optimizer step
LOSS_FWD, LOSS_BWD = 0.015, 0.025  # seconds slept by a loss computed outside the model, and its backward
BATCH = 3
PROFILE_STEP, CLEAN = 2, 3  # three clean steps: a median one hiccup cannot move
WINDOW = dict(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False)
END = window_end(PROFILE_STEP, CLEAN)  # counting, module timing, the check, three clean steps
STEPS = END + 2  # two steps after


class SleepyNet(nn.Module):
    """The user's model: a sleepy block and a head (the tree's root is this class)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Sleepy(FWD, BWD, tiny_ops=4)  # few ops: bf16 autocast casts each one
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batches(n: int) -> list[torch.Tensor]:
    return [torch.randn(BATCH, 4) for _ in range(n)]


def assert_sleeps_measured(metrics: dict[str, float]) -> None:
    """Each phase holds its own sleep: never less (a sleep does not end early). One-sided, as a loaded
    machine wakes sleepers late, and enough: phases are contiguous, so a boundary in the wrong place
    moves a whole sleep out of one phase, which then reads less than its sleep."""
    for key, sleep in ((names.FWD_LATENCY, FWD), (names.BWD_LATENCY, BWD), (names.STEP_LATENCY, STEP)):
        assert metrics[key] >= 0.98 * sleep, (key, metrics[key])
    assert 0.98 * (FWD + BWD + STEP) <= metrics[names.ITER_LATENCY] < 3 * (FWD + BWD + STEP)


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files under ``log_dir``: tag -> [(step, value)]."""
    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


# --- a plain loop ------------------------------------------------------------------------------------


def test_plain_loop_measures_each_phases_sleep_and_logs_the_window_then_throughput() -> None:
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), STEP)
    logged: list[tuple[int, dict[str, float]]] = []
    before = leftovers(model, optimizer)
    prof = StepProfiler(model, log=lambda m, s: logged.append((s, m)), log_every_n_steps=1, **WINDOW)
    assert prof.metrics is None and prof.result is None
    for x in batches(STEPS):
        with prof.step(x):
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    assert leftovers(model, optimizer) == before
    assert prof.metrics is not None and prof.result is not None
    assert_sleeps_measured(prof.metrics)
    assert prof.result.samples == BATCH
    assert prof.result.profile.model.class_name == "SleepyNet"  # the user's model is the root
    # the window's metrics once, at the step it ended, then throughput/* at every later step
    window = [(step, m) for step, m in logged if names.FWD_LATENCY in m]
    assert [step for step, _ in window] == [END] and window[0][1] == prof.metrics
    after = [step for step, m in logged if "throughput/samples_per_sec" in m]
    assert after == [END + 1, END + 2]
    rate = next(m for step, m in logged if step == END + 2)["throughput/samples_per_sec"]
    assert BATCH / (1.5 * (FWD + BWD + STEP)) < rate < BATCH / (FWD + BWD + STEP)


def loss_outside_the_model(output: torch.Tensor) -> torch.Tensor:
    """The loop's own loss: it sleeps LOSS_FWD, and its backward, the first autograd runs, LOSS_BWD."""
    time.sleep(LOSS_FWD)
    return SleepInBackward.apply(output, LOSS_BWD).pow(2).mean()


@pytest.mark.parametrize("call", ["loss.backward()", "torch.autograd.backward(loss)"])
def test_a_loss_computed_outside_the_model_is_forward_work_and_its_backward_starts_the_backward(
    call: str,
) -> None:
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), STEP)
    before = leftovers(model, optimizer)
    prof = StepProfiler(model, **WINDOW)
    for x in batches(STEPS):
        with prof.step(x):
            loss = loss_outside_the_model(model(x))
            loss.backward() if call == "loss.backward()" else torch.autograd.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    assert leftovers(model, optimizer) == before
    metrics = prof.metrics
    assert metrics is not None
    # one-sided, as assert_sleeps_measured: the loss's backward read as forward would leave the
    # backward LOSS_BWD short
    assert metrics[names.FWD_LATENCY] >= 0.98 * (FWD + LOSS_FWD), metrics[names.FWD_LATENCY]
    assert metrics[names.BWD_LATENCY] >= 0.98 * (BWD + LOSS_BWD), metrics[names.BWD_LATENCY]
    assert metrics[names.STEP_LATENCY] >= 0.98 * STEP


def accumulated(prof: StepProfiler, model: nn.Module, optimizer: torch.optim.Optimizer, xs: list) -> None:
    """A loop of two micro-batches an optimizer step over ``xs`` under ``prof``, then closed."""
    for i, x in enumerate(xs):
        with prof.step(x):
            model(x).sum().backward()
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    prof.close()


def test_two_micro_batches_per_optimizer_step_report_the_flops_of_both() -> None:
    """Gradient accumulation: the block without an optimizer step is a micro-batch of the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = batches(2 * STEPS)
    xs = [torch.randn(BATCH, 8) for _ in xs]
    prof = StepProfiler(model, **WINDOW)
    accumulated(prof, model, optimizer, xs)
    result = prof.result
    assert result is not None and result.micro_batches == 2 and result.samples == 2 * BATCH
    with FlopCounterMode(display=False) as reference:
        for x in xs[:2]:
            model(x).sum().backward()
    # by hand: forward 2 x 3 x (8 x 16 + 16 x 4) MACs per micro-batch = 1152 flops; backward: the
    # first layer's weight gradient only (its input needs none), the second's input and weight
    assert 2 * result.profile.fwd_macs == 2 * 1152 == 2 * 2 * BATCH * (8 * 16 + 16 * 4)
    bwd_by_hand = 2 * 2 * BATCH * (8 * 16 + 2 * 16 * 4)
    assert 2 * (result.profile.fwd_macs + result.profile.bwd_macs) == reference.get_total_flops()
    assert 2 * result.profile.bwd_macs == bwd_by_hand
    model.zero_grad()


def test_a_step_the_loops_end_cuts_between_its_micro_batches_is_no_clean_step() -> None:
    """Data that runs out between a step's micro-batches: the optimizer step never runs, and at close()
    that half step is none of the window's (it read as a clean step of half the samples and wall 0 s)."""
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), STEP)
    prof = StepProfiler(model, profile_step=PROFILE_STEP, clean_steps=CLEAN + 5, print_profile=False)
    accumulated(prof, model, optimizer, batches(2 * END + 1))  # END full steps, and one micro-batch more
    result = prof.result
    assert result is not None and prof.global_step == END
    first_clean = END - CLEAN
    assert result.steps.clean == tuple(range(first_clean, END)) and result.steps.skipped == ()
    steps = result.figures().steps
    assert [s.work.samples for s in steps] == [2 * BATCH] * CLEAN
    assert all(s.seconds.wall >= 2 * FWD + 2 * BWD + STEP for s in steps)  # every step's own sleeps
    metrics = prof.metrics
    # each step's wall holds its iter: the wall rate is at most the steps' samples over their summed iter
    # (the median step's rate may lie either side of it: one fast step of three moved it past on a loaded
    # machine)
    iters = sum(s.seconds.iter for s in steps)
    assert metrics[names.WALL_SAMPLES_PER_SEC] <= CLEAN * 2 * BATCH / iters * (1 + 1e-9)
    assert metrics[names.ITER_LATENCY] >= 2 * FWD + 2 * BWD + STEP


DATA = 0.02  # seconds the loader below waits for each micro-batch


def test_the_wait_for_every_micro_batch_is_data_and_a_declared_pause_is_no_part_of_the_step() -> None:
    """Four micro-batches a step, each fetched in DATA: the step's data time holds the four waits (the
    later ones lie between the blocks); then an evaluation of 3 x DATA declared with pause() / resume()
    after each step: neither data nor wall. Known sleeps, one-sided where a loaded machine wakes late."""
    micro, evaluation = 4, 3 * DATA
    for paused in (False, True):
        torch.manual_seed(0)
        model = SleepyNet()
        optimizer = SleepySGD(model.parameters(), STEP)
        prof = StepProfiler(model, **WINDOW)
        for i in range(micro * STEPS):
            time.sleep(DATA)  # the loader's fetch of the next micro-batch
            x = torch.randn(BATCH, 4)
            with prof.step(x):
                model(x).sum().backward()
                if i % micro == micro - 1:
                    optimizer.step()
                    optimizer.zero_grad()
            if paused and i % micro == micro - 1:
                prof.pause()
                time.sleep(evaluation)
                prof.resume()
        prof.close()
        metrics = prof.metrics
        assert metrics is not None
        data, wall = metrics[names.DATA_LATENCY], metrics[names.WALL_LATENCY]
        # the later waits were "other" (data read 1 x DATA); the pause was data (and in the wall)
        assert micro * DATA <= data < micro * DATA + 0.75 * evaluation, (paused, data)
        other = wall - data - metrics[names.ITER_LATENCY]
        assert 0 <= other < 0.75 * evaluation, (paused, other)


@pytest.mark.parametrize("where", ["before the forward", "after the optimizer step"])
def test_a_pause_declared_inside_the_block_is_no_part_of_the_phase_it_falls_in(where: str) -> None:
    """An evaluation of 0.1 s declared with pause() / resume() inside the block, at its start (in the
    forward phase) or after the optimizer step (in the step phase): out of that phase as out of the wall
    (it was left in the phase: a step phase of 10x the wall step, "bound by the optimizer step")."""
    evaluation = 0.1
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), STEP)
    prof = StepProfiler(model, **WINDOW)

    def evaluate() -> None:
        prof.pause()
        time.sleep(evaluation)
        prof.resume()

    for x in batches(STEPS):
        with prof.step(x):
            if where == "before the forward":
                evaluate()
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if where == "after the optimizer step":
                evaluate()
    prof.close()
    metrics = prof.metrics
    assert metrics is not None
    assert_sleeps_measured(metrics)  # each phase still holds its own sleep
    assert (
        metrics[names.FWD_LATENCY] < FWD + evaluation / 2
        and metrics[names.STEP_LATENCY] < STEP + evaluation / 2
    )
    assert metrics[names.ITER_LATENCY] <= metrics[names.WALL_LATENCY] < FWD + BWD + STEP + evaluation / 2


def test_the_profilers_own_work_between_blocks_is_in_no_steps_data_phase_or_wall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The profiler's own work in a window step's events (its votes, its step start), made long (OWN each):
    a loop fed from memory waits for no data, and read it as data ("bound by the input pipeline": 37% of a
    small model's step) or as the step's other. Each phase still holds its own sleep alone."""
    from flops_callbacks.session.window_plan import WindowPlan

    own = 0.03
    for name in ("vote", "start_step"):
        slowed = getattr(WindowPlan, name)

        def slow(self: WindowPlan, *args: object, _call: object = slowed, **kwargs: object) -> object:
            time.sleep(own)
            return _call(self, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(WindowPlan, name, slow)
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), STEP)
    prof = StepProfiler(model, **WINDOW)
    for x in batches(STEPS):  # from memory: no wait for data
        with prof.step(x):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    metrics = prof.metrics
    assert metrics is not None
    assert_sleeps_measured(metrics)
    assert metrics[names.DATA_LATENCY] < own / 2, metrics
    assert metrics[names.ITER_LATENCY] < FWD + BWD + STEP + own / 2, metrics
    assert metrics[names.WALL_LATENCY] < metrics[names.ITER_LATENCY] + own / 2, metrics


def test_a_step_outside_the_block_is_said_once_and_stopiteration_in_a_block_ends_the_data() -> None:
    """The loop's step() after the block: no step ends, a warning says so once (the counting step would
    count every block of the run). Then a loop whose ``next(it)`` raises StopIteration inside the block:
    the data ended, not the step; ``close()`` publishes the window so far, as after a ``break``."""
    from flops_callbacks.integrations.step_profiler import _UNSTEPPED

    model, xs = nn.Linear(4, 2), [torch.randn(BATCH, 4) for _ in range(_UNSTEPPED + 2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = StepProfiler(model, profile_step=50, print_profile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            with prof.step(x):
                model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        prof.close()
    said = [str(w.message) for w in caught if "ran no optimizer step" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"StepProfiler: {_UNSTEPPED} blocks in a row ran no")
    assert prof.global_step == 0
    # a block after close() runs unprofiled, said once, and the result stays the run's
    window = StepProfiler(model, profile_step=1, clean_steps=1, print_profile=False)
    for x in xs[:8]:
        with window.step(x):
            model(x).sum().backward()
            optimizer.step()
    window.close()
    kept = window.result
    assert kept is not None
    with pytest.warns(
        UserWarning, match=r"a block after close\(\), which ended this profiler's run"
    ) as after:
        for x in xs[:8]:
            with window.step(x):
                hooks = bool(
                    model._forward_pre_hooks or model._forward_hooks or _get_current_dispatch_mode_stack()
                )
                model(x).sum().backward()
                optimizer.step()
    assert len(after) == 1 and window.result is kept and not hooks
    # a short loop that never reaches that many blocks is told at close(), not only "no profile ran"
    prof = StepProfiler(model, profile_step=2, print_profile=False)
    with pytest.warns(UserWarning, match=r"StepProfiler: 10 blocks ran and none ran an optimizer step"):
        for x in xs[:10]:
            with prof.step(x):
                model(x).sum().backward()
            optimizer.step()
        prof.close()

    data = iter([torch.randn(BATCH, 4) for _ in range(END - 2)])  # ends before the window's last clean step
    prof = StepProfiler(model, **WINDOW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while True:
            try:
                with prof.step():
                    x = next(data)
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except StopIteration:
                break
        prof.close()
    assert prof.global_step == END - 2 and prof.result is not None  # the window as far as it went
    # its clean steps that ran: the block whose next() ended the data stepped nothing, and is none of them
    assert prof.result.steps.clean == (END - CLEAN,), prof.result.steps


def test_a_ctrl_c_while_the_windows_end_measures_the_hooks_cost_leaves_no_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window's end times a probe module with the module timer's global hooks on and off; a
    KeyboardInterrupt at the entry of the probe's stop() (where one lands: a call's first bytecode) left
    the hooks on for the rest of the process. The session's close removes them."""
    from torch.nn.modules import module as torch_module

    from flops_callbacks.timing import module_timer

    real_stop = module_timer.ModuleTimer.stop

    def interrupted_stop(self: module_timer.ModuleTimer) -> None:
        if sys._getframe(1).f_code.co_name == "hook_cost":  # the probe's timer, once
            monkeypatch.setattr(module_timer.ModuleTimer, "stop", real_stop)
            raise KeyboardInterrupt
        real_stop(self)

    monkeypatch.setattr(module_timer.ModuleTimer, "stop", interrupted_stop)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = leftovers(model, optimizer)
    prof = StepProfiler(model, **WINDOW)
    with pytest.raises(KeyboardInterrupt):
        try:
            for _ in range(STEPS):
                x = torch.randn(BATCH, 8)
                with prof.step(x):
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
        finally:
            prof.close()
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
    assert leftovers(model, optimizer) == before


def test_a_step_a_gradient_scaler_skipped_still_ends_the_optimizer_step() -> None:
    """A plain loop with ``torch.amp.GradScaler`` and inf gradients on the counting step: the scaler skips
    the optimizer's step(), and the loop's step ends all the same, as under accelerate and Fabric (it was
    merged into the next one: the counting step counted two micro-batches, and the profiler's steps fell
    one behind the loop's). Nothing of the scaler's wrapper stays."""
    original = torch.amp.GradScaler.__dict__["step"]
    model = nn.Linear(4, 2, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    prof = StepProfiler(model, **WINDOW)
    x = torch.randn(BATCH, 4)
    for i in range(STEPS):
        with prof.step(x):
            scaler.scale(model(x).sum()).backward()
            if i == PROFILE_STEP:
                model.weight.grad[0, 0] = float("inf")  # the scaler skips this step
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    prof.close()
    assert scaler.get_scale() < 65536.0  # the scaler did skip a step (and backed off)
    assert prof.global_step == STEPS and prof.result is not None
    assert prof.result.profile.fwd_flops == 2 * BATCH * 4 * 2  # one micro-batch's Linear(4, 2)
    assert torch.amp.GradScaler.__dict__["step"] is original


def test_a_lazy_model_profiled_from_step_0_has_its_window_start_once_its_first_forward_made_it() -> None:
    """``LazyLinear`` has no weight before its first forward: a window at step 0 would count nothing
    (it failed, and was dropped with a warning); it starts at step 1, on the parameters that forward made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    prof = StepProfiler(model, profile_step=0, clean_steps=CLEAN, print_profile=False)
    optimizer: torch.optim.Optimizer | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning fails the test
        for x in [torch.randn(BATCH, 8) for _ in range(window_end(1, CLEAN) + 2)]:
            with prof.step(x):
                model(x).sum().backward()
                optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
                optimizer.step()
                optimizer.zero_grad()
    prof.close()
    result = prof.result
    assert result is not None and result.steps.first == 1
    assert result.profile.fwd_macs == BATCH * (8 * 16 + 16 * 4) and result.profile.params == 8 * 16 + 16 * 4


def step_raising_in_module_timing(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, i: int, boom: Exception
) -> None:
    """Loop step ``i``'s training; the module-timing step raises ``boom`` inside its forward."""
    loss = model(x).sum()
    if i == PROFILE_STEP + 1:
        raise boom
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_exception_in_a_block_passes_unchanged_and_leaves_nothing() -> None:
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), 0.0)
    before = leftovers(model, optimizer)
    boom = RuntimeError("the user's own error")
    with pytest.raises(RuntimeError) as raised, StepProfiler(model, **WINDOW) as prof:
        for i, x in enumerate(batches(STEPS)):
            with prof.step(x):
                step_raising_in_module_timing(model, optimizer, x, i, boom)
    assert raised.value is boom
    assert leftovers(model, optimizer) == before
    assert prof.result is None


def test_bad_arguments_are_said_at_construction_naming_the_argument() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="StepProfiler: profile_step must be an int >= 0"):
        StepProfiler(model, profile_step=-1)
    with pytest.raises(ValueError, match=r"argument\(s\) \['profile_steps'\] \(did you mean 'profile_step'"):
        StepProfiler(model, profile_steps=3)
    with pytest.raises(ValueError, match=r"\['logdir'\] \(did you mean 'log_dir'\?\); its arguments are \["):
        StepProfiler(model, logdir="runs")  # one of StepProfiler's own arguments, not an option
    prof = StepProfiler(model)
    with pytest.raises(ValueError, match="StepProfiler.step: optimizer_step must be True, False or None"):
        prof.step(optimizer_step="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StepProfiler.mark: phase must be one of"):
        prof.mark("fwd")
    prof.close()
    with pytest.raises(ValueError, match="log_every_n_steps must be an int >= 1"):
        StepProfiler(model, log_every_n_steps=0)
    with pytest.raises(ValueError, match="accelerator or fabric, not both"):
        StepProfiler(model, accelerator=object(), fabric=object())
    with pytest.raises(ValueError, match="accelerator must be accelerate.Accelerator or None, got 'gpu'"):
        StepProfiler(model, accelerator="gpu")
    with pytest.raises(ValueError, match="StepProfiler: fabric must be lightning.Fabric or None, got 'cuda'"):
        StepProfiler(model, fabric="cuda")


# --- Fabric ------------------------------------------------------------------------------------------


def test_fabric_loop_logs_through_log_dict_and_profiles_the_users_model(tmp_path: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import TensorBoardLogger

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=TensorBoardLogger(tmp_path, name="run"))
    user_model = SleepyNet()
    model, optimizer = fabric.setup(user_model, SleepySGD(user_model.parameters(), STEP))
    before = leftovers(user_model)
    prof = StepProfiler(model, fabric=fabric, log_every_n_steps=1, **WINDOW)
    for x in batches(STEPS):
        with prof.step(x):
            loss = model(x).sum()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    fabric.logger.finalize("success")
    assert "backward" not in vars(fabric) and leftovers(user_model) == before
    assert prof.metrics is not None and prof.result is not None
    assert prof.result.profile.model.class_name == "SleepyNet"  # not _FabricModule
    assert prof.result.parallel.world_size == 1 and prof.result.compute_dtype is not None
    assert_sleeps_measured(prof.metrics)
    found = scalars(tmp_path)
    assert found[names.FWD_LATENCY] == [(END, pytest.approx(prof.metrics[names.FWD_LATENCY]))]
    assert [step for step, _ in found["throughput/samples_per_sec"]] == [END + 1, END + 2]
    assert (Path(fabric.logger.log_dir) / "flops_profile_step2.json").is_file()


def test_a_fabric_csv_logger_keeps_its_metrics_file_and_says_nothing_of_the_profilers_files(
    tmp_path: Path,
) -> None:
    """The profile's files went into the CSV logger's folder before its experiment existed: Lightning then
    warned that the folder was not empty and that its log files would be deleted."""
    import csv
    import warnings

    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    fabric = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path, name="run"))
    user_model = SleepyNet()
    model, optimizer = fabric.setup(user_model, SleepySGD(user_model.parameters(), STEP))
    prof = StepProfiler(model, fabric=fabric, log_every_n_steps=1, **WINDOW)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in batches(STEPS):
            with prof.step(x):
                fabric.backward(model(x).sum())
                optimizer.step()
                optimizer.zero_grad()
        prof.close()
        fabric.logger.finalize("success")
    assert not [w for w in said if "exists and is not empty" in str(w.message)]
    folder = Path(fabric.logger.log_dir)
    assert (folder / "flops_profile_step2.json").is_file()
    with open(folder / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    window = [r for r in rows if r.get(names.FWD_LATENCY)]
    assert [int(r["step"]) for r in window] == [END]
    assert float(window[0][names.FWD_LATENCY]) == pytest.approx(prof.metrics[names.FWD_LATENCY])


def test_fabric_step_starts_at_the_strategys_call_and_a_skipped_inner_step_still_ends_it() -> None:
    """The precision plugin's work before the inner ``step`` is the step's; a step it skipped (as a
    gradient scaler skips one with inf gradients) still ends the optimizer step."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import Precision

    class SkipsEveryOther(Precision):
        """Checks the gradients for STEP seconds, then skips the inner step every other call."""

        calls = 0

        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            time.sleep(STEP)
            self.calls += 1
            return None if self.calls % 2 else optimizer.step(**kwargs)

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=SkipsEveryOther())
    user_model = SleepyNet()
    model, optimizer = fabric.setup(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1))
    prof = StepProfiler(model, fabric=fabric, **WINDOW)
    for x in batches(STEPS):
        with prof.step(x):
            loss = model(x).sum()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    assert "optimizer_step" not in vars(fabric.strategy)
    assert prof.result is not None and prof.metrics is not None
    assert prof.global_step == STEPS and prof.result.published_at == END  # skipped steps are steps
    assert_sleeps_measured(prof.metrics)  # the plugin's sleep is in the step, not in the backward


# --- accelerate --------------------------------------------------------------------------------------


def test_accelerate_loop_logs_through_accelerator_log_with_its_dtype_and_sizes(tmp_path: Path) -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("run")
    user_model = SleepyNet()
    model, optimizer = accelerator.prepare(user_model, SleepySGD(user_model.parameters(), STEP))
    prof = StepProfiler(model, accelerator=accelerator, log_every_n_steps=1, **WINDOW)
    for x in batches(STEPS):
        with prof.step(x):
            loss = model(x).float().sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    accelerator.end_training()
    assert "backward" not in vars(accelerator)
    result = prof.result
    assert result is not None and prof.metrics is not None
    assert result.profile.model.class_name == "SleepyNet"
    assert result.compute_dtype == "bf16" and result.parallel.world_size == 1
    assert ("accelerate distributed type", "NO") in result.extra_lines
    assert_sleeps_measured(prof.metrics)
    found = scalars(tmp_path)
    assert found[names.FWD_LATENCY] == [(END, pytest.approx(prof.metrics[names.FWD_LATENCY]))]
    assert [step for step, _ in found["throughput/samples_per_sec"]] == [END + 1, END + 2]


def test_accelerates_fp16_on_a_cpu_autocasts_nothing_and_is_its_parameters_dtype() -> None:
    """``mixed_precision="fp16"`` on a CPU: accelerate turns its autocast off (``native_amp``), with no
    error; the matmuls run in fp32, as the model's output says, and so does the profile (and a measured
    peak is then fp32's, not fp16's)."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prof = StepProfiler(model, accelerator=accelerator, **WINDOW)
    dtypes = set()
    for x in batches(STEPS):
        with prof.step(x):
            out = model(x)
            dtypes.add(out.dtype)
            accelerator.backward(out.sum())
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    assert dtypes == {torch.float32}
    assert prof.result is not None and prof.result.compute_dtype == "fp32"


def test_a_loop_that_goes_on_after_a_window_step_raised_drops_the_window_and_says_so() -> None:
    """The user's loop catches its own error in a window step and goes on: the window is dropped (said
    once, as such), nothing of the profiler runs or stays after it, and no "no profile ran" is said."""
    torch.manual_seed(0)
    model = SleepyNet()
    optimizer = SleepySGD(model.parameters(), 0.0)
    before = leftovers(model, optimizer)
    boom = RuntimeError("the user's own error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StepProfiler(model, **WINDOW) as prof:
            for i, x in enumerate(batches(STEPS)):
                try:
                    with prof.step(x):
                        step_raising_in_module_timing(model, optimizer, x, i, boom)
                except RuntimeError as error:
                    assert error is boom
                    continue
                if i > PROFILE_STEP + 1:  # from the step after the fault on: no instrument
                    assert not prof.session.window_open and not prof.session.plan.open
    said = [str(w.message) for w in caught if str(w.message).startswith("StepProfiler")]
    assert said == [
        "StepProfiler: a window step raised (the exception your loop went on after); the profile window is "
        "dropped and nothing of the profiler stays; this run goes on unprofiled on every rank. "
        "Training goes on."
    ]
    assert prof.result is None and leftovers(model, optimizer) == before


def raised_workers(directory: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """tests/raised_workers.py on two ranks under torchrun (bounded: a hang fails the test)."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(root / "tests" / "raised_workers.py"), str(directory), *args]  # fmt: skip
    return run_bounded(command, timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})


def ranks_written(directory: Path) -> list[dict[str, Any]]:
    """Each rank's ``rank{r}.json`` from tests/raised_workers.py."""
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]


def went_on_unprofiled(done: subprocess.CompletedProcess, directory: Path, steps: list[int]) -> None:
    """Both ranks of a run whose rank 1 raised in a window step and went on trained to their end (their
    optimizer steps: ``steps``), at once, with the window dropped on both (said once, by the logging rank)
    and nothing of the profiler left."""
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = ranks_written(directory)
    assert [r["steps"] for r in ranks] == steps
    assert ranks[0]["said"] == [
        "StepProfiler: a window step raised on rank 1 (the exception your loop went on after); the profile "
        "window is dropped and nothing of the profiler stays; this run goes on unprofiled on every rank. "
        "Training goes on."
    ]
    assert ranks[1]["said"] == []  # said once, by the logging rank
    assert not any(r["result"] for r in ranks) and not any(r["hooks"] for r in ranks)
    assert max(r["seconds"] for r in ranks) < 60


def test_the_profilers_of_a_process_share_one_gloo_group_of_their_own(tmp_path: Path) -> None:
    """Three StepProfilers in turn on two ranks: one process group of the profiler's beside the default
    one, however many are made (each made its own, never destroyed: a gloo group's sockets and threads per
    callback or profiler, leaked across a sweep of runs); each one's window and throughput as alone."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(root / "tests" / "group_workers.py"), str(tmp_path)]  # fmt: skip
    done = run_bounded(command, timeout=240, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    for written in ranks_written(tmp_path):
        assert written["groups"] == [2, 2, 2]
        assert all(run["result"] for run in written["runs"])
    logged = ranks_written(tmp_path)[0]["runs"]
    assert logged[0]["logged"] and logged[0]["logged"] == logged[1]["logged"] == logged[2]["logged"]


def test_a_rank_whose_block_raised_closes_at_once_while_the_other_waits_in_the_steps_all_reduce(
    tmp_path: Path,
) -> None:
    """Two ranks under torchrun, ``prof.close()`` in a ``finally``: rank 1 raises in a window step while
    rank 0 waits in its all-reduce. Rank 1's close exchanges nothing (rank 0 never would), so its error
    ends the job at once, not after the ranks' 300 s timeout."""
    done = raised_workers(tmp_path, timeout=150)
    assert done.returncode != 0 and "ValueError: rank 1's own error" in done.stderr
    closed = json.loads((tmp_path / "rank1.json").read_text())
    assert closed["close_seconds"] < 10, closed


@pytest.mark.parametrize("kind", ["module timing", "communication"])
def test_a_rank_that_raised_in_a_window_step_and_went_on_drops_the_window_with_the_other(
    tmp_path: Path, kind: str
) -> None:
    """Two ranks under torchrun; rank 1 raises after its backward in a window step and its loop goes on
    (a batch skipped). Rank 0 waits in the step's end vote, which rank 1 skipped: rank 1 casts it at its
    next step's start, so both drop the window there, at once (not after the ranks' 300 s timeout; nor
    a gloo abort from two votes of different lengths), and train to the end."""
    from tests.support import comm_steps, module_steps

    step = module_steps(2)[0] if kind == "module timing" else comm_steps(2)[0]
    done = raised_workers(tmp_path, "go_on", str(step), timeout=200)
    went_on_unprofiled(done, tmp_path, [24, 23])


@pytest.mark.parametrize("kind", ["counting", "module timing", "clean", "after a shorter step"])
def test_a_rank_that_raised_in_a_micro_batch_before_its_steps_last_goes_on_with_that_step(
    tmp_path: Path, kind: str
) -> None:
    """Steps of two micro-batches; rank 1 raises in a window step's first (under ``no_sync()``, before its
    forward) and its loop goes on with the step's second, as the other rank does. Its next block is no
    new step: taken as one, it cast the end vote it owed there, while rank 0 waited in the step's
    all-reduce (both hung until torchrun's timeout). Its step's end vote is the drop, on both ranks.
    Steps of 3 and 1 micro-batches in turn (an epoch's short last step): the counting step's 3 follow a
    step of 1, which read as this step's length."""
    from tests.support import first_clean, module_steps

    step = {"module timing": module_steps(2)[0], "clean": first_clean(2, comm=True)}.get(kind, 2)
    counts = ["3,1"] if kind == "after a shorter step" else []
    done = raised_workers(tmp_path, "go_on_accumulated", str(step), *counts, timeout=90)
    went_on_unprofiled(done, tmp_path, [24, 24])


@pytest.mark.parametrize("kind", ["communication", "clean"])
def test_a_rank_that_raised_before_its_forward_goes_on_with_that_step_joining_the_others_all_reduce(
    tmp_path: Path, kind: str
) -> None:
    """Rank 1 raises before its forward in a window step (no gradient all-reduce of its own) and its loop
    goes on. Rank 0 waits in that step's all-reduce, which rank 1's next batch joins: rank 1 voting at that
    block's start (the end vote it owed, a clean step's batch vote) met none, and both waited for the
    ranks' 300 s timeout. That block is the step's, voting at its end only, with rank 0's end vote."""
    from tests.support import comm_steps, first_clean

    step = comm_steps(2)[0] if kind == "communication" else first_clean(2, comm=True)
    done = raised_workers(tmp_path, "go_on_forward", str(step), timeout=90)
    went_on_unprofiled(done, tmp_path, [24, 24])


@pytest.mark.parametrize("at", ["window", "after"])
def test_a_rank_that_raised_after_its_optimizer_step_and_went_on_counts_the_step_as_the_other(
    tmp_path: Path, at: str
) -> None:
    """Two ranks under torchrun; rank 1 raises after its optimizer step and its loop goes on. The step
    ran: it counts on rank 1 too, so both ranks exchange ``throughput/*`` at the same steps (rank 1 one
    behind waited in DDP's all-reduce while rank 0 waited in the exchange, for the ranks' 300 s timeout).
    In a window step, its end vote is cast there, and both drop the window at once."""
    from tests.support import module_steps

    step = module_steps(2)[0] if at == "window" else 17  # the window ends at step 13 (3 communication steps)
    done = raised_workers(tmp_path, "after_step", str(step), timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = ranks_written(tmp_path)
    assert [r["steps"] for r in ranks] == [24, 24]
    # the logging rank's throughput/*, at the logging steps every rank reached (a dropped window: none)
    assert [r["logged"] for r in ranks] == [[16, 20, 24] if at == "after" else [], []]
    assert [r["result"] for r in ranks] == [at == "after"] * 2
    assert max(r["seconds"] for r in ranks) < 60


def test_a_rank_whose_loop_ends_inside_the_window_under_join_drops_it_with_the_other_at_once(
    tmp_path: Path,
) -> None:
    """Uneven inputs under DDP's ``join()``: rank 1's loop ends at a communication step and it closes its
    profiler there, inside the ``join()``, while rank 0 votes in its next window step. The close's
    exchange meets that vote in one collective of one size: both ranks drop the window at once and rank 0
    trains to its end (rank 1's close was a gloo size mismatch that aborted it, and the job with it)."""
    from tests.raised_workers import RAISES_AT

    done = raised_workers(tmp_path, "uneven", timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = ranks_written(tmp_path)
    assert [r["steps"] for r in ranks] == [24, RAISES_AT]
    assert ranks[0]["said"][0].startswith(
        "StepProfiler: the ranks' vote failed (the ranks reached different points (rank 0 at a vote, rank 1 "
        "at the window's end: a rank's loop ended early?)); the profile window is dropped"
    ), ranks[0]["said"]
    assert not any(r["result"] for r in ranks) and max(r["seconds"] for r in ranks) < 60
