"""Module spans as a Chrome trace: one complete event per module call, forward and backward on their
own tracks, times in microseconds, in the same event shape torch.profiler writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flops_callbacks.reporting.chrome_trace import chrome_trace
from flops_callbacks.timing.spans import ModuleSpan

# One step of a model with a block called twice (a shared module) and a checkpointed block:
# the forward, the recompute of the checkpointed block inside the backward, the backward.
SPANS = [
    ModuleSpan("", "forward", 0.0, 0.010, 0),
    ModuleSpan("block", "forward", 0.001, 0.004, 1),
    ModuleSpan("block.linear", "forward", 0.001, 0.0025, 2),
    ModuleSpan("block", "forward", 0.005, 0.004, 1),  # the second call of the shared block
    ModuleSpan("head", "forward", 0.0092, 0.0008, 1),
    ModuleSpan("", "backward", 0.0105, 0.02, 0),
    ModuleSpan("head", "backward", 0.0105, 0.0015, 1),
    ModuleSpan("block", "recompute", 0.012, 0.003, 1),
    ModuleSpan("block", "backward", 0.015, 0.0125, 1),
]


def loaded(spans: list[ModuleSpan], **kwargs: str) -> list[dict]:
    """The trace as a viewer reads it: written to JSON text and parsed back."""
    data = json.loads(json.dumps(chrome_trace(spans, **kwargs)))
    assert set(data) == {"traceEvents", "displayTimeUnit"} and data["displayTimeUnit"] == "ms"
    return data["traceEvents"]


def test_one_complete_event_per_module_call_with_times_in_microseconds() -> None:
    events = loaded(SPANS)
    calls = [e for e in events if e["ph"] == "X"]
    assert len(calls) == len(SPANS) == 9
    track = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    expected = {  # (name, track, ts us, dur us, depth), outer calls first on each track
        ("(model)", "forward", 0.0, 10000.0, 0),
        ("block", "forward", 1000.0, 4000.0, 1),
        ("block.linear", "forward", 1000.0, 2500.0, 2),
        ("block", "forward", 5000.0, 4000.0, 1),
        ("head", "forward", 9200.0, 800.0, 1),
        ("(model)", "backward", 10500.0, 20000.0, 0),
        ("head", "backward", 10500.0, 1500.0, 1),
        ("block", "backward", 15000.0, 12500.0, 1),
        ("block", "recompute", 12000.0, 3000.0, 1),
    }
    got = [(e["name"], e["cat"], e["ts"], e["dur"], e["args"]["depth"]) for e in calls]
    assert got == sorted(got, key=lambda c: (track[c[1]], c[2], -c[3])) and set(got) == expected
    for event in calls:
        assert event["tid"] == track[event["cat"]]
        assert event["args"]["module"] == ("" if event["name"] == "(model)" else event["name"])


def test_metadata_names_the_process_and_one_track_per_phase_in_phase_order() -> None:
    events = loaded(SPANS, process_name="gpt2 step 7")
    meta = [e for e in events if e["ph"] == "M"]
    assert events[: len(meta)] == meta  # metadata first
    pids = {e["pid"] for e in events}
    assert len(pids) == 1
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["gpt2 step 7"]
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert sorted(names.values()) == ["backward", "forward", "recompute"]
    assert [names[tid] for tid in sorted(names, key=order.get)] == ["forward", "backward", "recompute"]


def test_tracks_only_for_the_phases_that_ran() -> None:
    events = loaded([s for s in SPANS if s.phase == "forward"])
    assert [e["args"]["name"] for e in events if e["name"] == "thread_name"] == ["forward"]
    assert [e["name"] for e in loaded([])] == ["process_name"]


def test_events_have_the_shape_torch_profiler_writes(tmp_path: Path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    prof.export_chrome_trace(str(tmp_path / "torch.json"))
    theirs = [
        e for e in json.loads((tmp_path / "torch.json").read_text())["traceEvents"] if e.get("ph") == "X"
    ]
    ours = [e for e in loaded(SPANS) if e["ph"] == "X"]
    assert theirs and ours
    assert set(ours[0]) == set(theirs[0]) == {"ph", "cat", "name", "pid", "tid", "ts", "dur", "args"}
    for key in ("ts", "dur"):
        assert isinstance(ours[0][key], float) and isinstance(theirs[0][key], (int, float))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"phase": "optimizer"}, "phase must be one of forward, backward, recompute; got 'optimizer'"),
        ({"duration": -1e-6}, "duration must be >= 0 seconds; got -1e-06"),
        ({"duration": float("nan")}, "duration must be >= 0 seconds; got nan"),
        ({"depth": -1}, "depth must be >= 0; got -1"),
    ],
)
def test_a_bad_span_is_refused_when_made(kwargs: dict, message: str) -> None:
    fields = {"name": "block", "phase": "forward", "start": 0.0, "duration": 1.0, "depth": 1} | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModuleSpan(**fields)
