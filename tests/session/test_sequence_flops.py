"""The model's work on a batch's real tokens: each sequence of a padded batch counted as if run alone,
under fake tensors, the fewest lengths counted (the extremes first) and the rest predicted."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from flops_callbacks import StepProfiler
from flops_callbacks import metrics as names
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.options import Options
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.publish import publish
from flops_callbacks.session.batch import shape_signature
from flops_callbacks.session.off_clock import OffClock, Replay
from flops_callbacks.session.sequence_flops import LaidOut, SequenceFlops
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.step_session import StepSession
from flops_callbacks.session.token_layout import layout_tensors
from flops_callbacks.timing.clock import CpuClock

VOCAB, WIDTH = 50, 16


class Attending(nn.Module):
    """Tokens attending to each other over their mask: its work is quadratic in the sequence's length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        scores = (h @ h.transpose(-1, -2)).masked_fill(attention_mask[:, None, :] == 0, -1e9)
        return self.out(scores.softmax(-1) @ h)


def attending_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["input_ids"], batch["attention_mask"]).sum()


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    attending_loss(model, batch).backward()


def counted(
    model: nn.Module, batch: dict[str, torch.Tensor], step: Callable[..., None] = step
) -> BatchCounts:
    """The engine's count of one ``step``'s first micro-batch (no gradient to add to)."""
    model.zero_grad(set_to_none=True)
    engine = CountingEngine(model)
    engine.start()
    try:
        step(model, batch)
    finally:
        engine.stop()
    model.zero_grad(set_to_none=True)
    return BatchCounts.of(engine.totals()[0])


def padded(lengths: list[int]) -> dict[str, torch.Tensor]:
    longest = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), longest), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths])
    return {"input_ids": ids * mask, "attention_mask": mask}


def laid_out(batch: dict[str, Any], replay: Any) -> LaidOut:
    held = layout_tensors(batch)
    assert held is not None
    return LaidOut(held.read(), batch, shape_signature(batch), replay)


def test_a_padded_batchs_model_work_is_its_rows_alone_four_lengths_counted_for_eight() -> None:
    torch.manual_seed(0)
    model = Attending()
    lengths = [2, 3, 4, 5, 6, 7, 8, 9]
    batch = padded(lengths)
    off_clock = OffClock()
    off_clock.why_not = ""  # a fake count matched the real one (the counting step's trial)
    sequences = SequenceFlops()
    item = laid_out(batch, Replay(step, batch))
    sequences.settle(model, off_clock, [item])
    # the ends first (2 and 9), then the middle: a quadratic and its check, the other four predicted
    assert sequences.counts == 4
    as_run = counted(model, batch)
    model_counts = sequences.model_counts(as_run, item)
    assert model_counts is not None
    alone = [counted(model, {k: v[r : r + 1, :n] for k, v in batch.items()}) for r, n in enumerate(lengths)]
    assert model_counts.model_fwd_flops == sum(c.fwd_flops for c in alone)
    assert model_counts.model_bwd_flops == sum(c.bwd_flops for c in alone)
    assert model_counts.run_flops == as_run.run_flops > model_counts.model_flops  # padding: run, not model's


def test_without_a_step_to_replay_the_model_work_is_the_runs_and_why_is_said() -> None:
    batch = padded([2, 5])
    sequences = SequenceFlops()
    off_clock = OffClock()
    item = laid_out(batch, "the loop gives no step function")
    sequences.settle(Attending(), off_clock, [item])
    assert sequences.counts == 0 and sequences.why_not == "the loop gives no step function"
    assert sequences.model_counts(BatchCounts(10, 20, 0, 5, 10, 0), item) is None


