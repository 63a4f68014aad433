"""What an adapter hands the session: what it read of its framework (:class:`TrainingContext`), where
the results go (:class:`Sink`), and the publisher that fills the sink (``Publish``).

The session knows none of them itself: an adapter hands it a context and a sink at its events, and
the callbacks' base hands it the publisher (:func:`flops_callbacks.reporting.publish.publish`) when it
builds the session, so that the session layer never imports the reporting layer above it.

The events an adapter maps onto the session (:class:`~flops_callbacks.session.step_session.StepSession`):

    train_start(global_step, max_steps=..)   at the start of a run (warnings come here, not at the end)
    step_start(global_step, model, context)  at the start of each optimizer step
    micro_batch_start(batch, replay)         before each micro-batch's forward (``replay``: its step again)
    phase(BACKWARD / OPTIMIZER_STEP / FORWARD), phase_end()   at the events between phases (FORWARD in
                                             a running forward: the user's code starts; stop_timing(): ends)
    micro_batch_end(pause=..)                after each micro-batch
    step_end(global_step, sink, logs=..)   when the optimizer step has ended
    train_end(global_step, sink)           at the end of the run
    close()                                  on an exception: nothing of the profiler remains
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.profile import Profile

if TYPE_CHECKING:  # the session layer's own types only
    from flops_callbacks.guard import Guard
    from flops_callbacks.options import Options
    from flops_callbacks.session.result import WindowResult

__all__ = ["Sink", "Publish", "TrainingContext"]


@dataclass(frozen=True)
class TrainingContext:
    """What the adapter reads from its framework when a window starts."""

    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    compute_dtype: str | None = None  # a flops_callbacks.peaks.DTYPES name: what the matmuls run in
    # report rows about the counting step's batches (the HF Trainer's own flops estimate)
    extra_lines: Callable[[list[Any], Profile], list[tuple[str, str]]] | None = None


class Sink(Protocol):
    """Where a framework's results go; the adapter implements it."""

    is_logging_rank: bool

    def log_dir(self) -> str | Path | None:
        """The run's log directory (called on every rank: Lightning's broadcasts)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Hand ``metrics`` to every logger of the run (logging rank only)."""

    def console(self, text: str) -> None:
        """Print ``text`` without breaking the framework's progress bar (logging rank only)."""

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        """Hand the report as Markdown (TensorBoard's Text tab) and the picture (W&B HTML) to the loggers
        that show them (None: it could not be rendered)."""


# Publishes a window's result on the logging rank: its report, files and metrics; with ``files_only``
# true, its report and JSON files again (the run's end adds what the profiler did after the window).
# Called as publish(result, options, log_dir, sink, guard, skip, files_only); the callbacks' base hands
# the session flops_callbacks.reporting.publish.publish.
Publish = Callable[
    ["WindowResult", "Options", "str | Path | None", Sink, "Guard", Collection[str], bool], None
]
