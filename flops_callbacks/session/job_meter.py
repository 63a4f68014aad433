"""The throughput meter after the window, on every rank: this rank's :class:`ThroughputMeter`, and the
exchange of every rank's interval at the logging steps, which every rank reaches, for the job's
``throughput/*``. A rank whose meter failed keeps joining the exchanges with nothing, and at the next
one every rank stops. A run resumed past its window meters from its first step, with no window's table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flops_callbacks.guard import Guard
from flops_callbacks.peaks import Peak, measured_dtype, resolve_peak
from flops_callbacks.session.adapter_api import Sink, TrainingContext
from flops_callbacks.session.meter import ThroughputMeter, throughput_metrics
from flops_callbacks.session.off_clock import Replay
from flops_callbacks.session.ranks import RankFailure, Ranks
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import ShapeFlops
from flops_callbacks.timing.clock import module_device

__all__ = ["JobMeter"]


class JobMeter:
    """Routes the session's events after the window to this rank's meter (None: ``throughput=False``)."""

    def __init__(self, meter: ThroughputMeter | None, ranks: Ranks, guard: Guard) -> None:
        self.meter, self.ranks, self.guard = meter, ranks, guard
        self.running = False  # the events are routed (every rank, from the window's agreed end)
        self.ok = False  # this rank's meter runs (else it joins the exchanges with nothing)
        self.unwindowed = False  # resumed past the window, none other due: metering starts at the next step

    def start(
        self, result: WindowResult | None, model: torch.nn.Module, flops: ShapeFlops, again: bool = False
    ) -> None:
        """The window ended on every rank: meter from now (``result`` None: this rank's build failed);
        ``again``: a re-profile window ended: the interval it paused goes on, its time left out."""
        if again:
            return self.resume()
        self.running, self.ok = self.meter is not None, False
        if self.meter is None or result is None:
            return
        with self.guard.own_work("starting throughput", "throughput/* is not logged"):
            self.meter.start(result, model, flops)
            self.ok = True

    def start_unwindowed(
        self, model: torch.nn.Module, context: Callable[[], TrainingContext] | None, given: Peak | None
    ) -> None:
        """A run resumed past its window meters from this step on every rank, with no window's table
        (:meth:`.ThroughputMeter.start_unwindowed`); ``given``: the user's peak. Once, when ``unwindowed``."""
        if not self.unwindowed:
            return
        self.unwindowed = False
        self.running, self.ok = self.meter is not None, False
        if self.meter is None:
            return
        with self.guard.own_work("starting throughput", "throughput/* is not logged"):
            device = module_device(model)
            found = context() if context is not None else TrainingContext()
            declared = found.compute_dtype

            def peak_of(matmuls: torch.dtype | None) -> float | None:
                peak, _ = resolve_peak(given, device, measured_dtype(declared, matmuls))
                return peak.flops if peak is not None else None

            self.meter.start_unwindowed(model, found.parallel.data_parallel, peak_of)
            self.ok = True

    def fail(self) -> None:
        """This rank's own work failed: its meter stops; with other ranks it joins their exchanges."""
        running = self.running and self.ranks.several
        self.close()
        self.unwindowed = False
        self.running = running

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()
        self.running = self.ok = False

    def micro_batch_start(self, batch: Any, replay: Replay | str | None = None) -> None:
        if self.meter is not None and self.ok:
            self.meter.micro_batch_start(batch, replay)

    def micro_batch_end(self) -> None:
        if self.meter is not None and self.ok:
            self.meter.micro_batch_end()  # an audited micro-batch's count ends here

    def step_end(self, global_step: int, sink: Sink, logs: bool, lead_in: bool) -> None:
        """An optimizer step ended: an audit of it ends; ``logs``: the job's interval is logged;
        ``lead_in``: the next step starts a re-profile window, whose time is paused from here (the next
        batch's wait included)."""
        if self.meter is not None and self.ok:
            self.meter.step_end()
        if logs:
            self.log(global_step, sink)
        if lead_in:
            self.pause()

    def step_raised(self) -> None:
        """A step raised and the loop goes on: an audit of it stops, and metering goes on."""
        if self.meter is not None and self.ok:
            self.meter.step_raised()

    def pause(self, late: bool = False) -> None:
        if self.meter is not None:
            self.meter.pause(late)

    def resume(self) -> None:
        if self.meter is not None:
            self.meter.resume()

    def log(self, global_step: int, sink: Sink) -> None:
        """Every rank's interval since the last call, exchanged; the job's ``throughput/*`` logged on the
        logging rank. A rank that has nothing to give (its meter failed) stops every rank's meter."""
        if not self.running or self.meter is None:
            return
        mine = None
        if self.ok:
            with self.guard.own_work("measuring throughput", "throughput/* stops"):
                mine = self.meter.interval()
        try:
            intervals = self.ranks.exchange(mine, throughput=True)
        except RankFailure as failure:
            intervals = [None]
            self.guard.fail("exchanging throughput across ranks", failure, "throughput/* stops")
        if any(i is None for i in intervals):  # a rank's meter failed (said there) or the exchange did
            self.close()
            return
        if sink.is_logging_rank:
            with self.guard.own_work("logging throughput", "throughput/* goes on"):
                metrics = throughput_metrics(intervals, self.meter.data_parallel, self.meter.peak)
                if metrics:
                    self.guard.user(sink.log_metrics, metrics, global_step)
