"""Where a token batch's sequences lie: padding (``attention_mask``) and packing (``position_ids`` that
restart, ``cu_seq_lens_*``, ``seq_idx``), read from the batch as the model is given it.

A batch of rows of ``L`` positions holds sequences: runs of real tokens with no restart inside. A padded
row holds one, a packed row several. The layout gives the samples (sequences), the real tokens, and
each sequence as a batch of its own (:func:`one_sequence`), whose count is the model's work on it alone.
Reading the tensors' values synchronizes a device, so a micro-batch keeps its :class:`LayoutTensors`
(references, no read) and reads them where the profiler waits for the device anyway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["CUMULATIVE_KEYS", "HeldLayout", "Layout", "LayoutTensors", "layout_tensors", "one_sequence"]

# HF's keys for sequence boundaries (transformers' DataCollatorWithFlattening, flash-attention kwargs)
CUMULATIVE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
_MAX_LENGTHS = ("max_length_q", "max_length_k")


class Layout(NamedTuple):
    """A batch's sequences: ``rows`` x ``length`` positions, each sequence's length, and where one of
    each length lies (row, start) to cut it out."""

    rows: int
    length: int
    lengths: Counter[int]  # sequence length -> how many
    where: dict[int, tuple[int, int]]  # sequence length -> (row, start) of one such sequence

    @property
    def sequences(self) -> int:
        return sum(self.lengths.values())

    @property
    def real_tokens(self) -> int:
        return sum(n * k for n, k in self.lengths.items())

    @property
    def positions(self) -> int:
        return self.rows * self.length

    @property
    def plain(self) -> bool:
        """Every row one sequence filling it: the batch's work is its sequences' work alone."""
        return self.lengths == Counter({self.length: self.rows})


class LayoutTensors(NamedTuple):
    """The tensors a batch's layout is read from (references: reading waits for the device)."""

    rows: int
    length: int
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    seq_idx: torch.Tensor | None
    cu_seq_lens: torch.Tensor | None

    def to_host(self) -> HeldLayout:
        """These tensors copied to the host without waiting for the device (:class:`HeldLayout`)."""
        tensors = [t for t in self[2:] if isinstance(t, torch.Tensor)]
        if all(t.device.type == "cpu" for t in tensors):
            return HeldLayout(self, None)
        copies = [t.to("cpu", non_blocking=True) if isinstance(t, torch.Tensor) else None for t in self[2:]]
        event = None
        if tensors[0].device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return HeldLayout(LayoutTensors(self.rows, self.length, *copies), event)

    def read(self) -> Layout:
        """The sequences: a position starts one where a boundary says so or the one before is padding.
        Read on the rows laid end to end, in a dozen tensor operations, then on the sequences' starts as
        Python lists: it runs for every packed micro-batch after the window, where each small operation
        costs microseconds of host time a small model's step feels."""
        rows, length = self.rows, self.length
        mask, packing = self.attention_mask, (self.position_ids, self.seq_idx, self.cu_seq_lens)
        if mask is not None and all(t is None for t in packing):
            padded = _padded_rows(mask)  # the usual padded batch, read in a few operations
            if padded is not None:
                return padded
        device = next(t.device for t in self if isinstance(t, torch.Tensor))
        total = rows * length
        start = torch.zeros(total, dtype=torch.bool, device=device)
        start[::length] = True  # every row starts a sequence
        pos = None
        if self.position_ids is not None:
            pos = self.position_ids.expand(rows, length).reshape(-1)
            start[1:] |= pos[1:] != pos[:-1] + 1
        if self.seq_idx is not None:
            index = self.seq_idx.expand(rows, length).reshape(-1)
            start[1:] |= index[1:] != index[:-1]
        if self.cu_seq_lens is not None:
            bounds = self.cu_seq_lens[:-1].to(device=device, dtype=torch.long)
            start[bounds[bounds < total]] = True
        if mask is None:  # every position real: a sequence runs to the next start
            begins = start.nonzero().view(-1)
            starts = begins.tolist()
            ends = [*starts[1:], total]  # (no row: no start, and no sequence)
            lengths = [end - at for at, end in zip(starts, ends, strict=False)]
            if pos is not None:  # padding-free rows padded at their end
                kept = _without_end_padding(starts, lengths, pos[begins].tolist(), length)
                starts, lengths = [at for at, _ in kept], [n for _, n in kept]
        else:  # a sequence is the run of real positions from its start (a real one after padding starts one)
            real = mask.reshape(-1).to(torch.bool)
            start[1:] |= ~real[:-1]
            begins = (start & real).nonzero().view(-1)
            starts = begins.tolist()
            seen = real.long().cumsum(0)  # real positions up to each, itself included
            upto = torch.cat((seen[begins], seen[-1:] + 1)).tolist()  # and one past the last
            lengths = [end - at for at, end in zip(upto, upto[1:], strict=False)]
        counts: Counter[int] = Counter()
        where: dict[int, tuple[int, int]] = {}
        for n, at in zip(lengths, starts, strict=True):
            counts[n] += 1
            where.setdefault(n, divmod(at, length))
        return Layout(rows, length, counts, where)


