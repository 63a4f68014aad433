"""Two saved profiles compared: the headline figures with their ranges and the modules by their own time
(the gate's rules on them: :mod:`.gate_rules`). Pure functions of a saved profile
(``reporting.profile_file.SavedProfile``); the command line (``flops_callbacks.cli``) prints and draws
what they return.

What counts as noise, in one place (:func:`is_noise`): a latency's range is what its clean steps spread
over, their fastest and slowest tenth left out (:data:`TRIM`: a step a neighbour's job stalled is not the
configuration's spread; under 10 steps, min .. max); a rate's is what the same steps' own rates spread over
(each step's work over its own time: with batches of changing lengths a long batch's step is slower at
the same rate, so the steps' times alone would read the lengths as noise); a step's energy (per step,
sample, token) is the wall step's range scaled from their mean, the same power over a faster or a slower
step, and tokens per joule its inverse; a count (flops, bytes, params) and the mean power are exact and
have none (:data:`COUNTS`: a run with no clean step has them as any run does). A
change is noise when the new run's figure lies within the base run's range: the base run's own steps
spread that far with nothing changed. A module's own time has no range of its own (its latency is one
module-timing step's), so its change is noise when it is within the base run's phase wobble:
the range of its fwd latency plus that of its bwd latency.

Several runs of one configuration (:func:`run_figures`, what ``gate`` reads from a folder): a figure is
the median of the runs' values and its range what those values spread over (:func:`spread_range` again).
A run's median moves from run to run with the machine's speed, by more than its own steps spread on a
shared machine; runs of the base and the change taken in turns meet the same drift.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flops_callbacks import metrics as names
from flops_callbacks import units
from flops_callbacks.phase_names import PROFILE_PASSES
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.profile_file import SavedProfile
from flops_callbacks.session.window_steps import CleanFigures, StepWork

__all__ = [
    "Change",
    "Figure",
    "COUNTS",
    "ModuleChange",
    "changes",
    "figure_text",
    "figures",
    "is_noise",
    "module_changes",
    "one_sided",
    "one_sided_lines",
    "own_seconds",
    "percent_text",
    "range_text",
    "relative",
    "run_figures",
    "short",
    "spread_range",
]

# the metric whose range over the clean steps gives a figure's range, and whether the figure is a rate
# over it (its range inverted); the JSON's "spread" keys
_RANGE_OF: dict[str, tuple[str, bool]] = {
    names.FWD_LATENCY: ("fwd", False),
    names.BWD_LATENCY: ("bwd", False),
    names.STEP_LATENCY: ("step", False),
    names.ITER_LATENCY: ("iter", False),
    names.DATA_LATENCY: ("data", False),
    names.WALL_LATENCY: ("wall", False),
    names.FWD_FLOPS_PER_SEC: ("fwd", True),
    names.BWD_FLOPS_PER_SEC: ("bwd", True),
    **{name: ("iter", True) for name in (names.FLOPS_PER_SEC, names.SAMPLES_PER_SEC, names.TOKENS_PER_SEC)},
    **{name: ("iter", True) for name in (names.REAL_TOKENS_PER_SEC, names.MFU, names.HFU)},
    names.WALL_SAMPLES_PER_SEC: ("wall", True),
    names.HARDWARE_FLOPS_PER_SEC: ("iter", True),
    names.WALL_TOKENS_PER_SEC: ("wall", True),
    names.TOKENS_PER_JOULE: ("wall", True),
}
# the work a rate counts in one clean step (None: the step does not say); a rate without one here counts
# the same work in every step (MFU and HFU are their FLOPS over the peak)
_WORK_OF: dict[str, Callable[[StepWork], float | None]] = {
    names.FWD_FLOPS_PER_SEC: lambda w: w.counts.model_fwd_flops,
    names.BWD_FLOPS_PER_SEC: lambda w: w.counts.model_bwd_flops,
    **dict.fromkeys((names.FLOPS_PER_SEC, names.MFU), lambda w: w.counts.model_flops),
    **dict.fromkeys((names.HARDWARE_FLOPS_PER_SEC, names.HFU), lambda w: w.counts.hardware_flops),
    **dict.fromkeys((names.SAMPLES_PER_SEC, names.WALL_SAMPLES_PER_SEC), lambda w: w.samples),
    **dict.fromkeys(
        (names.TOKENS_PER_SEC, names.WALL_TOKENS_PER_SEC, names.TOKENS_PER_JOULE), lambda w: w.tokens
    ),
    names.REAL_TOKENS_PER_SEC: lambda w: w.real_tokens,
}
# the energy of a step, a sample, a token: at the window's power a slower wall step burns longer, so its
# range is the wall step's, scaled (lower is better)
_ENERGY_OF = dict.fromkeys((names.ENERGY_PER_STEP, names.ENERGY_PER_SAMPLE, names.ENERGY_PER_TOKEN), "wall")
# figures of the clean steps' totals (samples, tokens or joules over their summed wall time), not of their
# median step: scaled from the steps' mean
_OF_TOTALS = frozenset(
    (names.WALL_SAMPLES_PER_SEC, names.WALL_TOKENS_PER_SEC, names.TOKENS_PER_JOULE, *_ENERGY_OF)
)
# the figures in the report's order; any other metric of a file follows them
ORDER = (*names.ALL, *names.PADDING, *names.WITH_PEAK)
TRIM = 0.1  # of a figure's clean steps, the fastest and the slowest tenth are left out of its range


def short(name: str) -> str:
    """A metric's name as the command line takes it: without ``flops_profiler/``.

    Args:
        name: a metric's name.
    """
    return name.removeprefix(names.PREFIX)


# the figures no clock makes (counts, and padding's share of them): a run with no clean step has them as any
COUNTS = frozenset(short(n) for n in (
    names.FWD_FLOPS, names.BWD_FLOPS, names.RECOMPUTE_FLOPS, names.FWD_MACS, names.FWD_BYTES, names.BWD_BYTES,
    names.SAVED_ACTIVATION_BYTES, names.PARAMS, names.CLEAN_STEPS, names.PADDING_FRACTION,
))  # fmt: skip


@dataclass(frozen=True)
class Figure:
    """One metric of a run as logged, with its range (its own value at both ends when exact); of
    several runs, their median and the range of their values."""

    name: str  # without the prefix
    value: float
    low: float
    high: float
    runs: int = 1  # how many runs the value is the median of

    def data(self) -> dict[str, float]:
        """As JSON data (what ``diff --json`` and ``gate --json`` print)."""
        return {"value": self.value, "low": self.low, "high": self.high, "runs": self.runs}


def spread_range(values: list[float]) -> tuple[float, float]:
    """What ``values`` (one latency over the clean steps) spread over: their lowest and highest once the
    fastest and slowest :data:`TRIM` of them are left out (all of them under 10).

    Args:
        values: the latency of each clean step, seconds.
    """
    ranked = sorted(values)
    cut = int(len(ranked) * TRIM)
    return ranked[cut], ranked[-1 - cut]


def _ranges(saved: SavedProfile) -> dict[str, tuple[float, float, float, float]]:
    """Each latency of the clean steps (the JSON's ``spread`` keys): its median, its mean and its range."""
    clean = saved.result.figures()
    found = {}
    for key, s in clean.spreads.items():
        values = [step.latency(key) for step in clean.steps]
        found[key] = (s.median, statistics.fmean(values) if values else s.median, *spread_range(values))
    return found


def _rate_range(clean: CleanFigures, name: str, value: float) -> tuple[float, float] | None:
    """What rate ``name`` (``value`` as logged) spreads over its clean steps: each step's own work over
    its own time, scaled as the figure is from the same rate of the step it is of (the median step, or
    the steps' totals); None where a step took no time."""
    key, work_of = _RANGE_OF[name][0], _WORK_OF.get(name, lambda w: None)

    def work(w: StepWork) -> float:
        amount = work_of(w)
        return 1.0 if amount is None or not all(work_of(s) for s in clean.work) else float(amount)

    seconds = [step.latency(key) for step in clean.steps]
    if not seconds or min(seconds) <= 0:
        return None
    if name in _OF_TOTALS:
        of = sum(work(s) for s in clean.work) / sum(seconds)
    else:
        median = clean.median_step()
        of = work(median.work) / median.latency(key) if median.latency(key) > 0 else 0.0
    if of <= 0:
        return None
    return spread_range(
        [value * work(step.work) / s / of for step, s in zip(clean.steps, seconds, strict=True)]
    )


def figures(saved: SavedProfile) -> dict[str, Figure]:
    """Every metric of ``saved`` with its range, by name without the prefix, in the report's order.

    Args:
        saved: the saved profile to read.
    """
    ranges, clean = _ranges(saved), saved.result.figures()
    ordered = [n for n in ORDER if n in saved.metrics] + [n for n in saved.metrics if n not in ORDER]
    found = {}
    for name in ordered:
        value = saved.metrics[name]
        low = high = value
        if name in _RANGE_OF and _RANGE_OF[name][0] in ranges:
            if not _RANGE_OF[name][1]:
                low, high = ranges[_RANGE_OF[name][0]][2:]
            else:
                low, high = _rate_range(clean, name, value) or (value, value)
        elif name in _ENERGY_OF and _ENERGY_OF[name] in ranges:
            _, mean, fastest, slowest = ranges[_ENERGY_OF[name]]
            if mean > 0:  # the same power over the fastest and the slowest step
                low, high = value * fastest / mean, value * slowest / mean
        found[short(name)] = Figure(short(name), value, min(low, value), max(high, value))
    return found


def run_figures(runs: Sequence[SavedProfile]) -> dict[str, Figure]:
    """The figures of one configuration's runs: one run's own (:func:`figures`); of several, each
    figure all of them have, as the median of their values within the range of those values.

    Args:
        runs: the saved runs, one or more, of one configuration.
    """
    if len(runs) == 1:
        return figures(runs[0])
    each = [figures(saved) for saved in runs]
    found = {}
    for name in each[0]:
        if all(name in f for f in each):
            values = [f[name].value for f in each]
            found[name] = Figure(name, statistics.median(values), *spread_range(values), runs=len(runs))
    return found


def is_noise(a: Figure, b: Figure) -> bool:
    """Whether ``b`` lies within ``a``'s range: the base's own clean steps (or runs) spread that far.

    Args:
        a: the figure in the base run.
        b: the same figure in the new run.
    """
    return a.low <= b.value <= a.high


NAMING = frozenset({"slow_rank"})  # figures naming something (a rank), not measuring it: no change in %


def relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return (b - a) / abs(a) if a else math.copysign(math.inf, b - a)


@dataclass(frozen=True)
class Change:
    """A figure from run A to run B."""

    a: Figure
    b: Figure

    @property
    def name(self) -> str:
        """The figure's short name, ``fwd_latency``."""
        return self.a.name

    @property
    def relative(self) -> float:
        """(B - A) / A; infinite when A is 0 and B is not; 0 for a figure that names (:data:`NAMING`)."""
        return 0.0 if self.name in NAMING else relative(self.a.value, self.b.value)

    @property
    def noise(self) -> bool:
        """Whether B lies within the spread of A's own clean steps (:func:`is_noise`)."""
        return is_noise(self.a, self.b)

    @property
    def direction(self) -> int:
        """+1 when B is better, -1 when worse, 0 when equal or neither (a count: more work is not worse)."""
        if self.a.value == self.b.value:
            return 0
        return (1 if self.b.value > self.a.value else -1) * better_up(self.name)


def better_up(name: str) -> int:
    """+1 for a figure better higher (a rate), -1 better lower (a latency, an energy), 0 for neither (a
    count: more work is not worse).

    Args:
        name: the figure's short name.
    """
    if name.endswith("_latency") or f"{names.PREFIX}{name}" in _ENERGY_OF:
        return -1
    return 1 if f"{names.PREFIX}{name}" in _RANGE_OF else 0


def changes(a: SavedProfile, b: SavedProfile) -> list[Change]:
    """Every figure both runs have, A's order.

    Args:
        a: the first run (the base).
        b: the second run.
    """
    fa, fb = figures(a), figures(b)
    return [Change(fa[n], fb[n]) for n in fa if n in fb]


@dataclass(frozen=True)
class ModuleChange:
    """A module's own work from run A to run B: its time, flops and bytes less its children's
    (``None``: the module is not in that run)."""

    name: str
    class_name: str
    seconds: tuple[float | None, float | None]  # own fwd + bwd + recompute latency
    flops: tuple[int | None, int | None]  # own fwd + bwd + recompute flops
    bytes: tuple[int | None, int | None]  # own fwd + bwd + recompute bytes moved
    noise: bool

    @property
    def delta_seconds(self) -> float:
        return (self.seconds[1] or 0.0) - (self.seconds[0] or 0.0)

    def sort_key(self) -> tuple[float, float, float]:
        def moved(pair: tuple[int | None, int | None]) -> float:
            return abs((pair[1] or 0) - (pair[0] or 0))

        return abs(self.delta_seconds), moved(self.flops), moved(self.bytes)


def own_seconds(profile: Profile) -> dict[str, dict[str, float]]:
    """Each module's own latency in each pass (:meth:`~flops_callbacks.profile.Profile.own_latency`).

    Args:
        profile: the profile whose modules are read.
    """
    return {name: {p: profile.own_latency(name, (p,)) for p in PROFILE_PASSES} for name in profile.modules}


def _own(profile: Profile) -> dict[str, tuple[str, float, int, int]]:
    """Each module's class and own time, flops and bytes (its totals less its children's)."""
    own, times = {}, own_seconds(profile)
    for name, m in profile.modules.items():
        kids = profile.children(name)
        seconds = sum(times[name].values())
        flops = m.hardware_flops - sum(k.hardware_flops for k in kids)
        moved = m.fwd_bytes + m.bwd_bytes + m.recompute_bytes
        moved -= sum(k.fwd_bytes + k.bwd_bytes + k.recompute_bytes for k in kids)
        own[name] = (m.class_name, seconds, flops, moved)
    return own


def _wobble(saved: SavedProfile) -> float:
    """The run's fwd latency range plus its bwd latency range: how far a module's own time moves with
    nothing changed.

    Args:
        saved: the run (the base) whose clean steps are read.
    """
    ranges = _ranges(saved)
    return sum(ranges[p][3] - ranges[p][2] for p in ("fwd", "bwd") if p in ranges)


def module_changes(a: SavedProfile, b: SavedProfile) -> list[ModuleChange]:
    """Every module of either run whose own time, flops or bytes changed, largest change of own time
    first (then of flops, then of bytes).

    Args:
        a: the first run (the base).
        b: the second run.
    """
    own_a, own_b = _own(a.result.profile), _own(b.result.profile)
    noise = _wobble(a)
    found = []
    for name in [*own_b, *(n for n in own_a if n not in own_b)]:
        ea, eb = own_a.get(name), own_b.get(name)
        seconds = (ea[1] if ea else None, eb[1] if eb else None)
        flops = (ea[2] if ea else None, eb[2] if eb else None)
        moved = (ea[3] if ea else None, eb[3] if eb else None)
        if ea and eb and (ea[1], ea[2], ea[3]) == (eb[1], eb[2], eb[3]):
            continue
        same_work = flops[0] == flops[1] and moved[0] == moved[1]
        delta = abs((seconds[1] or 0.0) - (seconds[0] or 0.0))
        class_name = (eb or ea or ("", 0.0, 0, 0))[0]
        found.append(ModuleChange(name, class_name, seconds, flops, moved, same_work and delta <= noise))
    return sorted(found, key=ModuleChange.sort_key, reverse=True)


def one_sided(a: SavedProfile, b: SavedProfile) -> list[tuple[str, str, str]]:
    """The figures only one run has: (the figure, the run that has it, "A" or "B", why the other has none).

    Args:
        a: the first run (the base).
        b: the second run.
    """
    fa, fb = figures(a), figures(b)
    return [(n, "A", b.why_absent(n)) for n in fa if n not in fb] + [
        (n, "B", a.why_absent(n)) for n in fb if n not in fa
    ]


def one_sided_lines(alone: list[tuple[str, str, str]]) -> list[str]:
    """The figures one run has and the other lacks (:func:`one_sided`), a line for each run and reason the
    other gives.

    Args:
        alone: what :func:`one_sided` returned.
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for name, side, why in alone:
        groups.setdefault((side, why), []).append(name)
    lines = []
    for (side, why), found in groups.items():
        other = "B" if side == "A" else "A"
        lines.append(f"only in {side}: {', '.join(found)} ({other} has none{': ' + why if why else ''})")
    return lines


# --- how figures read: the report's number formats --------------------------------------------------


def figure_text(f: Figure, value: float | None = None) -> str:
    """``value`` (the figure's own by default) as the report writes a figure of its kind.

    Args:
        f: the figure.
        value: the value to write; None: the figure's own.
    """
    v = f.value if value is None else value
    name = f.name
    if name.endswith("_latency"):
        return units.duration_to_string(v)
    if name.endswith("flops_per_sec"):
        return units.flops_to_string(v)
    if name in ("mfu", "hfu", "padding_fraction"):  # as the report writes them; a tiny one, readable
        return f"{100 * v:.2f}%" if v == 0 or abs(v) >= 1e-4 else f"{100 * v:.3g}%"
    if f"{names.PREFIX}{name}" in (*_ENERGY_OF, names.POWER):
        return f"{units.number_to_string(v)}{'W' if name == 'power' else 'J'}"
    if name.endswith("_bytes"):
        return units.bytes_to_string(v)
    if name.endswith("_macs"):
        return units.macs_to_string(v)
    if name == "params":
        return units.params_to_string(v)
    if name.endswith("_flops"):
        return units.number_to_string(v)
    if name == "slow_rank":  # a rank, or -1: none stands out
        return "none" if v < 0 else f"rank {v:.0f}"
    if name == "clean_steps":  # a count of steps (of several runs, their median)
        return f"{v:g}"
    return f"{v:.2f}"


def range_text(f: Figure) -> str:
    """The figure's range over the clean steps (:func:`spread_range`), ``low .. high``.

    Args:
        f: the figure.
    """
    return f"{figure_text(f, f.low)} .. {figure_text(f, f.high)}"


def percent_text(relative: float) -> str:
    """A relative change as ``+12.3%``.

    Args:
        relative: the change as a fraction (0.123 for +12.3%).
    """
    return f"{100 * relative:+.1f}%" if math.isfinite(relative) else ("+inf%" if relative > 0 else "-inf%")
