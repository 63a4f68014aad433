"""Publishing a window's result: the report text, the JSON, the picture, the trace, and the one writer
of files.

Every number shown comes from the metrics dict (:func:`flops_callbacks.metrics.window_metrics`),
computed once: the printed, the logged and the saved figures are the same by construction.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

from flops_callbacks import metrics as names
from flops_callbacks.files import write_text
from flops_callbacks.metrics import window_rates
from flops_callbacks.options import Options
from flops_callbacks.picture import render_html
from flops_callbacks.report import RunContext, render_profile
from flops_callbacks.result import WindowResult
from flops_callbacks.trace import chrome_trace
from flops_callbacks.units import duration_to_string, flops_to_string, percent


class Outlet(Protocol):
    """Where a framework's results go; the adapter implements it."""

    is_logging_rank: bool

    def log_dir(self) -> str | Path | None:
        """The run's log directory (called on every rank: Lightning's broadcasts)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Hand ``metrics`` to every logger of the run (logging rank only)."""

    def console(self, text: str) -> None:
        """Print ``text`` without breaking the framework's progress bar (logging rank only)."""

    def log_report(self, text: str, html: str, step: int) -> None:
        """Hand the report (TensorBoard's Text tab) and the picture (W&B HTML) to loggers that show them."""


def _steps_text(steps: tuple[int, ...]) -> str:
    return ", ".join(str(s) for s in steps)


def _module_source(result: WindowResult) -> str:
    s = result.steps
    if s.module_timing is None:
        return "none"
    if not s.module_shapes_match:
        return (
            f"none: step {s.module_timing} had other batch shapes than step {s.counting} "
            "(per-module FLOPS would mix two batches)"
        )
    return f"step {s.module_timing} (module hooks, no counting)"


def source_lines(result: WindowResult) -> list[tuple[str, str]]:
    """Which step each figure comes from, in the report's words."""
    s = result.steps
    lines = [
        ("flops, MACs, params from", f"step {s.counting} (counting step)"),
        ("module latencies from", _module_source(result)),
        (
            "fwd / bwd / step latency from",
            s.latency_source + (f": steps {_steps_text(s.clean)}" if s.clean else ""),
        ),
        (
            "rates from: the same steps' summed flops (samples, tokens) / summed times",
            f"{s.shapes} batch shape(s): flops of {s.shapes_counted} counted, {s.shapes_predicted} predicted",
        ),
    ]
    if s.shape_counting:
        lines.append(("steps counted for new batch shapes (not timed)", _steps_text(s.shape_counting)))
    if s.skipped:
        lines.append(("clean steps left out (batch shapes not countable)", _steps_text(s.skipped)))
    return lines


def spread_lines(result: WindowResult) -> list[tuple[str, str]]:
    """Each latency's median with its range over the clean steps (data and wall when timed)."""
    spreads = result.figures().spreads
    steps = spreads["iter"].steps
    lines = []
    for group in (("fwd", "bwd", "step"), ("iter", "data", "wall")):
        shown = [n for n in group if not (n in ("data", "wall") and spreads[n].high == 0)]
        values = [
            f"{duration_to_string(spreads[n].median)} "
            f"({duration_to_string(spreads[n].low)} .. {duration_to_string(spreads[n].high)})"
            for n in shown
        ]
        lines.append(
            (f"{' / '.join(shown)} latency over {steps} step(s): median (min .. max)", " / ".join(values))
        )
    return lines


