"""Support shared by the tests: the snapshot of everything the profiler could leave behind, the fault
the fault suites inject, and a step session driven as an adapter drives it."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from flops_callbacks import metrics as names
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.result import WindowSteps
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.step_session import StepSession
from flops_callbacks.session.window_plan import COMM_MIN, Kind, head
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.collector import collector_off
from flops_callbacks.timing.module_timer import ModuleTimer

# torch's FlopCounterMode counts the CPU's fused attention kernel (aten._scaled_dot_product_flash_attention
# _for_cpu) from torch 2.15 on, as we do; before, it has no formula for it and counts 0 (why we count it).
FLOP_COUNTER_COUNTS_CPU_SDPA = torch.__version__ >= (2, 15)


def end_process() -> None:
    """A multi-process worker's end, once everything is written: leave without interpreter teardown.
    A gloo worker thread that drops a finished collective's Python-owned tensors while the interpreter
    finalizes cannot take the GIL and aborts the process ("terminate called without an active
    exception"; a core dump showed ``ProcessGroupGloo::runLoop`` freeing an all_gather under a barrier)."""
    destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def destroy_group() -> None:
    """Destroy the default process group, if there is one."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def end_group_at_exit() -> None:
    """For a process that must end by returning (a ddp_spawn rank hands Lightning its results after its
    training ends), once its training ended: at exit, after multiprocessing has flushed its queues to the
    parent, leave as :func:`end_process` does, without the interpreter's teardown (destroying the group
    alone still let a gloo thread abort a spawned rank there now and then)."""
    atexit.register(end_process)


def held_back(latencies: list[list[float]], metrics: dict[str, float]) -> list[float]:
    """The rank's (fwd, bwd, step) whose latencies the job's are: the slow rank's where one stands out,
    else the slowest's (one clean step: each rank's median is its step)."""
    slow = int(metrics[names.SLOW_RANK])
    return latencies[slow] if slow >= 0 else max(latencies, key=sum)


def run_bounded(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``args`` in a session of its own; past ``timeout`` seconds kill its whole process group and
    every process under it (torchrun starts its workers in sessions of their own, out of the group's reach)
    and fail: a hang fails the test instead of stalling the suite."""
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(process.pid)
        out, err = process.communicate()
        raise AssertionError(f"hung: killed after {timeout} s: {' '.join(args)}\n{err[-3000:]}") from None
    finally:
        if process.poll() is None:
            _kill_all(process.pid)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _kill_all(pid: int) -> None:
    """SIGKILL to ``pid``'s process group and to every process under it, found in ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    under, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        under += found
        todo += found
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in under:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread, for runs whose step times are compared: with two threads on a 2-core machine,
    every op waits for the thread whose core another process holds, and the times are the load's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hooks_of(obj: object) -> dict[str, dict]:
    """Copies of an object's hook dicts (every dict attribute with "hook" in its name)."""
    return {k: dict(v) for k, v in vars(obj).items() if "hook" in k and isinstance(v, dict)}


def torch_state() -> dict[str, Any]:
    """torch's global hook dicts (modules, optimizers), autograd's entry points and both mode stacks."""
    state: dict[str, Any] = {}
    for namespace in (torch.nn.modules.module, importlib.import_module("torch.optim.optimizer")):
        for name, value in vars(namespace).items():
            if name.startswith("_global_") and isinstance(value, dict):
                state[f"{namespace.__name__}.{name}"] = dict(value)
    state["autograd entries"] = (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward)
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    state["function modes"] = list(_get_current_function_mode_stack())
    return state


def torch_namespaces() -> dict[tuple[str, str], Any]:
    """Every attribute of ``torch``, ``torch.nn.functional`` and ``torch.Tensor``: none may be patched."""
    return {(ns.__name__, key): value for ns in (torch, F, torch.Tensor) for key, value in vars(ns).items()}


def patched(before: dict[tuple[str, str], Any], after: dict[tuple[str, str], Any]) -> list[tuple[str, str]]:
    """Attributes of torch's namespaces that changed (torch may import submodules lazily: new modules
    are not changes)."""
    return [key for key, value in before.items() if after.get(key) is not value]


def leftovers(model: torch.nn.Module, *others: object) -> dict[str, Any]:
    """:func:`torch_state`, and the hook dicts and attribute names of every module of ``model`` and the
    hook dicts of ``others`` (optimizers): equal before and after a run when nothing of the profiler
    stays."""
    state = torch_state()
    for name, module in model.named_modules():
        state[f"module {name!r} hooks"] = hooks_of(module)
        if name:  # Lightning and the Trainer add attributes to the top module itself
            state[f"module {name!r} attributes"] = set(vars(module))
    for i, other in enumerate(others):
        state[f"other {i} hooks"] = hooks_of(other)
    return state


