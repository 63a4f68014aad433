"""The console summary of a window: the figures a person came for, read in ten seconds.

The rates, the median step's split, what bounds the step, the top modules, the sizes and where the
figures come from, each on a line or a small table of its own; each warning or doubt one line naming the
file that holds its details. Every figure is read from the window's metrics dict and result, as the full
report's are (:mod:`flops_callbacks.reporting.profile_report`): the two never disagree, the summary only says
less. Definitions live in the docs' glossary, not in the labels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from flops_callbacks import metrics as names
from flops_callbacks.communication.report import beyond_compute, comm_console_row
from flops_callbacks.communication.slow_rank_report import slow_rank_text, waited_for
from flops_callbacks.module_tree import parent_in
from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.reporting.energy_rows import energy_console_row
from flops_callbacks.reporting.profile_report import TITLE
from flops_callbacks.reporting.profile_sections import rule
from flops_callbacks.reporting.tree_check import TreeCheck
from flops_callbacks.session.result import WindowResult
from flops_callbacks.step_lists import step_list, steps_named
from flops_callbacks.units import duration_to_string, flops_to_string, number_to_string, params_to_string

__all__ = ["MAX_LINES", "bound_by", "render_console_summary", "Split", "TOP"]

MAX_LINES = 25  # from the header rule to the closing rule, warnings included
TOP = 3  # modules shown by time and by flops
WIDTH = 78  # the rules' width, as the full report's summary
LABEL = 14  # the label column
NAME = 26  # a module's name is cut to this many characters (its end kept: the leaf is what differs)
BOUND_SHARE = 0.3  # a part of the step this large is what bounds it
PARTS = ("data", "fwd", "bwd", "step", "other")


@dataclass(frozen=True)
class Split:
    """The median step on the wall clock: its parts in seconds and the whole (``wall``)."""

    parts: dict[str, float]
    wall: float
    timed_wall: bool  # False: no step before the timed ones, the parts are fwd / bwd / step only

    def share(self, part: str) -> float:
        """``part``'s share of the wall step (0 without a wall time).

        Args:
            part: one of :data:`PARTS`.
        """
        return self.parts[part] / self.wall if self.wall > 0 else 0.0


def _split(metrics: dict[str, float]) -> Split:
    parts = {
        "data": metrics.get(names.DATA_LATENCY, 0.0),
        "fwd": metrics[names.FWD_LATENCY],
        "bwd": metrics[names.BWD_LATENCY],
        "step": metrics[names.STEP_LATENCY],
    }
    wall = metrics.get(names.WALL_LATENCY)
    timed = wall is not None
    if wall is None:
        wall = sum(parts.values())
    parts["other"] = max(wall - sum(parts.values()), 0.0)
    return Split(parts, wall, timed)


def _row(label: str, value: str) -> str:
    return f"{label:<{LABEL}}{value}"


def _rate(metrics: dict[str, float], step: str, wall: str) -> str:
    if step not in metrics:
        return "n/a: the batch size was not found (pass batch_size_fn)"
    text = f"{metrics[step]:.2f} (step)"
    return text + (f", {metrics[wall]:.2f} (wall)" if wall in metrics else "")


def _split_lines(split: Split) -> list[str]:
    cells = [*PARTS, "wall"] if split.timed_wall else ["fwd", "bwd", "step", "iter"]
    seconds = [split.parts.get(c, split.wall) for c in cells]
    shares = [f"{100 * s / split.wall:.0f}%" if split.wall > 0 else "n/a" for s in seconds]
    return [
        _row("median step", "".join(f"{c:<11}" for c in cells).rstrip()),
        _row("", "".join(f"{duration_to_string(s):<11}" for s in seconds).rstrip()),
        _row("", "".join(f"{s:<11}" for s in shares).rstrip()),
    ]


def bound_by(split: Split, result: WindowResult) -> str:
    """What bounds the step: the input pipeline, the loop's own work, the optimizer step, the host (a GPU
    idle for much of fwd + bwd, read from its kernels), or the model's fwd + bwd (by the roofline, when both
    peaks are known: the limiter of most of the modules' time).

    Args:
        split: the step's time split into its parts.
        result: the window's result (its rooflines and peaks).
    """
    found = _largest_bound(split, result.device_idle())
    if found:
        return found
    comm = result.comm
    beyond = beyond_compute(comm, waited_for(result.slow_rank, comm.step.exposed)) if comm is not None else ""
    if comm is not None and comm.step.span and comm.step.exposed >= BOUND_SHARE * comm.step.span:
        return beyond  # exposed communication: the collective responsible, or the rank waited for
    beyond = f"; beyond compute: {beyond}" if beyond else ""
    model = split.share("fwd") + split.share("bwd")
    limits = _limiters(result)
    if not limits:
        roofline = "roofline: n/a (no peak bandwidth or FLOPS)"
        return f"the model's fwd + bwd ({model:.0%} of the step); {roofline}{beyond}"
    ranked = sorted(limits.items(), key=lambda kv: kv[1], reverse=True)
    shares = ", ".join(f"{kind} {share:.0%}" for kind, share in ranked)
    return f"{ranked[0][0]} ({model:.0%} of the step in fwd + bwd; module time {shares}){beyond}"


def _largest_bound(split: Split, idle: float | None) -> str:
    """What bounds the step outside the model's compute ("": nothing does): the largest of the wait for
    data, the loop's own work and the optimizer step (a part that prints as 30% of the wall step or more),
    or the host where the GPU idles 30% of fwd + bwd, unless the data's wait is the largest (the loop's
    and the step's host time have the host's cause)."""
    pipeline = "more DataLoader num_workers, pin_memory=True, prefetch_factor"
    says = {
        "data": "the input pipeline: {:.0%} of the step waits for data (" + pipeline + ")",
        "other": "the loop's own work: {:.0%} of the step is outside the phases",
        "step": "the optimizer step: {:.0%} of the step",
    }
    parts = [*(["data", "other"] if split.timed_wall else []), "step"]
    largest = max(parts, key=split.share)
    bounding = round(split.share(largest), 2) >= BOUND_SHARE
    if idle is not None and round(idle, 2) >= BOUND_SHARE and not (bounding and largest == "data"):
        helps = "torch.compile, CUDA graphs or a larger batch usually help"
        host = f"the host: the GPU idle {idle:.0%} of fwd + bwd, waiting for launches ({helps})"
        data = split.share("data") if split.timed_wall else 0.0
        return host + (f"; {data:.0%} of the step waits for data" if round(data, 2) >= BOUND_SHARE else "")
    return says[largest].format(split.share(largest)) if bounding else ""


def _limiters(result: WindowResult) -> dict[str, float]:
    """The modules' time (those without children, both passes) by what limits it on the roofline:
    ``compute-bound``, ``memory-bound``, ``overhead-bound``; shares of that time. Empty without both
    peaks or module latencies."""
    rooflines = result.rooflines() if result.steps.module_timing else {}
    parents = {parent_in(name, result.profile.modules) for name in result.profile.modules if name}
    seconds: dict[str, float] = {}
    for name, passes in rooflines.items():
        if name in parents:
            continue
        for r in passes.values():
            kind = "overhead-bound" if r.overhead_bound else f"{r.limiter}-bound"
            seconds[kind] = seconds.get(kind, 0.0) + r.seconds
    whole = sum(seconds.values())
    return {kind: s / whole for kind, s in seconds.items()} if whole > 0 else {}


def _own(profile: Profile) -> dict[str, tuple[float, int]]:
    """Each module's own time (:meth:`~flops_callbacks.profile.Profile.own_latency`, fwd + bwd) and own
    flops (fwd + bwd): its totals less its children's."""

    def flops(m: ModuleProfile) -> int:
        return m.fwd_flops + m.bwd_flops

    return {
        name: (profile.own_latency(name), max(flops(m) - sum(flops(c) for c in profile.children(name)), 0))
        for name, m in profile.modules.items()
    }


