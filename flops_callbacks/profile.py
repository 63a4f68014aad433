"""The result of a profile: plain dataclasses, their JSON form, and aggregation by depth.

Flops are counted per pass: ``fwd`` (the forward), ``bwd`` (the real backward, measured op by op) and
``recompute`` (forwards re-run inside the backward by activation checkpointing). MACs count only
multiply-accumulate ops (matmul, conv, attention), so ``2 * macs`` is exactly the flops that
``torch.utils.flop_counter.FlopCounterMode`` reports; the rest of ``flops`` is elementwise work. Bytes
(``fwd_bytes`` ...) are the memory traffic the same ops imply (:mod:`flops_callbacks.counting.bytes_moved`);
``saved_bytes`` the activations the forward leaves for the backward (parameters excluded, each storage
once). Latencies are in seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from flops_callbacks.module_tree import parent_in

__all__ = ["Counts", "Coverage", "ModuleProfile", "Profile", "UncountedOp", "is_number"]


def is_number(value: object) -> bool:
    """A figure read back from a profile file is a finite int or float (a string would fail later, unnamed;
    a NaN would pass every comparison)."""
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass
class Counts:
    """Flops, MACs and bytes of one pass-split unit of work (a module, a functional, or code outside the
    model), and the bytes its forward saved for the backward."""

    # floating-point operations, per pass
    fwd_flops: int = 0
    bwd_flops: int = 0
    recompute_flops: int = 0
    # multiply-accumulates (matmul, conv, attention), per pass
    fwd_macs: int = 0
    bwd_macs: int = 0
    recompute_macs: int = 0
    # bytes the ops read and write, per pass, and the activations saved for the backward
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    recompute_bytes: int = 0
    saved_bytes: int = 0
    calls: int = 0  # forward calls (of a module; of a functional that did flops)

    model_flops = property(lambda self: model_flops(self), doc="Forward + backward (MFU's numerator).")
    hardware_flops = property(lambda self: hardware_flops(self), doc="With recompute (HFU's numerator).")


class PassFlops(Protocol):
    """Anything with flops per pass: a :class:`Counts`, a profile, a batch's counts."""

    @property
    def fwd_flops(self) -> int: ...
    @property
    def bwd_flops(self) -> int: ...
    @property
    def recompute_flops(self) -> int: ...


def model_flops(counts: PassFlops) -> int:
    """Forward + backward: the work the model needs (MFU's numerator).

    Args:
        counts: a profile, a module or counts with the per-pass flops.
    """
    return counts.fwd_flops + counts.bwd_flops


def hardware_flops(counts: PassFlops) -> int:
    """Forward + backward + recompute: the work the device did (HFU's numerator).

    Args:
        counts: a profile, a module or counts with the per-pass flops.
    """
    return counts.fwd_flops + counts.bwd_flops + counts.recompute_flops


@dataclass
class ModuleProfile(Counts):
    """One module, keyed by its qualified name ("" is the model). Totals include its children."""

    name: str = ""
    class_name: str = ""
    depth: int = 0
    # parameters the module holds (its children's included), all and trainable
    params: int = 0
    trainable_params: int = 0
    functionals: dict[str, Counts] = field(default_factory=dict)  # the module's work by functional
    # seconds, from the module-timing steps (or the counting pass, outside a window)
    fwd_latency: float = 0.0
    bwd_latency: float = 0.0
    recompute_latency: float = 0.0
    extra_repr: str = ""  # the module's own settings (``in_features=8, ...``), shown on its report line


@dataclass
class UncountedOp:
    """An op that ran and does arithmetic we have no formula for: never silently zero."""

    op: str
    calls: int
    seconds: float
    time_share: float  # of the profile's measured forward + backward time


@dataclass
class Coverage:
    """What the counted flops cover: op calls with a formula, without arithmetic, and the rest."""

    counted_calls: int = 0
    free_calls: int = 0
    uncounted: list[UncountedOp] = field(default_factory=list)


