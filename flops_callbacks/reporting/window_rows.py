"""The full report's rows from a window: DeepSpeed's engine rows and ours (tokens, the wall step, spreads,
MFU, where each figure comes from, the tree's doubts), and the report text they make
(:func:`~flops_callbacks.reporting.profile_report.render_profile` lays it out).

Every number comes from the window's metrics dict (:meth:`~flops_callbacks.session.result.WindowResult.
metrics`), computed once: the printed, the logged and the saved figures are the same by construction.
"""

from __future__ import annotations

from flops_callbacks import metrics as names
from flops_callbacks.communication.report import comm_lines
from flops_callbacks.communication.slow_rank_report import slow_rank_lines, waited_for
from flops_callbacks.options import Options
from flops_callbacks.phase_names import STEP_PHASES
from flops_callbacks.reporting.energy_rows import energy_lines
from flops_callbacks.reporting.profile_report import EngineRows, render_profile
from flops_callbacks.reporting.profile_sections import render_roofline
from flops_callbacks.reporting.tree_check import TreeCheck, check_tree
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.step_lists import step_list, steps_named
from flops_callbacks.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    number_to_string,
    percent,
)

__all__ = [
    "device_busy_lines",
    "layout_lines",
    "model_forward_lines",
    "module_source",
    "rank_count_lines",
    "report_text",
    "roofline_text",
    "roofs_text",
    "run_rows",
    "source_lines",
    "spread_lines",
    "timing_lines",
    "tree_doubts",
    "wall_lines",
]


_TRACE_BY = {  # WindowSteps.module_trace_by, in the report's words
    "nearest": "the one nearest the clean steps' own forward",
    "median": "their median",
    "batch": "their median batch size",
}


def module_source(result: WindowResult) -> str:
    """Which steps the module latencies come from, or why none do.

    Args:
        result: the window's result.
    """
    s = result.steps
    if not s.module_timing:
        return "none"
    steps = steps_named(s.module_timing)
    if not s.module_shapes_match:
        return (
            f"none: {steps} had other batch shapes than step {s.counting} "
            "(per-module FLOPS would mix two batches)"
        )
    median = (
        f", the tree of step {s.module_trace}, {_TRACE_BY.get(s.module_trace_by, s.module_trace_by)}"
        if len(s.module_timing) > 1
        else ""
    )
    cost, taken = result.hook_cost, ""
    if cost is not None:
        taken = f"; less {duration_to_string(cost.per_call)} a call for the hooks, {cost.source}"
    reused = f"; reused: this window (step {result.step}) timed no module" if s.reused else ""
    how = "the device's kernels each call launched (torch.profiler)" if s.module_kernels else "module hooks"
    return f"{steps} ({how}, no counting{median}{taken}){reused}"


def source_lines(result: WindowResult) -> list[tuple[str, str]]:
    """Which step each figure comes from, in the report's words.

    Args:
        result: the window's result.
    """
    s, sources = result.steps, result.flops_sources
    lines = [
        (
            "flops, MACs, params from",
            (
                f"step {s.profile_step} (a module-timing step: its batches counted off the clock, as "
                f"its batch shapes were not counting step {s.counting}'s)"
                if s.profile_step is not None
                else f"step {s.counting} (counting step"
                + (f"; reused: this window (step {result.step}) counted no module)" if s.reused else ")")
            ),
        ),
        ("module latencies from", module_source(result)),
        (
            "fwd / bwd / step latency from",
            s.latency_source + (f": {steps_named(s.clean)}" if s.clean else ""),
        ),
        (
            "rates from: the step of the median FLOPS: its flops (samples, tokens) / its latencies",
            f"{s.shapes} batch shape(s): flops of {s.shapes_counted} counted, {s.shapes_predicted} predicted"
            + (f"; clean steps' flops {sources.in_words()}" if sources is not None else ""),
        ),
    ]
    if sources is not None and sources.content:
        lines.append(("flops depend on the batch's content", sources.content))
        if sources.spread is not None:
            median, low, high = sources.spread
            lines.append(
                (
                    f"model flops per sample of the {len(sources.counted_steps)} counted step(s): "
                    "median (min .. max)",
                    f"{flops_to_string(median)} ({flops_to_string(low)} .. {flops_to_string(high)})",
                )
            )
    if sources is not None and sources.on_steps:
        lines.append(("shapes counted on training steps (no count off the clock)", sources.on_steps))
    shown = tuple(n for n in s.shape_counting if sources is None or n != sources.check_step)  # said above
    if shown:
        lines.append(("steps counted, not timed (new batch shapes, checks)", step_list(shown)))
    if s.skipped:
        lines.append(("clean steps left out (batch shapes not countable)", step_list(s.skipped)))
    if s.compiled:
        lines.append(("clean steps left out (torch.compile compiled in them)", step_list(s.compiled)))
    return lines


