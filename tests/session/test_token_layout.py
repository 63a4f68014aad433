"""A token batch's layout: padding from ``attention_mask``, packing from ``position_ids`` that restart,
``cu_seq_lens_*`` or ``seq_idx``; and one of its sequences cut out as a batch of its own."""

from __future__ import annotations

from collections import Counter

import torch

from flops_callbacks.session.token_layout import layout_tensors, one_sequence


def test_right_and_left_padding_give_each_row_its_real_tokens() -> None:
    ids = torch.arange(14).view(2, 7)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
    held = layout_tensors({"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert held is not None
    layout = held.to_host().read()
    assert (layout.rows, layout.length, layout.lengths) == (2, 7, Counter({5: 2}))
    assert (layout.sequences, layout.real_tokens, layout.positions) == (2, 10, 14)
    assert not layout.plain and layout.where[5] == (0, 0)  # the first row's run of five


def test_position_ids_that_restart_are_packed_sequences() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])
    held = layout_tensors({"input_ids": torch.arange(10).view(1, 10), "position_ids": positions})
    assert held is not None
    layout = held.read()
    assert layout.lengths == Counter({3: 1, 2: 1, 4: 1, 1: 1}) and layout.sequences == 4
    assert layout.where == {3: (0, 0), 2: (0, 3), 4: (0, 5), 1: (0, 9)}
    assert (layout.real_tokens, layout.positions) == (10, 10)  # packed: no padding


def test_flash_attention_boundaries_and_sequence_ids_tell_the_same_sequences() -> None:
    ids = torch.arange(10).view(1, 10)
    cumulative = torch.tensor([0, 3, 5, 9, 10])
    by_bounds = layout_tensors({"input_ids": ids, "cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative})
    by_index = layout_tensors({"input_ids": ids, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])})
    assert by_bounds is not None and by_index is not None
    assert by_bounds.read().lengths == by_index.read().lengths == Counter({3: 1, 2: 1, 4: 1, 1: 1})


def test_a_packed_row_padded_at_its_end_leaves_the_padding_out() -> None:
    batch = {
        "input_ids": torch.arange(8).view(1, 8),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
    }
    held = layout_tensors(batch)
    assert held is not None
    layout = held.read()
    assert layout.lengths == Counter({3: 1, 2: 1}) and (layout.real_tokens, layout.positions) == (5, 8)


def test_a_packed_row_without_a_mask_padded_to_a_multiple_leaves_its_padding_out() -> None:
    # TRL's padding-free rows padded to a multiple of 16: position ids 0 on each pad, labels -100, no
    # mask (each pad read as a one-token sequence: 7 sequences of 16 real tokens, 6x the samples)
    pos = torch.cat([torch.arange(5), torch.arange(3), torch.arange(4), torch.zeros(4, dtype=torch.long)])
    ids = torch.cat([torch.arange(1, 13), torch.zeros(4, dtype=torch.long)])
    held = layout_tensors({"input_ids": ids[None], "labels": ids[None], "position_ids": pos[None]})
    assert held is not None
    layout = held.read()
    assert layout.lengths == Counter({5: 1, 3: 1, 4: 1})
    assert (layout.real_tokens, layout.positions) == (12, 16)
    # one position id 0 at the row's end may be a sequence of one token: it stays one
    one = layout_tensors({"input_ids": ids[None, :13], "position_ids": pos[None, :13]})
    assert one is not None and one.read().lengths == Counter({5: 1, 3: 1, 4: 1, 1: 1})


def test_each_rows_end_padding_is_its_own_and_a_row_starts_a_sequence_whatever_ends_the_row_before() -> None:
    # row 0: 3 + 2 real, then 2 pads; row 1: a one-token sequence, 4, then 1 pad (a single 0 stays one);
    # row 2: 3 pads after a sequence of 4 (the next row's 0 is no part of its run)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 0, 0]])
    held = layout_tensors({"input_ids": torch.ones(3, 7, dtype=torch.long), "position_ids": pos})
    assert held is not None
    layout = held.read()
    assert layout.lengths == Counter({3: 1, 2: 1, 1: 2, 5: 1, 4: 1})
    assert layout.where == {3: (0, 0), 2: (0, 3), 1: (1, 0), 5: (1, 1), 4: (2, 0)}
    assert (layout.real_tokens, layout.positions) == (16, 21)


def test_an_empty_batch_holds_no_sequence_whatever_tells_its_layout() -> None:
    empty = torch.zeros(0, 8, dtype=torch.long)
    for extra in ({"position_ids": empty}, {"cu_seq_lens_q": torch.tensor([0])}, {"attention_mask": empty}):
        held = layout_tensors({"input_ids": empty, **extra})
        assert held is not None
        layout = held.read()
        assert (layout.rows, layout.sequences, layout.real_tokens, layout.positions) == (0, 0, 0, 0)


def test_a_full_mask_is_plain_and_a_batch_without_one_tells_nothing() -> None:
    ids = torch.ones(2, 3, dtype=torch.long)
    held = layout_tensors({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert held is not None and held.read().plain
    assert layout_tensors({"input_ids": ids, "labels": ids}) is None
    assert layout_tensors((ids, ids)) is None  # not a mapping: no names to read
    assert layout_tensors({"pixel_values": torch.ones(2, 3, 4, 4), "labels": torch.ones(2)}) is None


def test_one_sequence_cuts_every_token_tensor_and_rewrites_the_boundaries() -> None:
    ids = torch.arange(10).view(1, 10)
    batch = {
        "input_ids": ids,
        "labels": ids + 100,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 9, 10]),
        "max_length_q": 4,
    }
    held = layout_tensors(batch)
    assert held is not None
    layout = held.read()
    args = (batch, torch.tensor(7))  # the HF Trainer's step: the inputs and num_items_in_batch
    inputs, items = one_sequence(args, layout, 4)
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8]]
    assert inputs["labels"].tolist() == [[105, 106, 107, 108]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 4] and inputs["max_length_q"] == 4
    assert int(items) == 7  # no token tensor: as it was


