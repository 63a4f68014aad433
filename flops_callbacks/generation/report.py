"""The text report and the picture of a profiled generation: a head per phase (prefill; decode per
token) whose every rate is printed with the numbers it divides, so that MFU and MBU can be checked by
hand, then the module trees of the prefill and of the middle decode step in the training report's layout
(:mod:`~flops_callbacks.reporting.profile_sections`), and the coverage.
"""

from __future__ import annotations

from collections.abc import Callable

from flops_callbacks import metrics as names
from flops_callbacks.generation.result import GenerationResult
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.picture import render_html
from flops_callbacks.reporting.profile_sections import (
    render_aggregated,
    render_coverage,
    render_detailed,
    render_roofline,
)
from flops_callbacks.roofline import as_data
from flops_callbacks.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    number_to_string,
    quantity_to_string,
)

__all__ = ["GENERATION_TITLE", "generation_picture", "generation_head", "render_generation"]

GENERATION_TITLE = "flops_callbacks Generation Profile"
_WIDTH = 86


def _rule(title: str) -> str:
    return f"{' ' + title + ' ':-^{_WIDTH}}"


def _row(label: str, value: str) -> str:
    return f"{label + ': ':<44}{value}"


def _fraction(value: float) -> str:
    return f"{100 * value:.3g}%"


def _rate_rows(result: GenerationResult, phase: str) -> list[str]:
    """MFU and MBU of a phase, each with the three numbers it is the quotient of (absent peaks: why)."""
    m = result.metrics()
    if phase == "prefill":
        flops, moved, seconds = names.PREFILL_FLOPS, names.PREFILL_BYTES, names.PREFILL_LATENCY
        mfu, mbu, latency = names.PREFILL_MFU, names.PREFILL_MBU, "prefill latency"
    else:
        flops, moved, seconds = (
            names.DECODE_FLOPS_PER_TOKEN,
            names.DECODE_BYTES_PER_TOKEN,
            names.DECODE_LATENCY_PER_TOKEN,
        )
        mfu, mbu, latency = names.DECODE_MFU, names.DECODE_MBU, "latency"
    rows = []
    if flops in m and seconds in m and m[seconds] > 0:
        rows.append(_row("FLOPS achieved", flops_to_string(m[flops] / m[seconds])))
        rows.append(_row("bytes/s achieved", bytes_to_string(m[moved] / m[seconds]) + "/s"))
    if mfu in m and result.peak is not None:
        rows.append(
            _row(
                f"MFU = flops / {latency} / peak FLOPS",
                f"{number_to_string(m[flops])}flops / {duration_to_string(m[seconds])} / "
                f"{flops_to_string(result.peak.flops)} = {_fraction(m[mfu])}",
            )
        )
    if mbu in m and result.bandwidth is not None:
        rows.append(
            _row(
                f"MBU = bytes / {latency} / peak bandwidth",
                f"{bytes_to_string(m[moved])} / {duration_to_string(m[seconds])} / "
                f"{bytes_to_string(result.bandwidth.bytes_per_sec)}/s = {_fraction(m[mbu])}",
            )
        )
    roof = result.rooflines().get(phase)
    if roof is not None:
        intensity = f"{roof.intensity:.3g} flops/B" if roof.intensity is not None else "no bytes"
        rows.append(_row("roofline", f"{intensity}, {roof.verdict()}"))
    return ["    " + row for row in rows]