def test_after_the_window_a_loop_with_no_step_to_replay_pays_nothing_for_its_padded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a StepProfiler gives no step function: each padded batch's sequences cannot be counted alone, and
    # the meter once paused and resumed its clock for them (two synchronizations a step on a GPU) and
    # said a count ran for each
    synchronized: list[int] = []
    monkeypatch.setattr(CpuClock, "synchronize", lambda self: synchronized.append(1))
    model = Attending()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # no audit (flops_audit="auto" places one by the steps' timings: a pause and a resume of its own)
    prof = StepProfiler(model, profile_step=1, clean_steps=2, log=lambda m, s: None, log_dir=tmp_path,
                        log_every_n_steps=5, print_profile=False, flops_audit=0)  # fmt: skip
    each = []
    for i in range(24):
        batch = padded([2 + i % 5, 6])
        before = len(synchronized)
        with prof.step(batch):
            step(model, batch)
            optimizer.step()
            optimizer.zero_grad()
        each.append(len(synchronized) - before)
    prof.close()
    assert prof.result is not None
    after = each[max(prof.result.steps.clean) + 1 :]
    assert len(after) >= 10 and set(after) <= {0, 1} and sum(after) <= len(after) // 5 + 1  # the logs' only
    saved = tmp_path / "flops_profile_step1.json"  # rewritten at the run's end with the work since
    assert json.loads(saved.read_text()).get("after_window", {}).get("counts", 0) == 0


def test_a_plain_batch_is_its_own_model_work_with_nothing_counted() -> None:
    batch = padded([4, 4])
    sequences = SequenceFlops()
    item = laid_out(batch, None)
    sequences.settle(Attending(), OffClock(), [item])
    counts = BatchCounts(10, 20, 0, 5, 10, 0)
    assert sequences.counts == 0 and sequences.model_counts(counts, item) == counts


class Sink:
    """Keeps the metrics logged; no files, no console."""

    is_logging_rank = True

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log_dir(self) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append(metrics)

    def console(self, text: str) -> None:
        pass

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        pass


def packed(lengths: list[int]) -> dict[str, torch.Tensor]:
    """One row of sequences of ``lengths``, packed: position ids restart at each."""
    total = sum(lengths)
    ids = torch.randint(1, VOCAB, (1, total), generator=torch.Generator().manual_seed(total))
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, total)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}


def packed_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    step(model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})


def test_packed_rows_after_the_window_meter_sequences_as_samples_and_their_work_alone() -> None:
    torch.manual_seed(0)
    model = Attending()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = Options(profile_step=0, clean_steps=2, flops_audit=0)
    session = StepSession(options, "test", publish=publish)
    session.train_start(0)
    rows = [[3, 5, 2], [4, 4], [6, 1, 3], [2, 2, 2, 2], [5, 5], [7, 3], [1, 8], [3, 3, 3]]
    window = len(laid_out_window(session, model, optimizer, rows))
    assert session.result is not None and session.result.layout is not None
    assert session.result.layout.packed
    after = [[2, 8], [4, 3, 3], [9, 1], [1, 1, 8]]  # rows the window counted; lengths it can predict
    sink = Sink()
    for i, lengths in enumerate(after):
        run_step(session, model, optimizer, packed(lengths), window + i, sink)
    session.log_throughput(window + len(after), sink)
    (metrics,) = sink.logged
    sequences = sum(len(lengths) for lengths in after)
    alone = sum(counted(model, packed([n])).run_flops for lengths in after for n in lengths)
    per_sample = metrics[names.THROUGHPUT_FLOPS_PER_SEC] / metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
    assert per_sample == pytest.approx(alone / sequences, rel=1e-9)  # a sequence is a sample: its own work
    assert metrics[names.THROUGHPUT_PROFILER_SECONDS] == 0.0  # every length predicted: nothing counted
    session.train_end(window + len(after), sink)


def run_step(
    session: StepSession,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    number: int,
    sink: Sink,
    loss_of: Callable[..., torch.Tensor] = attending_loss,
    replay: Callable[..., None] = packed_step,
) -> None:
    """One training step through the session: ``loss_of``'s forward, its backward, SGD; ``replay``: the
    step again, for a fake count."""
    session.step_start(number, model)
    optimizer.zero_grad()
    session.micro_batch_start(batch, Replay(replay, batch))
    loss = loss_of(model, batch)
    session.phase(BACKWARD)
    loss.backward()
    session.micro_batch_end()
    session.phase(OPTIMIZER_STEP)
    optimizer.step()
    session.step_end(number + 1, sink)


def laid_out_window(
    session: StepSession, model: nn.Module, optimizer: torch.optim.Optimizer, rows: list[list[int]]
) -> list[int]:
    """Steps of packed rows until the window ended; their numbers."""
    ran = []
    for number, lengths in enumerate(rows):
        if session.result is not None:
            break
        run_step(session, model, optimizer, packed(lengths), number, Sink())
        ran.append(number)
    return ran