def wall_lines(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """The wall step split into data / fwd / bwd / step / other, the wall rate, and the bottleneck."""
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
    rate = f"{metrics[names.WALL_SAMPLES_PER_SEC]:.2f}"
    if names.WALL_TOKENS_PER_SEC in metrics:
        rate += f" (tokens/second: {metrics[names.WALL_TOKENS_PER_SEC]:.2f})"
    lines = [
        ("wall step (previous step's end -> its end), median", f"{duration_to_string(wall)} = {split}"),
        ("samples/second over the wall step (above: compute rate, fwd+bwd+step)", rate),
    ]
    if wall > 0 and parts["data"] >= 0.3 * wall:
        lines.append(
            (
                f"BOTTLENECK: the input pipeline ({percent(parts['data'], wall)} of the wall step waits)",
                "more DataLoader num_workers, pin_memory=True, prefetching (prefetch_factor)",
            )
        )
    return lines


def timing_lines(result: WindowResult, metrics: dict[str, float]) -> list[tuple[str, str]]:
    """Rows after DeepSpeed's and the profile's own: tokens, rank spread, MFU, where figures come from."""
    lines = result.parallel.factor_lines()
    if names.TOKENS_PER_SEC in metrics:
        label = "tokens/second (all data-parallel replicas)"
        if names.PADDING_FRACTION in metrics:
            label = "tokens/second (positions processed, padding included; all replicas)"
        lines.append((label, f"{metrics[names.TOKENS_PER_SEC]:.2f}"))
    if names.PADDING_FRACTION in metrics:
        lines += [
            (
                "padding fraction (attention_mask zeros / positions)",
                f"{100 * metrics[names.PADDING_FRACTION]:.1f}%",
            ),
            (
                "real tokens/second (padding excluded; all replicas)",
                f"{metrics[names.REAL_TOKENS_PER_SEC]:.2f}",
            ),
        ]
    lines += [*wall_lines(metrics), *spread_lines(result)]
    if len(result.rank_latencies) > 1:
        iters = [sum(latencies) for latencies in result.rank_latencies]
        spread = f"{duration_to_string(min(iters))} .. {duration_to_string(max(iters))}"
        lines.append((f"iter latency over {len(iters)} ranks, min .. max (slowest shown)", spread))
    if result.micro_batches > 1:
        lines.append(("micro-batches per step", str(result.micro_batches)))
    lines.append(("compute dtype (picks the peak)", result.compute_dtype or "unknown"))
    if result.peak is None:
        lines.append(("MFU", f"n/a: {result.no_peak_reason}"))
    else:
        lines += [
            (f"peak FLOPS per device ({result.peak.source})", flops_to_string(result.peak.flops)),
            ("MFU = (fwd+bwd flops) / iter latency / peak", f"{100 * metrics[names.MFU]:.2f}%"),
            ("HFU = (fwd+bwd+recompute flops) / iter latency / peak", f"{100 * metrics[names.HFU]:.2f}%"),
        ]
    return lines + source_lines(result) + result.extra_lines


def run_rows(result: WindowResult, metrics: dict[str, float]) -> RunContext:
    """DeepSpeed's engine rows of the summary, from the window: sizes, batch, phase latencies."""
    return RunContext(
        parallel=result.parallel,
        batch_size=result.samples,
        model_params=result.sharded_model_params,
        fwd_latency=metrics[names.FWD_LATENCY],
        bwd_latency=metrics[names.BWD_LATENCY],
        step_latency=metrics[names.STEP_LATENCY],
        samples_per_second=metrics[names.SAMPLES_PER_SEC],
        rates=window_rates(result),
    )


def report_text(result: WindowResult, options: Options, detailed: bool) -> str:
    """The DeepSpeed-style report of a window; ``detailed`` adds the module tree."""
    metrics = result.metrics()
    return render_profile(
        result.profile,
        profile_step=result.step,
        module_depth=options.module_depth,
        top_modules=options.top_modules,
        detailed=detailed,
        timing_lines=timing_lines(result, metrics),
        run=run_rows(result, metrics),
    )


def json_data(result: WindowResult) -> dict[str, Any]:
    """Everything of a window as JSON-ready data: metrics, where each came from, and the full profile."""
    return {
        "step": result.step,
        "published_at_step": result.published_at,
        "steps": dataclasses.asdict(result.steps),
        "metrics": result.metrics(),
        "samples_per_device": result.samples,
        "micro_batches": result.micro_batches,
        "tokens_per_device": result.tokens,
        "compute_dtype": result.compute_dtype,
        "peak": dataclasses.asdict(result.peak) if result.peak else {"none": result.no_peak_reason},
        "parallel": dataclasses.asdict(result.parallel),
        "rank_latencies": result.rank_latencies,  # (fwd, bwd, step) median seconds, by rank
        # each latency over the clean steps: median, min, max, steps (the slowest rank's)
        "spread": {name: dataclasses.asdict(s) for name, s in result.figures().spreads.items()},
        "clean_totals": {  # what the rates are made of: sums over the clean steps
            "seconds": result.figures().sums,
            "counts": result.figures().counts._asdict(),
            "samples": result.figures().samples,
            "tokens": result.figures().tokens,
            "real_tokens": result.figures().real_tokens,
            "token_positions": result.figures().positions,
            "iter_seconds_per_step": result.figures().iters,  # this rank's, in step order
        },
        "profile": result.profile.to_dict(),
    }


def markdown_block(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard's Text tab renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def publish(result: WindowResult, options: Options, log_dir: str | Path | None, outlet: Outlet) -> None:
    """On the logging rank: the report to the console (or ``output_file``), the report, JSON, picture
    and trace into ``log_dir``, and the metrics to the loggers."""
    full = report_text(result, options, detailed=True)
    if options.output_file is not None:
        write_text(options.output_file, full + "\n")
    elif options.print_profile:
        outlet.console(full if options.detailed else report_text(result, options, detailed=False))
    html = picture(result)
    if log_dir is not None:
        stem = Path(log_dir) / f"flops_profile_step{result.step}"
        write_text(stem.with_suffix(".txt"), full + "\n")
        write_text(stem.with_suffix(".json"), json.dumps(json_data(result), indent=2))
        write_text(stem.with_suffix(".html"), html)
        trace = chrome_trace(
            result.spans, process_name=f"flops_callbacks modules, step {result.steps.module_timing}"
        )
        write_text(stem.with_suffix(".trace.json"), json.dumps(trace))
    outlet.log_metrics(result.metrics(), result.published_at)
    outlet.log_report(full, html, result.published_at)


def picture(result: WindowResult) -> str:
    """The profile's HTML picture, with the headline figures and the steps they come from above it."""
    metrics = result.metrics()
    steps = result.steps
    summary = [
        ("fwd latency", duration_to_string(metrics[names.FWD_LATENCY])),
        ("bwd latency", duration_to_string(metrics[names.BWD_LATENCY])),
        ("step latency", duration_to_string(metrics[names.STEP_LATENCY])),
        ("FLOPS per device", flops_to_string(metrics[names.FLOPS_PER_SEC])),
        ("samples/second (compute)", f"{metrics[names.SAMPLES_PER_SEC]:.2f}"),
    ]
    if names.WALL_LATENCY in metrics:
        summary += [
            ("samples/second (wall)", f"{metrics[names.WALL_SAMPLES_PER_SEC]:.2f}"),
            ("wall step", duration_to_string(metrics[names.WALL_LATENCY])),
            ("waiting for data", duration_to_string(metrics[names.DATA_LATENCY])),
        ]
    if names.MFU in metrics:
        summary.append(("MFU", f"{100 * metrics[names.MFU]:.2f}%"))
    summary += [
        ("module flops: the batch of", f"step {steps.counting}"),
        ("module latencies", _module_source(result)),
        ("phases: median of", ", ".join(str(s) for s in steps.clean) or "no clean step"),
    ]
    title = f"flops_callbacks profile, step {result.step}"
    return render_html(result.profile, title=title, summary=summary)
