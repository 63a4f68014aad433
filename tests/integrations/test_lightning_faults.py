"""Issue 11's fault matrix for FlopsProfilerCallback in a real lightning.Trainer: whatever ends a profile
window, the error reaches the caller unchanged and nothing of the profiler stays behind.

An exception is raised at each point of a window step (the forward, ``training_step``, another callback's
``on_before_backward``, the backward, ``on_after_backward``, gradient clipping, ``optimizer.step``, the LR
scheduler, another callback's ``on_train_batch_end``, a ``KeyboardInterrupt`` in ``optimizer.step``), at
each kind of window step: counting, module timing, clean. After each, torch's global hook dicts, both mode
stacks, the attributes of ``torch``, ``torch.nn.functional`` and ``torch.Tensor``, the optimizer's and
every module's hooks are as before, and a following fit in the same process counts what a fresh process
counts. The model is the one of test_lightning.py with a probe module that can raise in its forward and
in its backward (a custom autograd Function), so its flops are counted by hand the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn

from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.profile import Counts, Profile
from tests.raising import RaiseInBackward
from tests.support import (
    Fault,
    FaultyLR,
    first_clean,
    hooks_of,
    laid_out,
    lightning_settings,
    python_calls,
    torch_state,
    window_end,
    window_steps,
)

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 3
PROFILE_STEP, CLEAN = 1, 1
WINDOW_STEPS = {
    "counting": PROFILE_STEP,
    "module timing": PROFILE_STEP + 1,
    "clean": first_clean(PROFILE_STEP),
}
WINDOW_END = window_end(PROFILE_STEP, CLEAN)  # the global step after the window's last step
ROOT = Path(__file__).resolve().parents[2]

# By hand, as in test_lightning.py: the probe does no arithmetic (its clone is a copy, its backward
# hands the gradient on), the loss is outside the model.
FWD_FLOPS = 2 * BATCH * IN * HIDDEN + BATCH * HIDDEN + 2 * BATCH * HIDDEN * OUT  # 1200
BWD_FLOPS = (
    2 * BATCH * OUT * HIDDEN * 2 + BATCH * OUT  # head: grad input, weight, bias
    + BATCH * HIDDEN  # ReLU
    + 2 * BATCH * IN * HIDDEN + BATCH * HIDDEN  # first Linear: grad weight, bias (its input needs none)
)  # fmt: skip


# --- where to fail -----------------------------------------------------------------------------------


class Probe(nn.Module):
    """Inside the model: may raise in its forward or in its backward."""

    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fault.check("forward")
        return RaiseInBackward.apply(x, lambda: self.fault.check("backward"))


class FaultySGD(torch.optim.Optimizer):
    """Plain SGD that may raise in its step, after Lightning's closure (the forward and backward) ran.

    Not a ``torch.optim.SGD`` subclass: torch wraps ``SGD.step`` in a ``record_function`` the first time
    an ``SGD`` is built in a process, so the ops counted in a subclass's step would depend on what ran
    in the process before (the fresh process would see two ops fewer).
    """

    def __init__(self, params: Any, fault: Fault) -> None:
        super().__init__(params, {"lr": 0.01})
        self.fault = fault

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.fault.check("optimizer.step")
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-group["lr"])
        return loss


class FaultyMLP(L.LightningModule):
    """Linear(8, 16) -> Probe -> ReLU -> Linear(16, 4); the optimizer is built here, so that its hooks
    can be read before the fit."""

    def __init__(self, fault: Fault | None = None, manual: bool = False) -> None:
        super().__init__()
        self.fault = fault or Fault()
        self.block = nn.Sequential(nn.Linear(IN, HIDDEN), Probe(self.fault), nn.ReLU())
        self.head = nn.Linear(HIDDEN, OUT)
        self.automatic_optimization = not manual
        self.optimizer = FaultySGD(self.parameters(), self.fault)
        self.scheduler = FaultyLR(self.optimizer, self.fault)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self.block(x)), y)
        self.fault.check("training_step")
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.lr_schedulers().step()
        return loss

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any
    ) -> None:
        self.fault.check("gradient clipping")

    def configure_optimizers(self) -> dict:
        return {
            "optimizer": self.optimizer,
            "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"},
        }


class Injector(L.Callback):
    """After FlopsProfilerCallback in the list: tells the fault which step runs, and may raise in the
    callback events; keeps the exception Lightning's ``on_exception`` was given."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.seen: BaseException | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.fault.current = trainer.global_step
        self.strategy = trainer.strategy  # where the one-call training_step wrapper is set, before this
        self.fault.check("on_train_batch_start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.fault.check("on_before_backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.fault.check("on_after_backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.fault.check("on_train_batch_end")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.seen = exception


def loader(samples: int = 48) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, IN, generator=generator), torch.randn(samples, OUT, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def fit(
    root: Path,
    module: FaultyMLP,
    callback: FlopsProfilerCallback,
    extra: list[L.Callback] | None = None,
    **options: Any,
) -> L.Trainer:
    settings = lightning_settings(root, WINDOW_END, **options)
    trainer = L.Trainer(callbacks=[callback, *(extra or [])], **settings)
    trainer.fit(module, train_dataloaders=loader())
    return trainer


def quiet_callback(**kwargs: Any) -> FlopsProfilerCallback:
    return FlopsProfilerCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, **kwargs)


# --- the state that must come back -------------------------------------------------------------------


def process_state(module: FaultyMLP) -> dict[str, Any]:
    """What the profiler could leave behind, in torch, on the module and on its optimizer."""
    return {
        "torch": torch_state(),
        "grad mode": (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
        "namespaces": {ns.__name__: dict(vars(ns)) for ns in (torch, F, torch.Tensor)},
        "module hooks": {name: hooks_of(m) for name, m in module.named_modules()},
        # Lightning adds attributes to the LightningModule itself; none may appear on its submodules
        "module attributes": {name: set(vars(m)) for name, m in module.named_modules() if name},
        "optimizer hooks": hooks_of(module.optimizer),
        "optimizer step": (type(module.optimizer).step, "step" in vars(module.optimizer)),
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in before:
        if key == "namespaces":
            continue
        assert after[key] == before[key], key
    for ns, attributes in before["namespaces"].items():
        now = after["namespaces"][ns]
        changed = [k for k, v in attributes.items() if now.get(k) is not v]
        assert changed == [], ns
        # torch imports some submodules on first use (torch._dynamo): new names may only be modules
        added = [k for k in set(now) - set(attributes) if not isinstance(now[k], types.ModuleType)]
        assert added == [], ns


def counts(profile: Profile) -> dict[str, Any]:
    """Every count of a profile (per module, outside the model, coverage): no latency."""
    return {
        "modules": {
            name: {f.name: getattr(m, f.name) for f in dataclasses.fields(Counts)}
            for name, m in profile.modules.items()
        },
        "outside": dataclasses.asdict(profile.outside_model),
        "calls": (profile.coverage.counted_calls, profile.coverage.free_calls),
    }


def fresh_process_worker() -> None:
    """Prints the counts of one clean fit, in a process where nothing ran before."""
    import tempfile

    callback = quiet_callback()
    with tempfile.TemporaryDirectory() as root:
        fit(Path(root), FaultyMLP(), callback)
    print("counts", json.dumps(counts(callback.result.profile)))


@pytest.fixture(scope="module")
def fresh_counts() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, __file__, "fresh-counts"], capture_output=True, text=True, timeout=240, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("counts ")]
    return json.loads(line.split(" ", 1)[1])


def assert_a_clean_fit_counts_as_a_fresh_process(root: Path, fresh: dict[str, Any]) -> None:
    callback = quiet_callback()
    fit(root, FaultyMLP(), callback)
    result = callback.result
    assert laid_out(result.steps) == window_steps(PROFILE_STEP, CLEAN)
    assert (result.profile.fwd_flops, result.profile.bwd_flops) == (FWD_FLOPS, BWD_FLOPS)
    assert json.loads(json.dumps(counts(result.profile))) == fresh


@pytest.fixture
def sigint_handler() -> Iterator[None]:
    """Lightning ignores SIGINT for the rest of the process after a KeyboardInterrupt: put it back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


# --- the matrix ------------------------------------------------------------------------------------

POINTS = [
    ("on_train_batch_start", False),  # after ours: the strategy's training_step is wrapped, never called
    ("forward", False),
    ("training_step", False),
    ("on_before_backward", False),
    ("backward", False),
    ("on_after_backward", False),
    ("gradient clipping", False),
    ("optimizer.step", False),
    ("lr_scheduler.step", False),
    ("on_train_batch_end", False),
    ("backward", True),  # manual optimization: the window steps hook the optimizer
    ("optimizer.step", True),
]


@pytest.mark.parametrize("window_step", list(WINDOW_STEPS))
@pytest.mark.parametrize(("point", "manual"), POINTS, ids=[f"{p}{' (manual)' * m}" for p, m in POINTS])
def test_an_exception_in_a_window_step_reaches_the_caller_and_leaves_nothing(
    tmp_path: Path, fresh_counts: dict, point: str, manual: bool, window_step: str
) -> None:
    fault = Fault(point, WINDOW_STEPS[window_step])
    module, callback, injector = FaultyMLP(fault, manual=manual), quiet_callback(), Injector(fault)
    before = process_state(module)
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path / "faulty", module, callback, [injector])
    assert raised.value is fault.error and injector.seen is fault.error
    assert str(raised.value) == f"injected in {point} at step {WINDOW_STEPS[window_step]}"
    assert_same_state(before, process_state(module))
    assert not {"training_step", "backward", "optimizer_step"} & set(vars(injector.strategy))
    assert not callback.session.window_open
    if window_step != "clean" or point != "on_train_batch_end":  # that one ends after the window
        assert callback.result is None
    assert_a_clean_fit_counts_as_a_fresh_process(tmp_path / "clean", fresh_counts)


class BatchHookMLP(FaultyMLP):
    """With its own ``on_train_batch_start`` (Lightning calls it after every callback's): ours wraps it
    for one call, so that a batch it skips with -1 starts nothing."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.fault.check("the module's on_train_batch_start")


@pytest.mark.parametrize("point", ["on_train_batch_start", "the module's on_train_batch_start"])
def test_a_fault_before_or_in_the_modules_own_batch_start_leaves_it_unwrapped(
    tmp_path: Path, point: str
) -> None:
    fault = Fault(point, WINDOW_STEPS["counting"])  # a callback's after ours (the wrapper not called yet)
    module, callback, injector = BatchHookMLP(fault), quiet_callback(), Injector(fault)
    before = process_state(module)
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path, module, callback, [injector])
    assert raised.value is fault.error and injector.seen is fault.error
    assert "on_train_batch_start" not in vars(module)
    assert_same_state(before, process_state(module))
    assert not callback.session.window_open and callback.result is None


class FailingCleanup(L.Callback):
    """Before ours in the list: its ``on_exception`` raises, and Lightning calls no later callback's."""

    def __init__(self) -> None:
        self.error = RuntimeError("the cleanup failed")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        raise self.error


def fit_with_a_failing_cleanup_first(
    root: Path, callback: FlopsProfilerCallback, point: str, window_step: str, manual: bool = False
) -> None:
    """A fault at ``point`` of a window step, with a :class:`FailingCleanup` before ``callback``: what
    reaches the caller is the cleanup's error on the fault, and nothing of the profiler stays."""
    fault = Fault(point, WINDOW_STEPS[window_step])
    module, injector, cleanup = FaultyMLP(fault, manual), Injector(fault), FailingCleanup()
    before = process_state(module)
    trainer = L.Trainer(callbacks=[cleanup, callback, injector], **lightning_settings(root, WINDOW_END))
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(module, train_dataloaders=loader())
    assert raised.value is cleanup.error and raised.value.__context__ is fault.error
    assert injector.seen is None  # Lightning stopped at the cleanup: ours was not called either
    assert_same_state(before, process_state(module))
    assert not {"training_step", "backward", "optimizer_step"} & set(vars(trainer.strategy))
    assert not callback.session.window_open and callback.result is None


# the strategy's training_step, backward and optimizer_step (clipping, the closure) close the window on an
# exception themselves, before any callback's on_exception
STEPS_WORK = [
    ("training_step", False),
    ("backward", False),
    ("gradient clipping", False),
    ("optimizer.step", False),
    ("backward", True),
]


@pytest.mark.parametrize("window_step", list(WINDOW_STEPS))
@pytest.mark.parametrize(
    ("point", "manual"), STEPS_WORK, ids=[f"{p}{' (manual)' * m}" for p, m in STEPS_WORK]
)
def test_a_fault_in_the_steps_work_leaves_nothing_though_a_callback_before_ours_fails_in_on_exception(
    tmp_path: Path, point: str, manual: bool, window_step: str
) -> None:
    fit_with_a_failing_cleanup_first(tmp_path, quiet_callback(), point, window_step, manual)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="an exception outside the strategy's calls (the LR scheduler's step, another callback's "
    "on_train_batch_start or _end) reaches ours only through on_exception, which a callback before ours "
    "that raises there keeps from being called (docs: When something fails)",
)
def test_a_fault_in_the_lr_schedulers_step_with_a_callback_before_ours_failing_in_on_exception(
    tmp_path: Path,
) -> None:
    callback = quiet_callback()
    try:
        fit_with_a_failing_cleanup_first(tmp_path, callback, "lr_scheduler.step", "module timing")
    finally:
        callback._close()  # what Lightning did not call: the rest of the suite runs clean


