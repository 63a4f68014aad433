"""HFFlopsCallback never outlives its step: a fault injected at every point of the profile window.

Each case raises at one point of one window step (counting, module timing, clean) of a real
``transformers.Trainer`` run, then checks that the exception reached the caller unchanged and that
nothing of the profiler remains: torch's global hook dicts, both mode stacks, the attributes of
``torch``, ``torch.nn.functional`` and ``torch.Tensor``, every module's and the optimizer's hooks, the
Trainer's attributes and callbacks. A clean run in the same process then counts what a run before any
fault counted. The model is a two-layer MLP in plain torch, so its MACs are worked out by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

from flops_callbacks.integrations.hf import HFFlopsCallback
from tests.raising import RaiseInBackward
from tests.support import (
    Fault,
    FaultyLR,
    first_clean,
    hf_arguments,
    hooks_of,
    python_calls,
    torch_namespaces,
    torch_state,
    window_end,
)

PROFILE_STEP, CLEAN_STEPS = 1, 1
WINDOW = {
    "counting": PROFILE_STEP,
    "module timing": PROFILE_STEP + 1,  # the first of them
    "clean": first_clean(PROFILE_STEP),
}
MAX_STEPS = window_end(PROFILE_STEP, CLEAN_STEPS)  # the window's last step is the run's last
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4


class Boom(RuntimeError):
    pass


class Regressor(nn.Module):
    """Linear(IN, HIDDEN) -> ReLU -> Linear(HIDDEN, OUT), MSE loss; raises where the fault says."""

    def __init__(self, fault: Fault) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.fault = fault

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.fault.check("forward")
        loss = F.mse_loss(self.fc2(torch.relu(self.fc1(x))), labels)
        return {"loss": RaiseInBackward.apply(loss, lambda: self.fault.check("backward"))}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, size: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(size, IN, generator=generator),
            torch.randn(size, OUT, generator=generator),
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class FaultyTrainer(Trainer):
    """A Trainer whose ``compute_loss`` and gradient clipping raise where the fault says."""

    fault: Fault
    sgd: torch.optim.Optimizer  # the optimizer itself (trainer.optimizer becomes accelerate's wrapper)

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.fault.check("compute_loss")
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        self.fault.check("gradient clipping")
        return super()._clip_grad_norm(model)


class FailingSGD(torch.optim.SGD):
    def __init__(self, params: Any, fault: Fault) -> None:
        super().__init__(params, lr=1e-2)
        self.fault = fault

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.fault.check("optimizer.step")
        return super().step(closure)


class FailingCallback(TrainerCallback):
    """Another callback of the run, raising in one of its events (on_step_end sees the step + 1)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.fault.check("on_step_begin", state.global_step)

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self.fault.check("on_substep_end", state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.fault.check("on_pre_optimizer_step", state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.fault.check("on_step_end", state.global_step - 1)


def make_trainer(
    tmp_path: Path,
    fault: Fault,
    callbacks: list[TrainerCallback],
    max_steps: int = MAX_STEPS,
    accumulation: int = 1,
) -> FaultyTrainer:
    model = Regressor(fault)
    optimizer = FailingSGD(model.parameters(), fault)
    args = hf_arguments(tmp_path, max_steps, BATCH, seed=0, gradient_accumulation_steps=accumulation)
    trainer = FaultyTrainer(
        model=model,
        args=args,
        train_dataset=Pairs(),
        callbacks=callbacks,
        optimizers=(optimizer, FaultyLR(optimizer, fault)),
    )
    trainer.fault, trainer.sgd = fault, optimizer
    fault.step_of = lambda: trainer.state.global_step
    return trainer


def callback(**kwargs: Any) -> HFFlopsCallback:
    return HFFlopsCallback(profile_step=PROFILE_STEP, clean_steps=CLEAN_STEPS, print_profile=False, **kwargs)


# --- the state that must be the same after a fault as before it --------------------------------------


def attributes(trainer: FaultyTrainer) -> dict[str, set[str]]:
    """Attribute names of the Trainer, the optimizer and every module."""
    names = {"trainer": set(vars(trainer)), "optimizer": set(vars(trainer.sgd))}
    names.update({f"module {name!r}": set(vars(m)) for name, m in trainer.model.named_modules()})
    return names


@dataclass
class Snapshot:
    torch: dict[str, Any]
    namespaces: dict[tuple[str, str], Any]
    hooks: dict[str, dict[str, Any]]
    attributes: dict[str, set[str]]
    callbacks: list[TrainerCallback]

    @classmethod
    def of(cls, trainer: FaultyTrainer) -> Snapshot:
        hooks = {name: hooks_of(module) for name, module in trainer.model.named_modules()}
        hooks["optimizer"] = hooks_of(trainer.sgd)
        return cls(
            torch_state(),
            torch_namespaces(),
            hooks,
            attributes(trainer),
            list(trainer.callback_handler.callbacks),
        )

    def added(self, trainer: FaultyTrainer) -> dict[str, set[str]]:
        after = attributes(trainer)
        return {key: after[key] - names for key, names in self.attributes.items() if after[key] != names}

    def assert_same_after(self, trainer: FaultyTrainer, by_training: dict[str, set[str]]) -> None:
        """As before, but for the attributes a plain run of the Trainer adds itself (``by_training``)."""
        after = Snapshot.of(trainer)
        assert after.torch == self.torch
        assert [key for key, value in self.namespaces.items() if after.namespaces.get(key) is not value] == []
        assert after.hooks == self.hooks
        assert "training_step" not in vars(trainer) and "compute_loss" not in vars(trainer)
        added = self.added(trainer)
        assert {key: names - by_training.get(key, set()) for key, names in added.items()} == {
            key: set() for key in added
        }
        assert after.callbacks == self.callbacks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run before any fault: its counts, and the attributes a Trainer run adds by itself."""
    root = tmp_path_factory.mktemp("reference")
    plain = make_trainer(root / "plain", Fault(), [])
    before = Snapshot.of(plain)
    plain.train()
    profiled = callback()
    make_trainer(root / "profiled", Fault(), [profiled]).train()
    return {"counts": counts(profiled), "run_keys": before.added(plain)}


def counts(profiled: HFFlopsCallback) -> tuple[int, ...]:
    p = profiled.result.profile
    return (p.fwd_flops, p.bwd_flops, p.recompute_flops, p.fwd_macs, p.bwd_macs, p.params)


def test_reference_run_counts_the_hand_computed_macs(reference: dict[str, Any]) -> None:
    fwd_flops, bwd_flops, recompute_flops, fwd_macs, bwd_macs, params = reference["counts"]
    assert fwd_macs == BATCH * (IN * HIDDEN + HIDDEN * OUT)
    # weight gradients of both layers, input gradient of fc2 only (the batch needs none)
    assert bwd_macs == BATCH * (IN * HIDDEN + 2 * HIDDEN * OUT)
    assert params == IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
    assert fwd_flops >= 2 * fwd_macs and bwd_flops >= 2 * bwd_macs and recompute_flops == 0


def assert_a_clean_run_counts_as_before(tmp_path: Path, reference: dict[str, Any]) -> None:
    fresh = callback()
    trainer = make_trainer(tmp_path / "after", Fault(), [fresh])
    before = Snapshot.of(trainer)
    trainer.train()
    assert fresh.result is not None and counts(fresh) == reference["counts"]
    assert fresh.result.profile.bwd_flops > 0
    before.assert_same_after(trainer, reference["run_keys"])


# --- the matrix ----------------------------------------------------------------------------------------

POINTS = [
    "forward",
    "compute_loss",
    "backward",
    "gradient clipping",
    "on_pre_optimizer_step",
    "optimizer.step",
    "lr_scheduler.step",
    "on_step_end",
    "on_step_begin",
]


def run_with_fault(
    tmp_path: Path, fault: Fault, callbacks: list[TrainerCallback], reference: dict, accumulation: int = 1
) -> None:
    trainer = make_trainer(tmp_path / "faulty", fault, callbacks, accumulation=accumulation)
    before = Snapshot.of(trainer)
    with pytest.raises(type(fault.error)) as raised:
        trainer.train()
    assert raised.value is fault.error  # the same exception, not wrapped or replaced
    before.assert_same_after(trainer, reference["run_keys"])


AFTER_OURS_AT_STEP_BEGIN = pytest.mark.xfail(
    reason="the one-shot training_step wrapper, set in our on_step_begin (and on_substep_end), stays on "
    "the Trainer when a callback after ours raises in that event: no event or scope of ours comes before "
    "training_step",
    strict=True,
)


@pytest.mark.parametrize("step", list(WINDOW), ids=lambda s: s.replace(" ", "_"))
@pytest.mark.parametrize(
    "point", [p if p != "on_step_begin" else pytest.param(p, marks=AFTER_OURS_AT_STEP_BEGIN) for p in POINTS]
)
def test_a_fault_anywhere_in_the_window_propagates_and_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], point: str, step: str
) -> None:
    fault = Fault(point, WINDOW[step])
    # another callback's events: before ours in the list (on_step_end: ours never sees the step end),
    # after ours for on_step_begin (ours has already set up the step's first micro-batch)
    other = FailingCallback(fault)
    callbacks = [callback(), other] if point == "on_step_begin" else [other, callback()]
    run_with_fault(tmp_path, fault, callbacks, reference)
    assert fault.fired
    assert_a_clean_run_counts_as_before(tmp_path, reference)


@AFTER_OURS_AT_STEP_BEGIN
def test_another_callback_failing_after_ours_between_accumulated_micro_batches_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """With gradient accumulation our ``on_substep_end`` sets the wrapper for the next micro-batch: a
    callback after ours that raises there leaves it, as in ``on_step_begin``."""
    fault = Fault("on_substep_end", WINDOW["counting"])
    run_with_fault(tmp_path, fault, [callback(), FailingCallback(fault)], reference, accumulation=2)
    assert fault.fired


@pytest.mark.parametrize("step", list(WINDOW), ids=lambda s: s.replace(" ", "_"))
def test_another_callback_failing_after_ours_at_step_end_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], step: str
) -> None:
    # at the window's last step ours has published by then: the fault comes after the metrics
    fault = Fault("on_step_end", WINDOW[step])
    profiled = callback()
    run_with_fault(tmp_path, fault, [profiled, FailingCallback(fault)], reference)
    assert (profiled.result is not None) == (step == "clean")
    assert_a_clean_run_counts_as_before(tmp_path, reference)


@pytest.mark.parametrize("step", list(WINDOW), ids=lambda s: s.replace(" ", "_"))
def test_keyboard_interrupt_inside_optimizer_step_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], step: str
) -> None:
    fault = Fault("optimizer.step", WINDOW[step], error=KeyboardInterrupt())
    run_with_fault(tmp_path, fault, [callback()], reference)
    assert_a_clean_run_counts_as_before(tmp_path, reference)


# --- after the fault, the process runs as before it ----------------------------------------------------


def test_after_an_optimizer_fault_at_the_counting_step_iterations_run_as_before_and_memory_stays_flat(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # before the rewrite this case left the counting hooks and modes installed: every later
    # forward + backward of any model ran under them, 2x slower, and memory grew without bound
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(128, 128), nn.ReLU())]
    model, batch = nn.Sequential(*layers), torch.randn(32, 128)

    def iteration() -> None:
        model(batch).sum().backward()

    for _ in range(5):
        iteration()  # first-call initialisations
    before = python_calls(iteration)
    fault = Fault("optimizer.step", WINDOW["counting"])
    run_with_fault(tmp_path, fault, [callback()], reference)

    process = psutil.Process()
    rss_before = process.memory_info().rss
    first = python_calls(iteration)
    for _ in range(100):
        iteration()
    last, rss_growth = python_calls(iteration), process.memory_info().rss - rss_before
    # a hook, mode or patch left behind runs in every iteration: the same functions, as often, as before
    assert first == before, first - before
    assert last == before, last - before
    assert rss_growth < 50 * 2**20


# --- user functions and loggers that fail ---------------------------------------------------------------

# the user function's n-th call, one per micro-batch: the counting step's, the clean step's (after the
# module-timing steps'), the first metered one's
CALLS = {"counting": 1, "clean": first_clean(0) + 1, "metered": first_clean(0) + 2}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("argument", ["batch_size_fn", "tokens_fn"])
def test_a_failing_batch_size_or_tokens_fn_propagates_and_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], argument: str, call: str
) -> None:
    error, seen = Boom(argument), []

    def user_fn(inputs: dict[str, torch.Tensor]) -> int:
        seen.append(inputs)
        if len(seen) == CALLS[call]:
            raise error
        return int(inputs["x"].shape[0])

    fault = Fault(error=error)
    trainer = make_trainer(tmp_path / "faulty", fault, [callback(**{argument: user_fn})], MAX_STEPS + 1)
    before = Snapshot.of(trainer)
    with pytest.raises(Boom) as raised:
        trainer.train()
    assert raised.value is error and len(seen) == CALLS[call]
    assert trainer.state.global_step == PROFILE_STEP + CALLS[call] - 1
    before.assert_same_after(trainer, reference["run_keys"])
    assert_a_clean_run_counts_as_before(tmp_path, reference)


class FailingLogger(TrainerCallback):
    """A reporting callback whose on_log raises on the first logs holding ``key``."""

    def __init__(self, key: str, error: Exception) -> None:
        self.key, self.error = key, error

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if self.key in (logs or {}):
            raise self.error


@pytest.mark.parametrize("key", ["flops_profiler/fwd_flops", "throughput/samples_per_sec"])
def test_a_logger_failing_on_the_metrics_propagates_and_leaves_nothing(
    tmp_path: Path, reference: dict[str, Any], key: str
) -> None:
    error = Boom("logger")
    trainer = make_trainer(
        tmp_path / "faulty", Fault(), [FailingLogger(key, error), callback()], MAX_STEPS + 1
    )
    before = Snapshot.of(trainer)
    with pytest.raises(Boom) as raised:
        trainer.train()
    assert raised.value is error
    assert trainer.state.global_step == MAX_STEPS + (key.startswith("throughput"))
    before.assert_same_after(trainer, reference["run_keys"])  # the console printers are back in the list
    assert trainer.control.should_log  # as the Trainer set it: the loss of that step is still due
    assert_a_clean_run_counts_as_before(tmp_path, reference)