def generation_head(result: GenerationResult) -> str:
    """The report's head: the run and each phase's figures."""
    m = result.metrics()
    runs = len(result.runs)
    lines = [
        _rule(GENERATION_TITLE),
        _row("device", f"{result.device}, compute dtype {result.compute_dtype or 'unknown'}"),
        _row("model mode", f"{result.mode} (as served; every module's own mode given back after)"),
    ]
    if result.batch_size is not None:
        lines.append(_row("batch size (sequences)", str(result.batch_size)))
    if result.prompt_tokens is not None:
        prompt = f"{result.prompt_tokens} per sequence"
        if result.padding_tokens and result.batch_size:
            positions = result.prompt_tokens * result.batch_size
            prompt += f", {result.padding_tokens} of {positions} positions padding"
        lines.append(_row("prompt tokens", prompt))
    timed = result.runs[0] if result.runs else None  # its steps: the counting may have failed
    decode_steps = (
        (len(timed.steps) - timed.prefill_steps) if timed else (len(result.work) - result.prefill_steps)
    )
    new_tokens = f"{result.new_tokens} (1 from the prefill, {decode_steps} from decode steps)"
    lines += [
        _row("new tokens per sequence", new_tokens),
        _row("latencies from", f"{runs} timed run(s) after {result.warm_up} warm-up(s): medians"),
        _row("flops and bytes from", "a counting run apart (op by op; the decode's: the mean of its steps)"),
    ]
    peak, bandwidth = result.peak, result.bandwidth
    peak_text = (
        f"{flops_to_string(peak.flops)} ({peak.source})" if peak else f"unknown ({result.no_peak_reason})"
    )
    lines.append(_row("peak FLOPS", peak_text))
    bandwidth_text = (
        f"{bytes_to_string(bandwidth.bytes_per_sec)}/s ({bandwidth.source})"
        if bandwidth
        else f"unknown ({result.no_bandwidth_reason})"
    )
    lines.append(_row("peak bandwidth", bandwidth_text))
    if result.counting_failure:
        lines.append(_row("NOT COUNTED", result.counting_failure))
    chunks = f", in {result.prefill_steps} chunks" if result.prefill_steps > 1 else ""
    lines += ["", f"Prefill (the prompt's forward{chunks}):"]
    if names.PREFILL_FLOPS in m:
        prefill = result.prefill_work
        macs = number_to_string(prefill.macs) if prefill is not None else "n/a"
        lines.append("    " + _row("flops", f"{number_to_string(m[names.PREFILL_FLOPS])} ({macs}MACs)"))
        lines.append("    " + _row("bytes moved", bytes_to_string(m[names.PREFILL_BYTES])))
    if names.PREFILL_LATENCY in m:
        lines.append("    " + _row("latency (the forward)", duration_to_string(m[names.PREFILL_LATENCY])))
    if names.TIME_TO_FIRST_TOKEN in m:
        lines.append("    " + _row("time to first token", duration_to_string(m[names.TIME_TO_FIRST_TOKEN])))
    lines += _rate_rows(result, "prefill")
    lines += ["", "Decode, per token (one decode step: a token for each sequence):"]
    if not decode_steps and not result.token_gaps:
        lines.append("    no decode step (one new token: the prefill's)")
    if names.DECODE_FLOPS_PER_TOKEN in m:
        lines.append("    " + _row("flops", number_to_string(m[names.DECODE_FLOPS_PER_TOKEN])))
        moved = bytes_to_string(m[names.DECODE_BYTES_PER_TOKEN])
        lines.append("    " + _row("bytes moved (weights, KV cache, activations)", moved))
    if names.DECODE_LATENCY_PER_TOKEN in m:
        lines.append(
            "    "
            + _row(
                "latency (inter-token)",
                f"median {duration_to_string(m[names.DECODE_LATENCY_PER_TOKEN])}, "
                f"p90 {duration_to_string(m[names.DECODE_LATENCY_P90])} over {len(result.token_gaps)} gaps",
            )
        )
    if names.DECODE_FORWARD_LATENCY in m:
        forward = duration_to_string(m[names.DECODE_FORWARD_LATENCY])
        lines.append("    " + _row("the forward alone", f"median {forward}"))
    lines += _rate_rows(result, "decode")
    lines.append("")
    if names.GENERATION_LATENCY in m:
        lines.append(_row("generation latency", duration_to_string(m[names.GENERATION_LATENCY])))
    if names.GENERATION_TOKENS_PER_SEC in m:
        lines.append(_row("output tokens/s (all sequences)", f"{m[names.GENERATION_TOKENS_PER_SEC]:.2f}"))
    if names.KV_CACHE_BYTES in m:
        lines.append(_row("KV cache at the end", bytes_to_string(m[names.KV_CACHE_BYTES])))
    lines += _energy_rows(result)
    return "\n".join(lines)


def _energy_rows(result: GenerationResult) -> list[str]:
    """The timed runs' energy: the mean power, per new token, and each phase's where it spans enough of the
    counter's resolution (else why not); one row saying why where no counter was read."""
    spans, m = result.energy(), result.metrics()
    if not spans:
        return [_row("energy", f"n/a: {result.no_energy}")]
    whole = spans["run"]
    rows = [
        _row("mean power (timed runs)", quantity_to_string(m[names.GENERATION_POWER], "W")),
    ]
    if names.GENERATION_ENERGY_PER_TOKEN in m:
        per_token = quantity_to_string(m[names.GENERATION_ENERGY_PER_TOKEN], "J")
        rows.append(
            _row(
                "energy per new token (all sequences)",
                f"{per_token}; {m[names.GENERATION_TOKENS_PER_JOULE]:.2f} tokens/J",
            )
        )
    for phase, name, label in (
        ("prefill", names.PREFILL_ENERGY, "prefill energy (start -> first token)"),
        ("decode", names.DECODE_ENERGY_PER_TOKEN, "decode energy per token (a step)"),
    ):
        why = spans[phase].note(f"the {phase}") or "no step"
        rows.append(_row(label, quantity_to_string(m[name], "J") if name in m else f"n/a: {why}"))
    if not whole.long_enough:
        rows.append(_row("energy in doubt", whole.note("the timed runs")))
    counter = f"{whole.source}, resolution {duration_to_string(whole.resolution)}"
    head = f"Energy (the device's own counter: {counter}; host, network, cooling left out):"
    return ["", head, *("    " + row for row in rows)]