class SkippingMLP(FaultyMLP):
    """Manual optimization that skips a batch whose step raises (as a loop skips one on an OOM)."""

    skipped = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        try:
            return super().training_step(batch, batch_idx)
        except RuntimeError:
            self.skipped += 1
            return None


@pytest.mark.parametrize("point", ["backward", "optimizer.step"])
def test_an_exception_the_users_manual_step_catches_leaves_the_window_to_run_and_publish(
    tmp_path: Path, point: str
) -> None:
    fault = Fault(point, WINDOW_STEPS["module timing"])
    module, callback, injector = SkippingMLP(fault, manual=True), quiet_callback(), Injector(fault)
    before = process_state(module)
    fit(tmp_path, module, callback, [injector], max_steps=WINDOW_END + 2)
    assert fault.fired and module.skipped == 1 and injector.seen is None
    assert callback.result is not None and callback.result.steps.clean
    assert_same_state(before, process_state(module))


class IteratingMLP(FaultyMLP):
    """A ``training_step(dataloader_iter)`` of two batches a step: at an odd count of batches its second
    ``next`` raises ``StopIteration`` inside the step, which Lightning catches to end the epoch."""

    stopped = 0

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        losses = []
        for _ in range(2):
            try:
                batch, batch_idx, _ = next(dataloader_iter)
            except StopIteration:
                self.stopped += 1
                raise
            losses.append(super().training_step(batch, batch_idx))
        return sum(losses)


