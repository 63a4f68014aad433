"""The profile data: totals read from the model's own record, latencies replaceable, the JSON form, and
aggregation by depth and class. Profiles are built by hand from module records."""

from __future__ import annotations

import dataclasses
import json

from flops_callbacks.profile import Counts, Coverage, ModuleProfile, Profile


def record(name: str, class_name: str, **counts: int) -> ModuleProfile:
    return ModuleProfile(name=name, class_name=class_name, depth=name.count(".") + 1 if name else 0, **counts)


def two_layer_profile() -> Profile:
    root = record("", "Net", fwd_flops=30, bwd_flops=50, recompute_flops=7, fwd_macs=12, bwd_macs=24,
                  recompute_macs=3, params=40, trainable_params=25)  # fmt: skip
    modules = {
        "": root,
        "blocks": record("blocks", "ModuleList", fwd_flops=30),
        "blocks.0": record("blocks.0", "Linear", fwd_flops=10, params=20, fwd_latency=0.25),
        "blocks.1": record("blocks.1", "Linear", fwd_flops=20, params=20, fwd_latency=0.5),
    }
    return Profile(fwd_latency=1.0, bwd_latency=2.0, device="cpu", modules=modules,
                   outside_model=Counts(fwd_flops=3), coverage=Coverage(counted_calls=5))  # fmt: skip


def test_totals_are_the_model_records() -> None:
    profile = two_layer_profile()
    totals = (profile.fwd_flops, profile.bwd_flops, profile.recompute_flops, profile.fwd_macs,
              profile.bwd_macs, profile.recompute_macs, profile.params, profile.trainable_params)  # fmt: skip
    assert totals == (30, 50, 7, 12, 24, 3, 40, 25)
    assert (profile.model_flops, profile.hardware_flops) == (80, 87)  # fwd + bwd, then + recompute
    assert profile.model is profile.modules[""]


def test_latencies_are_replaceable_and_totals_follow_the_records() -> None:
    profile = dataclasses.replace(two_layer_profile(), fwd_latency=4.0, bwd_latency=5.0)
    assert (profile.fwd_latency, profile.bwd_latency, profile.fwd_flops) == (4.0, 5.0, 30)
    profile.modules = {name: dataclasses.replace(m, fwd_latency=9.0) for name, m in profile.modules.items()}
    assert profile.model.fwd_latency == 9.0
    assert profile.fwd_flops == 30


def test_json_form_holds_the_totals_and_every_record() -> None:
    data = json.loads(json.dumps(two_layer_profile().to_dict()))
    assert (data["fwd_flops"], data["bwd_macs"], data["params"]) == (30, 24, 40)
    assert (data["model_flops"], data["hardware_flops"]) == (80, 87)
    assert data["modules"]["blocks.1"]["fwd_flops"] == 20
    assert data["outside_model"]["fwd_flops"] == 3
    assert (data["fwd_latency"], data["device"]) == (1.0, "cpu")


def test_depths_children_and_aggregation_by_class() -> None:
    profile = two_layer_profile()
    assert profile.max_depth == 2
    assert [m.name for m in profile.at_depth(-1)] == ["blocks.0", "blocks.1"]
    assert [m.name for m in profile.children("blocks")] == ["blocks.0", "blocks.1"]
    [linear] = profile.aggregate_by_class(2).values()
    assert (linear.class_name, linear.fwd_flops, linear.params, linear.fwd_latency) == (
        "Linear",
        30,
        40,
        0.75,
    )