def _name(name: str, profile: Profile) -> str:
    shown = name or f"({profile.model.class_name})"
    return shown if len(shown) <= NAME else "..." + shown[-(NAME - 3) :]


def _top_lines(result: WindowResult) -> list[str]:
    """Two columns: the modules of most own time and of most own flops, with their shares of the model's."""
    profile = result.profile
    own = _own(profile)
    # the model's row, not the sum of the own figures: a shared module's calls are in two of them
    total_time = profile.model.fwd_latency + profile.model.bwd_latency
    total_flops = profile.model.fwd_flops + profile.model.bwd_flops
    timed = bool(result.steps.module_timing) and result.steps.module_shapes_match and total_time > 0

    def top(i: int) -> list[str]:  # the modules of most own time (0) or flops (1): none with none of it
        return [n for n in sorted(own, key=lambda n: own[n][i], reverse=True)[:TOP] if own[n][i] > 0]

    by_time, by_flops = top(0) if timed else [], top(1)
    column = NAME + 18
    lines = [_row("top modules", f"{'by own time (fwd + bwd)':<{column}}by own flops (fwd + bwd)")]
    for i in range(max(len(by_time), len(by_flops), 1)):
        left = right = ""
        if i < len(by_time):
            n = by_time[i]
            seconds = own[n][0]
            share = seconds / total_time
            left = f"{_name(n, profile):<{NAME}} {duration_to_string(seconds):>9} {share:>4.0%}"
        elif i == 0:
            left = "n/a: no module timing (see the full report)"
        if i < len(by_flops):
            n = by_flops[i]
            work = own[n][1]
            right = f"{_name(n, profile):<{NAME}} {number_to_string(work):>8} {work / total_flops:>4.0%}"
        lines.append(_row("", f"{left:<{column}}{right}".rstrip()))
    return lines


