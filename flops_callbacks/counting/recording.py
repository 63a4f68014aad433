"""What a trace records while it runs: running sums per context, spans to time, and coverage tallies.

The hot path adds each counted op to one int list, not to a :class:`~flops_callbacks.profile.Counts`
(a dataclass update costs several times a list update, on every op). The list's layout is read here
from ``Counts``' fields, once: slot ``i`` holds field ``i``, so a list becomes ``Counts(*sums)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from flops_callbacks.counting.registry import OpCount
from flops_callbacks.phase_names import PROFILE_PASSES
from flops_callbacks.profile import Counts

__all__ = [
    "as_counts",
    "BWD",
    "CALLS",
    "Site",
    "FWD",
    "plus",
    "REC",
    "Recording",
    "SAVED",
    "SLOTS",
    "Span",
    "Sums",
    "total",
]

FWD, BWD, REC = 0, 1, 2  # phases: forward, backward, recompute inside the backward
SLOTS = tuple(f.name for f in fields(Counts))
_FLOPS = tuple(SLOTS.index(f"{phase}_flops") for phase in PROFILE_PASSES)
_MACS = tuple(SLOTS.index(f"{phase}_macs") for phase in PROFILE_PASSES)
_BYTES = tuple(SLOTS.index(f"{phase}_bytes") for phase in PROFILE_PASSES)
SAVED = SLOTS.index("saved_bytes")  # bytes saved for the backward by the forward
CALLS = SLOTS.index("calls")  # forward calls of a functional that did flops
_REC_FLOPS, _REC_MACS = _FLOPS[REC], _MACS[REC]

Sums = list[int]  # one slot per field of Counts, in its order


def plus(a: Sums | None, b: Sums) -> Sums:
    """Slotwise sum as a new list (sum lists are shared between modules, never changed in place).

    Args:
        a: the sums so far, or None for none.
        b: the sums to add.
    """
    return b if a is None else [x + y for x, y in zip(a, b, strict=True)]


def total(parts: Any) -> Sums:
    """The slotwise sum of ``parts`` (zeros when there are none).

    Args:
        parts: the sum lists to add.
    """
    found: Sums = [0] * len(SLOTS)
    for part in parts:
        found = plus(found, part)
    return found


def as_counts(sums: Sums, **override: int) -> dict[str, int]:
    """``sums`` as ``Counts`` keyword arguments (``override`` replacing some).

    Args:
        sums: one slot per field of ``Counts``.
        **override: fields whose values replace the sums'.
    """
    return {**dict(zip(SLOTS, sums, strict=True)), **override}


class Site:
    """Where work goes: the modules on the stack (each once) and the functional being run.

    An op adds to its context only, one list update whatever the stack depth; the profile spreads
    each context's sums over its modules once. Contexts are interned, so identity is equality.

    Args:
        names: the modules on the stack, each once, outermost first.
        functional: the functional being run, or None.
    """

    __slots__ = ("names", "functional", "sums")

    def __init__(self, names: tuple[str, ...], functional: str | None) -> None:
        self.names = names  # () is outside the model's modules
        self.functional = functional
        self.sums: dict[str, Sums] = {}  # by functional (an op's own name where none was named)

    def sums_of(self, functional: str) -> Sums:
        """The sums of ``functional`` here, made (zeros) on its first op.

        Args:
            functional: the functional's name.
        """
        sums = self.sums.get(functional)
        if sums is None:
            sums = self.sums[functional] = [0] * len(SLOTS)
        return sums

    def add(self, phase: int, functional: str, count: OpCount, moved: int) -> None:
        """One counted op: its flops, MACs and bytes moved.

        Args:
            phase: the pass (``FWD``, ``BWD`` or ``REC``).
            functional: the functional the op ran in.
            count: the op's flops and MACs.
            moved: the op's bytes moved.
        """
        sums = self.sums_of(functional)
        sums[_FLOPS[phase]] += count.flops
        sums[_MACS[phase]] += count.macs
        sums[_BYTES[phase]] += moved
        if count.recompute_flops:
            sums[_REC_FLOPS] += count.recompute_flops
            sums[_REC_MACS] += count.recompute_macs

    def add_saved(self, functional: str, saved: int) -> None:
        """A tensor the forward saved for the backward.

        Args:
            functional: the functional that saved it.
            saved: its bytes.
        """
        self.sums_of(functional)[SAVED] += saved

    def add_bytes(self, phase: int, functional: str, moved: int) -> None:
        """One op without arithmetic (a copy, a gather) or without a formula: bytes only.

        Args:
            phase: the pass (``FWD``, ``BWD`` or ``REC``).
            functional: the functional the op ran in.
            moved: the op's bytes moved.
        """
        self.sums_of(functional)[_BYTES[phase]] += moved


Span = tuple[Any, Any]  # (start, end) clock marks


@dataclass(slots=True)
class Recording:
    """Everything counted and marked since a reset; turned into a profile by ``build_profile``."""

    module_calls: dict[str, int]  # forward calls of each profiled module (recomputes left out)
    contexts: dict[tuple[str, ...], dict[str | None, Site]] = field(default_factory=dict)
    counted_calls: int = 0  # op calls with a formula
    macs_by_dtype: dict[torch.dtype, int] = field(default_factory=dict)  # matmul-like MACs by output dtype
    free_calls: int = 0  # op calls without arithmetic
    uncounted: dict[str, list[Span]] = field(default_factory=dict)  # each call of each op without a formula
    # (module name, start, end, recompute) of every module call
    module_spans: list[tuple[str, Any, Any, bool]] = field(default_factory=list)
    top_spans: list[Span] = field(default_factory=list)  # calls of the outermost module: the forward
    bwd_op_spans: list[tuple[Site, Any, Any]] = field(default_factory=list)
    bwd_spans: list[Span] = field(default_factory=list)  # each backward pass, first op to its end
