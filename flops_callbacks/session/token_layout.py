"""Where a token batch's sequences lie: padding (``attention_mask``) and packing (``position_ids`` that
restart, ``cu_seq_lens_*``, ``seq_idx``), read from the batch as the model is given it.

A batch of rows of ``L`` positions holds sequences: runs of real tokens with no restart inside. A padded
row holds one, a packed row several. The layout gives the samples (sequences), the real tokens, and
each sequence as a batch of its own (:func:`one_sequence`), whose count is the model's work on it alone.
An encoder-decoder's row is a pair: its encoder's sequence and its decoder's span (the labels not -100,
or its ``decoder_attention_mask``), each cut to its own tokens.
Reading the tensors' values synchronizes a device, so a micro-batch keeps its :class:`LayoutTensors`
(references, no read) and reads them where the profiler waits for the device anyway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "CUMULATIVE_KEYS",
    "Decoder",
    "HeldLayout",
    "Layout",
    "LayoutTensors",
    "Unit",
    "layout_tensors",
    "one_sequence",
]

# HF's keys for sequence boundaries (transformers' DataCollatorWithFlattening, flash-attention kwargs)
CUMULATIVE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
_MAX_LENGTHS = ("max_length_q", "max_length_k")
# an encoder-decoder's decoder tensors (transformers' names), cut to a decoder's span, never an encoder's
_DECODER_KEYS = (
    "labels",
    "decoder_input_ids",
    "decoder_attention_mask",
    "decoder_position_ids",
    "decoder_inputs_embeds",
)
_LABEL_PAD = -100  # transformers' ignore index: a label position that is padding
# a float labels tensor holds a row's targets (multi-label classification: rows x labels), never tokens',
# even where a padded batch's length equals the labels' count (token labels are ids)
_ROW_TARGETS = ("labels", "label")

Unit = int | tuple[int, int]  # what is counted alone: a sequence's length, or (encoder, decoder) lengths


class Decoder(NamedTuple):
    """An encoder-decoder's rows as pairs: each row's encoder sequence with its decoder's span."""

    width: int  # decoder positions per row, padding included
    pairs: Counter[tuple[int, int]]  # (encoder length, decoder length) -> how many
    where: dict[tuple[int, int], tuple[int, int, int]]  # -> (row, encoder start, decoder start) of one


class Layout(NamedTuple):
    """A batch's sequences: ``rows`` x ``length`` positions, each sequence's length, and where one of
    each length lies (row, start) to cut it out."""

    rows: int
    length: int
    lengths: Counter[int]  # sequence length -> how many
    where: dict[int, tuple[int, int]]  # sequence length -> (row, start) of one such sequence
    decoder: Decoder | None = None  # an encoder-decoder's decoder spans (None: not one, or not read)
    whole_decoders: bool = False  # the batch holds decoder tensors whose spans were not read (counted whole)

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
        """Every row one sequence filling it (and its decoder): the batch's work is its sequences' alone."""
        whole = self.decoder is None or all(d == self.decoder.width for _, d in self.decoder.pairs)
        return whole and self.lengths == Counter({self.length: self.rows})

    def units(self) -> list[tuple[Unit, int]]:
        """What is counted alone and how many of each: sequence lengths, or an encoder-decoder's pairs."""
        if self.decoder is not None:
            return [(pair, k) for pair, k in self.decoder.pairs.items()]
        return [(n, k) for n, k in self.lengths.items()]


