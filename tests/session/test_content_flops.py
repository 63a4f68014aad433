"""Models whose flops are no polynomial of the batch's shapes (issue 32), each against an independent
count: our engine re-run on each clean step's batch with that step's weights (a copy of the model)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.options import Options
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.publish import publish
from flops_callbacks.session.batch import leading_batch_size
from flops_callbacks.session.meter import ThroughputMeter
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.step_session import StepSession
from tests.session.test_throughput import Quiet

D, VOCAB = 16, 32


class LengthBranch(nn.Module):
    """Two more MLP blocks when the sequence is longer than 48."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks[: 3 if ids.shape[1] > 48 else 1]:
            h = h + torch.relu(block(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


class ChunkedAttention(LengthBranch):
    """Full attention up to length 64, local attention in chunks of 32 above it."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        chunk = ids.shape[1] if ids.shape[1] <= 64 else 32
        parts = []
        for part in h.split(chunk, dim=1):
            parts.append(torch.softmax(part @ part.transpose(1, 2) / 4, -1) @ part)
        h = h + self.blocks[0](torch.cat(parts, 1))
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


class PaddingFree(LengthBranch):
    """MLPs and head on the real tokens only: ``h[attention_mask]``."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)[mask.bool()]
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return F.cross_entropy(self.head(h), ids[mask.bool()])


class TopOneMoE(nn.Module):
    """A top-1 router over 4 experts, each running on at most ``capacity`` of the tokens routed to it."""

    def __init__(self, experts: int = 4, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D)) for _ in range(experts)
        )
        self.head = nn.Linear(D, VOCAB)
        self.capacity_factor = capacity_factor

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).flatten(0, 1)
        choice = self.router(h).argmax(-1)
        capacity = math.ceil(self.capacity_factor * h.shape[0] / len(self.experts))
        out = h.clone()
        for e, expert in enumerate(self.experts):
            chosen = torch.nonzero(choice == e).flatten()[:capacity]
            out = out.index_add(0, chosen, expert(h[chosen]))
        return F.cross_entropy(self.head(out), ids.flatten())