def test_a_dataloader_iters_end_of_data_in_a_window_step_ends_the_epoch_not_the_window(
    tmp_path: Path,
) -> None:
    module, callback = IteratingMLP(), quiet_callback()
    before = process_state(module)
    settings = lightning_settings(tmp_path, WINDOW_END + 2)
    trainer = L.Trainer(callbacks=[callback], **settings)
    trainer.fit(module, train_dataloaders=loader(samples=5 * BATCH))  # an epoch's third step stops in it
    assert trainer.global_step == WINDOW_END + 2 and module.stopped >= 2
    assert callback.result is not None and callback.result.steps.clean
    params = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # each one's two uses' gradients added: a flop each
    profile = callback.result.profile
    assert (profile.fwd_flops, profile.bwd_flops) == (2 * FWD_FLOPS, 2 * BWD_FLOPS + params)
    assert_same_state(before, process_state(module))
    assert not {"training_step", "backward", "optimizer_step"} & set(vars(trainer.strategy))


@pytest.mark.usefixtures("sigint_handler")
@pytest.mark.parametrize("window_step", list(WINDOW_STEPS))
def test_a_keyboard_interrupt_in_the_optimizer_step_exits_through_lightning_and_leaves_nothing(
    tmp_path: Path, fresh_counts: dict, window_step: str
) -> None:
    fault = Fault("optimizer.step", WINDOW_STEPS[window_step], KeyboardInterrupt())
    module, callback, injector = FaultyMLP(fault), quiet_callback(), Injector(fault)
    before = process_state(module)
    with pytest.raises(SystemExit) as raised:
        fit(tmp_path / "faulty", module, callback, [injector])
    # Lightning's handler: on_exception gets the KeyboardInterrupt, then sys.exit(1) inside its except
    assert raised.value.code == 1 and raised.value.__context__ is fault.error
    assert injector.seen is fault.error
    assert module.trainer.state.status == TrainerStatus.INTERRUPTED
    assert_same_state(before, process_state(module))
    assert callback.result is None and not callback.session.window_open
    assert_a_clean_fit_counts_as_a_fresh_process(tmp_path / "clean", fresh_counts)


