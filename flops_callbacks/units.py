"""Numbers written exactly as DeepSpeed's flops profiler writes them (``6.28 TFLOPS``, ``76.67 ms``).

Scripts parse these strings, so every helper returns what DeepSpeed 0.19.8's helper of the same name
returns, byte for byte: T is the largest prefix (``2500 TFLOPS``, never ``2.5 PFLOPS``), zero has no
prefix, anything below 1 goes to ``m`` or ``u``. Written here rather than imported: DeepSpeed is not a
dependency. The one difference: an unknown ``units`` is a ``ValueError`` instead of being printed
unscaled.
"""

from __future__ import annotations

__all__ = [
    "bytes_to_string",
    "DEFAULT_PRECISION",
    "duration_to_string",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "percent",
    "quantity_to_string",
]

DEFAULT_PRECISION = 2

# DeepSpeed's prefixes, largest first; "" is 1 (zero and numbers in [1, 1000) use it).
_SCALES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def _auto_units(num: float) -> str:
    """The largest prefix that keeps ``num`` >= 1; zero takes none, and negatives ``u`` (as DeepSpeed)."""
    if num == 0:
        return ""
    return next((units for units, scale in _SCALES.items() if num >= scale), "u")


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` with a prefix and a space: ``'1.34 K'``, ``'999 '``, ``'0 '``; ``units`` forces a prefix.

    Args:
        num: the number.
        units: the prefix to use (``'G'``, ``''``, ...); None: the one that fits.
        precision: the digits after the point.
    """
    if units is None:
        units = _auto_units(num)
    elif units not in _SCALES:
        raise ValueError(f"units must be None or one of {tuple(_SCALES)}, got {units!r}")
    return f"{round(num / _SCALES[units], precision):g} {units}"


_SI = ("J", "W")  # the units written with SI's prefixes


def quantity_to_string(
    num: float, symbol: str, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``num`` with a prefix and a unit's symbol: ``'412.5 J'``, ``'305.12 W'``, ``'6.28 TFLOPS'``.

    Args:
        num: the number.
        symbol: the unit's symbol (``'J'``, ``'W'``, ``'FLOPS'``).
        units: the prefix to use (``'G'``, ``''``, ...); None: the one that fits.
        precision: the digits after the point.
    """
    text = number_to_string(num, units, precision)
    if symbol in _SI and text.endswith(" K"):  # kW, kJ: an SI unit's kilo (a count keeps DeepSpeed's K)
        text = text[:-1] + "k"
    return f"{text}{symbol}"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate in flops per second, ``'6.28 TFLOPS'`` (counts use number_to_string); arguments as its."""
    return quantity_to_string(flops, "FLOPS", units, precision)


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameter counts say B for billions, as model cards do, and carry no trailing space: ``'6.74 B'``.

    Args:
        params_num: the count.
        units: the prefix to use (``'B'`` for billions); None: the one that fits.
        precision: the digits after the point.
    """
    if units == "B":
        units = "G"
    return number_to_string(params_num, units, precision).replace("G", "B").strip()


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Multiply-accumulates, ``'336.23 MMACs'``; the arguments as :func:`number_to_string`'s."""
    return quantity_to_string(macs, "MACs", units, precision)


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Seconds: ``'76.67 ms'``, ``'34.09 us'``.

    Args:
        duration: the seconds.
        units: the prefix to use (``'m'``, ``'u'``, ...); None: the one that fits.
        precision: the digits after the point.
    """
    return quantity_to_string(duration, "s", units, precision)


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Bytes in powers of 1000, ``'1.5 GB'``; the arguments as :func:`number_to_string`'s."""
    return quantity_to_string(b, "B", units, precision)


def percent(part: float, whole: float) -> str:
    """``part`` as a share of ``whole``, as DeepSpeed's module lines print it: ``'33.33%'``, ``'100%'``;
    ``'0%'`` of nothing.

    Args:
        part: the share.
        whole: what it is a share of.
    """
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}%"
