"""The window's agreed end on every rank: each rank's figures exchanged, the job's result built and
published, the meter started; or the window dropped everywhere, said once.

Apart from the step session's events because it is the one point where the ranks exchange what they
measured, and both ways out of a window (its end, its drop) leave the session in the same state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flops_callbacks.session.adapter_api import Publish, Sink, TrainingContext
from flops_callbacks.session.builder import RankRow
from flops_callbacks.session.ranks import RankFailure
from flops_callbacks.session.reprofile import local_part, window_result
from flops_callbacks.session.window_plan import Decision
from flops_callbacks.user_warning import warn

if TYPE_CHECKING:
    import torch

    from flops_callbacks.guard import Guard
    from flops_callbacks.options import Options
    from flops_callbacks.session.instruments import Instruments
    from flops_callbacks.session.job_meter import JobMeter
    from flops_callbacks.session.off_clock import OffClock
    from flops_callbacks.session.ranks import Ranks
    from flops_callbacks.session.result import WindowResult
    from flops_callbacks.session.shape_flops import ShapeFlops
    from flops_callbacks.session.window_plan import WindowPlan
    from flops_callbacks.session.window_steps import WindowStep

__all__ = ["DROPPED", "WindowEnd"]

DROPPED = "the profile window is dropped and nothing of the profiler stays; this run goes on unprofiled"


class WindowEnd:
    """The window's end and drop, as methods of the step session (which holds the state below)."""

    options: Options
    owner: str
    guard: Guard
    plan: WindowPlan
    ranks: Ranks
    instruments: Instruments
    flops: ShapeFlops
    off_clock: OffClock
    job_meter: JobMeter
    publish: Publish | None
    result: WindowResult | None
    given_peak: Any
    given_bandwidth: Any
    _steps: list[WindowStep]
    _step: WindowStep | None
    _model: torch.nn.Module | None
    _context: TrainingContext
    _window_ran: bool
    _abandoned: bool
    _logging_rank: bool
    _unwritable: dict[str, str]

    def close(self, meter: bool = True) -> None:
        raise NotImplementedError

    def _abandon(self) -> None:
        raise NotImplementedError

    def _drop(self, decision: Decision) -> None:
        """Every rank agreed to drop the window: said once, by the logging rank, unless this rank's own
        failure was said already. No other window starts in this run."""
        self.plan.reset(run=True)
        self._window_ran = True
        if self._logging_rank and not self._abandoned:
            warn(f"{self.owner}: {decision.why}; {DROPPED} on every rank. Training goes on.")
        self._abandoned = True
        self.close()

    def _stop_instruments(self) -> None:
        """Stop what runs; a counted micro-batch's counts go in the table."""
        self.instruments.stop(self.flops, self._step)

    def _counting_failed(self) -> bool:
        """Whether a formula failed while counting (said here, and the window dropped)."""
        failure = self.instruments.failure()
        if failure is None:
            return False
        what, error = failure
        self.guard.fail(what, error, DROPPED)
        self._abandon()
        return True

    def _finish(self, global_step: int, sink: Sink) -> None:
        """The window's agreed end (every rank): exchange each rank's figures, build the job's result,
        publish it on the logging rank, and start (or resume) the throughput meter on every rank."""
        steps, self._steps, self._step = self._steps, [], None
        tracer = self.instruments.drop()
        model, self._model = self._model, None
        reprofile, base = self.plan.reprofile, self.result
        self.plan.reset()
        self.plan.ended(steps[-1].number if steps else global_step)  # agreed: the steps are every rank's
        self._window_ran = True
        local = None
        if model is not None:
            with self.guard.own_work("counting the window's new shapes", DROPPED, self._abandon):
                self.off_clock.finish(model, self.flops)  # before the exchange: no step's time
            with self.guard.own_work("building the profile", DROPPED, self._abandon):
                local = local_part(steps, self.flops, tracer, base if reprofile else None)
        mine: RankRow | str = local.row() if local is not None else "failed" if self._abandoned else "empty"
        try:
            rows = self.ranks.exchange(mine)
        except RankFailure as failure:
            return self._drop(Decision.dropped(f"exchanging every rank's figures failed ({failure})"))
        if any(row == "failed" for row in rows):
            return self._drop(Decision.dropped(f"rank {rows.index('failed')}'s profile failed"))
        if local is None or model is None or any(isinstance(row, str) for row in rows):
            return self.job_meter.resume() if reprofile else None  # no micro-batch: nothing to say
        with self.guard.own_work("asking the log dir", "the files in the log dir are not written"):
            log_dir = sink.log_dir()  # on every rank: Lightning's log_dir is a collective
        built = None
        with self.guard.own_work("building the profile", "no profile is published"):
            peaks = (self.given_peak, self.given_bandwidth)
            built = window_result(local, steps, rows, model, self._context, self.flops, global_step, peaks)
        self.result = built or self.result  # a failed re-profile keeps the last result to build on
        if built is not None and sink.is_logging_rank and self.publish is not None:
            self.publish(built, self.options, log_dir, sink, self.guard, set(self._unwritable))
        self.job_meter.start(self.result, model, self.flops, again=reprofile)
