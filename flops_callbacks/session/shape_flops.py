"""Flops of a micro-batch from its shapes: a table of the shape signatures that were counted, and an
exact predictor fitted on them, each counted signature checked by the others.

Why: with dynamic padding ("pad to the longest" collators) nearly every batch has other shapes, and
counting a batch needs the counting engine on its step, which makes that step useless for timing.
A model's op counts are polynomials in the dimensions of its inputs (a linear layer: ``B*L*d*d``,
attention: ``B*L*L*d``), so once a few shapes are counted the others follow exactly, with no step
instrumented. Nothing is assumed: the polynomial's coefficients are solved exactly (``Fraction``)
from counted points and the fit is trusted only when it reproduces at least one more counted point
(a model whose counts are not such a polynomial, e.g. one that pads internally to a multiple of 8,
fails the check and its shapes keep being counted). A model's counts are such a polynomial only between
the branches of its code (more layers above a length, local attention above a length), so a prediction
is made only inside the range of the counted points that verified it: a shape outside is counted
first, and the points on each side of a branch fit apart. Work that depends on the values (padding-free
layers, MoE routing) is found by a second count of a known shape (the window's check step: ``content``).
Points come from counted steps and from counts off the clock (:mod:`.off_clock`); a prediction spares a
fake count, and where none runs, a training step.

Signatures of one *family* (same tensor count, ranks and dtypes) share a predictor. Its variables are
the signature dims that vary among the family's counted points; dims that are equal to each other
at every counted point are one variable (every sequence length ``L`` of input_ids, attention_mask,
labels). Each count (fwd, bwd, recompute flops and MACs) is fitted on the monomials with degree at
most ``d`` in each variable, or of total degree at most ``d``, for ``d`` = 1, 2, 3, the smaller sets
first: the first whose system has full rank and is consistent with one more point than it has unknowns
is used, where every counted point is checked by the others (one spare point is not enough where the
others are degenerate: all of one batch size but one). A prediction must be a whole,
non-negative number, else the signature is unpredictable.

A later micro-batch of an optimizer step (gradient accumulation) also adds its gradients to the
ones before it: the same shapes cost more there, so later micro-batches are a table of their own
(``later=True``), counted and fitted apart from first ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import product
from typing import Any, NamedTuple

from flops_callbacks.session.batch import Signature
from flops_callbacks.user_warning import warn

__all__ = ["BatchCounts", "ContentFinding", "ShapeFlops", "extremes_first"]

MAX_DEGREE = 3  # of the fits' monomials: attention is quadratic in L, and a cubic leaves room


class _Slots(NamedTuple):
    fwd_flops: int
    bwd_flops: int
    recompute_flops: int
    fwd_macs: int
    bwd_macs: int
    recompute_macs: int
    model_fwd_flops: int
    model_bwd_flops: int


class BatchCounts(_Slots):
    """What a micro-batch (or a sum of them) costs: the counts the window's rates are made of (the fit
    solves for each slot). The pass counts are the hardware's, as the kernels ran (padding, masked-out
    attention and recompute included); the model slots are the model's work on the batch's real
    tokens, each sequence as if run alone (:mod:`.sequence_flops`): the passes' own for a batch that
    holds no padding or packing, as when they are not given."""

    def __new__(
        cls,
        fwd_flops: int,
        bwd_flops: int,
        recompute_flops: int,
        fwd_macs: int,
        bwd_macs: int,
        recompute_macs: int,
        model_fwd_flops: int | None = None,
        model_bwd_flops: int | None = None,
    ) -> BatchCounts:
        model_fwd = fwd_flops if model_fwd_flops is None else model_fwd_flops
        model_bwd = bwd_flops if model_bwd_flops is None else model_bwd_flops
        passes = (fwd_flops, bwd_flops, recompute_flops, fwd_macs, bwd_macs, recompute_macs)
        return super().__new__(cls, *passes, model_fwd, model_bwd)

    @classmethod
    def zero(cls) -> BatchCounts:
        return cls(0, 0, 0, 0, 0, 0)

    @classmethod
    def of(cls, counts: Any) -> BatchCounts:
        """The counts of a :class:`~flops_callbacks.profile.Counts` (or a profile's model totals): a
        batch as it ran, its model work its passes' own."""
        return cls(*(getattr(counts, name) for name in cls._fields[:6]))

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> BatchCounts:
        """Read back from JSON (a file without the model slots: the passes' own)."""
        return cls(**data)

    def with_model(self, fwd: int, bwd: int) -> BatchCounts:
        """These counts with the model's forward and backward work on the real tokens."""
        return self._replace(model_fwd_flops=fwd, model_bwd_flops=bwd)

    def plus(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(*(a + b for a, b in zip(self, other, strict=True)))

    def minus(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(*(a - b for a, b in zip(self, other, strict=True)))

    @property
    def model_flops(self) -> int:
        """The model's forward + backward on the real tokens (MFU's numerator)."""
        return self.model_fwd_flops + self.model_bwd_flops

    @property
    def hardware_flops(self) -> int:
        """Forward + backward + recompute as the kernels ran (HFU's numerator)."""
        return self.fwd_flops + self.bwd_flops + self.recompute_flops

    @property
    def run_flops(self) -> int:
        """Forward + backward as the kernels ran (recompute apart): what the shape table keys."""
        return self.fwd_flops + self.bwd_flops


Key = tuple[bool, Signature]  # (a later micro-batch of its step, its shapes)


def _family(key: Key) -> tuple:
    return key[0], tuple((len(shape), dtype) for shape, dtype in key[1])


def _dims(key: Key) -> tuple[int, ...]:
    return tuple(d for shape, _ in key[1] for d in shape)


class _Fit:
    """A verified polynomial of one family: which dims are variables, each count's coefficients, and the
    range (lowest .. highest) of each variable over the points that verified it."""

    def __init__(
        self,
        constants: dict[int, int],
        groups: list[list[int]],
        exponents: list[tuple[int, ...]],
        coefficients: list[list[Fraction]],
        ranges: list[tuple[int, int]],
    ) -> None:
        self.constants, self.groups = constants, groups
        self.exponents, self.coefficients, self.ranges = exponents, coefficients, ranges
        # each count's coefficients over one denominator: a prediction in integers (the meter makes one for
        # every new shape after the window, where Fraction sums cost a step's time)
        self._integers = []
        for column in coefficients:
            denominator = math.lcm(*(c.denominator for c in column))
            self._integers.append(([int(c * denominator) for c in column], denominator))

    def predict(self, dims: tuple[int, ...], beyond: bool = False) -> BatchCounts | None:
        """The counts at ``dims``; None outside the verified range (a longer sequence, a larger batch than
        any counted one may cross a branch of the model's code: it is counted first), unless ``beyond``."""
        if any(dims[p] != v for p, v in self.constants.items()):
            return None  # a dim that never varied among the counted points: no variable for it
        values = []
        for group, (low, high) in zip(self.groups, self.ranges, strict=True):
            if any(dims[p] != dims[group[0]] for p in group):
                return None  # dims that were always equal are not: another kind of batch
            if not beyond and not low <= dims[group[0]] <= high:
                return None
            values.append(dims[group[0]])
        row = _monomials(values, self.exponents)
        counts = []
        for numerators, denominator in self._integers:
            value, rest = divmod(sum(n * m for n, m in zip(numerators, row, strict=True)), denominator)
            if rest or value < 0:
                return None
            counts.append(value)
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
    """The polynomial of fewest unknowns that reproduces every counted point, each of them checked by the
    others (:func:`_each_checked`)."""
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
    for exponents in _exponent_sets(len(groups)):
        if len(exponents) >= len(points):
            return None  # more unknowns than points to verify them: count more shapes first
        rows = [_monomials([dims[g[0]] for g in groups], exponents) for dims, _ in points]
        solved = _solve(rows, [list(counts) for _, counts in points])
        if solved is not None and _each_checked(rows):
            values = [[dims[g[0]] for dims, _ in points] for g in groups]
            return _Fit(constants, groups, exponents, solved, [(min(v), max(v)) for v in values])
    return None


_PRIME = 2**61 - 1  # a Mersenne prime: the ranks of _each_checked are reckoned modulo it


def _each_checked(rows: list[list[int]]) -> bool:
    """Whether the points of ``rows`` (their monomials) pin the polynomial down with any one of them left
    out: then every point is a check of the others. One spare point is not enough where the others are
    degenerate: three full batches and the epoch's smaller last one fit ``a + b B + c L`` exactly, whatever
    ``B L`` term the three (one ``B``) cannot see. Ranks are reckoned modulo a prime (fast; a rank there is
    at most the rational one, so a yes is sure, and a rare no costs a count)."""
    return all(_full_rank(rows[:i] + rows[i + 1 :]) for i in range(len(rows)))


def _full_rank(rows: list[list[int]]) -> bool:
    """Whether ``rows`` have full column rank modulo :data:`_PRIME`."""
    m = [[v % _PRIME for v in row] for row in rows]
    for col in range(len(m[0])):
        pivot = next((i for i in range(col, len(m)) if m[i][col]), None)
        if pivot is None:
            return False
        m[col], m[pivot] = m[pivot], m[col]
        inverse = pow(m[col][col], _PRIME - 2, _PRIME)
        for i in range(col + 1, len(m)):
            if m[i][col]:
                factor = m[i][col] * inverse % _PRIME
                m[i] = [(a - factor * b) % _PRIME for a, b in zip(m[i], m[col], strict=True)]
    return True


def _exponent_sets(variables: int) -> list[list[tuple[int, ...]]]:
    """The monomials a fit of ``variables`` tries, the fewest unknowns first: for each degree ``d``, those
    of degree at most ``d`` in each variable (a batch size times an attention's length squared) and those
    of total degree at most ``d`` (an encoder-decoder's two lengths: their products stop at degree 2, 6
    unknowns where every exponent up to 2 is 9). A set holds the constant and every variable alone."""
    found: dict[tuple[tuple[int, ...], ...], None] = {}
    for degree in range(1, MAX_DEGREE + 1):
        each = list(product(range(degree + 1), repeat=variables))
        for chosen in (each, [e for e in each if sum(e) <= degree]):
            found[tuple(sorted(chosen, key=lambda e: (sum(e), e)))] = None
    return [list(exponents) for exponents in sorted(found, key=len)]


def _groups(everything: list[tuple[int, ...]]) -> list[list[int]]:
    """The variables of a set of dims tuples: the positions that vary, those always equal to each other
    as one."""
    first = everything[0]
    groups: list[list[int]] = []
    for p in range(len(first)):
        if all(dims[p] == first[p] for dims in everything):
            continue
        group = next((g for g in groups if all(dims[p] == dims[g[0]] for dims in everything)), None)
        if group is None:
            groups.append([p])
        else:
            group.append(p)
    return groups


def _along_one(points: list[tuple[int, BatchCounts]], value: int) -> BatchCounts | None:
    """A prediction at ``value`` from counted points that differ in one variable only: the smallest run
    of neighbouring points around ``value`` (at most a cubic's five) whose fit a spare point verifies.
    Runs, not all points, so that a branch of the model's code (other work above a length) splits the
    points into ranges, each fitted on its own."""
    ordered = sorted(points)
    below = [i for i, (v, _) in enumerate(ordered) if v < value]
    above = [i for i, (v, _) in enumerate(ordered) if v > value]
    if not below or not above:
        return None  # outside every counted range: counted first
    low, high = below[-1], above[0]
    for size in range(3, MAX_DEGREE + 3):
        for start in range(max(0, high - size + 1), min(low, len(ordered) - size) + 1):
            fit = _fit([((v,), c) for v, c in ordered[start : start + size]])
            counts = fit.predict((value,)) if fit is not None else None
            if counts is not None:
                return counts
    return None


def _predict(points: list[tuple[tuple[int, ...], BatchCounts]], dims: tuple[int, ...]) -> BatchCounts | None:
    """The counts at ``dims`` from a family's counted points (one fit of them all gave none), only inside a
    verified range: along one variable with the others as counted (:func:`_along_one`), else by a fit of
    the points that have one variable as asked (an encoder-decoder's batches of one size, its two lengths
    fitted: the epoch's smaller last batch makes the size a variable no fit of all pins down)."""
    groups = _groups([d for d, _ in points] + [dims])
    values = [[d[g[0]] for g in groups] for d, _ in points]
    want = [dims[g[0]] for g in groups]
    for k in range(len(groups)):
        line = [
            (v[k], c)
            for v, (_, c) in zip(values, points, strict=True)
            if all(v[j] == want[j] for j in range(len(groups)) if j != k)
        ]
        counts = _along_one(line, want[k])
        if counts is not None:
            return counts
    if len(groups) <= 2:
        return None  # with two variables, one as asked leaves a line: _along_one's
    for k in range(len(groups)):
        same = [point for v, point in zip(values, points, strict=True) if v[k] == want[k]]
        fit = _fit(same) if len(same) < len(points) else None
        counts = fit.predict(dims) if fit is not None else None
        if counts is not None:
            return counts
    return None


def extremes_first(values: Sequence[Any]) -> list[Any]:
    """Distinct ``values`` sorted, in the order that widens a fit's verified range fastest: the lowest,
    the highest, then the middle of each remaining gap in turn."""
    ordered = sorted(set(values))
    if len(ordered) <= 2:
        return ordered
    order, gaps = [ordered[0], ordered[-1]], [(0, len(ordered) - 1)]
    while gaps:
        low, high = gaps.pop(0)
        if high - low < 2:
            continue
        middle = (low + high) // 2
        order.append(ordered[middle])
        gaps += [(low, middle), (middle, high)]
    return order


class ContentFinding(NamedTuple):
    """A batch counted again did other work than the table said for its shapes: the model's flops depend
    on the batch's content (or on a mode it keeps), not on its shapes alone."""

    signature: Signature
    later: bool
    said: BatchCounts  # what the table held (counted before, or predicted)
    counted: BatchCounts
    how: str  # "counted" or "predicted": where ``said`` came from

    def ratios(self) -> dict[str, float]:
        """counted / said for each pass that did flops (fwd, bwd, recompute)."""
        passes = {"fwd": (self.said.fwd_flops, self.counted.fwd_flops)}
        passes |= {"bwd": (self.said.bwd_flops, self.counted.bwd_flops)}
        passes |= {"recompute": (self.said.recompute_flops, self.counted.recompute_flops)}
        return {name: new / old for name, (old, new) in passes.items() if old > 0}

    def text(self) -> str:
        ratios = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in self.ratios().items())
        shapes = [shape for shape, _ in self.signature]
        return f"a batch of shapes {shapes} did {ratios} the flops {self.how} for its shapes before"


class ShapeFlops:
    """The flops of each micro-batch shape signature: counted, or predicted inside a verified range
    (module doc), and what the window learns by counting a known shape again. Lookups are memoized: after
    the first, a signature costs a dict lookup."""

    def __init__(self) -> None:
        self.counted: dict[Key, BatchCounts] = {}  # the latest count of each signature
        # window step -> its counts, micro-batches counted, and what the table said of them before (None:
        # a shape it could not give)
        self.by_step: dict[int, tuple[BatchCounts, int, BatchCounts | None]] = {}
        self.checked: Key | None = None  # the first count compared with what the table held
        self.checked_step: int | None = None  # its window step
        self.content: ContentFinding | None = None  # the first count that differed from it
        self._known: dict[Key, BatchCounts | None] = {}  # lookups so far (None: unpredictable)
        self._beyond: dict[Key, BatchCounts | None] = {}  # lookups that may extrapolate
        # each family's polynomial over all its counted points (None: none fits them all), and the points
        self._fits: dict[tuple, tuple[_Fit | None, list[tuple[tuple[int, ...], BatchCounts]]]] = {}
        self.audited: dict[Key, BatchCounts] = {}  # after the window: the latest count of each signature
        self.correction = 1.0  # after the window: the latest count over the table's value, for the rest
        self.counted_on_steps: dict[Key, str] = {}  # shapes no fake count could give: why (the report's)

    def record(
        self, signature: Signature, counts: BatchCounts, later: bool = False, step: int | None = None
    ) -> None:
        """A counted micro-batch (of window step ``step``): its counts become a point of its family; a
        signature the table could already give is compared with it (the content check)."""
        key = (later, signature)
        said = self.get(signature, later)
        if said is not None:
            if self.checked is None:
                self.checked, self.checked_step = key, step
            if said != counts and self.content is None:
                how = "counted" if key in self.counted else "predicted"
                self.content = ContentFinding(signature, later, said, counts, how)
                warn(
                    f"flops_callbacks: the model's flops depend on the batch's content, not on its shapes "
                    f"alone: {self.content.text()}. The window counts every other step and the timed "
                    "steps' flops are estimated from their counted neighbours (the report says how sure).",
                )
        self.counted[key] = counts
        family = _family(key)  # its family's lookups and fit are stale; the other families' stand
        self._known = {k: v for k, v in self._known.items() if _family(k) != family}
        self._beyond = {k: v for k, v in self._beyond.items() if _family(k) != family}
        self._fits.pop(family, None)
        if step is not None:
            total, n, before = self.by_step.get(step, (BatchCounts.zero(), 0, BatchCounts.zero()))
            table = None if said is None or before is None else before.plus(said)
            self.by_step[step] = (total.plus(counts), n + 1, table)

    def get(self, signature: Signature, later: bool = False, beyond: bool = False) -> BatchCounts | None:
        """The counts of a micro-batch with this signature, or None when neither counted nor predictable
        inside the range its family's counted points verified; with ``beyond``, also outside it where one
        polynomial reproduces every counted point of the family, each checked by the others (after the
        window, where a count costs the run's time; the meter's audits check it)."""
        key = (later, signature)
        known = self._beyond if beyond else self._known
        try:
            return known[key]
        except KeyError:
            pass
        counts = self.counted.get(key)
        if counts is None:
            fit, points = self._family_fit(_family(key))
            dims = _dims(key)
            counts = fit.predict(dims, beyond) if fit is not None else None
            if counts is None and points:  # piecewise: each range between a model's branches on its own
                counts = _predict(points, dims)
        known[key] = counts
        return counts

    def _family_fit(self, family: tuple) -> tuple[_Fit | None, list[tuple[tuple[int, ...], BatchCounts]]]:
        """One polynomial over the family's every counted point (None: fewer than 3, or none fits), made
        once per count of the family: an exact fit over its points, tens of milliseconds with many."""
        if family not in self._fits:
            points = [(_dims(s), c) for s, c in self.counted.items() if _family(s) == family]
            self._fits[family] = (_fit(points) if len(points) >= 3 else None, points)
        return self._fits[family]

    def source(self, signature: Signature, later: bool = False) -> str:
        """How a signature's counts were obtained: "counted", "predicted", "extrapolated" or "unknown"."""
        if (later, signature) in self.counted:
            return "counted"
        if self.get(signature, later) is not None:
            return "predicted"
        return "extrapolated" if self.get(signature, later, beyond=True) is not None else "unknown"

    def audit(self, signature: Signature, later: bool, counts: BatchCounts) -> float | None:
        """A micro-batch counted after the window (:mod:`.meter`): from now on its signature reads this
        count and every other the table's value times the latest count's ratio to it (the table follows
        the counted value). Returns counted / what was read before, where they differ."""
        key = (later, signature)
        before = self.current(signature, later)
        table = self.get(signature, later, beyond=True)
        if table is None or key not in self.counted and self.get(signature, later) is None:
            self.record(signature, counts, later)  # a new (or extrapolated) shape: a point of its family
            self._family_fit(_family(key))  # fitted now, where the count's time is (out of the meter's clock)
        if table is not None and table.run_flops:
            self.correction = counts.run_flops / table.run_flops
        self.audited[key] = counts
        if before is None or before == counts.run_flops:
            return None
        return counts.run_flops / before

    def current(self, signature: Signature, later: bool = False) -> float | None:
        """The flops (fwd + bwd as run) the meter reads for a signature: its latest audited count, else
        the table's value (extrapolated where the family allows) times the latest audit's correction;
        None when unknown."""
        audited = self.audited.get((later, signature))
        if audited is not None:
            return float(audited.run_flops)
        counts = self.get(signature, later, beyond=True)
        return None if counts is None else counts.run_flops * self.correction
