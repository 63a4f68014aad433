"""DeepSpeed's number formatting: ``6.28 TFLOPS``, ``76.67 ms``, ``336.23 M`` params, ``6.74 B``."""

from __future__ import annotations

_SCALES = (
    (1e15, "P"),
    (1e12, "T"),
    (1e9, "G"),
    (1e6, "M"),
    (1e3, "K"),
    (1.0, ""),
    (1e-3, "m"),
    (1e-6, "u"),
)


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``num`` scaled to the largest unit that keeps it >= 1 (or to ``units``), as DeepSpeed prints."""
    if units is None:
        magnitude, units = next(((scale, unit) for scale, unit in _SCALES if abs(num) >= scale), _SCALES[-1])
        if num == 0:
            magnitude, units = 1.0, ""
    else:
        magnitude = dict((unit, scale) for scale, unit in _SCALES)[units]
    return f"{round(num / magnitude, precision):g} {units}"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """Parameter counts say B for billions, as DeepSpeed and model cards do."""
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"
