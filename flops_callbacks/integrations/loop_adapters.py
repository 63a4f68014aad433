"""The loop adapters of :class:`~flops_callbacks.StepProfiler`: what it reads of a plain PyTorch loop, an
accelerate loop (``accelerator=``) or a Lightning Fabric loop (``fabric=``), one :class:`LoopAdapter` each.

An adapter gives the user's model unwrapped (the profile's root is the model the user wrote, not what
``accelerator.prepare``, ``fabric.setup`` or DDP hand back), the run's sizes and compute dtype, an
:class:`~flops_callbacks.session.adapter_api.Sink` for the results, and the framework calls that mark
the backward's and the optimizer step's start. Why not one class with ``if accelerator`` branches: each
framework is imported only by its own adapter, so a plain loop needs neither installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.integrations.accelerate_state import compute_dtype, parallel_sizes
from flops_callbacks.integrations.strategy_state import precision_dtype, strategy_sizes
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import parameters_dtype
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.user_warning import warn

__all__ = [
    "accelerate_adapter",
    "fabric_adapter",
    "LogFn",
    "LoopAdapter",
    "plain_adapter",
    "unwrapped",
]

LogFn = Callable[[dict[str, float], int], None]  # the user's log(metrics, step)


@dataclass
class LoopAdapter:
    """The loop as the profiler sees it.

    Args:
        model: the user's model, the profile's root.
        runs: what the loop calls: a wrapper of ``model``, or ``model``.
        context: the run's sizes and compute dtype, asked at each window.
        sink: where the results go.
        backward_owner: the accelerator or Fabric whose ``backward(loss)`` the loop calls (the backward's
            exact start); None in a plain loop, whose backward starts at the forward's end.
        step_calls: the (object, method name) pairs the framework's optimizer step runs through, asked
            at each window: the wrapper's work before the inner optimizer's ``step`` is the step's, and a
            step the wrapper ran without the inner ``step`` (one a gradient scaler skipped) still ends
            the optimizer step.
        stepped: whether such a call was an optimizer step (accelerate's is not while it accumulates
            gradients).
    """

    model: torch.nn.Module
    runs: torch.nn.Module
    context: Callable[[], TrainingContext]
    sink: _PlainSink
    backward_owner: Any = None
    step_calls: Callable[[], list[tuple[Any, str]]] = list
    stepped: Callable[[], bool] = lambda: True


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without DDP / DataParallel / FSDP(1) wrappers (``.module``): the user's model.

    Args:
        model: what the loop calls, wrapped or not.
    """
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except ImportError:  # a torch built without distributed
        pass
    while isinstance(model, wrappers):
        inner = model.module
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


class _PlainSink:
    """The plain loop's sink: the user's ``log`` function, ``log_dir`` and the console (rank 0).

    Which rank logs is read at each run's start (:meth:`at_run_start`), not at construction: a loop
    may build its profiler before it starts the process group (``init_process_group``, ``fabric.launch``).
    A framework's sink overrides :meth:`_logging_rank` and :meth:`_log_to_framework`.
    """

    def __init__(self, framework: Any, log: LogFn | None, log_dir: str | Path | None) -> None:
        self.framework, self.log, self._log_dir = framework, log, log_dir
        self.is_logging_rank = True

    def _logging_rank(self) -> bool:
        return not _distributed() or torch.distributed.get_rank() == 0

    def _log_to_framework(self, metrics: dict[str, float], step: int) -> None:
        """A plain loop has no framework logger: only the user's ``log`` gets the metrics."""

    def at_run_start(self) -> None:
        self.is_logging_rank = self._logging_rank()

    def log_dir(self) -> str | Path | None:
        return self._log_dir

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.log is not None:
            self.log(dict(metrics), step)
        self._log_to_framework(dict(metrics), step)

    def console(self, text: str) -> None:
        print(text)

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        """A plain loop has no logger the profiler knows: the report is printed and in the files."""


