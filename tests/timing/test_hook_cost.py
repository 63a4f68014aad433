"""What the timing hooks cost, measured in place: the outermost calls on a clean pass against a timed
one, the bounds the probe puts on it, and each module's median over several timed steps."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn as nn

from flops_callbacks.phase_names import FORWARD
from flops_callbacks.timing.clock import CpuClock
from flops_callbacks.timing.hook_cost import MIN_CALLS, PROBE_CEILING, HookCost
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimer, ModuleTimes, median_step, nearest_step
from flops_callbacks.timing.outer_calls import OuterCalls
from tests.sleepy import Sleepy
from tests.support import forward_timed, hooks_of


class Nested(nn.Module):
    """Two children of known sleeps, each calling 2 tiny modules: 6 calls inside the model's call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Sleepy(fwd=0.03, bwd=0.0, tiny_ops=2)
        self.b = Sleepy(fwd=0.05, bwd=0.0, tiny_ops=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_outer_calls_mark_only_the_outermost_call_and_leave_no_hook() -> None:
    model = Nested()
    before = [hooks_of(m) for m in model.modules()]
    outer = OuterCalls([model, model.a], CpuClock())
    outer.start()
    try:
        model(torch.randn(2, 4))  # "" holds a and b: one span, not three
        model.a(torch.randn(2, 4))  # a child called on its own is an outer call too
    finally:
        outer.stop()
    assert outer.seconds() == pytest.approx(0.08 + 0.03, rel=0.15)
    assert [hooks_of(m) for m in model.modules()] == before
    model(torch.randn(2, 4))
    assert outer.seconds() == pytest.approx(0.11, rel=0.15)  # nothing marked once stopped


def test_the_timer_reads_the_same_outer_calls_and_counts_the_calls_inside() -> None:
    model = Nested()
    timer = forward_timed(model, torch.randn(2, 4))
    seconds, calls = timer.outer_calls()
    assert seconds == pytest.approx(0.08, rel=0.15)
    assert calls == 6  # a, a.tiny.0, a.tiny.1, b, b.tiny.0, b.tiny.1
    assert timer.outermost() == [model]


class Step(nn.Module):
    """A framework's step calling two children directly, as a ``training_step`` may: no call of the
    root holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Nested()
        self.head = Sleepy(fwd=0.02, bwd=0.0, tiny_ops=1)


def test_the_outermost_calls_are_those_the_step_made_directly() -> None:
    step = Step()
    timer = ModuleTimer(step, CpuClock())
    timer.start()
    try:
        step.head(step.model(torch.randn(2, 4)))
        step.head(torch.randn(2, 4))  # the same module called again: one entry, two outer calls
    finally:
        timer.stop()
    assert timer.outermost() == [step.model, step.head]
    seconds, calls = timer.outer_calls()
    assert seconds == pytest.approx(0.08 + 2 * 0.02, rel=0.15)
    assert calls == 6 + 2 * 1  # inside the model's call and each head call


def test_a_cost_measured_in_place_is_the_difference_over_the_calls_inside() -> None:
    probe = HookCost(per_call=10e-6, own=2e-6, source="probe")
    # 6 ms more over 300 calls: 20 us a call, within [probe, ceiling]; the own share stays the probe's 1/5
    cost = probe.measured(hooked=0.016, clean=0.010, calls=300, detail="outer calls")
    assert (cost.per_call, cost.own) == (pytest.approx(20e-6), pytest.approx(4e-6))
    assert (cost.source, cost.detail) == ("measured in place", "outer calls")


def test_a_measured_cost_is_kept_between_the_probe_and_a_ceiling_and_says_so() -> None:
    probe = HookCost(per_call=10e-6, own=2e-6, source="probe")
    low = probe.measured(hooked=0.0101, clean=0.010, calls=100, detail="outer")  # 1 us a call: noise
    assert low.per_call == pytest.approx(10e-6) and low.source == "measured in place, kept to the probe's"
    assert "1.0 us, kept to the probe's" in low.detail
    paused = probe.measured(hooked=0.310, clean=0.010, calls=30, detail="outer")  # a 0.3 s pause
    assert paused.per_call == pytest.approx(PROBE_CEILING * 10e-6)
    assert paused.source == f"measured in place, kept to {PROBE_CEILING:g}x the probe's"


def test_a_difference_within_the_clean_steps_noise_leaves_the_probes_cost_and_says_why() -> None:
    probe = HookCost(per_call=10e-6, own=2e-6, source="probe", detail="a one-op module")
    # 30 calls' hooks cost 0.3 ms by the probe; clean steps varying by 3 ms drown them (a large-op model)
    noisy = probe.measured(hooked=0.034, clean=0.030, calls=30, detail="outer", noise=0.003)
    assert (noisy.per_call, noisy.own, noisy.source) == (probe.per_call, probe.own, "probe")
    assert noisy.detail == (
        "a one-op module; not measured in place: the clean steps' outer calls vary by 3.00 ms, more than "
        "the hooks of 30 calls cost by the probe (0.30 ms)"
    )
    # the same difference where the clean steps vary less than the hooks cost: measured
    quiet = probe.measured(hooked=0.034, clean=0.030, calls=30, detail="outer", noise=0.0002)
    assert quiet.source.startswith("measured in place") and quiet.per_call > probe.per_call


def test_too_few_calls_to_measure_on_leave_the_probes_cost_and_say_why() -> None:
    probe = HookCost(per_call=10e-6, own=2e-6, source="probe", detail="a one-op module")
    few = probe.measured(hooked=0.02, clean=0.01, calls=MIN_CALLS - 1, detail="outer")
    assert (few.per_call, few.own, few.source) == (probe.per_call, probe.own, "probe")
    why = f"not measured in place: {MIN_CALLS - 1} module call(s) inside the model's, fewer than {MIN_CALLS}"
    assert few.detail == f"a one-op module; {why}"


def test_the_probe_costs_more_than_nothing_and_its_own_share_is_part_of_it() -> None:
    cost = hook_cost()
    assert 0 < cost.per_call < 1e-3  # microseconds on any machine, not a millisecond
    assert 0 <= cost.own <= cost.per_call


def _times(fwd_root: float, fwd_a: float, start: float) -> ModuleTimes:
    from flops_callbacks.timing.spans import ModuleSpan

    return ModuleTimes(
        fwd={"": fwd_root, "a": fwd_a},
        bwd={"": 2 * fwd_root},
        recompute={},
        spans=[ModuleSpan("", FORWARD, start, fwd_root, 0)],
    )


def test_the_tree_is_the_median_steps_whose_pause_drops_out_with_its_step() -> None:
    steps = [_times(0.010, 0.004, 1.0), _times(0.310, 0.304, 2.0), _times(0.012, 0.005, 3.0)]
    times = median_step(steps)
    assert times is steps[2]  # the model's forward + backward: 30, 930 and 36 ms; the median is 36
    assert times.fwd == {"": 0.012, "a": 0.005}  # the 0.3 s pause of the second step is left out
    one = _times(0.01, 0.0, 0.0)
    assert median_step([one]) is one


def test_the_tree_nearest_a_reference_forward_is_the_step_of_the_least_ratio_either_way() -> None:
    steps = [_times(0.0125, 0.005, 1.0), _times(0.0118, 0.004, 2.0), _times(0.0, 0.0, 3.0)]
    # each step's forward is what is set against the reference (the outermost calls, a loss module called
    # outside the model included), not the tree's root
    forwards = [0.0125, 0.0118, 0.0]
    # against 10 ms: 1.25x and 1.18x; the step of no forward is never the nearest
    assert nearest_step(steps, forwards, 0.010) is steps[1]
    # against 14 ms: 12.5 ms is 1.12x under it, 11.8 ms 1.19x under it
    assert nearest_step(steps, forwards, 0.014) is steps[0]
    assert nearest_step(steps, [0.0125, 0.0118, 0.0140], 0.014) is steps[2]  # its root is not what counts
    # by ratio, not difference: 8.2 ms is 1.22x under 10 ms (1.8 ms away), 12 ms 1.2x over it (2 ms away)
    under_over = [_times(0.0082, 0.0, 1.0), _times(0.012, 0.0, 2.0)]
    assert nearest_step(under_over, [0.0082, 0.012], 0.010) is under_over[1]
    equal = [_times(0.009, 0.0, 1.0), _times(0.009, 0.0, 2.0)]
    assert nearest_step(equal, [0.009, 0.009], 0.010) is equal[0]  # of equals, the earlier step
    # no positive forward, or no reference: none is nearest (the caller takes the median)
    assert nearest_step(equal, [0.0, -0.001], 0.010) is None
    assert nearest_step(equal, [0.009, 0.009], 0.0) is None
    assert nearest_step([], [], 0.010) is None


def test_the_median_steps_children_fit_in_their_parent_where_each_modules_median_would_not() -> None:
    # three consistent steps (a + b <= root in each): each module's own median would give a = 5, b = 6
    # against a root of 10, children 1.1x wider than their parent
    def tree(root: float, a: float, b: float) -> ModuleTimes:
        return ModuleTimes({"": root, "a": a, "b": b}, {"": root}, {}, [])

    steps = [tree(0.010, 0.007, 0.003), tree(0.010, 0.003, 0.007), tree(0.011, 0.005, 0.006)]
    assert statistics.median(t.fwd["a"] for t in steps) + statistics.median(t.fwd["b"] for t in steps) > 0.010
    times = median_step(steps)
    assert times in steps and times.fwd["a"] + times.fwd["b"] <= times.fwd[""]


def test_the_timer_takes_the_measured_cost_off_each_call_inside_a_span() -> None:
    model = Nested()
    model(torch.randn(2, 4))  # first-call initialisations (after a compile test: dynamo's) off the clock
    timer = ModuleTimer(model, CpuClock())
    timer.start()
    try:
        begin = time.perf_counter()
        model(torch.randn(2, 4))
        total = time.perf_counter() - begin
    finally:
        timer.stop()
    raw = timer.times()
    times = timer.times(HookCost(per_call=0.002, own=0.001, source="given"))
    # the spans as marked: the model's within the outside clock, a child at least its sleep
    assert 0.08 <= raw.fwd[""] <= total and raw.fwd["a"] >= 0.03
    # a child: its 2 calls (4 ms) and its own share (1 ms) off; the model: 6 calls inside (12 ms) and its
    # own share off, never less than its children (exactly: a loaded machine's late wake-ups stay in both)
    assert times.fwd["a"] == pytest.approx(raw.fwd["a"] - 0.005, abs=1e-9)
    assert times.fwd["b"] == pytest.approx(raw.fwd["b"] - 0.005, abs=1e-9)
    children = times.fwd["a"] + times.fwd["b"]
    assert times.fwd[""] == pytest.approx(max(raw.fwd[""] - 0.013, children), abs=1e-9)


class Gapped(Nested):
    """Nested, with 10 ms of the parent's own work between its two children (as slept: ``slept``)."""

    slept = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        begin = time.perf_counter()
        time.sleep(0.01)
        self.slept = time.perf_counter() - begin
        return self.b(x)


def test_the_own_share_is_raised_until_the_outer_calls_children_fit_in_them() -> None:
    model = Gapped()
    model(torch.randn(2, 4))  # first-call initialisations (after a compile test: dynamo's) off the clock
    timer = forward_timed(model, torch.randn(2, 4))
    raw = timer.times()
    gap = raw.fwd[""] - raw.fwd["a"] - raw.fwd["b"]  # the 10-ms sleep between the children, as spanned
    assert gap >= model.slept >= 0.01

    def share(per_call: float) -> float:
        """A cost per call, none of it inside a call's own span: the model loses its 6 calls' cost, each
        child only its 2 calls', so the children exceed their parent by 2 x the cost less the gap; each
        child's own hooks hold half that (the parent's measure is the anchor; the children's sleeps
        keep their spans above it all)."""
        return (2 * per_call - gap) / 2

    given = HookCost(per_call=0.01, own=0.0, source="given", detail="test")
    fitted = timer.fitted(given)
    assert fitted.own == pytest.approx(share(0.01), abs=1e-8)
    assert (fitted.per_call, fitted.source) == (given.per_call, given.source)
    assert fitted.detail.startswith("test; own share") and "in place" in fitted.detail
    times = timer.times(fitted)
    assert times.fwd["a"] + times.fwd["b"] <= times.fwd[""] + 1e-6
    # children that fit in their parent leave the share as it was; a dearer cost, a larger share
    assert timer.fitted(HookCost(0.0, 0.0, "none")) == HookCost(0.0, 0.0, "none")
    dear = timer.fitted(HookCost(per_call=0.011, own=0.0, source="dear"))
    assert dear.own == pytest.approx(share(0.011), abs=1e-8) and dear.own >= fitted.own


class HookedTime:
    """A virtual clock on which every mark costs ``before`` + ``after`` (a timing hook's own work around
    its clock read) and module bodies take what they add: a call's hooks cost 2 x (before + after), half
    of it inside its own span (the pre hook's work after its mark, the post hook's before)."""

    def __init__(self, before: float, after: float) -> None:
        self.now, self.before, self.after = 0.0, before, after

    def mark(self) -> float:
        self.now += self.before
        mark = self.now
        self.now += self.after
        return mark

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass

    def done(self, mark: object) -> bool:
        return True


class Body(nn.Module):
    def __init__(self, clock: HookedTime, seconds: float) -> None:
        super().__init__()
        self.clock, self.body = clock, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.body
        return x


class LossInside(nn.Module):
    """An HF-style model: one child (the network of 48 small leaves) and the loss around it."""

    def __init__(self, clock: HookedTime) -> None:
        super().__init__()
        self.clock = clock
        self.net = nn.Sequential(*[Body(clock, 10e-6) for _ in range(48)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.clock.now += 20e-6  # the loss
        return out


def test_under_a_one_child_wrapper_the_own_share_fits_every_call_inside_not_the_one_child() -> None:
    clock = HookedTime(before=3e-6, after=2e-6)  # 10 us a call, 5 us of it inside its own span
    model = LossInside(clock)
    timer = ModuleTimer(model, clock)  # type: ignore[arg-type]
    timer.start()
    try:
        with torch.no_grad():
            model(torch.zeros(1))
    finally:
        timer.stop()
    # the cost measured in place (10 us), the probe's share under-read (0): the 48 leaves (15 us spans)
    # exceed the model's span less its 49 calls by 215 us; the excess is the leaves' own share, 48 of
    # them (4.5 us each), not the one child's (which took the whole 10 us off each leaf: 5 us, half)
    fitted = timer.fitted(HookCost(per_call=10e-6, own=0.0, source="given"))
    assert fitted.own == pytest.approx(215e-6 / 48, rel=0.01)
    times = timer.times(fitted)
    leaves = sum(times.fwd[f"net.{i}"] for i in range(48))
    assert leaves == pytest.approx(48 * 10e-6, rel=0.06)  # the leaves' true 480 us
    assert leaves <= times.fwd["net"] + 1e-12 <= times.fwd[""] + 2e-12