def test_the_callback_that_saw_the_fault_profiles_the_next_fit(tmp_path: Path) -> None:
    fault = Fault("optimizer.step", PROFILE_STEP)
    callback = quiet_callback()
    with pytest.raises(RuntimeError):
        fit(tmp_path / "faulty", FaultyMLP(fault), callback, [Injector(fault)])
    fit(tmp_path / "again", FaultyMLP(), callback)
    assert callback.result.step == PROFILE_STEP and callback.result.published_at == WINDOW_END
    assert (callback.result.profile.fwd_flops, callback.result.profile.bwd_flops) == (FWD_FLOPS, BWD_FLOPS)


# --- user functions that fail ------------------------------------------------------------------------


@pytest.mark.parametrize("window_step", list(WINDOW_STEPS))
@pytest.mark.parametrize("argument", ["batch_size_fn", "tokens_fn"])
def test_a_failing_batch_size_fn_or_tokens_fn_propagates_unchanged_and_leaves_nothing(
    tmp_path: Path, fresh_counts: dict, argument: str, window_step: str
) -> None:
    fault = Fault(argument, WINDOW_STEPS[window_step])

    def user_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        fault.current = module.trainer.global_step  # called before the injector hears of the step
        fault.check(argument)
        return len(batch[0])

    module, callback = FaultyMLP(fault), quiet_callback(**{argument: user_fn})
    before = process_state(module)
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path / "faulty", module, callback)
    assert raised.value is fault.error
    assert_same_state(before, process_state(module))
    assert callback.result is None and not callback.session.window_open
    assert_a_clean_fit_counts_as_a_fresh_process(tmp_path / "clean", fresh_counts)


