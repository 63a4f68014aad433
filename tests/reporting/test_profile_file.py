"""The profile file read back: a real run's JSON loads into the result it was written from (written
again, it is the same JSON; rendered again, the same report and picture as the run's own files), and
a file that is not a profile, or of another schema version, is refused with its name and the reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.options import Options
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Bandwidth
from flops_callbacks.reporting.profile_file import (
    SCHEMA,
    SCHEMA_VERSION,
    ProfileFileError,
    from_json,
    json_data,
    load,
)
from flops_callbacks.reporting.publish import picture
from flops_callbacks.reporting.window_rows import module_source, report_text
from tests.saved_runs import CLEAN, FWD_FLOPS, PAUSE, PEAK, PROFILE_STEP


def test_a_real_runs_file_loads_back_into_the_result_it_was_written_from(runs: dict[str, Path]) -> None:
    path = runs["A"]
    written = json.loads(path.read_text())
    assert (
        (written["schema"], written["schema_version"])
        == (SCHEMA, SCHEMA_VERSION)
        == ("flops_callbacks.profile", 2)
    )
    saved = load(path)
    assert saved.source == str(path)
    assert json.loads(json.dumps(json_data(saved.result, saved.report))) == written  # every key, every value
    assert saved.report == {"module_depth": -1, "top_modules": 2}  # the run's report options, for show
    assert saved.metrics == written["metrics"]
    assert saved.result.metrics() == saved.metrics  # recomputed from what was read: the same figures
    assert saved.metrics[names.FWD_FLOPS] == FWD_FLOPS == 19712  # by hand (tests/saved_runs.py)
    assert saved.result.peak is not None and saved.result.peak.flops == PEAK
    spread = saved.result.figures().spreads["fwd"]
    assert spread.steps == CLEAN and 2 * PAUSE <= spread.low <= spread.median <= spread.high
    slow = saved.result.profile.modules["slow"]
    assert (slow.class_name, slow.fwd_flops, slow.fwd_latency >= PAUSE) == (
        "Pause",
        2 * 4 * 32 * 32 + 4 * 32,
        True,
    )


def test_the_report_and_picture_rendered_from_the_file_are_the_runs_own(runs: dict[str, Path]) -> None:
    saved = load(runs["A"])
    stem = runs["A"].with_suffix("")
    report = report_text(saved.result, Options(**saved.report), detailed=True)
    assert report + "\n" == stem.with_suffix(".txt").read_text()
    assert picture(saved.result) == stem.with_suffix(".html").read_text()
    assert f"Profile Summary at step {PROFILE_STEP}:" in stem.with_suffix(".txt").read_text()


def test_a_file_that_is_not_a_profile_is_refused_with_its_name_and_why(
    tmp_path: Path, runs: dict[str, Path]
) -> None:
    text = runs["A"].read_text()
    cases = {
        "missing.json": None,
        "truncated.json": text[: len(text) // 2],
        "foreign.json": json.dumps({"loss": 0.5, "metrics": {}}),
        "list.json": "[1, 2]",
        "other.json": json.dumps({"schema": "other.tool", "metrics": {}}),
        "trace.json": runs["A"].with_suffix(".trace.json").read_text(),  # the run's other JSON
    }
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
    reasons = {}
    for name in cases:
        with pytest.raises(ProfileFileError) as raised:
            load(tmp_path / name)
        assert str(raised.value).startswith(f"{tmp_path / name}: ")
        reasons[name] = str(raised.value).removeprefix(f"{tmp_path / name}: ")
    assert reasons["missing.json"] == "cannot be read (No such file or directory)"
    assert reasons["truncated.json"].startswith("not a profile: not valid JSON (")
    not_ours = f'not a flops_callbacks profile (no "schema": "{SCHEMA}";'
    assert all(reasons[n].startswith(not_ours) for n in ("foreign.json", "list.json", "trace.json"))
    assert reasons["other.json"].startswith(
        f'not a flops_callbacks profile (its "schema" is "other.tool", not "{SCHEMA}";'
    )


def test_a_one_process_file_has_no_communication_steps_and_reads_back_none(runs: dict[str, Path]) -> None:
    data = json.loads(runs["A"].read_text())
    assert "communication" not in data["steps"]  # one process: no communication step, no key
    assert "slow_rank" not in data and names.SLOW_RANK not in data["metrics"]  # and no slow rank
    assert from_json(data, "new.json").result.steps.communication == ()


def test_of_the_report_options_only_those_known_and_usable_are_read(runs: dict[str, Path]) -> None:
    data = json.loads(runs["A"].read_text())
    data["report"] = {"module_depth": 2, "top_modules": "3", "style": "full"}  # a later version's keys
    assert from_json(data, "new.json").report == {"module_depth": 2}
    data["report"] = {"module_depth": -2, "top_modules": 0}  # out of range: the defaults instead
    assert from_json(data, "new.json").report == {}
    del data["report"]  # a file written before the key: the defaults
    assert from_json(data, "old.json").report == {}


def test_an_unknown_schema_version_or_a_missing_key_is_refused(runs: dict[str, Path]) -> None:
    data = json.loads(runs["A"].read_text())
    with pytest.raises(ProfileFileError, match=r"^new.json: profile schema version 3 is written by a newer "):
        from_json({**data, "schema_version": 3}, "new.json")
    with pytest.raises(ProfileFileError, match=r"^odd.json: profile schema version 'x' is unknown \(this "):
        from_json({**data, "schema_version": "x"}, "odd.json")
    without = {k: v for k, v in data.items() if k != "clean_each"}
    with pytest.raises(
        ProfileFileError,
        match=r"^cut.json: a profile of schema version 2, but malformed: missing key 'clean_each'$",
    ):
        from_json(without, "cut.json")


def test_a_hand_damaged_step_list_or_an_empty_clean_each_is_refused_naming_the_field(
    runs: dict[str, Path],
) -> None:
    """Fields every reader counts or takes a median of: refused as read, not failed on later."""
    data = json.loads(runs["A"].read_text())

    def steps(**changed: object) -> dict:
        return {**data, "steps": {**data["steps"], **changed}}

    cases = {
        '"steps": "clean" is null, expected a list of step numbers': steps(clean=None),
        '"steps": "skipped" is [6.5], expected a list of step numbers': steps(skipped=[6.5]),
        '"steps": "counting" is "1", expected an integer': steps(counting="1"),
        '"clean_each" is [], expected a list of each clean step\'s work and seconds (at least the one step a '
        "window with no clean step timed instead)": {**data, "clean_each": []},
    }
    for why, damaged in cases.items():
        with pytest.raises(ProfileFileError) as raised:
            from_json(damaged, "hand.json")
        assert str(raised.value) == f"hand.json: a profile of schema version 2, but malformed: {why}"


def test_what_a_cpu_run_leaves_empty_round_trips_too(runs: dict[str, Path]) -> None:
    """The fields a single-process CPU run leaves empty, as a sharded GPU run or the HF adapter fills them:
    written, read back, written again, the same; the report and picture rendered from either, the same."""
    full = dataclasses.replace(
        load(runs["A"]).result,
        parallel=ParallelSizes(world_size=4, data_parallel=2, tensor_parallel=2),
        rank_latencies=[(0.01, 0.02, 0.003), (0.011, 0.021, 0.004)],
        sharded_model_params=5064,
        peak_memory={"forward": 1 << 20, "backward": 3 << 20, "optimizer_step": 2 << 20},
        bandwidth=Bandwidth(1e10, "peak_bandwidth argument"),
        extra_lines=[("flops by the HF Trainer's estimate (6 x params x tokens)", "1.2 M")],
        compute_dtype="bf16",
    )
    written = json.loads(json.dumps(json_data(full)))
    assert written["profile"]["modules"]["slow.linear"]["roofline"]["fwd"]["limiter"] in ("compute", "memory")
    again = from_json(written).result
    assert json.loads(json.dumps(json_data(again))) == written
    assert report_text(again, Options(), detailed=True) == report_text(full, Options(), detailed=True)
    assert "flops by the HF Trainer's estimate (6 x params x tokens):" in report_text(again, Options(), False)
    assert picture(again) == picture(full)


def test_how_the_trees_step_was_chosen_reads_back_and_a_file_without_it_says_what_it_did(
    runs: dict[str, Path],
) -> None:
    data = json.loads(runs["A"].read_text())
    assert data["steps"]["module_trace_by"] == "nearest"  # a CPU run whose clean steps marked its forward
    assert from_json(data, "new.json").result.steps.module_trace_by == "nearest"
    del data["steps"]["module_trace_by"]  # written before the key: the median by time
    assert from_json(data, "old.json").result.steps.module_trace_by == "median"
    data["steps"]["profile_step"] = data["steps"]["module_trace"]  # ... or, of other shapes, by batch size
    assert from_json(data, "old.json").result.steps.module_trace_by == "batch"
    data["steps"]["module_trace_by"] = "kernel"  # a later version's rule: said as it is, not refused
    result = from_json(data, "new.json").result
    assert f"the tree of step {result.steps.module_trace}, kernel;" in module_source(result)
