"""ShapeFlops: counted shapes, and an exact predictor that is trusted only once a counted point checks it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.session import shape_flops
from flops_callbacks.session.batch import shape_signature
from flops_callbacks.session.shape_flops import BatchCounts, ShapeFlops


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=128, n_embd=16, n_layer=2, n_head=2, bos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(length: int, size: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (size, length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def counted(model: GPT2LMHeadModel, inputs: dict[str, torch.Tensor]) -> BatchCounts:
    model.zero_grad(set_to_none=True)  # a step's first micro-batch: no gradient to add to
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(**inputs).loss.backward()
    finally:
        tracer.stop()
    return BatchCounts.of(tracer.profile().model)


def torch_flops(model: GPT2LMHeadModel, inputs: dict[str, torch.Tensor]) -> int:
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as mode:
        model(**inputs).loss.backward()
    return mode.get_total_flops()


def test_a_gpt2s_flops_at_an_unseen_length_are_predicted_exactly_after_four_counted_lengths() -> None:
    model, table = tiny_gpt2(), ShapeFlops()
    for n, length in enumerate((16, 24, 40, 72)):
        inputs = batch(length)
        table.record(shape_signature(inputs), counted(model, inputs))
        # attention is quadratic in L: a line through 2 points and a parabola through 3 are not verified
        assert (table.get(shape_signature(batch(57))) is None) == (n < 3)
    inputs = batch(57)
    predicted = table.get(shape_signature(inputs))
    assert table.source(shape_signature(inputs)) == "predicted"
    assert predicted == counted(model, inputs)
    # the same work as torch's own counter sees (matmuls and attention: its registry's ops)
    assert torch_flops(model, inputs) <= predicted.model_flops


def test_dims_that_never_varied_or_stop_being_equal_are_not_predicted() -> None:
    table = ShapeFlops()
    for length in (1, 2, 3, 12):  # counts = 5 + 3 L + 2 L^2 (a batch of 2 x L ids and mask)
        sig = (((2, length), torch.int64), ((2, length), torch.int64))
        table.record(sig, BatchCounts(5 + 3 * length + 2 * length**2, length, 0, 7, 1, 0))
    assert table.get((((2, 10), torch.int64), ((2, 10), torch.int64))) == BatchCounts(235, 10, 0, 7, 1, 0)
    assert table.get((((3, 10), torch.int64), ((3, 10), torch.int64))) is None  # the batch size never varied
    assert table.get((((2, 10), torch.int64), ((2, 11), torch.int64))) is None  # L and L' were always equal
    assert table.get((((2, 10), torch.float32), ((2, 10), torch.int64))) is None  # another family


def test_a_familys_fit_is_made_where_its_new_count_is_and_a_count_of_another_family_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The meter reads the table on its clock: a count after the window (an audit, a fake count: both out
    of that clock) emptied every family's fit, and the next new shape's lookup refitted on the clock (tens
    of milliseconds with many points: metered steps read 5-8x slower)."""
    fits: list[int] = []
    made = shape_flops._fit
    monkeypatch.setattr(shape_flops, "_fit", lambda points: fits.append(len(points)) or made(points))

    def ids(rows: int, length: int) -> tuple:
        return (((rows, length), torch.int64), ((rows, length), torch.int64))

    def counts(rows: int, length: int) -> BatchCounts:
        return BatchCounts(rows * (5 + 3 * length + 2 * length**2), rows * length, 0, 7, 1, 0)

    table, other = ShapeFlops(), ((((4,), torch.float32),))
    for length in (1, 2, 3, 12):
        table.record(ids(2, length), counts(2, length))
    fits.clear()  # (each record's content check fitted the points before it)
    assert table.current(ids(2, 10)) == counts(2, 10).run_flops and fits == [4]
    table.audit(other, False, BatchCounts(1, 0, 0, 0, 0, 0))  # another family's count
    assert table.current(ids(2, 20)) == counts(2, 20).run_flops and fits == [4]  # the fit kept
    table.audit(ids(2, 30), False, counts(2, 30))  # a new point of the family: refitted there
    assert fits == [4, 5]
    assert table.current(ids(2, 40)) == counts(2, 40).run_flops and fits == [4, 5]  # not on the clock


