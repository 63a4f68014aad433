"""The phase names: each set named once, the sets distinct, and the short forms the profile's own fields."""

from __future__ import annotations

from dataclasses import fields

from flops_callbacks.phase_names import MODULE_PASSES, PROFILE_PASSES, ROOFLINE_PASSES, STEP_PHASES
from flops_callbacks.profile import Counts, ModuleProfile
from flops_callbacks.timing import phases, spans


def test_a_step_has_three_phases_and_a_module_three_passes_sharing_the_first_two() -> None:
    assert STEP_PHASES == ("forward", "backward", "optimizer_step")
    assert MODULE_PASSES == ("forward", "backward", "recompute")
    assert set(STEP_PHASES) & set(MODULE_PASSES) == {"forward", "backward"}


def test_the_short_passes_are_the_prefixes_of_the_profiles_flops_macs_bytes_and_latency_fields() -> None:
    count_fields = {f.name for f in fields(Counts)}
    module_fields = {f.name for f in fields(ModuleProfile)}
    assert len(PROFILE_PASSES) == len(MODULE_PASSES) == 3
    for short in PROFILE_PASSES:
        assert {f"{short}_flops", f"{short}_macs", f"{short}_bytes"} <= count_fields
        assert f"{short}_latency" in module_fields
    assert ROOFLINE_PASSES == ("fwd", "bwd")


def test_the_timing_modules_use_these_names_and_hold_none_of_their_own() -> None:
    assert phases.STEP_PHASES is STEP_PHASES
    assert spans.MODULE_PASSES is MODULE_PASSES
    assert STEP_PHASES[:2] == (phases.FORWARD, phases.BACKWARD)
