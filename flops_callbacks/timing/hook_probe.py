"""The timing hooks' cost from a synthetic probe (a :class:`~flops_callbacks.timing.hook_cost.HookCost`):
the fallback where no measure in place exists, and the share of a call's own hooks inside its span."""

from __future__ import annotations

import statistics
import time

import torch

from flops_callbacks.phase_names import FORWARD
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.module_timer import ModuleTimer

__all__ = ["hook_cost", "stop_probes"]

# a probe's timer until it has measured: an interrupt (Ctrl-C) while it stops leaves it to stop_probes()
_RUNNING: list[ModuleTimer] = []


def stop_probes() -> None:
    """Remove the hooks of a probe an interrupt left running (the session's close calls it)."""
    while _RUNNING:
        _RUNNING[-1].stop()
        _RUNNING.pop()


class _Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0  # one small op with an autograd node, as a real call makes


def hook_cost(calls: int = 50, rounds: int = 15) -> HookCost:
    """The hooks' cost from a probe: a one-op module called ``calls`` times with a timer's hooks on and
    off (its outputs kept, as a forward keeps them), the fastest of ``rounds`` each, and its spans
    against its plain calls (a few ms in all). About half what the hooks cost inside a real model
    (module doc): the fallback when no in-place measure exists, and the share of a call's own hooks
    that lies inside its span.

    Args:
        calls: the probe module's calls per round.
        rounds: the rounds, of which the fastest counts.
    """
    probe = _Probe()
    x = torch.zeros(4, requires_grad=True) * 1.0
    timer = ModuleTimer(probe, CpuClock())

    def run(each: list[float]) -> float:
        outputs = []
        begin = time.perf_counter()
        for _ in range(calls):
            mark = time.perf_counter()
            outputs.append(probe(x))
            each.append(time.perf_counter() - mark)
        return time.perf_counter() - begin

    plain: list[float] = []
    hooked: list[float] = []
    plain_calls: list[float] = []
    hooked_calls: list[float] = []  # (the spans are read from the timer instead)
    _RUNNING.append(timer)
    for _ in range(rounds):
        plain.append(run(plain_calls))
        timer.start()
        try:
            hooked.append(run(hooked_calls))
        finally:
            timer.stop()
    _RUNNING.remove(timer)
    spans = [span.duration for span in timer.times().spans if span.phase == FORWARD]
    per_call = max((min(hooked) - min(plain)) / calls, 0.0)
    own = max(statistics.median(spans) - statistics.median(plain_calls), 0.0)
    return HookCost(per_call, min(own, per_call), "probe", "a one-op module with the hooks on and off")
