"""The window's JSON file: its layout, written with a schema name and version, and read back.

One module owns the layout both ways: :func:`json_data` is what ``flops_profile_step{N}.json`` holds
(:mod:`~flops_callbacks.reporting.publish` writes it), :func:`load` turns such a file back into the
:class:`~flops_callbacks.session.result.WindowResult` it was made from, so that a saved run is shown,
diffed and gated through the same renderers and the same metrics as a live one (the command line,
:mod:`~flops_callbacks.cli`). What is not read back: the module spans (the Chrome trace
file holds them). Why JSON and not pickle: the file is read by other tools and years later, and a
pickle ties it to this package's classes; the version says which layout a reader has in hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flops_callbacks import metrics as names
from flops_callbacks.communication.report import comm_data, comm_from_data
from flops_callbacks.communication.slow_rank_report import slow_rank_data, slow_rank_from_data, waited_for
from flops_callbacks.options import Options, check_report_args
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.profile import Profile, is_number
from flops_callbacks.reporting.declared_types import check_declared_types
from flops_callbacks.roofline import as_data
from flops_callbacks.session.flops_sources import FlopsSources
from flops_callbacks.session.result import AfterWindow, BatchLayout, WindowResult, WindowSteps
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.window_steps import SUMS, CleanFigures, CleanStep, StepSeconds, StepWork
from flops_callbacks.timing.energy_figures import EnergySpan
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.units import flops_to_string

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "ProfileFileError",
    "SavedProfile",
    "from_json",
    "json_data",
    "load",
    "load_runs",
    "profile_json",
    "roofline_entries",
]

SCHEMA = "flops_callbacks.profile"  # the "schema" key of every profile file: what tells it from other JSON
SCHEMA_VERSION = 2  # raised when a key is renamed or removed, or changes meaning (a new key: not needed)
WINDOW_FILE = re.compile(r"flops_profile_step\d+\.json")  # a window's profile, not its .trace.json


class ProfileFileError(ValueError):
    """A file that is not a profile this version can read; the message names the file and why."""


@dataclass(frozen=True)
class SavedProfile:
    """A profile file read back: the window's result, and its metrics as they were logged."""

    source: str  # the file's path, as given
    result: WindowResult
    metrics: dict[str, float]
    report: dict[str, int] = dataclasses.field(default_factory=dict)  # module_depth, top_modules of its .txt

    def varies(self) -> bool:
        """Whether the clean steps' flops changed from step to step (batches of changing lengths)."""
        return len({w.counts for w in self.result.figures().work}) > 1

    def batch_size(self) -> int | float | None:
        """Samples per device of a clean step: their median (an epoch's last, short batch is not the batch
        size); None where unknown, or where packed rows hold a changing number of sequences (samples)."""
        samples = [w.samples for w in self.result.figures().work]
        known = [n for n in samples if n is not None]
        packed = self.result.layout is not None and self.result.layout.packed
        return statistics.median_low(known) if len(known) == len(samples) and not packed else None

    def why_absent(self, figure: str) -> str:
        """Why the run has no ``figure`` (a metric's name without the prefix), as its file says ("": it says
        nothing): an energy figure's counter, MFU's and HFU's peak."""
        name = f"{names.PREFIX}{figure}"
        if name in names.ENERGY:
            return self.result.no_energy_reason
        return self.result.no_peak_reason if name in names.WITH_PEAK else ""

    def setup(self) -> dict[str, str]:
        """What the run ran on, in words: its world and data-parallel sizes, device type, and the compute
        dtype, peak FLOPS and whether its model flops left the padding apart, where its file has them
        (what a comparison names where two runs differ)."""
        r = self.result
        found = {"world size": str(r.parallel.world_size)}
        found["data-parallel size"] = str(r.parallel.data_parallel)
        found["device type"] = r.profile.device.split(":")[0]
        if r.compute_dtype is not None:
            found["compute dtype"] = r.compute_dtype
        if r.peak is not None:
            found["peak FLOPS"] = flops_to_string(r.peak.flops)
        if r.layout is not None and r.layout.positions > r.layout.real_tokens:  # padding: told apart or not
            found["model flops"] = "as run (padding in)" if r.layout.not_apart else "padding apart"
        return found