def _tree(
    title: str,
    result: GenerationResult,
    phase: str,
    profile: Profile,
    module_depth: int,
    detailed: bool,
    top_modules: int = 1,
) -> list[str]:
    parts = [_rule(title)]
    rooflines = result.module_rooflines(phase)
    if rooflines and result.peak is not None and result.bandwidth is not None:
        roofs = (
            f"peak {flops_to_string(result.peak.flops)}, peak bandwidth "
            f"{bytes_to_string(result.bandwidth.bytes_per_sec)}/s: ridge at "
            f"{result.peak.flops / result.bandwidth.bytes_per_sec:.3g} flops/B"
        )
        parts.append(render_roofline(profile, rooflines, roofs))
    parts.append(render_aggregated(profile, module_depth, top_modules))
    if detailed:
        parts.append(render_detailed(profile, module_depth))
    return parts


def render_generation(
    result: GenerationResult, module_depth: int = -1, detailed: bool = True, top_modules: int = 1
) -> str:
    """The whole report: the head, then each phase's module tree (``detailed``; its aggregated profile
    ``top_modules`` per depth) and the coverage."""
    parts = [generation_head(result)]
    if result.prefill is not None or result.decode is not None:
        parts.append(
            f"Module latencies below: {result.module_latencies or 'unknown'}, each tree's of its own step. "
            "The phases' latencies above come from the timed runs; flops and bytes below are the counting "
            "run's."
        )
    if result.prefill is not None:
        chunk = f" (its first chunk of {result.prefill_steps})" if result.prefill_steps > 1 else ""
        parts += _tree(
            f"Prefill{chunk}", result, "prefill", result.prefill, module_depth, detailed, top_modules
        )
    if result.decode is not None:
        shown = (result.decode_shown or 0) + 1  # counted from 1, as the steps are said
        step = f"decode step {shown} of {result.decode_work.steps if result.decode_work else 0}"
        title = f"Decode ({step}: the cache at mid-length)"
        parts += _tree(title, result, "decode", result.decode, module_depth, detailed, top_modules)
        parts.append(render_coverage(result.decode, "generate()'s own between model calls: choosing tokens"))
    parts.append("-" * _WIDTH)
    return "\n\n".join(parts)


def generation_picture(result: GenerationResult) -> str:
    """The middle decode step's module tree as the HTML picture (the prefill's if no decode step ran),
    with each phase's headline figures above it."""
    profile = result.decode or result.prefill
    if profile is None:
        raise ValueError("no module tree to draw: the counting run counted no step")
    headline = [(label.strip(), value) for label, value in _headline_pairs(result)]
    headline.append(("module latencies from", result.module_latencies or "unknown"))
    phase = "a decode step (the cache at mid-length)" if result.decode is not None else "the prefill"
    rooflines = result.module_rooflines("decode" if result.decode is not None else "prefill")
    peak, bandwidth = result.peak, result.bandwidth
    roofline = (
        {
            "peak_flops": peak.flops,
            "peak_bandwidth": bandwidth.bytes_per_sec,
            "peak_source": peak.source,
            "bandwidth_source": bandwidth.source,
            "modules": as_data(rooflines),
        }
        if rooflines and peak is not None and bandwidth is not None
        else None
    )
    return render_html(
        profile,
        title=f"flops_callbacks generation profile: {phase}",
        headline=headline,
        roofline=roofline,
        no_roofline="no roofline per module (both peaks and the module-timing run's latencies are needed); "
        "each phase's verdict is in the summary above",
    )


def _headline_pairs(result: GenerationResult) -> list[tuple[str, str]]:
    m = result.metrics()
    shown: dict[str, Callable[[float], str]] = {
        names.PREFILL_FLOPS: number_to_string,
        names.PREFILL_LATENCY: duration_to_string,
        names.TIME_TO_FIRST_TOKEN: duration_to_string,
        names.PREFILL_MFU: _fraction,
        names.DECODE_FLOPS_PER_TOKEN: number_to_string,
        names.DECODE_BYTES_PER_TOKEN: bytes_to_string,
        names.DECODE_LATENCY_PER_TOKEN: duration_to_string,
        names.DECODE_MBU: _fraction,
        names.GENERATION_TOKENS_PER_SEC: lambda v: f"{v:.2f}",
        names.GENERATION_ENERGY_PER_TOKEN: lambda v: quantity_to_string(v, "J"),
        names.GENERATION_POWER: lambda v: quantity_to_string(v, "W"),
        names.KV_CACHE_BYTES: bytes_to_string,
    }
    pairs = [
        (name.removeprefix(names.GENERATION_PREFIX).replace("_", " "), fmt(m[name]))
        for name, fmt in shown.items()
        if name in m
    ]
    pairs += [(f"{phase} roofline", r.verdict()) for phase, r in result.rooflines().items()]
    return pairs