def test_one_sequence_of_a_padded_batch_takes_its_row_and_per_row_tensors() -> None:
    ids = torch.arange(14).view(2, 7)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": mask, "score": torch.tensor([0.5, 2.0])}
    held = layout_tensors(batch)
    assert held is not None
    layout = held.read()
    cut = one_sequence(batch, layout, 5)
    assert cut["input_ids"].tolist() == [[9, 10, 11, 12, 13]] and cut["attention_mask"].tolist() == [[1] * 5]
    assert cut["score"].tolist() == [2.0]
    # a multi-label batch's float labels, as many as the padded length: the row's targets, whole
    labels = torch.arange(14.0).view(2, 7)
    cut = one_sequence({**batch, "labels": labels}, layout, 5)
    assert cut["labels"].tolist() == [labels[1].tolist()] and cut["input_ids"].shape == (1, 5)
    token_labels = one_sequence({**batch, "labels": ids}, layout, 5)["labels"]  # a causal LM's: token ids
    assert token_labels.tolist() == [[9, 10, 11, 12, 13]]


def test_an_encoder_decoders_rows_pair_their_encoder_with_their_decoders_span() -> None:
    # labels padded with -100 on the right (DataCollatorForSeq2Seq), a row with none; or a decoder mask
    # padded on the left, which is read first
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]])
    labels = torch.tensor([[5, 6, -100, -100, -100], [5, 6, 7, 8, 9], [-100] * 5])
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": mask, "labels": labels}
    held = layout_tensors(batch, decoder_marks=True)
    assert held is not None
    layout = held.to_host().read()
    assert layout.decoder is not None and layout.decoder.width == 5
    assert layout.decoder.pairs == Counter({(3, 2): 1, (4, 5): 1, (3, 1): 1})  # no label: its first token
    assert layout.decoder.where == {(3, 2): (0, 0, 0), (4, 5): (1, 0, 0), (3, 1): (2, 1, 0)}
    assert layout.units() == [((3, 2), 1), ((4, 5), 1), ((3, 1), 1)] and not layout.plain
    assert layout.lengths == Counter({3: 2, 4: 1})  # the samples and real tokens are the encoder's
    decoder_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    held = layout_tensors({**batch, "decoder_attention_mask": decoder_mask}, decoder_marks=True)
    assert held is not None
    read = held.read().decoder
    assert read is not None and read.pairs == Counter({(3, 3): 1, (4, 5): 1, (3, 1): 1})
    assert read.where == {(3, 3): (0, 0, 2), (4, 5): (1, 0, 0), (3, 1): (2, 1, 4)}
    # any other model's labels are no decoder; and without ``decoder`` none is kept
    assert held.without_decoder_marks().read().decoder is None
    plain = layout_tensors(batch)
    assert plain is not None and plain.decoder_marks is None and plain.read().decoder is None
    full = {**batch, "attention_mask": torch.ones(3, 4), "labels": torch.ones(3, 5, dtype=torch.long)}
    held = layout_tensors(full, decoder_marks=True)
    assert held is not None and held.read().plain  # every encoder and decoder whole


def test_packed_encoder_rows_share_a_decoder_and_are_read_without_one() -> None:
    batch = {
        "input_ids": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 0, 1, 2]]),
        "labels": torch.tensor([[1, 2, -100]]),
    }
    held = layout_tensors(batch, decoder_marks=True)
    assert held is not None and held.read().decoder is None and held.read().whole_decoders
    assert held.read().lengths == Counter({2: 1, 3: 1})


def test_whole_decoders_are_said_where_a_batch_holds_decoder_tensors_whose_spans_are_not_read() -> None:
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    told = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([[1, -100], [1, 2]])}
    untold = {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": torch.ones(2, 3, dtype=torch.long),
    }
    classes = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.tensor([0, 1]),
    }  # a decoder of the inputs
    read = {}
    for name, batch in (("told", told), ("untold", untold), ("classes", classes)):
        held = layout_tensors(batch, decoder_marks=True)
        assert held is not None
        read[name] = held.read()
        assert not held.without_decoder_marks().read().whole_decoders  # not an encoder-decoder's
    assert read["told"].decoder is not None and not read["told"].whole_decoders
    assert read["untold"].decoder is None and read["untold"].whole_decoders  # its padding unknown: in
    assert read["classes"].decoder is None and not read["classes"].whole_decoders  # cut with the encoder


def test_one_pair_cuts_the_decoders_tensors_to_its_decoder_even_as_long_as_the_encoders() -> None:
    # inputs and labels of 4 positions: the decoder tensors are cut by the decoder's span, not the encoder's
    ids = torch.arange(8).view(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    labels = torch.tensor([[1, 2, 3, 4], [5, 6, -100, -100]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "decoder_input_ids": labels + 10}
    held = layout_tensors(batch, decoder_marks=True)
    assert held is not None
    layout = held.read()
    cut = one_sequence((batch,), layout, (3, 2))[0]
    assert cut["input_ids"].tolist() == [[5, 6, 7]] and cut["attention_mask"].tolist() == [[1, 1, 1]]
    assert cut["labels"].tolist() == [[5, 6]] and cut["decoder_input_ids"].tolist() == [[15, 16]]
    whole = one_sequence(batch, layout, (4, 4))
    assert whole["labels"].tolist() == [[1, 2, 3, 4]] and whole["input_ids"].tolist() == [[0, 1, 2, 3]]
