"""Publishing a window's result: the console (the summary, or the full report), the report file, the
JSON (its layout, written and read back, is :mod:`~flops_callbacks.reporting.profile_file`'s), the
picture, the trace, and the one writer of files. The full report's rows are
:mod:`~flops_callbacks.reporting.window_rows`', the console summary
:mod:`~flops_callbacks.reporting.console_summary`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path

from flops_callbacks import metrics as names
from flops_callbacks.communication.report import comm_trace
from flops_callbacks.files import write_text
from flops_callbacks.guard import Guard
from flops_callbacks.options import Options
from flops_callbacks.reporting.chrome_trace import chrome_trace
from flops_callbacks.reporting.console_summary import render_console_summary
from flops_callbacks.reporting.picture import render_html
from flops_callbacks.reporting.profile_file import json_data, roofline_entries
from flops_callbacks.reporting.window_rows import module_source, report_text, tree_doubts
from flops_callbacks.session.adapter_api import Sink
from flops_callbacks.session.result import WindowResult
from flops_callbacks.step_lists import step_list
from flops_callbacks.units import duration_to_string, flops_to_string

__all__ = ["console_text", "markdown_block", "picture", "publish"]


def console_text(result: WindowResult, options: Options, full: str, details: str) -> str:
    """What the console shows: the summary (``details``: where the full report is written, "" if
    nowhere), or with ``report="full"`` the full report (the module tree only if ``detailed``)."""
    if options.report == "summary":
        return render_console_summary(result, tree_doubts(result), details)
    return full if options.detailed else report_text(result, options, detailed=False)


def markdown_block(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard's Text tab renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def publish(
    result: WindowResult,
    options: Options,
    log_dir: str | Path | None,
    sink: Sink,
    guard: Guard,
    skip: Collection[str] = (),
    files_only: bool = False,
) -> None:
    """On the logging rank: the report to the console (or ``output_file``), the report, JSON, picture
    and trace into ``log_dir``, and the metrics to the loggers.

    Each output is the profiler's own work (``guard``): one that fails is said and the others still
    go out; the metrics are logged whatever failed. ``skip`` names destinations ("output_file",
    "log_dir") already said to be unwritable at the start of the run. The loggers are the user's:
    their exceptions pass. With ``files_only`` (the run's end, after the profiler counted off the clock
    since the window), only the report and JSON files are written again.
    """
    if files_only:
        return _rewrite(result, options, log_dir, guard, skip)
    metrics = result.metrics()
    full = html = None
    with guard.own_work("rendering the report", "the metrics are logged"):
        full = report_text(result, options, detailed=True)
    with guard.own_work("rendering the picture", "the metrics and the report are logged"):
        html = picture(result)
    files: list[tuple[Path, Callable[[], str]]] = []
    to_file = options.output_file is not None and "output_file" not in skip
    to_log_dir = log_dir is not None and "log_dir" not in skip
    stem = Path(log_dir) / f"flops_profile_step{result.step}" if log_dir is not None else None
    if to_file and full is not None and options.output_file is not None:
        report = full + "\n"
        files.append((Path(options.output_file), lambda: report))
    elif full is not None and (options.print_profile or options.output_file is not None):
        # an output_file said to be unwritable at the start: its full report comes to the console instead
        with guard.own_work("printing the report", "the metrics are logged"):
            details = str(stem.with_suffix(".txt")) if to_log_dir and stem is not None else ""
            sink.console(full if options.output_file else console_text(result, options, full, details))
    if to_log_dir and stem is not None:
        if full is not None:
            files.append((stem.with_suffix(".txt"), lambda: full + "\n"))
        files.append((stem.with_suffix(".json"), lambda: _json_text(result, options)))
        if html is not None:
            files.append((stem.with_suffix(".html"), lambda: html))
        process = f"flops_callbacks modules, step {result.steps.module_trace}"
        files.append(
            (
                stem.with_suffix(".trace.json"),
                lambda: json.dumps(chrome_trace(result.spans, process_name=process)),
            )
        )
        if result.comm is not None:  # the median communication step's timeline, beside the modules'
            comm = result.comm
            files.append((stem.with_suffix(".comm.trace.json"), lambda: json.dumps(comm_trace(comm))))
    _write_all(files, guard)
    # the report first: W&B's picture is logged uncommitted, and joins the row the metrics then commit
    guard.user(sink.log_report, None if full is None else markdown_block(full), html, result.published_at)
    guard.user(sink.log_metrics, metrics, result.published_at)


def _rewrite(
    result: WindowResult, options: Options, log_dir: str | Path | None, guard: Guard, skip: Collection[str]
) -> None:
    """The report and JSON files written again, as :func:`publish` wrote them (the result has grown)."""
    full = report_text(result, options, detailed=True)
    files: list[tuple[Path, Callable[[], str]]] = []
    if options.output_file is not None and "output_file" not in skip:
        files.append((Path(options.output_file), lambda: full + "\n"))
    if log_dir is not None and "log_dir" not in skip:
        stem = Path(log_dir) / f"flops_profile_step{result.step}"
        files.append((stem.with_suffix(".txt"), lambda: full + "\n"))
        files.append((stem.with_suffix(".json"), lambda: _json_text(result, options)))
    _write_all(files, guard)


def _json_text(result: WindowResult, options: Options) -> str:
    """The JSON file's text, with the options its report file was rendered with (for ``show``)."""
    report = {"module_depth": options.module_depth, "top_modules": options.top_modules}
    return json.dumps(json_data(result, report), indent=2)