def _distributed() -> bool:
    """Whether a process group runs (the profiler's ranks are its processes)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def plain_adapter(model: torch.nn.Module, log: LogFn | None, log_dir: str | Path | None) -> LoopAdapter:
    """A plain PyTorch loop: one process, or DDP / FSDP under ``torch.distributed`` (sizes from it).

    Args:
        model: what the loop calls (DDP / FSDP wrappers are taken off for the profile's root).
        log: the user's ``log(metrics, step)``, or None.
        log_dir: where the files go, or None for none.
    """

    def context() -> TrainingContext:
        world = torch.distributed.get_world_size() if _distributed() else 1
        sizes = ParallelSizes(world_size=world, data_parallel=world)
        return TrainingContext(sizes, parameters_dtype(user))

    def step_calls() -> list[tuple[Any, str]]:
        # a gradient scaler's step is the loop's optimizer step: its unscale and checks are the step's, and
        # one it skipped (inf gradients) still ends the step, as accelerate's and Fabric's wrappers do
        return [(torch.amp.GradScaler, "step")]

    user = unwrapped(model)
    return LoopAdapter(user, model, context, _PlainSink(None, log, log_dir), step_calls=step_calls)


class _AccelerateSink(_PlainSink):
    """Metrics through ``accelerator.log`` (every tracker: TensorBoard, W&B, MLflow, ...); the report as
    TensorBoard text and a W&B HTML panel where those trackers run."""

    def _logging_rank(self) -> bool:
        # and the process group's rank 0: accelerate on a CPU without cpu=True calls every process its main
        return bool(self.framework.is_main_process) and super()._logging_rank()

    def _log_to_framework(self, metrics: dict[str, float], step: int) -> None:
        self.framework.log(metrics, step=step)

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        for tracker in self.framework.trackers:
            if tracker.name == "tensorboard" and markdown is not None:
                tracker.writer.add_text(names.REPORT, markdown, global_step=step)
            elif tracker.name == "wandb" and html is not None:
                import wandb

                tracker.run.log({names.PICTURE: wandb.Html(html)}, commit=False)


def accelerate_adapter(
    accelerator: Any, model: torch.nn.Module, log: LogFn | None, log_dir: str | Path | None
) -> LoopAdapter:
    """An accelerate loop: sizes and the distributed type from ``accelerator.state``, the compute dtype
    from its mixed precision, metrics through ``accelerator.log``.

    Args:
        accelerator: the loop's ``accelerate.Accelerator``.
        model: what the loop calls (``accelerator.prepare``'s result or the model itself).
        log: the user's ``log(metrics, step)``, or None.
        log_dir: where the files go; None: the accelerator's logging dir.
    """
    user = unwrapped(accelerator.unwrap_model(model))
    said: list[bool] = []

    def context() -> TrainingContext:
        state = accelerator.state
        world = accelerator.num_processes
        group = torch.distributed.get_world_size() if _distributed() else world
        if group != world and not said:  # the profiler's ranks are the process group's
            said.append(True)
            if torch.distributed.get_rank() == 0:
                warn(
                    f"StepProfiler: accelerate runs {world} process(es) as {accelerator.distributed_type} "
                    f"while torch.distributed holds {group} (accelerate launch on a CPU without "
                    "Accelerator(cpu=True): each process trains alone, no gradient is synchronized); the "
                    f"profile counts the {group} processes of the process group, and its rank 0 logs",
                )
        sizes = parallel_sizes(accelerator, user, state, world_size=group)
        kind = str(accelerator.distributed_type).split(".")[-1]
        return TrainingContext(
            sizes,
            compute_dtype(None, user, accelerator),
            lambda _b, _p: [("accelerate distributed type", kind)],
        )

    def step_calls() -> list[tuple[Any, str]]:
        # accelerate keeps the optimizers it prepared only here (no public list): an AcceleratedOptimizer's
        # step runs its own checks before the inner optimizer's step, or skips that under accumulation
        return [(optimizer, "step") for optimizer in getattr(accelerator, "_optimizers", ())]

    directory = log_dir if log_dir is not None else accelerator.logging_dir
    sink = _AccelerateSink(accelerator, log, directory)
    return LoopAdapter(
        user, model, context, sink, accelerator, step_calls, lambda: bool(accelerator.sync_gradients)
    )


class _FabricSink(_PlainSink):
    """Metrics through ``fabric.log_dict`` (every Fabric logger, saved after); the report as TensorBoard
    text where a TensorBoard logger runs."""

    def _logging_rank(self) -> bool:
        return bool(self.framework.is_global_zero)

    def log_dir(self) -> str | Path | None:
        """The files' folder, each logger's experiment made first: a CSV logger that finds its folder
        holding the profile's files warns that it is not empty and its log files will be deleted."""
        for logger in self.framework.loggers:
            logger.experiment  # noqa: B018  (made on the logging rank, a no-op elsewhere)
        return self._log_dir

    def _log_to_framework(self, metrics: dict[str, float], step: int) -> None:
        self.framework.log_dict(metrics, step=step)
        for logger in self.framework.loggers:
            logger.save()

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        from lightning.fabric.loggers import TensorBoardLogger

        for logger in self.framework.loggers:
            if isinstance(logger, TensorBoardLogger) and markdown is not None:
                logger.experiment.add_text(names.REPORT, markdown, global_step=step)


def fabric_adapter(
    fabric: Any, model: torch.nn.Module, log: LogFn | None, log_dir: str | Path | None
) -> LoopAdapter:
    """A Fabric loop: sizes from its strategy, the compute dtype from its precision, metrics through
    ``fabric.log_dict``.

    Args:
        fabric: the loop's ``lightning.Fabric``.
        model: what the loop calls (``fabric.setup``'s result or the model itself).
        log: the user's ``log(metrics, step)``, or None.
        log_dir: where the files go; None: the first logger's log dir.
    """
    try:
        from lightning.fabric.strategies import DeepSpeedStrategy, ModelParallelStrategy
        from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled
    except ImportError as err:
        raise ImportError("StepProfiler(fabric=...) needs Lightning: pip install lightning") from err
    wrapper, _ = _unwrap_compiled(model)
    inner = wrapper._forward_module if isinstance(wrapper, _FabricModule) else wrapper
    user = unwrapped(wrapper.module if isinstance(wrapper, _FabricModule) else wrapper)

    def context() -> TrainingContext:
        strategy = fabric.strategy
        mesh = strategy.device_mesh if isinstance(strategy, ModelParallelStrategy) else None
        engine = inner if isinstance(strategy, DeepSpeedStrategy) else None
        sampler = getattr(strategy, "distributed_sampler_kwargs", None)  # None on one device
        sizes = strategy_sizes(fabric.world_size, sampler, mesh, engine)
        precision = str(getattr(strategy.precision, "precision", "32-true"))
        kind = type(strategy).__name__
        return TrainingContext(
            sizes, precision_dtype(precision, user), lambda _b, _p: [("Fabric strategy", kind)]
        )

    directory = log_dir
    if directory is None and fabric.loggers:
        directory = getattr(fabric.logger, "log_dir", None)
    # every optimizer step of a Fabric loop runs through its strategy (``_FabricOptimizer.step``)
    step_calls = lambda: [(fabric.strategy, "optimizer_step")]  # noqa: E731
    return LoopAdapter(user, model, context, _FabricSink(fabric, log, directory), fabric, step_calls)