def _sources(result: WindowResult) -> str:
    s = result.steps
    modules = f"modules: {steps_named(s.module_timing)}" if s.module_timing else "modules: none timed"
    counted = f"flops: step {s.profiled}" + (" (an earlier window's)" if s.reused else "")
    return f"{counted}; {modules}; phases: {s.latency_source}, {steps_named(s.clean)}"


def _short(note: str) -> str:
    """A tree note's first clause: what disagrees, without the figures (those are in the file)."""
    found = re.match(r"module tree: the model's (\w+) on .*? is ([\d.]+x) (.+?) \(", note)
    if found:
        return f"the module tree's {found[1]} is {found[2]} {found[3]}"
    return note.removeprefix("module tree: ").split(": ", 1)[0]


def _warnings(result: WindowResult, doubts: TreeCheck, details: str) -> list[str]:
    where = f"; details in {Path(details).name}" if details else ""
    lines = [f"doubt: {_short(note)}{where}" for note in doubts.notes]
    s, sources = result.steps, result.flops_sources
    if sources is not None and sources.content:
        lines.append(f"warning: the flops depend on the batch's content, {sources.in_words()}{where}")
    if sources is not None and sources.on_steps:
        lines.append(f"note: shapes counted on training steps, not off the clock{where}")
    layout = result.layout
    if layout is not None and layout.not_apart and (layout.padding > 0 or layout.packed):
        what = "padding and packing" if layout.packed else "padding"
        lines.append(f"warning: model flops and MFU count the {what} (not told apart){where}")
    if s.skipped:
        skipped = step_list(s.skipped)
        lines.append(f"warning: clean steps left out (batch shapes not countable): {skipped}{where}")
    if s.compiled:
        lines.append(f"note: clean steps left out (torch.compile compiled in them): {step_list(s.compiled)}")
    if not s.module_shapes_match and s.module_timing:
        lines.append(f"warning: no module latencies (other batch shapes than the counting step's){where}")
    return lines


def _sizes(result: WindowResult) -> str:
    p = result.parallel
    text = f"world {p.world_size}, data parallel {p.data_parallel}, model parallel {p.model_parallel}"
    if p.model_parallel > 1:
        factors = (p.tensor_parallel, p.pipeline_parallel, p.context_parallel)
        text += " = tensor {} x pipeline {} x context {}".format(*factors)
    if len(result.rank_latencies) > 1:
        iters = [sum(latencies) for latencies in result.rank_latencies]
        low, high = duration_to_string(min(iters)), duration_to_string(max(iters))
        text += f"; times: each step's slowest rank (the ranks' own median iter {low} .. {high})"
    return text