def json_data(result: WindowResult, report: dict[str, int] | None = None) -> dict[str, Any]:
    """Everything of a window as JSON-ready data: metrics, where each came from, and the full profile;
    ``report``: the options the run's report was rendered with (``module_depth``, ``top_modules``), so
    that ``show`` prints the same report again."""
    figures = result.figures()
    data = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "step": result.step,
        "published_at_step": result.published_at,
        # a one-process window has no communication steps, a fixed-shape one profiles its counting step, a
        # CPU times its modules by their hooks, an uncompiled model compiles nothing
        "steps": {
            k: v
            for k, v in dataclasses.asdict(result.steps).items()
            if v or k not in ("communication", "profile_step", "module_kernels", "compiled", "eager_tree")
        },
        "model_forward": result.model_forward,  # seconds; steps: steps.model_forward
        "model_forward_high": result.model_forward_high,  # the slowest of those steps'
        "hook_cost": None if result.hook_cost is None else dataclasses.asdict(result.hook_cost),
        "metrics": result.metrics(),
        "samples_per_device": result.samples,
        "micro_batches": result.micro_batches,
        "tokens_per_device": result.tokens,
        "compute_dtype": result.compute_dtype,
        "peak": dataclasses.asdict(result.peak) if result.peak else {"none": result.no_peak_reason},
        "parallel": dataclasses.asdict(result.parallel),
        "sharded_model_params": result.sharded_model_params,  # global parameters when sharded, else None
        "rank_latencies": result.rank_latencies,  # (fwd, bwd, step) seconds, by rank
        "rank_counts": result.rank_counts,  # each rank's counting-step totals: per GPU is their mean
        # per clean step: counted / predicted / estimated; uncertainty: a bound on the total's error
        "flops_sources": None if result.flops_sources is None else dataclasses.asdict(result.flops_sources),
        "counting_iter": result.counting_iter,  # the counting step's fwd + bwd + step seconds
        "peak_memory_allocated": result.peak_memory,  # bytes per phase, clean steps; None off CUDA
        "bandwidth": dataclasses.asdict(result.bandwidth)
        if result.bandwidth
        else {"none": result.no_bandwidth_reason},
        # each latency over the clean steps: median, min, max, steps (the slowest rank's)
        "spread": {name: dataclasses.asdict(s) for name, s in figures.spreads.items()},
        "clean_steps": len(result.steps.clean),  # the latencies' steps (0: a cut window's, inflated)
        "clean_totals": _work_json(figures.total())  # sums over the clean steps: the wall rates'
        | {"seconds": figures.sums, "iter_seconds_per_step": figures.iters},
        "clean_median_step": _work_json(figures.median_step().work),  # what the rates divide
        # each clean step (the job's: the ranks' mean work, the slowest rank's seconds), to read back
        "clean_each": [
            {"work": _work_json(step.work), "seconds": dict(zip(SUMS, step.seconds, strict=True))}
            for step in figures.steps
        ],
        # the clean steps' token batches: rows, sequences (packing), real tokens and positions (padding), and
        # why the model's work could not be told from the run's ("" where it was)
        "batch_layout": None if result.layout is None else result.layout._asdict(),
        # the profiler's own counting after the window (off the clock): how many times, its seconds
        "after_window": result.after._asdict(),
        # a CUDA device's kernel seconds launched in each phase of the module-timing step (None: not read)
        "device_busy": result.device_busy,
        # every rank's energy counter over its clean steps (joules, seconds; each GPU or host's counter once
        # in the job's figures), or why there is none
        "energy": {"ranks": [s._asdict() for s in result.energy]}
        if result.energy
        else {"none": result.no_energy_reason},
        "extra_lines": result.extra_lines,  # the report rows the framework's adapter added
        "profile": profile_json(result),
    }
    if report is not None:
        data["report"] = report
    if result.comm is not None:  # the median communication step's split (several ranks)
        data["communication"] = comm_data(result.comm, waited_for(result.slow_rank, result.comm.step.exposed))
    if result.slow_rank is not None:  # the rank the others wait for, or none (several ranks)
        data["slow_rank"] = slow_rank_data(result.slow_rank)
    return data