def model_forward_lines(result: WindowResult) -> list[tuple[str, str]]:
    """The model's own forward on the clean steps against the forward phase, which also holds the loss
    and the framework's work: what DeepSpeed's fwd latency (the engine's forward call) compares with.

    Args:
        result: the window's result.
    """
    seconds = result.model_forward
    if seconds is None:
        return []
    steps = result.steps.model_forward
    if steps == result.steps.clean:  # as usual: the steps are listed once, in the latencies' own row
        which = f"median of the {len(steps)} clean steps" if len(steps) > 1 else "the clean step"
    else:
        which = ("median of " if len(steps) > 1 else "") + steps_named(steps)
    value = f"{duration_to_string(seconds)} ({which})"
    if len(result.rank_latencies) > 1:  # the phases above are the slowest rank's
        return [("the model's own forward, this rank (outermost module calls, clean steps)", value)]
    rest = "the rest: the loss, the training step's own code"
    if seconds > result.fwd_latency:  # medians of scattered steps (the phases': one step's): no rest to name
        rest = "each a median over the clean steps, which scatter: their ranges are above"
    share = f"{percent(seconds, result.fwd_latency)} of fwd latency ({rest})"
    return [("the model's own forward (outermost module calls, clean steps)", f"{value}: {share}")]


def spread_lines(result: WindowResult) -> list[tuple[str, str]]:
    """Each latency's range over the clean steps (data and wall when timed): where a slow step shows (the
    latencies above are the median step's).

    Args:
        result: the window's result.
    """
    spreads = result.figures().spreads
    steps = spreads["iter"].steps
    if steps < 2:
        return []  # one step: its latencies are printed above

    def spread(names: list[str], label: str) -> tuple[str, str]:
        values = [
            f"{duration_to_string(spreads[n].low)} .. {duration_to_string(spreads[n].high)}" for n in names
        ]
        return f"{label} of the {steps} clean step(s): min .. max", " / ".join(values)

    lines = [spread(["fwd", "bwd", "step"], "fwd / bwd / step latency")]
    if spreads["wall"].high > 0:
        lines.append(spread(["iter", "data", "wall"], "fwd+bwd+step / data / wall"))
    else:
        lines.append(spread(["iter"], "fwd+bwd+step"))
    return lines