def _write_all(files: list[tuple[Path, Callable[[], str]]], guard: Guard) -> None:
    """Write every file; the ones that fail are said in one warning (a full disk fails them all)."""
    failed: list[tuple[Path, Exception]] = []
    for path, text in files:

        def write(path: Path = path, text: Callable[[], str] = text) -> None:
            write_text(path, text())

        error = guard.attempt(write)
        if error is not None:
            failed.append((path, error))
    if failed:
        paths = ", ".join(str(path) for path, _ in failed)
        guard.fail("writing the profile's files", failed[0][1], f"not saved: {paths}; the metrics are logged")


def picture(result: WindowResult) -> str:
    """The profile's HTML picture, with the headline figures and the steps they come from above it."""
    metrics = result.metrics()
    steps = result.steps
    headline = [
        ("fwd latency", duration_to_string(metrics[names.FWD_LATENCY])),
        *(
            [("the model's own forward (clean steps)", duration_to_string(result.model_forward))]
            if result.model_forward is not None
            else []
        ),
        ("bwd latency", duration_to_string(metrics[names.BWD_LATENCY])),
        ("step latency", duration_to_string(metrics[names.STEP_LATENCY])),
        ("FLOPS per device", flops_to_string(metrics[names.FLOPS_PER_SEC])),
        (
            "samples/second (step)",
            f"{metrics[names.SAMPLES_PER_SEC]:.2f}" if names.SAMPLES_PER_SEC in metrics else "n/a",
        ),
    ]
    if names.WALL_LATENCY in metrics:
        headline += [
            ("samples/second (wall)", f"{metrics.get(names.WALL_SAMPLES_PER_SEC, float('nan')):.2f}"),
            ("wall step", duration_to_string(metrics[names.WALL_LATENCY])),
            ("waiting for data", duration_to_string(metrics[names.DATA_LATENCY])),
        ]
    if names.MFU in metrics and result.peak is not None:  # the peak's kind beside it: measured, not silent
        headline.append((f"MFU ({result.peak.kind} peak)", f"{100 * metrics[names.MFU]:.2f}%"))
    headline += [
        ("module flops: the batch of", f"step {steps.profiled}"),
        ("module latencies", module_source(result)),
        ("phases: median of", step_list(steps.clean) if steps.clean else "no clean step"),
    ]
    title = f"flops_callbacks profile, step {result.step}"
    peak, bandwidth, entries = result.peak, result.bandwidth, roofline_entries(result)
    roofline = (
        {
            "peak_flops": peak.flops,
            "peak_bandwidth": bandwidth.bytes_per_sec,
            "peak_source": peak.source,
            "bandwidth_source": bandwidth.source,
            "modules": entries,
        }
        if peak is not None and bandwidth is not None and entries
        else None
    )
    why = result.no_roofline_reason or "no module latency was measured (the run ended before module timing)"
    return render_html(
        result.profile,
        title=title,
        headline=headline,
        roofline=roofline,
        no_roofline=why,
        doubts=tree_doubts(result),
    )