class Translating(nn.Module):
    """A toy encoder-decoder (its config says so, as transformers' do): the encoder attends over its mask,
    the decoder causally to itself and to the encoder, a loss over its labels not -100. Its work grows as
    n^2, d^2 and n*d in its encoder's and decoder's lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(is_encoder_decoder=True, to_dict=dict)
        self.embed, self.out = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        padding = attention_mask[:, None, :] == 0
        h = self.embed(input_ids)
        h = (h @ h.transpose(-1, -2)).masked_fill(padding, -1e9).softmax(-1) @ h
        y = self.embed(labels.clamp(min=0))
        later = torch.ones(y.shape[1], y.shape[1], dtype=torch.bool, device=y.device).triu(1)
        y = (y @ y.transpose(-1, -2)).masked_fill(later, -1e9).softmax(-1) @ y
        y = (y @ h.transpose(-1, -2)).masked_fill(padding, -1e9).softmax(-1) @ h
        return nn.functional.cross_entropy(self.out(y).flatten(0, 1), labels.flatten(), ignore_index=-100)


def translations(pairs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Rows of (input, labels) lengths, each padded to the longest (labels with -100)."""
    longest, most = max(n for n, _ in pairs), max(d for _, d in pairs)
    generator = torch.Generator().manual_seed(len(pairs) * longest + most)
    ids = torch.randint(1, VOCAB, (len(pairs), longest), generator=generator)
    mask = torch.tensor([[1] * n + [0] * (longest - n) for n, _ in pairs])
    labels = torch.randint(1, VOCAB, (len(pairs), most), generator=generator)
    real = torch.tensor([[1] * d + [0] * (most - d) for _, d in pairs])
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels.masked_fill(real == 0, -100)}


def translation_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch)


def translation_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    translation_loss(model, batch).backward()


TRANSLATING = (translation_loss, translation_step)  # run_step's loss and replay for an encoder-decoder


def alone(model: nn.Module, batch: dict[str, torch.Tensor]) -> BatchCounts:
    """The counts of each row's pair alone: its encoder's tokens, its decoder's (the engine, summed)."""
    n, d = batch["attention_mask"].sum(1).tolist(), (batch["labels"] != -100).sum(1).tolist()
    total = BatchCounts.zero()
    for r, (encoder, decoder) in enumerate(zip(n, d, strict=True)):
        row = {"input_ids": batch["input_ids"][r : r + 1, :encoder]}
        row |= {"attention_mask": batch["attention_mask"][r : r + 1, :encoder]}
        row |= {"labels": batch["labels"][r : r + 1, :decoder]}
        total = total.plus(counted(model, row, translation_step))
    return total


def test_an_encoder_decoders_rows_are_counted_as_pairs_in_the_window_and_after_it() -> None:
    torch.manual_seed(0)
    model = Translating()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=2, flops_audit=0), "test", publish=publish)
    session.train_start(0)
    generator = torch.Generator().manual_seed(0)
    window = [
        [(int(n), int(d)) for n, d in torch.randint(2, 9, (4, 2), generator=generator).tolist()]
        for _ in range(12)
    ]
    batches = []
    for number, pairs in enumerate(window):
        if session.result is not None:
            break
        batches.append(translations(pairs))
        run_step(session, model, optimizer, batches[-1], number, Sink(), *TRANSLATING)
    result = session.result
    assert result is not None and result.layout is not None and not result.layout.decoder_padding
    for clean, number in zip(result.figures().steps, result.steps.clean, strict=True):
        own = alone(model, batches[number])
        assert (clean.work.counts.model_fwd_flops, clean.work.counts.model_bwd_flops) == own[:2]
        assert clean.work.counts.run_flops > own.run_flops  # the padding of both is apart
    # after the window: each pair's own work, a pair a sample
    after, sink = [translations([(3, 7), (8, 2), (5, 5)]), translations([(2, 2), (6, 8)])], Sink()
    for i, batch in enumerate(after):
        run_step(session, model, optimizer, batch, len(batches) + i, sink, *TRANSLATING)
    session.log_throughput(len(batches) + len(after), sink)
    (metrics,) = sink.logged
    per_sample = metrics[names.THROUGHPUT_FLOPS_PER_SEC] / metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
    assert per_sample == pytest.approx(sum(alone(model, b).run_flops for b in after) / 5, rel=1e-9)
    session.train_end(len(batches) + len(after), sink)


