"""Compiled models, however they were compiled, in both frameworks (dynamo's "eager" backend: no C++
toolchain needed): the profiler's steps run them eagerly and say so, dynamo compiles exactly the frames
it compiles without the profiler, the module-timing step costs what an eager step costs, and the tree's
root agrees with the forward phase."""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch._dynamo.utils import counters

from flops_callbacks import FlopsProfilerCallback, HFFlopsCallback
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.module_tree import has_compiled
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.module_timer import ModuleTimer
from tests.support import first_clean, lightning_settings, module_steps, window_end

WIDTH, BATCH = 256, 128  # a forward of ~2 ms: compute, not dynamo's guards, sets the times
PROFILE_STEP = 2  # counting 2, then the module-timing steps, then 2 clean steps
STEPS = window_end(PROFILE_STEP, 2) + 1  # one step past the window
EAGER_NOTE = "runs eagerly while the profiler is on"
pytestmark = pytest.mark.usefixtures("one_thread")  # the window's steps compared with each other


class Block(nn.Module):
    """A module defined outside torch: dynamo skips torch's own files (an in-place compiled
    ``nn.Sequential`` of torch layers compiles nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def stack() -> Stack:
    torch.manual_seed(0)
    return Stack()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


# --- how a module can be compiled ------------------------------------------------------------------


def test_every_way_of_compiling_is_seen_and_a_disabled_function_is_not() -> None:
    plain = stack()
    assert not has_compiled(plain.modules())
    assert has_compiled(torch.compile(stack(), backend="eager").modules())  # OptimizedModule
    in_place = stack()
    in_place.compile(backend="eager")
    assert has_compiled(in_place.modules())  # module.compile()
    inner = stack()
    inner.blocks[2].compile(backend="eager")
    assert has_compiled(inner.modules())  # a compiled submodule
    method = stack()
    method.forward = torch.compile(method.forward, backend="eager")  # what Lightning's from_compiled does
    assert has_compiled(method.modules())
    disabled = stack()
    disabled.forward = torch._dynamo.disable(disabled.forward)
    assert not has_compiled(disabled.modules())


def test_a_model_compiled_in_place_is_counted_and_timed_eagerly_with_no_new_graph() -> None:
    model = stack()
    model.compile(backend="eager")
    x = torch.randn(BATCH, WIDTH)
    model(x).sum().backward()
    graphs = compiled_graphs()
    assert graphs >= 1
    tracer = CountingEngine(model)
    with pytest.warns(UserWarning, match=EAGER_NOTE):
        tracer.start()
    try:
        model(x).sum().backward()
    finally:
        tracer.stop()
    assert tracer.profile().modules["blocks.0.linear"].calls == 1  # every module's call seen: it ran eagerly
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    try:
        loss = model(x).sum()
        timer.arm()
        loss.backward()
    finally:
        timer.stop()
    assert {"", "blocks.0", "blocks.3.linear"} <= set(timer.times().fwd)
    model(x).sum().backward()
    assert compiled_graphs() == graphs  # the compiled graph ran again, unchanged


def loop(prof: Any, runs: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` training steps of ``runs`` on random batches under the StepProfiler ``prof``, then closed."""
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH)
        with prof.step(x):
            runs(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()


def test_a_wrapped_compiled_models_tree_is_the_models_own_from_its_root() -> None:
    """``torch.compile(model)`` handed to StepProfiler or FlopsProfiler: the root is the model (a
    ``Stack``), as Lightning and the HF Trainer report theirs, not torch's ``OptimizedModule`` wrapper."""
    from flops_callbacks import FlopsProfiler, StepProfiler

    model = stack()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    prof = StepProfiler(compiled, profile_step=1, clean_steps=1, print_profile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager note
        loop(prof, compiled, optimizer, window_end(1, 1) + 1)
        with FlopsProfiler(compiled) as counted:
            compiled(torch.randn(BATCH, WIDTH))
    assert prof.result is not None
    for profile in (prof.result.profile, counted.get_profile()):
        root = profile.modules[""]
        assert (root.class_name, root.calls) == ("Stack", 1)
        assert sorted(profile.modules)[:3] == ["", "blocks", "blocks.0"]
        assert root.fwd_flops == 4 * (2 * BATCH * WIDTH * WIDTH + BATCH * WIDTH)  # addmm, relu


def test_a_model_compiled_in_place_under_the_step_profiler_compiles_the_frames_it_compiles_alone() -> None:
    """``model.compile()`` puts the module's hooks inside the compiled frame: the block's hooks on the model
    (where a forward starts, where the backward reaches its output) made dynamo trace them on the window's
    clean steps, 3 graphs for 1 (a graph break at the output's hook), the first clean step recompiling
    (30x a step) and left out."""
    from flops_callbacks import StepProfiler

    def frames_of(profiled: bool) -> tuple[int, Any]:
        torch._dynamo.reset()
        counters.clear()
        model = stack()
        model.compile(backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        prof = StepProfiler(model, profile_step=2, clean_steps=3, print_profile=False)
        if not profiled:
            prof.close()  # a block after close() runs nothing of the profiler
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager note
            loop(prof, model, optimizer, window_end(2, 3) + 2)
        return counters["frames"]["total"], prof.result

    alone, _ = frames_of(profiled=False)
    frames, result = frames_of(profiled=True)
    assert frames == alone == 1
    assert result.steps.compiled == () and len(result.steps.clean) == 3


@pytest.mark.parametrize("compiled", [True, False])
def test_a_clean_step_in_which_torch_compile_compiled_is_left_out_and_said(
    tmp_path: Path, compiled: bool
) -> None:
    """``profile_step=0``: the window's first steps run eagerly, so the compiled code first runs (and
    compiles, here a second or more with inductor) on the first clean step; its time was a clean step's,
    in the wall rates and the latencies' max. It is left out and said; the model uncompiled: none is."""
    from flops_callbacks import StepProfiler

    model = stack()
    runs = torch.compile(model, backend="eager") if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = tmp_path / "report.txt"
    prof = StepProfiler(runs, profile_step=0, clean_steps=3, print_profile=False, output_file=report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager note
        loop(prof, runs, optimizer, window_end(0, 3) + 2)
    steps = prof.result.steps
    first = first_clean(0)
    if compiled:
        assert steps.compiled == (first,) and first not in steps.clean and steps.eager_tree
        assert "clean steps left out (torch.compile compiled in them)" in report.read_text()
    else:
        assert steps.compiled == () and steps.clean[0] == first and not steps.eager_tree
    assert len(steps.clean) >= 2 and not steps.skipped


# --- Lightning: torch.compile(lightning_module) passed to Trainer.fit -------------------------------------


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = stack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def fit_compiled(root: Path, profiled: bool) -> tuple[FlopsProfilerCallback | None, StepTimes, int]:
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(STEPS * BATCH, WIDTH, generator=generator),
        torch.randn(STEPS * BATCH, WIDTH, generator=generator),
    )
    settings = {"profile_step": PROFILE_STEP, "clean_steps": 2, "print_profile": False}
    ours = FlopsProfilerCallback(**settings) if profiled else None
    times = StepTimes()
    trainer = L.Trainer(callbacks=[times] + ([ours] if ours else []), **lightning_settings(root, STEPS))
    compiled = torch.compile(Regressor(), backend="eager")
    trainer.fit(compiled, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return ours, times, compiled_graphs()


def assert_window_holds(result: Any, step_seconds: list[float]) -> None:
    clean = [step_seconds[first_clean(PROFILE_STEP)], step_seconds[first_clean(PROFILE_STEP) + 1]]
    # the module-timing steps: no dearer than 3x a clean one (their median: one step's hiccup on a shared
    # machine, 50-100 ms here, is not the bug this guards against, which made every one 35x to 670x)
    timing = statistics.median(step_seconds[step] for step in module_steps(PROFILE_STEP))
    assert timing <= 3 * max(clean), step_seconds
    root = result.profile.modules[""].fwd_latency
    # an eager tree beside a compiled phase, on a shared machine: the same order, not equal (the bug this
    # guards against read 70x to 1,500x); how close they come is measured in benchmarks/
    assert result.fwd_latency / 3 <= root <= 3 * result.fwd_latency


def test_a_compiled_lightning_module_runs_eagerly_on_the_window_and_compiles_no_more_frames(
    tmp_path: Path,
) -> None:
    _, _, graphs_alone = fit_compiled(tmp_path / "alone", profiled=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, times, graphs = fit_compiled(tmp_path / "profiled", profiled=True)
    assert graphs_alone >= 1
    assert graphs == graphs_alone
    assert any(EAGER_NOTE in str(w.message) for w in caught)
    assert ours is not None and ours.result is not None
    assert set(ours.result.profile.modules) >= {"", "net", "net.blocks.3.linear"}  # no _orig_mod level
    assert_window_holds(ours.result, times.seconds)
    # no hook on a compiled model's clean steps (it could change dynamo's guards): the probe's cost, said
    cost = ours.result.hook_cost
    assert cost is not None and cost.source == "probe" and "dynamo compiled code" in cost.detail


# --- HF Trainer: TrainingArguments(torch_compile=True), compiled by accelerate --------------------------


class HFRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = stack()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(x), y)}


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(STEPS * BATCH, WIDTH, generator=generator)
        self.y = torch.randn(STEPS * BATCH, WIDTH, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class HFStepTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def train_compiled(root: Path, profiled: bool) -> tuple[HFFlopsCallback | None, HFStepTimes, int, Any]:
    torch._dynamo.reset()
    counters.clear()
    settings = {"profile_step": PROFILE_STEP, "clean_steps": 2, "print_profile": False}
    ours = HFFlopsCallback(**settings) if profiled else None
    times = HFStepTimes()
    args = transformers.TrainingArguments(
        output_dir=str(root),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        torch_compile=True,
        torch_compile_backend="eager",
    )
    trainer = transformers.Trainer(
        model=HFRegressor(), args=args, train_dataset=Pairs(), callbacks=[times] + ([ours] if ours else [])
    )
    trainer.train()
    return ours, times, compiled_graphs(), trainer


def test_the_model_the_hf_trainer_compiled_runs_eagerly_on_the_window_and_compiles_no_more_frames(
    tmp_path: Path,
) -> None:
    _, _, graphs_alone, _ = train_compiled(tmp_path / "alone", profiled=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, times, graphs, trainer = train_compiled(tmp_path / "profiled", profiled=True)
    assert has_compiled(trainer.model_wrapped.modules()) and not has_compiled(trainer.model.modules())
    assert graphs_alone >= 1
    assert graphs == graphs_alone
    assert any(EAGER_NOTE in str(w.message) for w in caught)
    assert ours is not None and ours.result is not None
    assert_window_holds(ours.result, times.seconds)