@dataclass
class Fault:
    """Raises ``error`` once, at ``point``, in the optimizer step that started at global step ``step``.

    The step being run is ``current`` (set by a test's callback as steps start), or ``step_of()`` when
    given (read from a Trainer), or the ``step`` a check passes.
    """

    point: str | None = None
    step: int = -1
    error: BaseException | None = None
    current: int | None = None
    step_of: Callable[[], int] | None = None
    fired: bool = False
    raised_at: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.error is None:
            self.error = RuntimeError(f"injected in {self.point} at step {self.step}")

    def check(self, point: str, step: int | None = None) -> None:
        if point != self.point or self.fired:
            return
        if step is None:
            step = self.step_of() if self.step_of is not None else self.current
        if step == self.step:
            self.fired = True
            assert self.error is not None
            raise self.error


class FaultyLR(torch.optim.lr_scheduler.LambdaLR):
    """A constant schedule whose step may raise (the fault matrices' "lr_scheduler.step")."""

    def __init__(self, optimizer: torch.optim.Optimizer, fault: Fault) -> None:
        self.fault = fault
        super().__init__(optimizer, lambda step: 1.0)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.fault.check("lr_scheduler.step")
        super().step(*args, **kwargs)


# --- a step session driven as an adapter drives it ---------------------------------------------------

B, IN, OUT = 5, 6, 2


# --- the window's layout, from the run plan: tests name steps through these, not through literals ----


def _head_steps(profile_step: int, kind: Kind, comm: bool = False) -> tuple[int, ...]:
    """The steps of ``kind`` in the fixed head of a window counted at ``profile_step`` (its layout's)."""
    return tuple(profile_step + i for i, k in enumerate(head(comm=COMM_MIN if comm else 0)) if k == kind)


def module_steps(profile_step: int) -> tuple[int, ...]:
    """The module-timing steps of a window counted at ``profile_step``: the steps right after it."""
    return _head_steps(profile_step, Kind.MODULE_TIMING)


def comm_steps(profile_step: int) -> tuple[int, ...]:
    """The communication steps of a several-rank window counted at ``profile_step``: right after the
    module-timing steps."""
    return _head_steps(profile_step, Kind.COMMUNICATION, comm=True)


def check_step(profile_step: int, comm: bool = False) -> int:
    """The step after the module-timing steps (and the communication steps, with ``comm``: several
    ranks), counted again to check the shape table (issue 32)."""
    return profile_step + len(head(comm=COMM_MIN if comm else 0))


def first_clean(profile_step: int, comm: bool = False) -> int:
    """The first clean step of a window counted at ``profile_step`` (every batch of one shape)."""
    return check_step(profile_step, comm) + 1


def window_end(profile_step: int, clean: int, comm: bool = False) -> int:
    """The global step at which a window with ``clean`` clean steps has ended and published (``comm``:
    with the communication steps, as a multi-process window has)."""
    return first_clean(profile_step, comm) + clean


def window_steps(profile_step: int, clean: int, **fields: Any) -> WindowSteps:
    """The ``WindowSteps`` of a window on a CPU whose every step had the counted shapes and marked the
    model's own forward (the tree: the module-timing step nearest it); ``module_trace`` is left None
    (which step that is depends on the clock: compare with :func:`laid_out`)."""
    cleans = tuple(range(first_clean(profile_step), window_end(profile_step, clean)))
    settings: dict[str, Any] = dict(
        counting=profile_step, module_timing=module_steps(profile_step), clean=cleans, skipped=(),
        latency_source=f"median of {clean} clean step(s)", model_forward=cleans,
        model_forward_shapes_match=True, shape_counting=(check_step(profile_step),), first=profile_step,
        module_trace_by="nearest",
    )  # fmt: skip
    return WindowSteps(**{**settings, **fields})


def module_source(profile_step: int, trace: int | None) -> str:
    """The start of the report's "module latencies from" value for a window counted at ``profile_step``
    on a CPU whose tree is step ``trace``'s."""
    steps = module_steps(profile_step)
    if len(steps) == 1:
        return f"step {steps[0]} (module hooks, no counting"
    consecutive = steps == tuple(range(steps[0], steps[-1] + 1))
    listed = f"{steps[0]}-{steps[-1]}" if len(steps) > 2 and consecutive else ", ".join(map(str, steps))
    return (
        f"steps {listed} (module hooks, no counting, the tree of step {trace}, the one nearest the clean "
        "steps' own forward"
    )


def laid_out(steps: WindowSteps) -> WindowSteps:
    """``steps`` with its ``module_trace`` checked (one of its module-timing steps) and then left None,
    to compare with :func:`window_steps`."""
    assert steps.module_trace in steps.module_timing, steps
    return dataclasses.replace(steps, module_trace=None)