@pytest.mark.parametrize("steps", [2, 3])
def test_a_window_cut_before_its_clean_steps_reads_one_steps_flops_and_tokens_and_says_they_are_as_run(
    steps: int,
) -> None:
    """The run ends in the module-timing steps, each of another length: the step timed instead of the
    clean ones is the one whose batch the profile counted (its tokens with its flops), and its flops are
    its batch as run, padding in, said so."""
    torch.manual_seed(0)
    model = Attending()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=2, flops_audit=0), "test", publish=publish)
    batches = [padded([2, 9]), padded([3, 12, 5]), padded([4, 6])][:steps]
    with pytest.warns(UserWarning, match="rest on 0 clean step"):
        session.train_start(0, max_steps=steps)
    for number, batch in enumerate(batches):
        run_step(session, model, optimizer, batch, number, Sink(), replay=step)
    session.train_end(steps, Sink())
    result = session.result
    assert result is not None and result.steps.clean == ()
    timed = result.steps.profile_step  # a module-timing step, its batch counted off the clock
    assert timed in result.steps.module_timing and result.steps.latency_source.startswith("the module timing")
    batch = batches[timed]
    work = result.figures().median_step().work
    real = int(batch["attention_mask"].sum())
    rows, positions = batch["input_ids"].shape
    assert (work.samples, work.positions, work.real_tokens) == (rows, rows * positions, real)
    assert work.counts.run_flops == counted(model, batch).run_flops  # that step's batch as run
    assert result.layout is not None and result.layout.padding > 0
    assert result.layout.not_apart == "no clean step ran: the step timed instead was counted as run"


class PooledNorm(nn.Module):
    """Attention, then each row's mean token through a BatchNorm: a batch of one row cannot train it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(VOCAB, WIDTH), nn.BatchNorm1d(WIDTH)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        scores = (h @ h.transpose(-1, -2)).masked_fill(attention_mask[:, None, :] == 0, -1e9)
        h = scores.softmax(-1) @ h
        pooled = (h * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        return self.out(self.norm(pooled))


class Console(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def console(self, text: str) -> None:
        self.text += text


def test_a_sequence_that_cannot_run_alone_leaves_the_padding_in_said_and_the_module_view_whole() -> None:
    """A model whose one-row batch fails (BatchNorm in training): each sequence alone cannot be counted,
    so model flops are the batches as run, the summary warns, and the reason is in the report; the fake
    counts of the batches as run go on (the module-timing steps' trees, the clean steps' new shapes)."""
    torch.manual_seed(0)
    model = PooledNorm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lengths = torch.randint(2, 30, (16, 4), generator=torch.Generator().manual_seed(1)).tolist()
    batches = [padded(row) for row in lengths]
    session = StepSession(Options(profile_step=1, clean_steps=3, flops_audit=0), "test", publish=publish)
    session.train_start(0)
    console = Console()
    window = []
    for number, batch in enumerate(batches):
        if session.result is not None:
            break
        run_step(session, model, optimizer, batch, number, console, loss_of=attending_loss, replay=step)
        window.append(batch)
    result = session.result
    assert result is not None and result.layout is not None and result.steps.clean
    assert result.layout.not_apart.startswith(
        "one sequence alone could not be counted (ValueError: Expected more than 1 value per channel"
    )
    assert result.steps.module_shapes_match  # the module-timing steps' own batches counted off the clock
    assert "no module timing" not in console.text
    assert "warning: model flops and MFU count the padding (not told apart)" in console.text
    as_run = {counted(model, batches[n]).run_flops for n in result.steps.clean}
    work = result.figures().median_step().work.counts
    assert work.model_flops == work.run_flops in as_run
    sink = Sink()
    after = batches[len(window) :]
    for i, batch in enumerate(after):
        run_step(session, model, optimizer, batch, len(window) + i, sink, loss_of=attending_loss, replay=step)
    session.log_throughput(len(batches), sink)
    (metrics,) = sink.logged
    per_sample = metrics[names.THROUGHPUT_FLOPS_PER_SEC] / metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
    assert per_sample == pytest.approx(sum(counted(model, b).run_flops for b in after) / (4 * len(after)))
    session.train_end(len(batches), sink)