def wall_lines(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """The wall step split into data / fwd / bwd / step / other, the wall rate, and the bottleneck.

    Args:
        metrics: the window's metrics dict.
    """
    if names.WALL_LATENCY not in metrics:
        return []
    wall = metrics[names.WALL_LATENCY]
    parts = {
        "data": metrics[names.DATA_LATENCY],
        "fwd": metrics[names.FWD_LATENCY],
        "bwd": metrics[names.BWD_LATENCY],
        "step": metrics[names.STEP_LATENCY],
    }
    parts["other"] = max(wall - sum(parts.values()), 0.0)
    split = " + ".join(f"{k} {duration_to_string(v)} {100 * v / wall:.0f}%" for k, v in parts.items())
    rate = f"{metrics[names.WALL_SAMPLES_PER_SEC]:.2f}" if names.WALL_SAMPLES_PER_SEC in metrics else "n/a"
    if names.WALL_TOKENS_PER_SEC in metrics:
        rate += f" (tokens/second: {metrics[names.WALL_TOKENS_PER_SEC]:.2f})"
    lines = [
        (
            "wall step (previous step's end -> its end) of the median step",
            f"{duration_to_string(wall)} = {split}",
        ),
        ("samples/second over the wall steps (their samples / their summed wall time)", rate),
    ]
    if wall > 0 and parts["data"] >= 0.3 * wall:
        lines.append(
            (
                f"BOTTLENECK: the input pipeline ({percent(parts['data'], wall)} of the wall step waits)",
                "more DataLoader num_workers, pin_memory=True, prefetching (prefetch_factor)",
            )
        )
    return lines


def layout_lines(result: WindowResult) -> list[tuple[str, str]]:
    """The model's work and the hardware's on the median clean step, and the padding and packing that
    separate them (token batches only; an after-window line where the profiler counted since).

    Args:
        result: the window's result.
    """
    layout, counts, lines = result.layout, result.figures().median_step().work.counts, []
    if layout is not None:
        if layout.packed:
            per_row = f"{layout.sequences / layout.rows:.2f}"
            lines.append(("sequences per row (packed; each a sample)", per_row))
        lines.append(
            (
                "model / hardware flops per step (model: real tokens, each sequence alone; hardware: as run)",
                f"{number_to_string(counts.model_flops)} / {number_to_string(counts.hardware_flops)}",
            )
        )
        if layout.not_apart:
            lines.append(("model flops: the run's (padding and packing not apart)", layout.not_apart))
        if layout.decoder_padding:
            decoder = "its encoder's sequences, each with its row's whole decoder (the decoder's padding in)"
            lines.append(("model flops of an encoder-decoder", decoder))
    if result.after.counts:
        lines.append(
            (
                "profiler's own counting after the window (off throughput's clock)",
                f"{result.after.counts} count(s), {duration_to_string(result.after.seconds)}",
            )
        )
    return lines


def device_busy_lines(result: WindowResult, metrics: dict[str, float]) -> list[tuple[str, str]]:
    """How busy the device is in each phase: the kernels the module-timing step launched in it against the
    phase's latency, and the rest of fwd + bwd, the device's idle time (a CUDA device only).

    Args:
        result: the window's result.
        metrics: its metrics dict.
    """
    busy = result.device_busy
    if busy is None or names.DEVICE_IDLE not in metrics:
        return []
    cells = []
    for phase, latency, share in zip(
        STEP_PHASES,
        (result.fwd_latency, result.bwd_latency, result.step_latency),
        (names.DEVICE_BUSY_FWD, names.DEVICE_BUSY_BWD, names.DEVICE_BUSY_STEP),
        strict=True,
    ):
        cells.append(
            f"{duration_to_string(busy.get(phase, 0.0))} of {duration_to_string(latency)} "
            f"({percent(metrics[share], 1.0)})"
        )
    return [
        (
            f"device busy fwd / bwd / step (kernels launched on step {result.steps.module_trace} / "
            "the phase's latency)",
            " / ".join(cells),
        ),
        (
            "device idle in fwd + bwd (waiting for the host: launches, Python)",
            percent(metrics[names.DEVICE_IDLE], 1.0),
        ),
    ]


def timing_lines(result: WindowResult, metrics: dict[str, float]) -> list[tuple[str, str]]:
    """Rows after DeepSpeed's and the profile's own: tokens, rank spread, MFU, where figures come from.

    Args:
        result: the window's result.
        metrics: its metrics dict.
    """
    lines = result.parallel.factor_lines()
    if result.samples is None:
        lines.append(("samples/second", "n/a: the batch size was not found (pass batch_size_fn)"))
    each = result.figures().median_step().work
    if names.TOKENS_PER_SEC in metrics and each.tokens is not None:
        lines += [
            ("tokens per step per GPU", _count(each.tokens)),
            (
                "tokens/second = tokens per step per GPU * dp_size / iter latency",
                f"{metrics[names.TOKENS_PER_SEC]:.2f}",
            ),
        ]
    if names.PADDING_FRACTION in metrics:
        lines += [
            (
                "padding fraction (padding positions / positions, from attention_mask or position_ids; "
                "tokens are positions, padding included)",
                f"{100 * metrics[names.PADDING_FRACTION]:.1f}%",
            ),
            (
                "real tokens/second (padding excluded: a median step's real tokens * dp_size / iter latency)",
                f"{metrics[names.REAL_TOKENS_PER_SEC]:.2f}",
            ),
        ]
    lines += layout_lines(result)
    lines += [*wall_lines(metrics), *spread_lines(result), *model_forward_lines(result)]
    lines += device_busy_lines(result, metrics)
    waits = waited_for(result.slow_rank, result.comm.step.exposed) if result.comm is not None else ""
    lines += comm_lines(result.comm, metrics, waits)  # the summary's words: the rank waited for
    lines += slow_rank_lines(result.slow_rank)
    if len(result.rank_latencies) > 1:
        iters = [sum(latencies) for latencies in result.rank_latencies]
        spread = f"{duration_to_string(min(iters))} .. {duration_to_string(max(iters))}"
        lines.append((f"each rank's own median iter latency over {len(iters)} ranks, min .. max", spread))
        lines += rank_count_lines(result)
    lines.append(("compute dtype (picks the peak)", result.compute_dtype or "unknown"))
    lines.append(("peak memory allocated fwd / bwd / step (clean steps)", _peak_memory_text(result)))
    if result.peak is not None and result.bandwidth is None:  # without a peak, the MFU row says why
        lines.append(("roofline per module", f"n/a: {result.no_bandwidth_reason}"))
    if result.peak is None:
        lines.append(("MFU", f"n/a: {result.no_peak_reason}"))
    else:  # of the flops the FLOPS rows divide: the clean step's where it is not the counting step's
        of = "clean step's " if each.counts != BatchCounts.of(result.per_gpu_profile()) else ""
        model = "model " if each.counts.model_flops != each.counts.run_flops else ""
        lines += [
            (f"peak FLOPS per device ({result.peak.source})", flops_to_string(result.peak.flops)),
            (f"MFU = ({of}{model}fwd+bwd flops) / iter latency / peak", f"{100 * metrics[names.MFU]:.2f}%"),
            (
                f"HFU = ({of}fwd+bwd+recompute flops) / iter latency / peak",
                f"{100 * metrics[names.HFU]:.2f}%",
            ),
        ]
    lines += energy_lines(result, metrics)
    doubts = [("module latencies in doubt", note) for note in tree_doubts(result).notes]
    return lines + source_lines(result) + doubts + result.extra_lines


def rank_count_lines(result: WindowResult) -> list[tuple[str, str]]:
    """Over several ranks, the counting step's work per GPU (their mean, printed above) and its range.

    Args:
        result: the window's result.
    """
    world = len(result.rank_counts)
    lines = []
    for name, label in (("fwd_flops", "fwd flops"), ("bwd_flops", "bwd flops")):
        low_high = result.rank_range(name)
        if low_high is not None:
            lines.append(
                (
                    f"{label} per GPU = the {world} ranks' mean; min .. max",
                    f"{number_to_string(low_high[0])} .. {number_to_string(low_high[1])}",
                )
            )
    return lines


def tree_doubts(result: WindowResult) -> TreeCheck:
    """What is wrong with the module tree's latencies against the clean steps' phases (if anything), the
    phases scaled to the tree's batch where it did more flops (dynamic padding: another batch's shapes).

    Args:
        result: the window's result.
    """
    steps = result.steps
    own = result.model_forward if steps.model_forward_shapes_match else None  # else other batches' forward
    high = result.model_forward_high if own is not None else None
    clean = result.figures().median_step().work.counts.run_flops
    ratio = BatchCounts.of(result.profile).run_flops / clean if clean else 1.0
    return check_tree(
        result.profile,
        result.fwd_latency,
        result.bwd_latency,
        steps.module_timing,
        own,
        high,
        steps.module_trace,
        ratio,
        steps.eager_tree,
    )


def _peak_memory_text(result: WindowResult) -> str:
    if result.peak_memory is None:
        return f"n/a on {result.profile.device.split(':')[0]} (CUDA only)"
    return " / ".join(bytes_to_string(result.peak_memory.get(phase, 0)) for phase in STEP_PHASES)


def _count(n: int | float) -> str:
    return f"{n:g}" if isinstance(n, float) else str(n)


def run_rows(result: WindowResult, metrics: dict[str, float]) -> EngineRows:
    """DeepSpeed's engine rows of the head, from the window: sizes, the micro-batch, phase latencies,
    and the median clean step's flops and samples that the rates divide.

    Args:
        result: the window's result.
        metrics: its metrics dict.
    """
    each = result.figures().median_step().work
    return EngineRows(
        parallel=result.parallel,
        batch_size=result.micro_batch_size,
        model_params=result.sharded_model_params,
        fwd_latency=metrics[names.FWD_LATENCY],
        bwd_latency=metrics[names.BWD_LATENCY],
        step_latency=metrics[names.STEP_LATENCY],
        samples_per_second=metrics.get(names.SAMPLES_PER_SEC),
        step_counts=each.counts,
        micro_batches=result.micro_batches,
        samples_per_step=each.samples,
    )


def report_text(result: WindowResult, options: Options, detailed: bool) -> str:
    """The DeepSpeed-style report of a window; ``detailed`` adds the module tree.

    Args:
        result: the window's result.
        options: the run's options (depth, top modules, ...).
        detailed: whether the module tree is printed.
    """
    metrics = result.metrics()
    return render_profile(
        result.profile,
        profile_step=result.step,
        module_depth=options.module_depth,
        top_modules=options.top_modules,
        detailed=detailed,
        timing_lines=timing_lines(result, metrics),
        run=run_rows(result, metrics),
        roofline=roofline_text(result),
        totals=result.per_gpu_profile(),
    )


def roofs_text(result: WindowResult) -> str:
    """The two roofs and their sources, and the ridge point between them ("" unless both are known).

    Args:
        result: the window's result.
    """
    peak, bandwidth = result.peak, result.bandwidth
    if peak is None or bandwidth is None:
        return ""
    return (
        f"peak {flops_to_string(peak.flops)} ({peak.source}), peak bandwidth "
        f"{bytes_to_string(bandwidth.bytes_per_sec)}/s ({bandwidth.source}): ridge at "
        f"{peak.flops / bandwidth.bytes_per_sec:.3g} flops/B"
    )


def roofline_text(result: WindowResult) -> str:
    """The report's roofline section ("" unless both peaks and module latencies are known).

    Args:
        result: the window's result.
    """
    rooflines = result.rooflines() if result.steps.module_timing else {}
    if not rooflines:
        return ""
    return render_roofline(result.profile, rooflines, roofs_text(result))
