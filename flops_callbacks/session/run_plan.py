"""What a run's start says about its profile window: where the window falls in the run, the warnings due
now rather than at the window's end (a profile_step the run never reaches, a window it cuts short, a run
resumed past it), and the destinations that cannot be written. Asked once per run; it holds no state of
the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flops_callbacks.files import unwritable_reason
from flops_callbacks.options import Options
from flops_callbacks.session.window_plan import (
    CLEAN_MIN,
    COMM_MAX,
    MODULE_TIMING_STEPS,
    before_clean,
    resumed_window,
)
from flops_callbacks.user_warning import warn

__all__ = ["RunPlan", "unwritable_destinations"]


@dataclass(frozen=True)
class RunPlan:
    """Where the window falls in a run that starts at ``global_step`` (``max_steps``: its length, if
    known; ``steps_per_batch``: global steps per optimizer step, several under Lightning's manual
    optimization with several optimizers)."""

    options: Options
    global_step: int
    max_steps: int | None
    steps_per_batch: int
    first: int  # the window's first step
    last: int  # the step its last step starts at (at least: with clean_steps="auto", or several ranks)
    comm: int = 0  # the window's communication steps by place (several ranks; "auto" may add more)

    @classmethod
    def of(
        cls,
        options: Options,
        global_step: int,
        max_steps: int | None,
        steps_per_batch: int,
        comm: int = 0,
    ) -> RunPlan:
        clean = CLEAN_MIN if options.clean_steps == "auto" else options.clean_steps
        per, start = steps_per_batch, resumed_window(options, global_step) or options.profile_step
        first = global_step + -(-(start - global_step) // per) * per
        last = first + (before_clean(comm=comm) + clean - 1) * per
        return cls(options, global_step, max_steps, per, first, last, comm)

    @property
    def most(self) -> int:
        """The step its last step starts at when ``comm_steps="auto"`` runs all :data:`COMM_MAX`."""
        more = COMM_MAX - self.comm if self.comm and self.options.comm_steps == "auto" else 0
        return self.last + more * self.steps_per_batch

    @property
    def resumed_past(self) -> bool:
        """Resumed past ``profile_step``: its window does not run (with ``profile_every``, the grid's
        next does, :func:`~flops_callbacks.session.window_plan.resumed_window`)."""
        return self.global_step > self.options.profile_step

    @property
    def unreachable(self) -> bool:
        return self.max_steps is not None and self.max_steps <= self.first

    def warn(self, owner: str, profiled_before: bool, profiled_step: int | None = None) -> None:
        """Say now if no profile can run in this run, or only a cut-short one, or one cut short if
        ``comm_steps="auto"`` runs all its communication steps. ``profiled_step``: the step the run before
        the checkpoint profiled, where known (its files' name)."""
        profile_step, max_steps = self.options.profile_step, self.max_steps
        if self.resumed_past and self.options.profile_every is None:
            if profiled_before and profiled_step is not None:
                before = (
                    f"step {profiled_step} was profiled before the checkpoint "
                    f"(flops_profile_step{profiled_step}.txt in that run's log dir)"
                )
            elif profiled_before:
                before = "a window ran before the checkpoint (flops_profile_step*.txt in that run's log dir)"
            else:
                before = f"past profile_step={profile_step}"
            counted = (
                "counted, out of the metered time"
                if self.options.flops_audit != 0
                else "no flops: flops_audit=0"
            )
            meter = (
                f"; throughput/* goes on from its first step ({counted})" if self.options.throughput else ""
            )
            warn(
                f"{owner}: resumed at step {self.global_step}, {before}: no profile runs in this run{meter}. "
                "Set profile_step >= the step you resume from, or profile_every, to profile again.",
            )
        elif self.unreachable and max_steps is not None:
            warn(
                f"{owner}: profile_step={profile_step} is never reached: the run has {max_steps} "
                f"optimizer steps (0 .. {max_steps - 1}). Use a profile_step below {max_steps}.",
            )
        elif max_steps is not None and max_steps <= self.last:
            more = f"-{COMM_MAX}" if self.options.comm_steps == "auto" else ""  # "auto" may add up to it
            comm = f"{self.comm}{more} x communication, " if self.comm else ""
            warn(
                f"{owner}: the profile window needs steps {self.first} .. {self.last} "
                f"(counting, {MODULE_TIMING_STEPS} x module timing, {comm}a check, "
                f"clean_steps={self.options.clean_steps!r}); the run has {max_steps} steps: "
                f"the latencies will rest on {self._clean_left(self.comm)} clean step(s).",
            )
        elif max_steps is not None and max_steps <= self.most:
            warn(
                f"{owner}: the profile window needs steps {self.first} .. {self.last}, or up to "
                f"{self.most} if its first {self.comm} communication steps disagree (comm_steps='auto' "
                f"then runs up to {COMM_MAX}); the run has {max_steps} steps: the latencies would then "
                f"rest on {self._clean_left(COMM_MAX)} clean step(s). comm_steps={self.comm} fixes "
                "the count.",
            )

    def _clean_left(self, comm: int) -> int:
        """The clean steps the run leaves the window with ``comm`` communication steps."""
        steps = -(-(self.max_steps - self.first) // self.steps_per_batch) if self.max_steps else 0
        return max(steps - before_clean(comm=comm), 0)


def unwritable_destinations(
    owner: str, output_file: str | Path | None, log_dir: str | Path | None
) -> dict[str, str]:
    """The window's destinations ("output_file", "log_dir") that cannot be written, each said now with
    why; they are not tried at the window's end."""
    places = {  # each destination as given, and the folder it needs
        "output_file": (output_file, Path(output_file).parent) if output_file is not None else None,
        "log_dir": (log_dir, Path(log_dir)) if log_dir is not None else None,
    }
    lost = {"output_file": "the report (printed instead)", "log_dir": "the files in the log dir"}
    unwritable: dict[str, str] = {}
    for place, found in places.items():
        reason = unwritable_reason(found[1]) if found is not None else None
        if found is not None and reason is not None:
            unwritable[place] = reason
            warn(
                f"{owner}: cannot write {place} {found[0]}: {reason}. Not saved: {lost[place]}; "
                "the metrics are logged. Training goes on.",
            )
    return unwritable
