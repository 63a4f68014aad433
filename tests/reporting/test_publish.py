"""Publishing a window: the JSON says where every figure came from, files go through one writer, and
the report's rows are read from the metrics dict."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flops_callbacks import metrics as names
from flops_callbacks.files import write_text
from flops_callbacks.guard import Guard
from flops_callbacks.options import Options
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Peak
from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile
from flops_callbacks.reporting.profile_file import json_data
from flops_callbacks.reporting.publish import markdown_block, publish
from flops_callbacks.reporting.window_rows import report_text, source_lines, tree_doubts
from flops_callbacks.session.result import WindowResult, WindowSteps
from flops_callbacks.timing.spans import ModuleSpan


def window(skipped: tuple[int, ...] = ()) -> WindowResult:
    root = ModuleProfile(fwd_flops=100, bwd_flops=200, fwd_macs=50, bwd_macs=100, params=1000, name="")
    profile = Profile(0.25, 0.5, "cpu", {"": root}, Counts(), Coverage())
    return WindowResult(
        profile=profile,
        steps=WindowSteps(10, (11,), (12, 14), skipped, "median of 2 clean step(s)", module_trace=11),
        fwd_latency=0.25,
        bwd_latency=0.5,
        step_latency=0.25,
        samples=8,
        tokens=1024,
        micro_batches=2,
        parallel=ParallelSizes(world_size=2, data_parallel=2),
        compute_dtype="bf16",
        peak=Peak(1000.0, "peak_flops argument"),
        spans=[ModuleSpan("", "forward", 0.0, 0.25, 0), ModuleSpan("", "backward", 0.3, 0.5, 0)],
        published_at=15,
    )


def test_the_json_holds_the_counts_the_sources_and_the_metrics() -> None:
    data = json.loads(json.dumps(json_data(window(skipped=(13,)))))  # as saved
    assert (data["step"], data["published_at_step"]) == (10, 15)
    assert data["steps"] == {
        "counting": 10, "module_timing": [11], "clean": [12, 14], "skipped": [13],
        "latency_source": "median of 2 clean step(s)", "shape_counting": [], "shapes": 1,
        "shapes_counted": 1, "shapes_predicted": 0, "module_shapes_match": True, "module_trace": 11,
        "module_trace_by": "median", "model_forward": [], "model_forward_shapes_match": False, "first": None,
    }  # fmt: skip
    # one step of the result's latencies stands for the clean steps: its spread is that step
    assert data["spread"]["iter"] == {"median": 1.0, "low": 1.0, "high": 1.0, "steps": 1}
    assert (data["samples_per_device"], data["micro_batches"], data["tokens_per_device"]) == (8, 2, 1024)
    assert data["compute_dtype"] == "bf16"
    assert data["peak"] == {"flops": 1000.0, "source": "peak_flops argument"}
    assert data["metrics"][names.MFU] == 0.3  # (100 + 200) / 1.0 s / 1000
    assert data["model_forward"] is None and data["model_forward_high"] is None  # no clean step marked it


def test_the_report_says_where_each_figure_came_from_and_the_dtype_and_peak() -> None:
    text = report_text(window(skipped=(13,)), Options(), detailed=False)
    assert dict(source_lines(window(skipped=(13,)))) == {
        "flops, MACs, params from": "step 10 (counting step)",
        "module latencies from": "step 11 (module hooks, no counting)",
        "fwd / bwd / step latency from": "median of 2 clean step(s): steps 12, 14",
        "rates from: the step of the median FLOPS: its flops (samples, tokens) / its latencies": (
            "1 batch shape(s): flops of 1 counted, 0 predicted"
        ),
        "clean steps left out (batch shapes not countable)": "13",
    }
    for label in ("compute dtype (picks the peak)", "peak FLOPS per device (peak_flops argument)", "MFU ="):
        assert label in text
    assert "MFU = (fwd+bwd flops) / iter latency / peak:" in text and "30.00%" in text


class Sink:
    is_logging_rank = True

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.calls: list[str] = []

    def log_dir(self) -> Path:
        return self.directory

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(f"metrics@{step}")

    def console(self, text: str) -> None:
        self.calls.append("console")

    def log_report(self, text: str, html: str, step: int) -> None:
        self.calls.append(f"report@{step}")


def test_publishing_prints_writes_four_files_then_logs(tmp_path: Path) -> None:
    sink = Sink(tmp_path)
    publish(window(), Options(), tmp_path, sink, Guard("test"))
    assert sink.calls == ["console", "report@15", "metrics@15"]  # the report first: W&B's picture joins
    names_written = sorted(p.name for p in tmp_path.iterdir())
    assert names_written == [
        "flops_profile_step10.html",
        "flops_profile_step10.json",
        "flops_profile_step10.trace.json",
        "flops_profile_step10.txt",
    ]
    trace = json.loads((tmp_path / "flops_profile_step10.trace.json").read_text())
    assert [(e["cat"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"] == [
        ("forward", 250000.0),
        ("backward", 500000.0),
    ]


def test_output_file_takes_the_report_instead_of_the_console(tmp_path: Path) -> None:
    sink = Sink(tmp_path / "logs")
    publish(window(), Options(output_file=tmp_path / "out" / "report.txt"), None, sink, Guard("test"))
    assert "console" not in sink.calls
    assert "Detailed Profile" in (tmp_path / "out" / "report.txt").read_text()  # the whole report


def test_markdown_block_and_the_one_writer(tmp_path: Path) -> None:
    assert markdown_block("a\n  b") == "    a\n      b"
    path = write_text(tmp_path / "deep" / "er" / "f.txt", "x")
    assert path.read_text() == "x"


def own_forward_row(result: WindowResult) -> str:
    """The value of the report's row for the model's own forward."""
    text = report_text(result, Options(), detailed=False)
    rows = dict(line.split(":  ", 1) for line in text.splitlines() if ":  " in line)
    return rows["the model's own forward (outermost module calls, clean steps)"].strip()


def test_the_root_is_checked_against_the_models_own_forward_only_of_steps_with_the_same_shapes() -> None:
    result = window()
    result.profile.modules[""] = dataclasses.replace(result.profile.model, fwd_latency=0.2)  # in the phase
    result.model_forward = 0.1  # the same calls on the clean steps: the root reads 2x them
    result.steps = dataclasses.replace(result.steps, model_forward=(12, 14), model_forward_shapes_match=True)
    assert [note.split(": ")[1] for note in tree_doubts(result).notes] == [
        "the model's forward on step 11 (200 ms) is 2.00x the model's own forward (100 ms, clean steps)"
    ]
    assert own_forward_row(result) == (
        "100 ms (median of the 2 clean steps): 40% of fwd latency "
        "(the rest: the loss, the training step's own code)"
    )
    result.steps = dataclasses.replace(result.steps, model_forward=(14,))  # one clean step marked it
    assert own_forward_row(result).startswith("100 ms (step 14): 40% of fwd latency")
    # above the forward phase (the median of the marks against the median step's phase): no "rest"
    result.model_forward = 1.2 * result.fwd_latency
    assert own_forward_row(result).endswith(
        ": 120% of fwd latency (each a median over the clean steps, which scatter: their ranges are above)"
    )
    result.model_forward = 0.1
    # clean steps of other batch shapes: their forward is another batch's, no measure of the tree
    result.steps = dataclasses.replace(result.steps, model_forward_shapes_match=False)
    assert tree_doubts(result).notes == []