def _as_run(result: WindowResult) -> str:
    """What the hardware's flops hold beyond the model's, on the median step: recompute, padding,
    packed rows' attention across sequences."""
    counts, layout = result.figures().median_step().work.counts, result.layout
    held = ["recompute"] if counts.recompute_flops else []
    if layout is not None and layout.padding > 0:
        held.append("padding")
    if layout is not None and layout.packed:
        held.append("packed rows")
    return ", ".join(held) or "the kernels' own work"


def _model(result: WindowResult, metrics: dict[str, float]) -> str:
    profile = result.per_gpu_profile()
    dtype = result.compute_dtype or "dtype unknown"
    text = (
        f"{params_to_string(profile.params)} params, {result.profile.device}, {dtype}; "
        f"flops per step: fwd {number_to_string(metrics[names.FWD_FLOPS]).strip()}, "
        f"bwd {number_to_string(metrics[names.BWD_FLOPS]).strip()}"
    )
    if result.micro_batch_size is not None:
        text += f"; batch {result.micro_batch_size}" + (
            f" x {result.micro_batches} micro-batches" if result.micro_batches > 1 else ""
        )
    return text


def _comm_lines(result: WindowResult) -> list[str]:
    """The communication step's split of its step, one line (none in a one-process run)."""
    return [] if result.comm is None else [_row("communication", comm_console_row(result.comm))]


def _slow_rank_lines(result: WindowResult) -> list[str]:
    """The rank the others wait for, or that none stands out, one line (none in a one-process run)."""
    slow = result.slow_rank
    return [] if slow is None else [_row("slow rank", slow_rank_text(slow))]


def render_console_summary(result: WindowResult, doubts: TreeCheck, details: str = "") -> str:
    """The summary of ``result`` for the console, at most :data:`MAX_LINES` lines from rule to rule;
    ``doubts``: the module tree's check; ``details``: where the full report is (a path, "" if nowhere).

    Args:
        result: the window's result.
        doubts: the module tree's check.
        details: where the full report is (a path; "" if nowhere).
    """
    metrics = result.metrics()
    split = _split(metrics)
    if names.MFU in metrics:
        mfu = f"MFU {100 * metrics[names.MFU]:.2f}%, HFU {100 * metrics[names.HFU]:.2f}%"
        if result.peak is not None:  # which peak: a datasheet's, the user's, or measured here
            mfu += f" of {flops_to_string(result.peak.flops)} {result.peak.kind}"
    else:
        mfu = f"n/a: {result.no_peak_reason}"
    hardware = metrics[names.HARDWARE_FLOPS_PER_SEC]
    flops = flops_to_string(metrics[names.FLOPS_PER_SEC])
    if hardware != metrics[names.FLOPS_PER_SEC]:
        flops += f" (hardware {flops_to_string(hardware)}: with {_as_run(result)})"
    head = [
        rule(TITLE, WIDTH),
        f"Profile Summary at step {result.step}"
        + (f" (full report: {details})" if details else " (full report: report='full' prints it)"),
        _row("FLOPS", f"{flops} per device"),
        _row("MFU / HFU", mfu),
        _row("samples/s", _rate(metrics, names.SAMPLES_PER_SEC, names.WALL_SAMPLES_PER_SEC)),
    ]
    if names.TOKENS_PER_SEC in metrics:
        head.append(_row("tokens/s", _rate(metrics, names.TOKENS_PER_SEC, names.WALL_TOKENS_PER_SEC)))
    head.append(_row("energy", energy_console_row(result, metrics)))
    body = [
        *_split_lines(split),
        _row("bound by", bound_by(split, result)),
        *_comm_lines(result),
        *_slow_rank_lines(result),
        *_top_lines(result),
        _row("model", _model(result, metrics)),
        _row("sizes", _sizes(result)),
        _row("from", _sources(result)),
    ]
    warnings = _warnings(result, doubts, details)
    room = MAX_LINES - len(head) - len(body) - 1
    if len(warnings) > room:
        more = len(warnings) - room + 1
        warnings = [*warnings[: room - 1], f"and {more} more warning(s) in the full report"]
    return "\n".join([*head, *body, *warnings, "-" * WIDTH])