class LayoutTensors(NamedTuple):
    """The tensors a batch's layout is read from (references: reading waits for the device);
    ``decoder_marks``: an encoder-decoder's tensor that tells its decoder's real positions (its labels, or
    its decoder mask), ``decoder_pad_value`` where padding; ``decoder_held``: the batch holds decoder
    tensors (rows x decoder positions)."""

    rows: int
    length: int
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    seq_idx: torch.Tensor | None
    cu_seq_lens: torch.Tensor | None
    decoder_marks: torch.Tensor | None = None
    decoder_pad_value: int = _LABEL_PAD
    decoder_held: bool = False

    def to_host(self) -> HeldLayout:
        """These tensors copied to the host without waiting for the device (:class:`HeldLayout`)."""
        tensors = {k: t for k, t in self._asdict().items() if isinstance(t, torch.Tensor)}
        if all(t.device.type == "cpu" for t in tensors.values()):
            return HeldLayout(self, None)
        copies: dict[str, Any] = {k: t.to("cpu", non_blocking=True) for k, t in tensors.items()}
        event = None
        if any(t.device.type == "cuda" for t in tensors.values()):  # (a batch may hold host tensors too)
            event = torch.cuda.Event()
            event.record()
        return HeldLayout(self._replace(**copies), event)

    def without_decoder_marks(self) -> LayoutTensors:
        """These tensors with no decoder read (a model that is no encoder-decoder: its labels are not one)."""
        return self._replace(decoder_marks=None, decoder_held=False)

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
                return self._laid_out(*padded)
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
        return self._laid_out(lengths, starts)

    def _laid_out(self, lengths: list[int], starts: list[int]) -> Layout:
        """The layout of sequences of ``lengths`` starting at ``starts`` (on the rows laid end to end)."""
        counts: Counter[int] = Counter()
        where: dict[int, tuple[int, int]] = {}
        for n, at in zip(lengths, starts, strict=True):
            counts[n] += 1
            where.setdefault(n, divmod(at, self.length))
        decoder = self._decoder(lengths, starts)
        return Layout(self.rows, self.length, counts, where, decoder, self.decoder_held and decoder is None)

    def _decoder(self, lengths: list[int], starts: list[int]) -> Decoder | None:
        """Each row's encoder sequence paired with its decoder's span, from the first to the last real
        position (a row with none: its decoder's first token, which runs anyway); None with no decoder
        tensor, or rows packed (whose sequences share one decoder)."""
        if self.decoder_marks is None:
            return None
        rows = [at // self.length for at in starts]
        if len(set(rows)) != len(rows):
            return None
        real = (self.decoder_marks != self.decoder_pad_value).byte()
        width = int(real.shape[1])
        some, first, after_last = torch.stack((real.amax(1), real.argmax(1), real.flip(1).argmax(1))).tolist()
        pairs: Counter[tuple[int, int]] = Counter()
        where: dict[tuple[int, int], tuple[int, int, int]] = {}
        for n, at, row in zip(lengths, starts, rows, strict=True):
            begin, d = (first[row], width - after_last[row] - first[row]) if some[row] else (0, 1)
            pairs[n, d] += 1
            where.setdefault((n, d), (row, at % self.length, begin))
        return Decoder(width, pairs, where)


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


def _padded_rows(mask: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """The sequences (lengths, and starts on the rows laid end to end) of a padded batch whose every row
    holds one run of real tokens (padded on the right or the left); None where a row holds several (then
    read as packed)."""
    real = mask.to(torch.bool)
    runs = real[:, 0] + (real[:, 1:] > real[:, :-1]).sum(1)  # runs of real tokens, each row
    lengths, counted, starts = torch.stack((real.sum(1), runs, real.byte().argmax(1))).tolist()
    if any(n > 1 for n in counted):
        return None
    length = int(mask.shape[1])
    kept = [(n, row * length + at) for row, (n, at) in enumerate(zip(lengths, starts, strict=True)) if n]
    return [n for n, _ in kept], [at for _, at in kept]


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


def layout_tensors(batch: Any, decoder_marks: bool = False) -> LayoutTensors | None:
    """A mapping batch's layout tensors (no value read), or None when it tells no padding or packing:
    no ``attention_mask`` (2-D), ``position_ids``, ``seq_idx`` nor ``cu_seq_lens_q`` beside its tokens.
    With ``decoder_marks`` (for an encoder-decoder), also what tells its decoder's spans: its
    ``decoder_attention_mask``, else its ``labels``. (A window keeps them for any model, as references,
    and reads the others' layouts :meth:`LayoutTensors.without_decoder_marks`: which model it is, the
    window's end says.)"""
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
    if not any(isinstance(t, torch.Tensor) for t in held[2:]):
        return None
    return held._replace(**_decoder_marks(batch, rows)) if decoder_marks else held


def _decoder_marks(batch: Mapping, rows: int) -> dict[str, Any]:
    """An encoder-decoder's batch's fields of :class:`LayoutTensors`: whether it holds decoder tensors, and
    the one its decoder's spans are read from (its ``decoder_attention_mask``, else its labels,
    transformers' -100 where padding), where one is a rows x positions tensor."""
    held = [batch.get(k) for k in _DECODER_KEYS]
    fields: dict[str, Any] = {"decoder_held": any(_per_row(v, rows) for v in held)}
    for key, pad in (("decoder_attention_mask", 0), ("labels", _LABEL_PAD)):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == rows:
            return {**fields, "decoder_marks": value, "decoder_pad_value": pad}
    return fields


def _per_row(value: Any, rows: int) -> bool:
    """Whether ``value`` is a tensor of rows (or one row, broadcast) x positions."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] in (rows, 1)


def one_sequence(args: Any, layout: Layout, unit: Unit) -> Any:
    """``args`` (a step's arguments, the batch inside) with the batch cut to one sequence of ``unit``
    (its tokens; an encoder-decoder's pair: its encoder's and its decoder's) of ``layout`` (the first
    such): tensors of ``rows x length`` cut to it, an encoder-decoder's decoder tensors to its decoder's
    span, per-row tensors to its row, boundaries rewritten for one sequence; everything else as it is."""
    if isinstance(unit, tuple):
        assert layout.decoder is not None
        (n, d), (row, start, begin) = unit, layout.decoder.where[unit]
        span = (layout.decoder.width, begin, d)
    else:
        n, (row, start), span = unit, layout.where[unit], None
    rows, length = layout.rows, layout.length

    def cut(value: Any, key: Any = None) -> Any:
        if isinstance(value, torch.Tensor):
            if key in CUMULATIVE_KEYS:
                return torch.tensor([0, n], dtype=value.dtype, device=value.device)
            if span is not None and key in _DECODER_KEYS and value.dim() >= 2 and value.shape[1] == span[0]:
                first = row if value.shape[0] == rows else 0
                return value[first : first + 1, span[1] : span[1] + span[2]]
            if key == "seq_idx" and value.dim() >= 2:
                return torch.zeros_like(value[row : row + 1, start : start + n])
            targets = key in _ROW_TARGETS and value.is_floating_point()
            if value.dim() >= 2 and value.shape[1] == length and value.shape[0] in (rows, 1) and not targets:
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