@dataclass
class Profile:
    """A profiled stretch of work on one model: every module, coverage, and the pass latencies.

    The totals (flops, MACs, parameters) are the model's own record, ``modules[""]``: read through
    the properties below, never stored twice. ``fwd_latency`` / ``bwd_latency`` are the passes'
    times, which the step layer may replace with its phase times.
    """

    fwd_latency: float
    bwd_latency: float
    device: str
    modules: dict[str, ModuleProfile]
    outside_model: Counts
    coverage: Coverage
    causal_attention: str = "full"

    @property
    def model(self) -> ModuleProfile:
        return self.modules[""]

    @property
    def fwd_flops(self) -> int:
        return self.model.fwd_flops

    @property
    def bwd_flops(self) -> int:
        return self.model.bwd_flops

    @property
    def recompute_flops(self) -> int:
        return self.model.recompute_flops

    @property
    def fwd_macs(self) -> int:
        return self.model.fwd_macs

    @property
    def bwd_macs(self) -> int:
        return self.model.bwd_macs

    @property
    def recompute_macs(self) -> int:
        return self.model.recompute_macs

    @property
    def fwd_bytes(self) -> int:
        return self.model.fwd_bytes

    @property
    def bwd_bytes(self) -> int:
        return self.model.bwd_bytes

    @property
    def recompute_bytes(self) -> int:
        return self.model.recompute_bytes

    @property
    def saved_bytes(self) -> int:
        return self.model.saved_bytes

    @property
    def params(self) -> int:
        return self.model.params

    @property
    def trainable_params(self) -> int:
        return self.model.trainable_params

    @property
    def model_flops(self) -> int:
        return self.model.model_flops

    @property
    def hardware_flops(self) -> int:
        return self.model.hardware_flops

    @property
    def max_depth(self) -> int:
        return max(m.depth for m in self.modules.values())

    def at_depth(self, depth: int) -> list[ModuleProfile]:
        """Modules at ``depth`` (0 is the model; -1 the deepest).

        Args:
            depth: the depth (0 is the model; -1 the deepest).
        """
        if depth < 0:
            depth = self.max_depth
        return [m for m in self.modules.values() if m.depth == depth]

    def aggregate_by_class(self, depth: int) -> dict[str, ModuleProfile]:
        """Modules at ``depth`` summed per class, as DeepSpeed's aggregated profile shows them.

        Args:
            depth: the depth (0 is the model; -1 the deepest).
        """
        merged: dict[str, ModuleProfile] = {}
        for m in self.at_depth(depth):
            acc = merged.setdefault(m.class_name, ModuleProfile(class_name=m.class_name, depth=m.depth))
            for name in (
                *_SUMMED,
                "params",
                "trainable_params",
                "fwd_latency",
                "bwd_latency",
                "recompute_latency",
            ):
                setattr(acc, name, getattr(acc, name) + getattr(m, name))
        return merged

    def children(self, name: str) -> list[ModuleProfile]:
        """Modules whose nearest profiled ancestor is ``name``, in registration order.

        Args:
            name: a module's qualified name ("" for the model).
        """
        modules = self.modules
        cached = self.__dict__.get("_children")  # not a field: JSON and equality never see it
        if cached is None or cached[0] is not modules:  # one pass, kept per modules dict
            index: dict[str, list[ModuleProfile]] = {}
            for m in modules.values():
                if m.name:
                    index.setdefault(parent_in(m.name, modules), []).append(m)
            cached = self.__dict__["_children"] = (modules, index)
        return list(cached[1].get(name, []))

    def own_latency(self, name: str, passes: Sequence[str] = ("fwd", "bwd")) -> float:
        """Module ``name``'s own seconds over ``passes`` (field prefixes: "fwd", "bwd", "recompute"): its
        latency less its children's, never below 0 (the children's hooks may overlap their parent's).

        Args:
            name: a module's qualified name ("" for the model).
            passes: the passes whose latencies are summed.
        """

        def seconds(m: ModuleProfile) -> float:
            return sum(getattr(m, f"{p}_latency") for p in passes)

        return max(seconds(self.modules[name]) - sum(seconds(c) for c in self.children(name)), 0.0)

    def to_dict(self) -> dict[str, Any]:
        """Everything, as JSON-ready plain data (derived totals included)."""
        totals = (*_COUNTED_TOTALS, "params", "trainable_params", "model_flops", "hardware_flops")
        return {**{name: getattr(self, name) for name in totals}, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile :meth:`to_dict` wrote (its derived totals, and keys other writers add to a module
        entry such as ``roofline``, are left: they are computed from the fields).

        Args:
            data: what :meth:`to_dict` returned, read back from JSON.
        """

        def counts(entry: dict[str, Any], kind: type[Counts] = Counts) -> Any:
            known = {f.name: f.type for f in fields(kind)}
            found = {k: v for k, v in entry.items() if k in known}
            for key, value in found.items():  # a count or a time as anything else would fail later, unnamed
                if known[key] in ("int", "float") and not is_number(value):
                    raise ValueError(f'a module\'s "{key}" is {json.dumps(value)}, expected a number')
            return kind(**found)

        modules = {}
        for name, entry in data["modules"].items():
            module = counts(entry, ModuleProfile)
            module.functionals = {f: counts(c) for f, c in entry["functionals"].items()}
            modules[name] = module
        coverage = data["coverage"]
        return cls(
            fwd_latency=data["fwd_latency"],
            bwd_latency=data["bwd_latency"],
            device=data["device"],
            modules=modules,
            outside_model=counts(data["outside_model"]),
            coverage=Coverage(
                counted_calls=coverage["counted_calls"],
                free_calls=coverage["free_calls"],
                uncounted=[UncountedOp(**u) for u in coverage["uncounted"]],
            ),
            causal_attention=data["causal_attention"],
        )


_SUMMED = tuple(f.name for f in fields(Counts))
_COUNTED_TOTALS = tuple(name for name in _SUMMED if name != "calls")
