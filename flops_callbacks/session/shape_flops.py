"""Flops of a micro-batch from its shapes: a table of the shape signatures that were counted, and an
exact predictor fitted on them and verified by one more counted signature.

Why: with dynamic padding ("pad to the longest" collators) nearly every batch has other shapes, and
counting a batch needs the counting engine on its step, which makes that step useless for timing.
A model's op counts are polynomials in the dimensions of its inputs (a linear layer: ``B*L*d*d``,
attention: ``B*L*L*d``), so once a few shapes are counted the others follow exactly, with no step
instrumented. Nothing is assumed: the polynomial's coefficients are solved exactly (``Fraction``)
from counted points and the fit is trusted only when it reproduces at least one more counted point
(a model whose counts are not such a polynomial, e.g. one that pads internally to a multiple of 8,
fails the check and its shapes keep being counted). Why not a replay under ``FakeTensorMode`` /
``meta``: the training step (forward, loss, backward) belongs to the framework and the user's code
and cannot be re-run after it, and a replay of only ``model(batch)`` would miss the loss and the
backward that the counting engine sees.

Signatures of one *family* (same tensor count, ranks and dtypes) share a predictor. Its variables are
the signature dims that vary among the family's counted points; dims that are equal to each other
at every counted point are one variable (every sequence length ``L`` of input_ids, attention_mask,
labels). Each count (fwd, bwd, recompute flops and MACs) is fitted on the monomials with degree at
most ``d`` in each variable, for ``d`` = 1, 2, 3 in turn: the first ``d`` whose system has full rank
and is consistent with one more point than it has unknowns is used. A prediction must be a whole,
non-negative number, else the signature is unpredictable.

A later micro-batch of an optimizer step (gradient accumulation) also adds its gradients to the
ones before it: the same shapes cost more there, so later micro-batches are a table of their own
(``later=True``), counted and fitted apart from first ones.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import product
from typing import Any, NamedTuple

from flops_callbacks.profile import hardware_flops, model_flops
from flops_callbacks.session.batch import Signature

__all__ = ["BatchCounts", "ShapeFlops"]

MAX_DEGREE = 3  # per variable: attention is quadratic in L; cubic leaves room, more needs many points


# The flops and MACs fields of flops_callbacks.profile.Counts, per pass, as a tuple (the fit solves for
# each slot).
class _PassCounts(NamedTuple):
    fwd_flops: int
    bwd_flops: int
    recompute_flops: int
    fwd_macs: int
    bwd_macs: int
    recompute_macs: int


class BatchCounts(_PassCounts):
    """What a micro-batch (or a sum of them) costs: the counts the window's rates are made of."""

    @classmethod
    def zero(cls) -> BatchCounts:
        return cls(*(0 for _ in cls._fields))

    @classmethod
    def of(cls, counts: Any) -> BatchCounts:
        """The counts of a :class:`~flops_callbacks.profile.Counts` (or a profile's model totals)."""
        return cls(*(getattr(counts, name) for name in cls._fields))

    def plus(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(*(a + b for a, b in zip(self, other, strict=True)))

    def minus(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(*(a - b for a, b in zip(self, other, strict=True)))

    model_flops = property(model_flops, doc="Forward + backward.")
    hardware_flops = property(hardware_flops, doc="Forward + backward + recompute.")


Key = tuple[bool, Signature]  # (a later micro-batch of its step, its shapes)


def _family(key: Key) -> tuple:
    return key[0], tuple((len(shape), dtype) for shape, dtype in key[1])


def _dims(key: Key) -> tuple[int, ...]:
    return tuple(d for shape, _ in key[1] for d in shape)


class _Fit:
    """A verified polynomial of one family: which dims are variables and each count's coefficients."""

    def __init__(
        self,
        constants: dict[int, int],
        groups: list[list[int]],
        exponents: list[tuple[int, ...]],
        coefficients: list[list[Fraction]],
    ) -> None:
        self.constants, self.groups = constants, groups
        self.exponents, self.coefficients = exponents, coefficients

    def predict(self, dims: tuple[int, ...]) -> BatchCounts | None:
        if any(dims[p] != v for p, v in self.constants.items()):
            return None  # a dim that never varied among the counted points: no variable for it
        values = []
        for group in self.groups:
            if any(dims[p] != dims[group[0]] for p in group):
                return None  # dims that were always equal are not: another kind of batch
            values.append(dims[group[0]])
        row = _monomials(values, self.exponents)
        counts = []
        for coefficients in self.coefficients:
            value = sum((c * m for c, m in zip(coefficients, row, strict=True)), Fraction(0))
            if value.denominator != 1 or value < 0:
                return None
            counts.append(int(value))
        return BatchCounts(*counts)


def _monomials(values: list[int], exponents: list[tuple[int, ...]]) -> list[int]:
    row = []
    for exps in exponents:
        term = 1
        for value, e in zip(values, exps, strict=True):
            term *= value**e
        row.append(term)
    return row


def _solve(rows: list[list[int]], rhs: list[list[int]]) -> list[list[Fraction]] | None:
    """Exact least-unknowns solve of ``rows @ x = rhs[j]`` for each count j: the coefficients when the
    system has full column rank, is consistent, and has at least one row beyond its rank (the check)."""
    n, k = len(rows), len(rows[0])
    if n <= k:
        return None
    m = [
        [Fraction(v) for v in row] + [Fraction(r[j]) for j in range(len(rhs[0]))]
        for row, r in zip(rows, rhs, strict=True)
    ]
    for col in range(k):  # Gauss-Jordan: column col's pivot goes to row col
        pivot = next((r for r in range(col, n) if m[r][col] != 0), None)
        if pivot is None:
            return None  # not full rank: the points do not pin the polynomial down yet
        m[col], m[pivot] = m[pivot], m[col]
        lead = m[col][col]
        m[col] = [v / lead for v in m[col]]
        for r in range(n):
            if r != col and m[r][col] != 0:
                factor = m[r][col]
                m[r] = [a - factor * b for a, b in zip(m[r], m[col], strict=True)]
    if any(v != 0 for r in range(k, n) for v in m[r][k:]):
        return None  # a point the polynomial does not reproduce
    return [[m[i][k + j] for i in range(k)] for j in range(len(rhs[0]))]


def _fit(points: list[tuple[tuple[int, ...], BatchCounts]]) -> _Fit | None:
    """The lowest-degree polynomial that reproduces every counted point, with one point to spare."""
    if len(points) < 3:
        return None
    first = points[0][0]
    varying = [p for p in range(len(first)) if any(dims[p] != first[p] for dims, _ in points)]
    constants = {p: first[p] for p in range(len(first)) if p not in varying}
    groups: list[list[int]] = []
    for p in varying:
        group = next((g for g in groups if all(dims[p] == dims[g[0]] for dims, _ in points)), None)
        if group is None:
            groups.append([p])
        else:
            group.append(p)
    for degree in range(1, MAX_DEGREE + 1):
        exponents = sorted(product(range(degree + 1), repeat=len(groups)), key=lambda e: (sum(e), e))
        if len(exponents) >= len(points):
            return None  # more unknowns than points to verify them: count more shapes first
        rows = [_monomials([dims[g[0]] for g in groups], exponents) for dims, _ in points]
        solved = _solve(rows, [list(counts) for _, counts in points])
        if solved is not None:
            return _Fit(constants, groups, exponents, solved)
    return None


class ShapeFlops:
    """The flops of each micro-batch shape signature: counted, or predicted by a verified fit (module
    doc). Lookups are memoized: after the first, a signature costs a dict lookup."""

    def __init__(self) -> None:
        self.counted: dict[Key, BatchCounts] = {}
        self._known: dict[Key, BatchCounts | None] = {}  # lookups so far (None: unpredictable)
        self._fits: dict[tuple, _Fit | None] = {}

    def record(self, signature: Signature, counts: BatchCounts, later: bool = False) -> None:
        """A counted micro-batch: its counts become a point of its family's fit."""
        key = (later, signature)
        self.counted[key] = counts
        self._fits.pop(_family(key), None)
        self._known = {s: c for s, c in self._known.items() if c is not None}  # unknowns may fit now

    def get(self, signature: Signature, later: bool = False) -> BatchCounts | None:
        """The counts of a micro-batch with this signature, or None when neither counted nor predictable."""
        key = (later, signature)
        try:
            return self._known[key]
        except KeyError:
            pass
        counts = self.counted.get(key)
        if counts is None:
            family = _family(key)
            if family not in self._fits:
                points = [(_dims(s), c) for s, c in self.counted.items() if _family(s) == family]
                self._fits[family] = _fit(points)
            fit = self._fits[family]
            counts = fit.predict(_dims(key)) if fit is not None else None
        self._known[key] = counts
        return counts

    def source(self, signature: Signature, later: bool = False) -> str:
        """How a signature's counts were obtained: "counted", "predicted" or "unknown"."""
        if (later, signature) in self.counted:
            return "counted"
        return "predicted" if self.get(signature, later) is not None else "unknown"
