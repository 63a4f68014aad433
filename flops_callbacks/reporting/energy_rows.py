"""The window's energy as people read it: the console summary's one line and the full report's rows.

Every number is read from the window's metrics dict (:mod:`flops_callbacks.session.energy_reads` computes
it once) and its spans; where no counter could be read, one line says why and nothing else is printed.
"""

from __future__ import annotations

from flops_callbacks import metrics as names
from flops_callbacks.session.result import WindowResult
from flops_callbacks.timing.energy_figures import LONG_ENOUGH_RESOLUTIONS, EnergySpan, job_spans
from flops_callbacks.units import duration_to_string, quantity_to_string

__all__ = ["counters_text", "energy_console_row", "energy_lines"]


def counters_text(spans: tuple[EnergySpan, ...]) -> str:
    """What was read, each counter once: ``'NVML total energy of 8 GPUs'``, ``'RAPL package+dram of 1 host'``.

    Args:
        spans: every rank's span.
    """
    by_source: dict[str, int] = {}
    for span in job_spans(spans):
        by_source[span.source] = by_source.get(span.source, 0) + 1
    parts = []
    for source, n in by_source.items():
        what = "host" if source.startswith("RAPL") else "GPU"
        parts.append(f"{source} of {n} {what}{'s' if n > 1 else ''}")
    return ", ".join(parts)


def _worst(spans: tuple[EnergySpan, ...]) -> EnergySpan:
    return max(job_spans(spans), key=lambda s: s.error)


def energy_console_row(result: WindowResult, metrics: dict[str, float]) -> str:
    """The console summary's energy line: per step, per token, tokens per joule and the mean power, what
    was read and how far off it may be; or why there is none.

    Args:
        result: the window's result.
        metrics: its metrics dict.
    """
    if names.ENERGY_PER_STEP not in metrics:
        return f"n/a: {result.no_energy_reason or 'no energy counter was read'}"
    text = f"{quantity_to_string(metrics[names.ENERGY_PER_STEP], 'J')} per step"
    if names.ENERGY_PER_TOKEN in metrics:
        text += f", {quantity_to_string(metrics[names.ENERGY_PER_TOKEN], 'J')} per token"
        text += f", {metrics[names.TOKENS_PER_JOULE]:.2f} tokens/J"
    elif names.ENERGY_PER_SAMPLE in metrics:
        text += f", {quantity_to_string(metrics[names.ENERGY_PER_SAMPLE], 'J')} per sample"
    text += f"; {quantity_to_string(metrics[names.POWER], 'W')} ({counters_text(result.energy)})"
    worst = _worst(result.energy)
    if not worst.long_enough:
        text += f"; off by up to {100 * worst.error:.0f}% (too short for the counter)"
    return text


def energy_lines(result: WindowResult, metrics: dict[str, float]) -> list[tuple[str, str]]:
    """The full report's energy rows: what was read, the figures and their formulas, and where the clean
    steps were too short for the counter's resolution; one row saying why where there is none.

    Args:
        result: the window's result.
        metrics: its metrics dict.
    """
    if names.ENERGY_PER_STEP not in metrics:
        return [("energy", f"n/a: {result.no_energy_reason or 'no energy counter was read'}")]
    spans = result.energy
    resolutions = sorted({s.resolution for s in job_spans(spans)})
    resolution = " / ".join(duration_to_string(r) for r in resolutions)
    lines = [
        (
            "energy counter (the devices' own: the host's other parts, network and cooling left out)",
            f"{counters_text(spans)}; resolution {resolution}",
        ),
        (
            "energy per step = the job's joules over the clean steps (each: previous step's end -> its end) "
            "/ their number",
            quantity_to_string(metrics[names.ENERGY_PER_STEP], "J"),
        ),
    ]
    if names.ENERGY_PER_SAMPLE in metrics:
        label = "energy per sample = energy per step / samples per step per GPU * dp_size"
        lines.append((label, quantity_to_string(metrics[names.ENERGY_PER_SAMPLE], "J")))
    if names.ENERGY_PER_TOKEN in metrics:
        lines += [
            (
                "energy per token = energy per step / tokens per step per GPU * dp_size",
                quantity_to_string(metrics[names.ENERGY_PER_TOKEN], "J"),
            ),
            ("tokens per joule = 1 / energy per token", f"{metrics[names.TOKENS_PER_JOULE]:.2f}"),
        ]
    lines.append(
        ("mean power = joules / seconds between the counter's reads (each counter's, summed)",
         quantity_to_string(metrics[names.POWER], "W")),
    )  # fmt: skip
    if len(spans) > 1:
        each = [s.joules / s.steps for s in spans]
        lines.append(
            (
                f"energy per step over the {len(spans)} ranks' counters, min .. max (ranks on one GPU or "
                "host read it once)",
                f"{quantity_to_string(min(each), 'J')} .. {quantity_to_string(max(each), 'J')}",
            )
        )
    beyond = _beyond_wall(result)
    if beyond:
        lines.append(beyond)
    worst = _worst(spans)
    if not worst.long_enough:
        lines.append(
            (
                f"energy in doubt (clean steps under {LONG_ENOUGH_RESOLUTIONS}x the counter's resolution)",
                worst.note("the clean steps"),
            )
        )
    return lines


def _beyond_wall(result: WindowResult) -> tuple[str, str] | None:
    """A row where the counter's spans hold a step of more seconds than the wall step (by over 5%): the
    profiler's votes and reads between the steps, which the wall step leaves out and the counter cannot
    (their joules are in the energy per step, at whatever power the devices drew meanwhile)."""
    clean = result.figures()
    wall = clean.sums["wall"] / len(clean.steps) if clean.steps else 0.0
    held = max((s.seconds / s.steps for s in job_spans(result.energy)), default=0.0)
    if wall <= 0 or held <= 1.05 * wall:
        return None
    return (
        "energy spans beyond the wall step (the profiler's votes and reads between steps: their joules are "
        "in the energy per step)",
        f"{held / wall:.2f}x: {duration_to_string(held)} a step, the wall step {duration_to_string(wall)}",
    )