class Sink:
    """Keeps what a session publishes: console text, logged metrics, and a real log dir."""

    is_logging_rank = True

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.printed: list[str] = []
        self.logged: list[tuple[dict[str, float], int]] = []
        self.reports: list[tuple[str, str, int]] = []

    def log_dir(self) -> Path | None:
        return self.directory

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((dict(metrics), step))

    def console(self, text: str) -> None:
        self.printed.append(text)

    def log_report(self, text: str, html: str, step: int) -> None:
        self.reports.append((text, html, step))


def run(
    session: StepSession,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    sink: Sink,
    batch: torch.Tensor | None = None,
    micro_batches: int = 1,
    parallel: ParallelSizes | None = None,
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda model, batch: model(batch).sum(),
) -> None:
    """Drive ``session`` as an adapter would, one optimizer step per global step in ``steps``."""
    for step in steps:
        session.step_start(step, model, lambda: TrainingContext(parallel or ParallelSizes()))
        optimizer.zero_grad()
        for _ in range(micro_batches):
            session.micro_batch_start(torch.randn(B, IN) if batch is None else batch)
            loss = loss_of(model, torch.randn(B, IN) if batch is None else batch)
            session.phase(BACKWARD)
            loss.backward()
            session.micro_batch_end()
        session.phase(OPTIMIZER_STEP)
        optimizer.step()
        session.step_end(step + 1, sink, logs=True)


# --- real Trainers, quiet: what the framework tests share ----------------------------------------------


def lightning_settings(root: Path, max_steps: int, /, **overrides: Any) -> dict[str, Any]:
    """``lightning.Trainer`` arguments for a short CPU run that writes and prints nothing of its own (no
    logger, checkpoint, progress bar, model summary or sanity check), logging at every step."""
    settings: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        default_root_dir=root,
    )  # fmt: skip
    return {**settings, **overrides}


def hf_arguments(output_dir: Path, max_steps: int, batch: int, /, **overrides: Any) -> Any:
    """``transformers.TrainingArguments`` for a short CPU run: no saving, no reporting backend, no
    progress bar, logging at every step."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=str(output_dir), use_cpu=True, max_steps=max_steps, per_device_train_batch_size=batch,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
    )  # fmt: skip
    return TrainingArguments(**{**settings, **overrides})


def python_calls(iteration: Callable[[], object]) -> Counter[tuple[str, str]]:
    """The Python functions one call of ``iteration`` enters, by file and name, with how often: a hook,
    mode or patch left behind adds its functions to every iteration, however fast the machine runs
    (a count, not a time: CI once read a 1.9x "slowdown" with nothing of ours left, another process on
    a core). The garbage collector is held off so that no finalizer lands in the count."""
    calls: Counter[tuple[str, str]] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls[frame.f_code.co_filename, frame.f_code.co_qualname] += 1

    with collector_off():
        sys.setprofile(profile)
        try:
            iteration()
        finally:
            sys.setprofile(None)
    return calls


def holds_sleep(measured: float, seconds: float) -> bool:
    """Whether a span that holds a sleep of ``seconds`` (and a few tiny ops) measured it: not less (a sleep
    does not end early), and under 1.5x (a busy machine wakes a sleeper late: CI read 70 ms for 50). The
    wrong attributions these tests guard against are whole sleeps: none, or twice."""
    return 0.98 * seconds <= measured < 1.5 * seconds


def forward_timed(model: nn.Module, x: torch.Tensor) -> ModuleTimer:
    """A module timer (CPU clock) that marked one forward of ``model`` on ``x``, stopped."""
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    try:
        model(x)
    finally:
        timer.stop()
    return timer


def loss_counts(model: nn.Module, batch: dict[str, torch.Tensor], **extra: Any) -> BatchCounts:
    """The counting engine on one micro-batch of a transformers model, called as the HF Trainer calls it
    (``model(**batch, **extra).loss``, then its backward): a step's first, with no gradient to add to."""
    engine = CountingEngine(model)
    engine.start()
    try:
        model(**batch, **extra).loss.backward()
    finally:
        engine.stop()
    return BatchCounts.of(engine.profile().model)


class VoteClock:
    """A rank's steps' clock (the one the session gives its window plan) that only its votes move: the
    i-th vote takes ``waits[i]`` seconds (``rest`` past the list's end). A fake ``Ranks``' gather calls
    :meth:`vote`."""

    def __init__(self, waits: list[float], rest: float = 0.0) -> None:
        self.waits, self.rest, self.now = waits, rest, 0.0

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def vote(self) -> None:
        self.now += self.waits.pop(0) if self.waits else self.rest
