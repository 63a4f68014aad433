"""A profiled generation's JSON file: its layout, written with a schema name and version, and read back.

One module owns the layout both ways, as :mod:`~flops_callbacks.reporting.profile_file` does for a
training window: :func:`generation_json` is what the file holds, :func:`generation_from_json` turns it
back into the :class:`~flops_callbacks.generation.result.GenerationResult` it was made from, so
that the command line shows a saved generation with the same renderer as the live one. Its own schema
name, not the window's: the two results hold different things, and a reader must know which it has.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flops_callbacks.generation.result import CountedStep, GenerationResult
from flops_callbacks.generation.run import RunTimes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.profile_file import ProfileFileError
from flops_callbacks.roofline import as_data
from flops_callbacks.timing.energy_figures import CounterName, Reading

__all__ = [
    "GENERATION_SCHEMA",
    "GENERATION_SCHEMA_VERSION",
    "generation_from_json",
    "generation_json",
    "read_generation",
]

GENERATION_SCHEMA = "flops_callbacks.generation"
GENERATION_SCHEMA_VERSION = 1  # raised when a key is renamed or removed, or changes meaning


def generation_json(result: GenerationResult) -> dict[str, Any]:
    """Everything of a generation as JSON-ready data: the metrics, the steps' work and times, both trees."""
    rooflines = {"phases": result.rooflines()}
    return {
        "schema": GENERATION_SCHEMA,
        "schema_version": GENERATION_SCHEMA_VERSION,
        "metrics": result.metrics(),
        "device": result.device,
        "compute_dtype": result.compute_dtype,
        "mode": result.mode,
        "batch_size": result.batch_size,
        "prompt_tokens": result.prompt_tokens,
        "padding_tokens": result.padding_tokens,
        "warm_up": result.warm_up,
        "kv_cache_bytes": result.kv_cache_bytes,
        "counting_failure": result.counting_failure,
        "module_latencies": result.module_latencies,
        "no_energy_reason": result.no_energy,  # each run's "energy": (joules, time, counter) x 3
        "peak": dataclasses.asdict(result.peak) if result.peak else {"none": result.no_peak_reason},
        "bandwidth": dataclasses.asdict(result.bandwidth)
        if result.bandwidth
        else {"none": result.no_bandwidth_reason},
        "roofline": as_data(rooflines)["phases"],  # per phase: the Roofline fields
        "work": [dataclasses.asdict(step) for step in result.work],  # the counting run's steps
        "runs": [dataclasses.asdict(run) for run in result.runs],  # each timed run's seconds
        "decode_shown": result.decode_shown,
        "prefill_steps": result.prefill_steps,
        "prefill": None if result.prefill is None else result.prefill.to_dict(),
        "decode": None if result.decode is None else result.decode.to_dict(),
    }


def generation_from_json(data: dict[str, Any]) -> GenerationResult:
    """The result :func:`generation_json` wrote (KeyError, TypeError or ValueError when malformed)."""
    peak, bandwidth = data["peak"], data["bandwidth"]
    return GenerationResult(
        device=data["device"],
        compute_dtype=data["compute_dtype"],
        batch_size=data["batch_size"],
        prompt_tokens=data["prompt_tokens"],
        padding_tokens=data["padding_tokens"],
        work=tuple(CountedStep(**step) for step in data["work"]),
        prefill=None if data["prefill"] is None else Profile.from_dict(data["prefill"]),
        decode=None if data["decode"] is None else Profile.from_dict(data["decode"]),
        decode_shown=data["decode_shown"],
        prefill_steps=data["prefill_steps"],
        runs=tuple(_run_times(run) for run in data["runs"]),
        warm_up=data["warm_up"],
        kv_cache_bytes=data["kv_cache_bytes"],
        peak=None if "none" in peak else Peak(**peak),
        no_peak_reason=peak.get("none", ""),
        bandwidth=None if "none" in bandwidth else Bandwidth(**bandwidth),
        no_bandwidth_reason=bandwidth.get("none", ""),
        mode=data["mode"],
        counting_failure=data["counting_failure"],
        module_latencies=data["module_latencies"],
        no_energy_reason=data.get("no_energy_reason", ""),
    )


def read_generation(path: str | Path) -> GenerationResult | None:
    """The generation saved at ``path``; None when the file is not a generation's (a training window's is
    read by :func:`~flops_callbacks.reporting.profile_file.load`, which says what else is wrong);
    :class:`~flops_callbacks.reporting.profile_file.ProfileFileError` naming it when it is one this
    version cannot read."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != GENERATION_SCHEMA:
        return None
    version = data.get("schema_version")
    if version != GENERATION_SCHEMA_VERSION:
        raise ProfileFileError(
            f"{path}: generation profile schema version {version!r} is unknown (this flops_callbacks reads "
            f"version {GENERATION_SCHEMA_VERSION})"
        )
    try:
        return generation_from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        what = f"missing key {error}" if isinstance(error, KeyError) else str(error)
        raise ProfileFileError(f"{path}: a generation profile, but malformed: {what}") from None


def _run_times(run: dict[str, Any]) -> RunTimes:
    return RunTimes(
        total=run["total"],
        first_token=run["first_token"],
        tokens=run["tokens"],
        prefill_steps=run["prefill_steps"],
        steps=tuple(run["steps"]),
        token_gaps=tuple(run["token_gaps"]),
        energy=tuple(Reading(j, at, CounterName(*c)) for j, at, c in run.get("energy", [])),
    )