class RaisingLogger(CSVLogger):
    """A CSV logger whose ``log_metrics`` raises when it is given metrics named ``prefix*``."""

    def __init__(self, root: Path, prefix: str) -> None:
        super().__init__(root)
        self.prefix = prefix
        self.error = RuntimeError(f"logger refuses {prefix}")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if any(name.startswith(self.prefix) for name in metrics):
            raise self.error
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("prefix", ["flops_profiler/", "throughput/"])
def test_a_logger_raising_on_our_metrics_propagates_unchanged_and_leaves_nothing(
    tmp_path: Path, fresh_counts: dict, prefix: str
) -> None:
    module, callback, logger = FaultyMLP(), quiet_callback(), RaisingLogger(tmp_path / "faulty", prefix)
    before = process_state(module)
    with pytest.raises(RuntimeError) as raised:  # throughput is logged from the step after the window
        fit(tmp_path / "faulty", module, callback, logger=logger, max_steps=WINDOW_END + 1)
    assert raised.value is logger.error
    assert module.trainer.global_step == WINDOW_END + (prefix == "throughput/")
    assert_same_state(before, process_state(module))
    assert not callback.session.window_open and not callback.session.wants_batches
    assert_a_clean_fit_counts_as_a_fresh_process(tmp_path / "clean", fresh_counts)


# --- after a fault, training runs as before ---------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def iteration(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """One plain forward + backward + step of ``model``."""
    x, y = torch.randn(BATCH, IN), torch.randn(BATCH, OUT)

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    return step


def test_after_a_fault_in_the_optimizer_step_200_iterations_run_as_before_and_memory_stays_flat(
    tmp_path: Path,
) -> None:
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    step = iteration(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(20):
        step()  # first-call initialisations
    before = python_calls(step)
    fault = Fault("optimizer.step", PROFILE_STEP)  # issue 11's case: the counting step's optimizer step
    with pytest.raises(RuntimeError):
        fit(tmp_path, FaultyMLP(fault), quiet_callback(), [Injector(fault)])
    rss = rss_bytes()
    first = python_calls(step)
    for _ in range(200):
        step()
    last, growth = python_calls(step), rss_bytes() - rss
    # a hook, mode or patch left behind runs in every iteration: the same functions, as often, as before
    assert first == before, first - before
    assert last == before, last - before
    assert growth < 50 * 2**20


if __name__ == "__main__" and sys.argv[1:] == ["fresh-counts"]:
    fresh_process_worker()
