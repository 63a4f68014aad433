"""What two runs' figures do not say: that the runs did different work, ran on different setups, or had
batches of varying lengths, each a note that ``diff`` and ``gate`` print before the figures. Why apart from
:mod:`.compare`: the figures are compared there whatever the runs were; these say whether comparing them
means anything."""

from __future__ import annotations

from flops_callbacks import units
from flops_callbacks.reporting.compare import percent_text, relative
from flops_callbacks.reporting.profile_file import SavedProfile

__all__ = ["setup_note", "varying_note", "work_note"]


def work_note(a: SavedProfile, b: SavedProfile) -> str | None:
    """What says the runs did different work (another model or batch), so that their times are not
    comparable; None when their flops per step are the same, or when their params and batch sizes are and
    either run's batches vary from step to step (its flops then follow each batch's lengths).

    Args:
        a: the first run.
        b: the second run.
    """
    pa, pb = a.result.profile, b.result.profile
    if (pa.fwd_flops, pa.bwd_flops, pa.recompute_flops) == (pb.fwd_flops, pb.bwd_flops, pb.recompute_flops):
        return None
    size = a.batch_size(), b.batch_size()
    if pa.params == pb.params and size[0] == size[1] and (a.varies() or b.varies()):
        return None  # one configuration whose batches vary: each one's flops follow its lengths
    flops = f"{units.number_to_string(pa.hardware_flops)} -> {units.number_to_string(pb.hardware_flops)}"
    params = f"params {units.params_to_string(pa.params)} -> {units.params_to_string(pb.params)}"
    samples = "samples per device {} -> {}".format(*("n/a" if n is None else n for n in size))
    return (
        f"the runs did different work: fwd+bwd+recompute flops per step {flops} "
        f"({percent_text(relative(pa.hardware_flops, pb.hardware_flops))}; {params}, {samples}): "
        "another model or another batch, so their times are not comparable"
    )


# what a difference of setup does to the figures, where it is not plain
_SETUP_EFFECT = {
    "data-parallel size": " (samples and tokens per second count every replica)",
    "peak FLOPS": " (MFU and HFU are over each run's own)",
    "model flops": " (flops_per_sec and MFU count different work: hardware_flops_per_sec compares)",
}


def setup_note(a: SavedProfile, b: SavedProfile) -> str | None:
    """What says the runs ran on different setups (world or data-parallel size, device type, compute dtype,
    peak FLOPS, model flops with the padding apart or not: :meth:`~.profile_file.SavedProfile.setup`),
    each A's -> B's; None when they did not. Peaks that differ are named however close: a given one was
    meant, a measured one moves MFU by its own ratio.

    Args:
        a: the first run.
        b: the second run.
    """
    sa, sb = a.setup(), b.setup()
    effect = dict(_SETUP_EFFECT)
    if all(s.result.peak is not None and s.result.peak.kind == "measured" for s in (a, b)):
        effect["peak FLOPS"] = " (each run measured its own: MFU and HFU are over each run's own)"
    found = [f"{k} {sa[k]} -> {sb[k]}{effect.get(k, '')}" for k in sa if k in sb and sa[k] != sb[k]]
    return f"the runs ran on different setups: {'; '.join(found)}" if found else None


def varying_note(a: SavedProfile, b: SavedProfile) -> str | None:
    """What says that a run's batches vary in length, so that its flops, MACs and bytes are one batch's (the
    counting step's); None when neither run's do.

    Args:
        a: the first run.
        b: the second run.
    """
    varying = [label for label, saved in (("A", a), ("B", b)) if saved.varies()]
    if not varying:
        return None
    whose = "A's and B's batches vary" if len(varying) == 2 else f"{varying[0]}'s batches vary"
    return (
        f"{whose} in length (dynamic padding, packing): flops, MACs and bytes are each run's counting step's "
        "one batch's, not comparable; the rates (flops_per_sec, mfu) and params are"
    )