def test_counts_that_are_no_polynomial_keep_being_counted() -> None:
    table = ShapeFlops()
    for length in (8, 9, 10, 11, 12, 13):  # padded internally to a multiple of 8: a step, no polynomial
        table.record((((1, length), torch.int64),), BatchCounts(-(-length // 8) * 8, 0, 0, 0, 0, 0))
    assert table.get((((1, 30), torch.int64),)) is None


def test_after_the_window_a_length_beyond_every_counted_one_is_extrapolated_on_one_fit_of_all() -> None:
    model, table = tiny_gpt2(), ShapeFlops()
    for length in (16, 24, 40, 72):
        inputs = batch(length)
        table.record(shape_signature(inputs), counted(model, inputs))
    for length in (8, 100):  # below and above every counted length
        inputs = batch(length)
        signature = shape_signature(inputs)
        assert table.get(signature) is None  # in the window: counted first
        assert table.source(signature) == "extrapolated"
        assert table.get(signature, beyond=True) == counted(model, inputs)  # one parabola fits all four
        assert table.current(signature) == float(counted(model, inputs).run_flops)


def test_no_extrapolation_where_no_one_polynomial_fits_every_counted_point() -> None:
    table = ShapeFlops()
    for length in (2, 3, 5, 6, 10, 11, 13, 14):  # counts = 3 L below 8, 3 L + 100 above: a branch
        ids = torch.zeros(1, length, dtype=torch.long)
        flops = 3 * length + (100 if length > 8 else 0)
        table.record(shape_signature({"input_ids": ids}), BatchCounts(flops, 0, 0, 0, 0, 0))
    beyond = shape_signature({"input_ids": torch.zeros(1, 20, dtype=torch.long)})
    assert table.get(beyond, beyond=True) is None and table.source(beyond) == "unknown"
    for length, flops in ((4, 12), (12, 136)):  # each side of the branch fits on its own, in its range
        inside = shape_signature({"input_ids": torch.zeros(1, length, dtype=torch.long)})
        assert table.get(inside) == BatchCounts(flops, 0, 0, 0, 0, 0)


def tiny_t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def pair(source: int, target: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (2, source))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(1, 64, (2, target)),
    }


def test_an_encoder_decoders_two_lengths_are_predicted_after_seven_counted_pairs() -> None:
    """Its counts are of total degree 2 in the two lengths (each attention, and the decoder's over the
    encoder's): 6 unknowns and a check, where every exponent up to 2 in each length would take 10 pairs."""
    model, table = tiny_t5(), ShapeFlops()
    unseen = pair(11, 6)
    pairs = [(6, 3), (14, 9), (10, 5), (6, 9), (14, 3), (8, 7), (12, 4)]
    for n, (source, target) in enumerate(pairs):
        inputs = pair(source, target)
        table.record(shape_signature(inputs), counted(model, inputs))
        assert (table.get(shape_signature(unseen)) is None) == (n < 6)  # 6 unknowns, then the check
    assert table.source(shape_signature(unseen)) == "predicted"
    assert table.get(shape_signature(unseen)) == counted(model, unseen)


def test_a_polynomial_of_total_degree_two_in_two_lengths_needs_seven_points_and_is_exact() -> None:
    table = ShapeFlops()

    def signature(a: int, b: int) -> tuple:
        return (((4, a), torch.int64), ((4, b), torch.int64))

    def flops(a: int, b: int) -> BatchCounts:  # 7 + 3a + 5b + 2a^2 + ab + 4b^2, and its backward twice
        fwd = 7 + 3 * a + 5 * b + 2 * a * a + a * b + 4 * b * b
        return BatchCounts(fwd, 2 * fwd, 0, a * b, 2 * a * b, 0)

    for a, b in [(2, 2), (9, 2), (2, 9), (9, 9), (5, 3), (3, 6), (7, 5)]:
        table.record(signature(a, b), flops(a, b))
    assert all(table.get(signature(a, b)) == flops(a, b) for a in range(2, 10) for b in range(2, 10))
    assert table.get(signature(10, 5)) is None  # beyond the counted range: counted first


def test_three_full_batches_and_the_epochs_smaller_last_one_predict_nothing_they_cannot_check() -> None:
    """Counts of 10 B L: three batches of 8 and one of 5 fit ``a + b B + c L`` with a point to spare, but
    the three (one B) cannot see a ``B L`` term: no point checks the fifth, so nothing is predicted."""
    table = ShapeFlops()

    def signature(size: int, length: int) -> tuple:
        return (((size, length), torch.int64),)

    for size, length in [(8, 10), (8, 20), (8, 30), (5, 17)]:
        table.record(signature(size, length), BatchCounts(10 * size * length, 0, 0, 0, 0, 0))
    assert table.get(signature(5, 30)) is None and table.source(signature(5, 30)) == "unknown"
    table.record(signature(5, 25), BatchCounts(10 * 5 * 25, 0, 0, 0, 0, 0))  # a fifth: B L is seen
    table.record(signature(5, 11), BatchCounts(10 * 5 * 11, 0, 0, 0, 0, 0))  # a sixth: each one checked
    assert table.get(signature(5, 30)) == BatchCounts(1500, 0, 0, 0, 0, 0)
    assert table.get(signature(7, 12)) == BatchCounts(840, 0, 0, 0, 0, 0)


def test_an_encoder_decoders_pairs_stay_predicted_after_the_epochs_smaller_last_batch() -> None:
    """Seven pairs of lengths at batch 4 and one at batch 3: the size is then a variable no fit of all the
    points pins down, and the pairs at batch 4 are fitted on their own."""
    table = ShapeFlops()

    def signature(size: int, a: int, b: int) -> tuple:
        return (((size, a), torch.int64), ((size, b), torch.int64))

    def flops(size: int, a: int, b: int) -> BatchCounts:  # per row, and a relative bias of a x a once
        fwd = size * (7 + 3 * a + 5 * b + 2 * a * a + a * b + 4 * b * b) + 11 * a * a
        return BatchCounts(fwd, 2 * fwd, 0, 0, 0, 0)

    for a, b in [(2, 2), (9, 2), (2, 9), (9, 9), (5, 3), (3, 6), (7, 5)]:
        table.record(signature(4, a, b), flops(4, a, b))
    table.record(signature(3, 6, 4), flops(3, 6, 4))
    assert table.get(signature(4, 5, 6)) == flops(4, 5, 6)
    assert table.get(signature(3, 5, 6)) is None  # one point at batch 3: nothing to fit there