def _work_json(work: StepWork) -> dict[str, Any]:
    return {
        "counts": work.counts._asdict(),
        "samples": work.samples,
        "tokens": work.tokens,
        "real_tokens": work.real_tokens,
        "token_positions": work.positions,
    }


def _work(data: dict[str, Any]) -> StepWork:
    return StepWork(
        BatchCounts.from_dict(data["counts"]), data["samples"], data["tokens"], data["real_tokens"],
        data["token_positions"],
    )  # fmt: skip


def profile_json(result: WindowResult) -> dict[str, Any]:
    """The profile's JSON, each module entry with its forward and backward roofline where known."""
    data = result.profile.to_dict()
    for name, phases in roofline_entries(result).items():
        data["modules"][name]["roofline"] = phases
    return data


def roofline_entries(result: WindowResult) -> dict[str, dict[str, dict[str, Any]]]:
    """Each module's rooflines as plain data, by name and pass (the JSON's and the picture's)."""
    if not result.steps.module_timing:
        return {}  # the counting step's latencies are inflated by counting: no verdict on them
    return as_data(result.rooflines())


def load(path: str | Path) -> SavedProfile:
    """The profile file at ``path``; :class:`ProfileFileError` naming it when it cannot be read, is not
    JSON, is not a profile, or has a schema version this package does not know."""
    source = str(path)
    if Path(path).is_dir():
        raise ProfileFileError(f"{source}: a folder, not a profile file (flops_profile_step{{N}}.json)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ProfileFileError(f"{source}: cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ProfileFileError(f"{source}: not a profile: not UTF-8 text ({error.reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileFileError(f"{source}: not a profile: not valid JSON ({error})") from None
    return from_json(data, source)


def load_runs(folder: str | Path) -> list[SavedProfile]:
    """Every ``flops_profile_step{N}.json`` under ``folder`` (its subfolders too, in path order), each a
    run of one configuration; :class:`ProfileFileError` naming the folder when it holds none."""
    found = sorted(p for p in Path(folder).rglob("flops_profile_step*.json") if WINDOW_FILE.fullmatch(p.name))
    if not found:
        raise ProfileFileError(
            f"{folder}: a folder with no flops_profile_step{{N}}.json in it or under it (a folder stands "
            "for several runs of one configuration: each run's profile file)"
        )
    return [load(p) for p in found]


def from_json(data: Any, source: str = "<data>") -> SavedProfile:
    """The profile that :func:`json_data` wrote, as read from JSON (``source`` names it in errors)."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        key = f'its "schema" is {json.dumps(found)}, not "{SCHEMA}"' if found else f'no "schema": "{SCHEMA}"'
        raise ProfileFileError(
            f"{source}: not a flops_callbacks profile ({key}; the profile is the "
            "flops_profile_step{N}.json a profiled run writes into its log folder)"
        )
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        why = "written by a newer flops_callbacks: upgrade to read it" if newer else "unknown"
        raise ProfileFileError(
            f"{source}: profile schema version {version!r} is {why} (this flops_callbacks reads "
            f"version {SCHEMA_VERSION})"
        )
    try:
        metrics = {str(k): float(v) for k, v in data["metrics"].items()}
        for name, value in metrics.items():  # a NaN would pass every comparison
            if not math.isfinite(value):
                raise ValueError(f'"metrics": "{name}" is {value}, expected a finite number')
        result = _result(data, metrics)
        check_declared_types(result, "")  # here, not as a TypeError deep in a comparison
        if "" not in result.profile.modules:
            raise ValueError('"profile": "modules" has no "" key (the model\'s own row)')
        return SavedProfile(source, result, metrics, _report(data.get("report")))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        what = f"missing key {error}" if isinstance(error, KeyError) else str(error)
        raise ProfileFileError(
            f"{source}: a profile of schema version {version}, but malformed: {what}"
        ) from None


def _seconds(seconds: dict[str, Any], name: str) -> float:
    """A clean step's seconds of one phase, a number (else the comparison would fail on it, unnamed)."""
    value = seconds[name]
    if not is_number(value):
        raise ValueError(f'a clean step\'s "seconds": "{name}" is {json.dumps(value)}, expected a number')
    return float(value)


def _report(found: Any) -> dict[str, int]:
    """The report options a file was written with, those this version knows and can use (checked as
    the entry points check them; a file's other keys or values are no reason to refuse it: ``show``
    falls back to the defaults)."""
    if not isinstance(found, dict):
        return {}
    defaults = {"module_depth": Options.module_depth, "top_modules": Options.top_modules}
    usable = {}
    for key in defaults.keys() & found.keys():
        try:
            check_report_args(**{**defaults, key: found[key]})
        except ValueError:
            continue
        usable[key] = found[key]
    return usable


def _tuples(entry: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists back to the tuples the dataclasses hold."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}


def _steps(entry: dict[str, Any]) -> dict[str, Any]:
    """The window's steps as saved; a file written before ``module_trace_by`` was kept chose the tree of a
    step of other batch shapes by its batch size, and every other tree as the median by time."""
    steps = _tuples(entry)
    for f in dataclasses.fields(WindowSteps):  # the step numbers and counts that every reader reads
        if f.name not in steps or f.type not in ("int", "tuple[int, ...]"):
            continue
        value, one = steps[f.name], f.type == "int"
        many = isinstance(value, tuple) and all(type(v) is int for v in value)
        if not (type(value) is int if one else many):
            wanted = "an integer" if one else "a list of step numbers"
            raise ValueError(f'"steps": "{f.name}" is {json.dumps(entry[f.name])}, expected {wanted}')
    if "module_trace_by" not in steps:
        steps["module_trace_by"] = "median" if steps.get("profile_step") is None else "batch"
    return steps


def _result(data: dict[str, Any], metrics: dict[str, float]) -> WindowResult:
    peak, bandwidth = data["peak"], data["bandwidth"]
    if not isinstance(data["clean_each"], list) or not data["clean_each"]:
        raise ValueError(
            f'"clean_each" is {json.dumps(data["clean_each"])}, expected a list of each clean step\'s work '
            "and seconds (at least the one step a window with no clean step timed instead)"
        )
    clean = CleanFigures(
        tuple(
            CleanStep(_work(each["work"]), StepSeconds(*(_seconds(each["seconds"], name) for name in SUMS)))
            for each in data["clean_each"]
        )
    )
    return WindowResult(
        profile=Profile.from_dict(data["profile"]),
        steps=WindowSteps(**_steps(data["steps"])),
        # the phase latencies are the metrics' (window_metrics writes them as they are)
        fwd_latency=metrics[names.FWD_LATENCY],
        bwd_latency=metrics[names.BWD_LATENCY],
        step_latency=metrics[names.STEP_LATENCY],
        samples=data["samples_per_device"],
        tokens=data["tokens_per_device"],
        micro_batches=data["micro_batches"],
        parallel=ParallelSizes(**data["parallel"]),
        compute_dtype=data["compute_dtype"],
        peak=None if "none" in peak else Peak(**peak),
        no_peak_reason=peak.get("none", ""),
        bandwidth=None if "none" in bandwidth else Bandwidth(**bandwidth),
        no_bandwidth_reason=bandwidth.get("none", ""),
        rank_latencies=[tuple(r) for r in data["rank_latencies"]],
        rank_counts=list(data.get("rank_counts", [])),
        flops_sources=None
        if data.get("flops_sources") is None
        else FlopsSources(**_tuples(data["flops_sources"])),
        counting_iter=data.get("counting_iter"),
        sharded_model_params=data["sharded_model_params"],
        extra_lines=[(label, value) for label, value in data["extra_lines"]],
        peak_memory=data["peak_memory_allocated"],
        published_at=data["published_at_step"],
        clean=clean,
        hook_cost=None if data["hook_cost"] is None else HookCost(**data["hook_cost"]),
        model_forward=data["model_forward"],
        model_forward_high=data["model_forward_high"],
        comm=None if data.get("communication") is None else comm_from_data(data["communication"]),
        slow_rank=None if data.get("slow_rank") is None else slow_rank_from_data(data["slow_rank"]),
        layout=None if data.get("batch_layout") is None else BatchLayout(**data["batch_layout"]),
        after=AfterWindow(**data.get("after_window", {})),
        energy=tuple(EnergySpan(**s) for s in data.get("energy", {}).get("ranks", [])),
        no_energy_reason=data.get("energy", {}).get("none", ""),
        device_busy=data.get("device_busy"),
    )