class KeepsMode(LengthBranch):
    """Switches to a wider path for good after its first batch shorter than 16 (a mode it keeps)."""

    wide = False

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.wide = self.wide or ids.shape[1] < 16
        h = self.embed(ids)
        for block in self.blocks[: 3 if self.wide else 1]:
            h = h + torch.relu(block(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


Batch = tuple[torch.Tensor, torch.Tensor]


def batch_of(length: int, real: int | None = None, size: int = 4, vocab: int = VOCAB) -> Batch:
    ids = torch.randint(0, vocab, (size, length))
    mask = torch.ones_like(ids)
    if real is not None:
        for row in mask:
            row[torch.randint(max(real - 4, 1), real + 1, ()).item() :] = 0
    return ids, mask


def truth(model: nn.Module, batch: Batch) -> int:
    """Our engine on a copy of the model with this step's weights: the batch's model flops."""
    twin = copy.deepcopy(model)
    tracer = CountingEngine(twin)
    tracer.start()
    try:
        twin(*batch).backward()
    finally:
        tracer.stop()
    return BatchCounts.of(tracer.profile().model).model_flops


def train(
    model: nn.Module, batches: list[Batch], after: int, clean_steps: int = 6
) -> tuple[StepSession, dict[int, int], list[tuple[int, int]]]:
    """Run a window from step 0 over ``batches``, then ``after`` more of them metered; returns the session,
    the truth of each window step, and each metered step's (metered flops, truth)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = StepSession(
        Options(profile_step=0, clean_steps=clean_steps, flops_audit=0), "test", publish=publish
    )
    # audits: a shape outside the range is counted
    session.meter = session.job_meter.meter = ThroughputMeter(leading_batch_size)
    session.train_start(0)
    truths: dict[int, int] = {}
    metered: list[tuple[int, int]] = []
    for step, batch in enumerate(batches):
        if session.result is not None and len(metered) >= after:
            break
        true = truth(model, batch)
        truths[step] = true
        session.step_start(step, model)
        before = session.meter._flops if session.job_meter.running else None
        optimizer.zero_grad(set_to_none=True)
        session.micro_batch_start(batch)
        loss = model(*batch)
        session.phase(BACKWARD)
        loss.backward()
        session.micro_batch_end()
        session.phase(OPTIMIZER_STEP)
        optimizer.step()
        # an audit: out of the interval
        audited = session.job_meter.running and session.meter._paused_at is not None
        if before is not None and session.meter._flops is not None and not audited:
            metered.append((int(session.meter._flops - before), true))
        session.step_end(step + 1, Quiet())
    return session, truths, metered


def window_ratio(session: StepSession, truths: dict[int, int]) -> float:
    r = session.result
    assert r is not None
    return r.figures().counts.model_flops / sum(truths[n] for n in r.steps.clean)


def lengths(early: range, late: range, n_early: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    pick = lambda r: int(torch.randint(r.start, r.stop, (), generator=g))  # noqa: E731
    return [pick(early) for _ in range(n_early)] + [pick(late) for _ in range(n - n_early)]


def crossed(model_type: Callable[[], nn.Module], early: range, late: range) -> None:
    torch.manual_seed(0)
    model = model_type()
    batches = [batch_of(L) for L in lengths(early, late, 12, 80)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        session, truths, metered = train(model, batches, after=20, clean_steps=8)
    ratio = window_ratio(session, truths)
    after = sum(m for m, _ in metered) / sum(t for _, t in metered)
    print(f"{model_type.__name__}: window {ratio:.4f}, after {after:.4f}, {session.result.steps}")
    assert abs(ratio - 1) < 0.01 and abs(after - 1) < 0.01
    assert not any("content" in str(w.message) for w in said)  # shapes alone explain it: no content said


def test_a_length_branch_crossed_by_later_batches_is_counted_then_verified_not_extrapolated() -> None:
    crossed(LengthBranch, range(12, 49), range(49, 129))


def test_chunked_attention_above_a_length_is_counted_then_verified_not_extrapolated() -> None:
    crossed(ChunkedAttention, range(12, 65), range(65, 129))


def content(model: nn.Module, batches: list[Batch]) -> tuple[float, StepSession]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        session, truths, _ = train(model, batches, after=0, clean_steps=6)
    found = [w for w in said if "depend on the batch's content" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in said]
    r = session.result
    assert r is not None and r.flops_sources is not None and r.flops_sources.content
    assert set(r.flops_sources.sources) == {"estimated"} and r.flops_sources.uncertainty > 0
    return window_ratio(session, truths), session


def test_padding_free_at_one_shape_is_said_to_depend_on_content_and_estimated_within_10_percent() -> None:
    torch.manual_seed(0)
    reals = [60] * 6 + [int(60 - 44 * i / 30) for i in range(30)]  # real lengths fall from 56..60 to ~12..16
    ratio, session = content(PaddingFree(), [batch_of(64, real) for real in reals])
    print(f"padding-free: window {ratio:.4f}, {session.result.flops_sources}")
    assert abs(ratio - 1) < 0.10


def test_moe_routing_with_capacity_is_said_to_depend_on_content_and_estimated_within_10_percent() -> None:
    torch.manual_seed(0)
    model = TopOneMoE()
    batches = [batch_of(32, vocab=VOCAB if i % 3 else 4) for i in range(40)]  # some batches of few tokens
    ratio, session = content(model, batches)
    print(f"moe: window {ratio:.4f}, {session.result.flops_sources}")
    assert abs(ratio - 1) < 0.10


def test_a_mode_the_model_keeps_is_found_by_counting_a_known_shape_again() -> None:
    torch.manual_seed(0)
    batches = [batch_of(32)] * 4 + [batch_of(12)] + [batch_of(32) for _ in range(30)]
    ratio, session = content(KeepsMode(), batches)
    print(f"mode: window {ratio:.4f}, {session.result.flops_sources}")
    assert abs(ratio - 1) < 0.01  # after the switch every batch does the same work: neighbours are exact