def _without_end_padding(
    starts: list[int], lengths: list[int], first_positions: list[int], length: int
) -> list[tuple[int, int]]:
    """The sequences (each start and length; ``first_positions``: each one's first position id) less each
    row's padding at its end where rows carry no mask: a run of two or more one-token sequences of
    position id 0 there (TRL's padding-free rows padded to a multiple: each pad would read as a sequence).
    A single one at a row's end stays a sequence: it may be one."""
    kept: list[tuple[int, int]] = []
    run: list[tuple[int, int]] = []  # the one-token sequences of position 0 since the last other one
    for i, (at, n, first) in enumerate(zip(starts, lengths, first_positions, strict=True)):
        if n == 1 and first == 0:
            run.append((at, n))
        else:
            kept += run + [(at, n)]
            run = []
        if i + 1 == len(starts) or starts[i + 1] // length != at // length:  # the row's last sequence
            kept += run if len(run) < 2 else []  # two or more: the row's padding
            run = []
    return kept


def _padded_rows(mask: torch.Tensor) -> Layout | None:
    """The layout of a padded batch whose every row holds one run of real tokens (padded on the right or
    the left); None where a row holds several (then read as packed)."""
    real = mask.to(torch.bool)
    runs = real[:, 0] + (real[:, 1:] > real[:, :-1]).sum(1)  # runs of real tokens, each row
    lengths, counted, starts = torch.stack((real.sum(1), runs, real.byte().argmax(1))).tolist()
    if any(n > 1 for n in counted):
        return None
    counts: Counter[int] = Counter()
    where: dict[int, tuple[int, int]] = {}
    for row, (n, at) in enumerate(zip(lengths, starts, strict=True)):
        if n:
            counts[n] += 1
            where.setdefault(n, (row, at))
    return Layout(int(mask.shape[0]), int(mask.shape[1]), counts, where)


class HeldLayout(NamedTuple):
    """A micro-batch's layout tensors on the host: copies a device may still be making (``event``)."""

    tensors: LayoutTensors
    event: Any  # a CUDA event recorded after the copies (None: on the host already)

    def ready(self) -> bool:
        """Whether :meth:`read` reads without waiting for the device."""
        return self.event is None or bool(self.event.query())

    def read(self) -> Layout:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors.read()


def _get(batch: Mapping, key: str, rows: int, length: int) -> torch.Tensor | None:
    value = batch.get(key)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[-1] != length:
        return None
    return value if value.shape[0] in (rows, 1) else None


def layout_tensors(batch: Any) -> LayoutTensors | None:
    """A mapping batch's layout tensors (no value read), or None when it tells no padding or packing:
    no ``attention_mask`` (2-D), ``position_ids``, ``seq_idx`` nor ``cu_seq_lens_q`` beside its tokens."""
    if not isinstance(batch, Mapping):
        return None
    found = (batch.get(k) for k in ("input_ids", "labels", "attention_mask"))
    tokens = next((t for t in found if isinstance(t, torch.Tensor)), None)
    if tokens is None or tokens.dim() != 2:
        return None
    rows, length = int(tokens.shape[0]), int(tokens.shape[1])
    mask = _get(batch, "attention_mask", rows, length)
    if mask is not None and mask.shape[0] != rows:
        mask = None
    cumulative = next((batch[k] for k in CUMULATIVE_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if cumulative is not None and cumulative.dim() != 1:
        cumulative = None
    held = LayoutTensors(
        rows,
        length,
        mask,
        _get(batch, "position_ids", rows, length),
        _get(batch, "seq_idx", rows, length),
        cumulative,
    )
    return held if any(isinstance(t, torch.Tensor) for t in held[2:]) else None


def one_sequence(args: Any, layout: Layout, n: int) -> Any:
    """``args`` (a step's arguments, the batch inside) with the batch cut to one sequence of ``n``
    tokens of ``layout`` (the first such): tensors of ``rows x length`` cut to it, per-row tensors to its
    row, boundaries rewritten for one sequence; everything else as it is."""
    row, start = layout.where[n]
    rows, length = layout.rows, layout.length

    def cut(value: Any, key: Any = None) -> Any:
        if isinstance(value, torch.Tensor):
            if key in CUMULATIVE_KEYS:
                return torch.tensor([0, n], dtype=value.dtype, device=value.device)
            if key == "seq_idx" and value.dim() >= 2:
                return torch.zeros_like(value[row : row + 1, start : start + n])
            if value.dim() >= 2 and value.shape[1] == length and value.shape[0] in (rows, 1):
                first = row if value.shape[0] == rows else 0
                return value[first : first + 1, start : start + n]
            if value.dim() >= 1 and value.shape[0] == rows and rows > 1:
                return value[row : row + 1]
            return value
        if key in _MAX_LENGTHS and isinstance(value, int):
            return n
        if isinstance(value, Mapping):
            cut_items = {k: cut(v, k) for k, v in value.items()}
            try:
                return type(value)(cut_items)  # type: ignore[call-arg]
            except Exception:  # noqa: BLE001  (a mapping type that cannot be built from a dict)
                return cut_items
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(cut(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        return value

    return cut(args)
