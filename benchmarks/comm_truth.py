"""Truth of the exposed communication: the reported ``exposed_comm_latency`` of a 2-process DDP step
(gloo on CPU) against the same step's cost of synchronizing, measured from outside.

"True" is the framework's own training step, timed on each rank from the framework's step-begin event
to its step-end event (:class:`TrainBlocks`): the median such step with gradient sync less the median
one under no_sync (DDP's ``require_backward_grad_sync``, the flag ``no_sync()`` sets), in blocks of
each kind in turn (``--pairs`` steps of each, a block's first step left out), a barrier before a
block's first step only, as a training run's steps follow each other; half the blocks before the
window and half after it, so that they bracket its stretch of the run; then the ranks' mean (the
reported figure is the ranks' mean too). It is the very step the window profiles, with the
framework's data, optimizer and callbacks (which cancel out), and what a stopwatch over a run that
synchronizes against one that does not would count, the wait for a late rank included. "Aligned ms"
is the same over training blocks run in the same rounds with a barrier before every step (after its
batch is read, as the window's vote lines the ranks up before a communication step).

The other truths, printed beside it, time outside steps instead (forward, backward and an SGD step of
the same DDP model, called by the benchmark after training or between the window's steps).
"After ms": blocks of synced steps and of no_sync steps in turn after training, a barrier before each
step. "Pairs ms" is the same difference over interleaved pairs (sync first, then no_sync first, in
turn), run in the same rounds: a step's time depends on the step before it (the base model's no_sync
step runs 9-26% longer after a synced one), so pairs charge part of the sync to the no_sync steps.
"Free ms" is the blocks' difference with no barrier but before a block's first step: without a
barrier a synced step also waits for whatever made the other rank late in the step before (its
optimizer step, its data, the end of the last all-reduce, which the ranks do not leave at once).
"Stretch ms" (with ``--stretch``) is the blocks' difference taken while the window runs
(:class:`Stretch`): after each training step from the first communication step until the profile is
published, a block of three synced and one of three no_sync outside steps, a barrier before each
("s.free ms": two more such blocks with no barrier but before their first step). On a shared CPU the
same all-reduce's cost moves by up to 1.5x between stretches of a second or two, so a truth taken after
training is of another stretch than the window's; with ``--stretch`` the window's steps follow outside
steps rather than training steps. The last line counts the Lightning and HF runs within the goal against
each truth.
"Halves" is the truth of the blocks before the window over that of the blocks after it (half the
steps each): the reference's own repeatability within one run, against which the reported figure's
misses can be weighed (a truth whose halves disagree by more than the goal's band cannot hold a
single window within it every time).
"Reported" is the profile's ``flops_profiler/exposed_comm_latency`` from the same processes' training
run; "wait ms" the part of it that was compute waiting for a core while communication ran
(``core_wait``, moved from overlapped to exposed: docs/communication.md); "ranks ms" its ranks' range
(one far above the other: that rank waited on the other).
Each framework runs twice: the base model (6 x Linear(256, 256), DDP's default buckets),
and one whose communication is slower (6 x Linear(768, 768), 1 MB buckets: 9x the bytes in 6
all-reduces), to show the figure follows. Goal: reported / true within [0.75, 1.33].

The outside steps run on the framework's own DDP model where it can be called outside its loop (the
HF Trainer's ``model_wrapped``, the loop's); Lightning's wrapper calls ``training_step`` only inside its
loop, so there the same module is wrapped by a ``DistributedDataParallel`` of Lightning's defaults.

``--perturbation`` measures instead what ``torch.profiler`` itself costs: in a plain DDP loop, sync -
no_sync without the profiler and with every step under the communication steps' recorder, and the
profiled synced steps' median exposed time, with the wait for a core moved and ("ops only") without.

``--witness`` adds a second reference that needs no profiler: a DDP communication hook (the default
all-reduce, timed from its launch to its completion with ``perf_counter``) records every bucket's
all-reduce in the training run, by the step it ran in. The "hook ms" column is the union of those
intervals in the window's kept communication step, the ranks' mean: what ``comm_latency`` measures
("comm/hook"; the HF Trainer's also counts its DDP's all-reduce of the used-parameter map, made under
``find_unused_parameters``, which the hook does not see), and
for the base model in the loop and Lightning (one bucket, at the backward's end, under no compute)
what ``exposed_comm_latency`` measures too. It tells the method's error on the very step reported apart
from the spread between that step and the outside steps' medians. With ``--perturbation`` it gives, of
the plain loop's synced steps, the median all-reduce unprofiled and profiled, and the range of the
medians of each 9 in a row (what a window of nine steps could read, with no profiler: the hook only). The
hook runs Python on gloo's thread: runs with it are not the runs without it.

``--device cuda`` runs the loop (and ``--perturbation``) over NCCL with the model on a GPU, the outside
steps timed between synchronizations. With fewer GPUs than ranks, the ranks share a GPU: NCCL refuses
two ranks on one device of one host, so each rank names a host of its own (``NCCL_HOSTID``) and NCCL
moves the data over sockets. That exercises the NCCL path's recording and classing; its times are
those of two processes taking turns on one GPU, not of a multi-GPU step.

Why 100 steps of each kind: the difference of two medians of 15 steps each moved 1.6-4.4 ms for the
base model's 2.8 ms within one run; of 100 in blocks, one framework's truths spread 21-63% over seven
runs (max / min), the machine's drift between runs included.

``--comm-steps N`` fixes the window's count of communication steps (default ``"auto"``): what a median
of more steps buys.

    python benchmarks/comm_truth.py [--frameworks loop,lightning,hf] [--cases base,slower] [--pairs 100]
                                    [--repeats 1] [--device cpu|cuda] [--witness] [--comm-steps auto|N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flops_callbacks.session.window_plan import COMM_MAX, MODULE_TIMING_STEPS, before_clean  # noqa: E402
from tests.comm_workers import BATCH, Pairs, Regressor  # noqa: E402
from tests.support import end_process  # noqa: E402

CLEAN, WARMUP = 3, 4  # WARMUP: training steps before the first training block (a process's first run slow)


def train_steps(profile_step: int, comm_steps: str) -> int:
    """Training steps: the window ends by then, with as many communication steps as ``comm_steps`` runs
    (``"auto"``: as many as it may)."""
    return profile_step + before_clean(comm=COMM_MAX if comm_steps == "auto" else int(comm_steps)) + CLEAN + 2


CASES = {"base": (256, 25), "slower comm": (768, 1)}  # width, DDP bucket MB
GOAL = (0.75, 1.33)  # reported / true
# the truths printed (module doc): the key in a run's figures, its column's name and width; the first
# is the truth of the goal
TRUTHS = (
    ("true", "true", 8), ("aligned", "aligned", 10), ("after", "after", 8), ("stretch", "stretch", 10),
    ("stretch_free", "s.free", 9), ("pairs", "pairs", 8), ("free", "free", 7),
)  # fmt: skip
TIMEOUT = timedelta(seconds=300)


BLOCK = 6  # steps of one kind in a row; a block's first step, after another block's, is not counted
STRETCH = 3  # counted steps of each kind after each window step (Stretch)


def schedule(pairs: int) -> list[tuple[str, bool]]:
    """(block, sync) of each outside step: rounds of a block of synced steps, one of no_sync steps, one
    of ``BLOCK - 1`` interleaved pairs (sync first, then no_sync first, in turn across the rounds: half
    the no_sync steps follow a synced one) and the free-running blocks of each kind (no barrier but
    before a block's first step), the five in a rotating order so that the machine's drift falls on
    each alike; at least ``pairs`` counted steps of each kind per truth (whole rounds). Block names:
    "S", "N", free "s", "n" (a trailing "0" marks a block's uncounted first step), "P"."""
    kept = BLOCK - 1
    rounds, steps, order = math.ceil(pairs / kept), [], "SNPsn"
    for r in range(rounds):
        for b in order[r % 5 :] + order[: r % 5]:
            if b == "P":
                firsts = [(r * kept + i) % 2 == 0 for i in range(kept)]  # the pair's first is synced
                steps += [("P", sync) for first in firsts for sync in (first, not first)]
            else:
                steps += [(b + "0", b in "Ss")] + [(b, b in "Ss")] * kept
    return steps


class Truths(NamedTuple):
    """One rank's outside figures (seconds): :func:`outside`'s three differences, and where its steps
    were profiled, the counted synced block steps' median exposed time, with the wait for a core moved
    and from the op intervals alone (else None)."""

    blocks: float
    pairs: float
    free: float
    exposed: float | None = None
    ops_only: float | None = None


def _synchronize(model: Any) -> None:
    """Wait for ``model``'s GPU, if it is on one (a step's time, not its launches')."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def sync_cost(seconds: dict[tuple[bool, bool], list[float]], kind: bool) -> float | None:
    """Median synced less median no_sync step of ``seconds``, keyed (synced, ``kind``) (seconds;
    None: a kind with no step)."""
    synced, unsynced = seconds.get((True, kind)), seconds.get((False, kind))
    if not synced or not unsynced:
        return None
    return statistics.median(synced) - statistics.median(unsynced)


def timed_step(
    ddp: Any,
    loss: Any,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    sync: bool,
    mark: Any = lambda phase: None,
) -> float:
    """One outside step (forward, backward, optimizer step), synced or under ``no_sync()``, its phases
    marked by ``mark`` as the session marks them: its seconds, between synchronizations on a GPU."""
    from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP

    _synchronize(ddp)
    start = time.perf_counter()
    with contextlib.nullcontext() if sync else ddp.no_sync():
        mark(FORWARD)
        out = loss(ddp, batch)
        mark(BACKWARD)
        out.backward()
    mark(OPTIMIZER_STEP)
    optimizer.step()
    optimizer.zero_grad()
    _synchronize(ddp)
    mark("")
    return time.perf_counter() - start


def outside(
    ddp: nn.Module,
    loss: Any,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    pairs: int,
    profiled: bool = False,
    clock: AllReduceClock | None = None,
) -> Truths:
    """This rank's cost of synchronizing a step (seconds), three ways over one :func:`schedule`:
    "blocks", the median synced step in a run of synced steps less the median no_sync step in a run of
    no_sync steps (each block's first step left out), each step after a barrier; "pairs", the median
    synced less the median no_sync step of interleaved pairs, after a barrier each; and "free", blocks
    run as a training run runs them, a barrier before a block's first step only (module doc). Why
    blocks and pairs: a step's time depends on the step before it (for the base model a no_sync step
    after a synced one runs 9-26% longer than after a no_sync one, benchmarks/README.md), and a
    training run is synced steps after synced steps, as the window's are. With ``profiled``, every step
    runs under the communication steps' recorder (started before the barrier, phases marked as the
    session marks them), and the counted synced block steps' median exposed time comes too, with the
    wait for a core moved and from the op intervals alone. A ``clock`` hooked on ``ddp`` files the
    i-th counted synced block step under step i (the other steps under None)."""
    from flops_callbacks.communication.breakdown import breakdown
    from flops_callbacks.communication.recorder import CommRecorder

    cuda = next(ddp.parameters()).is_cuda
    seconds: dict[tuple[str, bool], list[float]] = {}
    exposed: list[float] = []
    ops_only: list[float] = []
    counted = 0
    for i, (block, sync) in enumerate(schedule(pairs)):
        batch = batches[i % len(batches)]
        recorder = CommRecorder(cuda=cuda) if profiled else None
        if recorder is not None:
            recorder.start()
        mark = recorder.mark if recorder is not None else lambda phase: None
        if clock is not None:
            clock.step = counted if block == "S" else None
        counted += block == "S"
        if block not in ("s", "n"):  # a free-running block's steps follow each other as training's do
            torch.distributed.barrier()
        seconds.setdefault((block, sync), []).append(timed_step(ddp, loss, batch, optimizer, sync, mark))
        if recorder is not None:
            recorder.stop()
            split = recorder.breakdown()
            if block == "S" and split is not None and recorder.events is not None:
                exposed.append(split.step.exposed)
                unmoved = breakdown(recorder.events._replace(waits=()))  # the op intervals alone
                ops_only.append(unmoved.step.exposed if unmoved is not None else math.nan)
    med = statistics.median
    return Truths(
        blocks=med(seconds["S", True]) - med(seconds["N", False]),
        pairs=med(seconds["P", True]) - med(seconds["P", False]),
        free=med(seconds["s", True]) - med(seconds["n", False]),
        exposed=med(exposed) if exposed else None,
        ops_only=med(ops_only) if ops_only else None,
    )


class AllReduceClock:
    """``hook``, a DDP communication hook: the default all-reduce (divided by the world size, as DDP's
    own), each bucket's timed from launch to completion by the step it ran in (``step``, set by the loop)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.spans: dict[int | None, list[tuple[float, float]]] = {}

    # unannotated: DDP compares a hook's annotations with its classes, and here they are strings
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        start, step = time.perf_counter(), self.step
        world = torch.distributed.get_world_size()
        work = torch.distributed.all_reduce(bucket.buffer().div_(world), async_op=True)

        def done(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self.spans.setdefault(step, []).append((start, time.perf_counter()))
            return future.value()[0]

        return work.get_future().then(done)  # type: ignore[no-any-return]

    def seconds(self, step: int) -> float | None:
        """The union of step ``step``'s all-reduces (None: none ran in it)."""
        from flops_callbacks.communication.intervals import merge, total

        spans = self.spans.get(step)
        return total(merge(spans)) if spans else None


class Stretch:
    """The truth of the window's own stretch of the run: after each training step from the first
    communication step until the profile is published, a block of :data:`STRETCH` synced and one of
    no_sync outside steps (a barrier before each, a block's first step left out; which comes first
    alternates), so that the sync's cost is sampled while the window runs (module doc: the same
    all-reduce's cost moves by up to 1.5x between stretches of a second or two on a shared CPU)."""

    def __init__(
        self, loss: Any, batch: Any, clock: AllReduceClock | None, profile_step: int, on: bool
    ) -> None:
        self.loss, self.batch, self.clock, self.profile_step, self.on = loss, batch, clock, profile_step, on
        self.ddp: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.seconds: dict[tuple[bool, bool], list[float]] = {}

    def use(self, ddp: nn.Module) -> None:
        self.ddp, self.optimizer = ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def after(self, step: int, published: bool) -> None:
        """Training step ``step`` (0-based) ended; ``published``: the window's figures are out."""
        if (
            not self.on
            or published
            or step < self.profile_step + MODULE_TIMING_STEPS
            or self.optimizer is None
        ):
            return
        kept = self.clock.step if self.clock is not None else None
        if self.clock is not None:
            self.clock.step = None  # the witness files the window's own steps only
        kinds = [(True, False), (False, False), (True, True), (False, True)]  # (sync, free)
        for sync, free in kinds[step % 4 :] + kinds[: step % 4]:
            for i in range(STRETCH + 1):
                if not free or i == 0:
                    torch.distributed.barrier()
                seconds = timed_step(self.ddp, self.loss, self.batch, self.optimizer, sync)
                if i:
                    self.seconds.setdefault((sync, free), []).append(seconds)
        if self.clock is not None:
            self.clock.step = kept

    def truth(self, free: bool = False) -> float | None:
        """Median synced less median no_sync step (seconds; ``free``: of the blocks with no barrier but
        before their first step; None: no block ran)."""
        return sync_cost(self.seconds, free)


class TrainBlocks:
    """The truth of the framework's own training step: training steps in blocks of :data:`BLOCK`,
    synced and under no_sync in turn (DDP's ``require_backward_grad_sync``, the flag ``no_sync()``
    sets), a barrier before a block's first step only (left out), each timed from the framework's
    step-begin event to its step-end event: ``sync - no_sync`` of the very step the window profiles
    (its data, optimizer and framework work cancel out), as a training run runs it. Each round also
    runs a synced and a no_sync block "aligned", a barrier before every step (after its batch is read,
    as the window's vote lines the ranks up before a communication step): that difference leaves out
    a rank made late by its data or the step before. Half the rounds run before the window (from step
    :data:`WARMUP` to ``profile_step``), half once it is published, so that the two bracket the
    window's stretch of the run."""

    def __init__(self, pairs: int) -> None:
        rounds = max(2, math.ceil(pairs / (BLOCK - 1)))  # a round: a synced and a no_sync block of each
        rounds += rounds % 2  # even: as many rounds, and of each order, before the window as after it
        orders = [(r % 2 == 0, r % 2 == 1) for r in range(rounds)]  # which comes first alternates
        self.plan = [
            (i == 0, sync, aligned)
            for order in orders
            for aligned in (False, True)
            for sync in order
            for i in range(BLOCK)
        ]
        self.steps = len(self.plan)
        self.profile_step = WARMUP + self.steps // rounds * (rounds // 2)  # the window after half the rounds
        self.current: tuple[bool, bool, bool, bool, Any, float] | None = None
        # before the window (False) and after it (True): (synced, aligned) -> counted steps' seconds
        self.halves: dict[bool, dict[tuple[bool, bool], list[float]]] = {False: {}, True: {}}

    def begin(self, ddp: Any, step: int, published: bool) -> None:
        """Training step ``step`` (0-based) starts; ``published``: the window's figures are out."""
        if not self.plan or not (published or WARMUP <= step < self.profile_step):
            return
        first, sync, aligned = self.plan.pop(0)
        if first or aligned:
            torch.distributed.barrier()
        ddp.require_backward_grad_sync = sync
        _synchronize(ddp)
        self.current = (first, sync, aligned, published, ddp, time.perf_counter())

    def end(self) -> None:
        """The step that :meth:`begin` started ended (nothing if it started none)."""
        if self.current is None:
            return
        first, sync, aligned, after, ddp, start = self.current
        _synchronize(ddp)
        seconds, self.current = time.perf_counter() - start, None
        ddp.require_backward_grad_sync = True
        if not first:
            self.halves[after].setdefault((sync, aligned), []).append(seconds)

    def truth(self, aligned: bool = False) -> float | None:
        """Median synced less median no_sync training step (seconds; ``aligned``: of the blocks with a
        barrier before each step; None: no block ran)."""
        before, after = self.halves[False], self.halves[True]
        both = {key: before.get(key, []) + after.get(key, []) for key in {*before, *after}}
        return sync_cost(both, aligned)

    def half(self, after: bool) -> float | None:
        """:meth:`truth` of the free-running blocks before the window (``after`` False) or after it:
        the two halves' agreement is the reference's own repeatability (module doc)."""
        return sync_cost(self.halves[after], False)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**{k: v.to(next(model.parameters()).device) for k, v in batch.items()})["loss"]


def _group(device: str) -> torch.device:
    """This rank's process group (gloo on CPU, NCCL on a GPU) and its device (module doc: shared GPUs)."""
    if device == "cpu":
        torch.distributed.init_process_group("gloo", timeout=TIMEOUT)
        return torch.device("cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world:
        os.environ["NCCL_HOSTID"] = f"comm-truth-rank-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(gpu)
    torch.distributed.init_process_group("nccl", timeout=TIMEOUT, device_id=gpu)
    return gpu


def _ddp(width: int, bucket: int, device: torch.device) -> nn.parallel.DistributedDataParallel:
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        Regressor(width).to(device), device_ids=ids, bucket_cap_mb=bucket
    )


def perturbation(width: int, bucket: int, out: Path, pairs: int, device: str, witness: bool) -> None:
    """One 2-process run of a plain DDP loop: sync - no_sync without the profiler and under it, and the
    profiled synced steps' median exposed time: what ``torch.profiler`` itself costs the step's sync.
    With ``witness``, each synced step's all-reduces under :class:`AllReduceClock` too."""
    ddp = _ddp(width, bucket, _group(device))
    clock = AllReduceClock() if witness else None
    if clock is not None:
        ddp.register_comm_hook(None, clock.hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    batches = [next(iter(torch.utils.data.DataLoader(Pairs(width), batch_size=BATCH)))]
    outside(ddp, _loss, optimizer, batches, 10)  # warm-up
    hooked: list[list[float | None]] = []  # each synced step's all-reduces: unprofiled, profiled
    half = max(pairs // 2, 1)
    figures: list[Truths] = []
    for count, under in ((pairs, False), (half, True)):
        if clock is not None:
            clock.spans.clear()
        figures.append(outside(ddp, _loss, optimizer, batches, count, profiled=under, clock=clock))
        counted = sum(block == "S" for block, _ in schedule(count))
        hooked.append([clock.seconds(i) for i in range(counted)] if clock is not None else [])
    plain, profiled = figures
    every: list[Any] = [None] * torch.distributed.get_world_size()
    mine = (plain.blocks, profiled.blocks, profiled.exposed, profiled.ops_only, *hooked)
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() == 0:
        ranks = zip(*[e[:4] for e in every], strict=True)
        columns = [[x for x in column if x is not None] for column in ranks]
        means = [statistics.fmean(c) if c else math.nan for c in columns]  # a rank with no split: left out
        seen: dict[str, Any] = dict(zip(("true", "profiled", "exposed", "ops_only"), means, strict=True))
        for key, at in (("hook", 4), ("hook_profiled", 5)):  # each step's, the ranks' mean
            steps = zip(*[e[at] for e in every], strict=True)
            seen[key] = [statistics.fmean(step) for step in steps if None not in step]
        (out / "seen.json").write_text(json.dumps(seen))
    torch.distributed.barrier()
    end_process()  # no interpreter teardown for a gloo thread to abort in (tests/support.py)


def worker(
    framework: str,
    width: int,
    bucket: int,
    out: Path,
    pairs: int,
    device: str,
    witness: bool,
    comm_steps: str = "auto",
    stretch_blocks: bool = False,
) -> None:
    """One 2-process run under torchrun: train with the profiler, then time sync against no_sync (with
    ``witness``, every all-reduce under :class:`AllReduceClock`, the outside steps' too)."""
    from flops_callbacks import FlopsProfilerCallback, HFFlopsCallback, StepProfiler
    from flops_callbacks import metrics as names

    train = TrainBlocks(pairs)
    last = train_steps(train.profile_step, comm_steps) + train.steps
    data = Pairs(width, size=BATCH * 2 * last)  # enough for the loop's one pass (and the ranks' shards)
    batches = [next(iter(torch.utils.data.DataLoader(data, batch_size=BATCH)))]
    count = comm_steps if comm_steps == "auto" else int(comm_steps)
    options: dict[str, Any] = dict(
        profile_step=train.profile_step, clean_steps=CLEAN, print_profile=False, comm_steps=count
    )
    clock = AllReduceClock() if witness else None
    stretch = Stretch(_loss, batches[0], clock, train.profile_step, stretch_blocks)
    if framework == "loop":
        ddp: Any = _ddp(width, bucket, _group(device))
        if clock is not None:
            ddp.register_comm_hook(None, clock.hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        stretch.use(ddp)
        prof = StepProfiler(ddp, **options)
        for step, batch in enumerate(torch.utils.data.DataLoader(data, batch_size=BATCH)):
            if step == last:
                break
            if clock is not None:
                clock.step = prof.global_step
            train.begin(ddp, step, prof.result is not None)
            with prof.step(batch):
                _loss(ddp, batch).backward()
                optimizer.step()
                optimizer.zero_grad()
            train.end()
            stretch.after(step, prof.result is not None)
        prof.close()
        result = prof.result
    elif framework == "lightning":
        import lightning as L
        from lightning.pytorch.strategies import DDPStrategy

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = Regressor(width)

            def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
                return _loss(self.model, batch)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=1e-4)

        class Steps(L.Callback):
            def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
                if clock is not None:  # Lightning registers a strategy's ddp_comm_hook on CUDA only
                    trainer.strategy.model.register_comm_hook(None, clock.hook)
                # the outside steps' own DDP of the same module (module doc); Lightning's reducer, not
                # prepared by its own forward, lets these backwards be
                outer = nn.parallel.DistributedDataParallel(module.model, bucket_cap_mb=bucket)
                if clock is not None:
                    outer.register_comm_hook(None, clock.hook)
                stretch.use(outer)

            def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
                if clock is not None:
                    clock.step = trainer.global_step
                train.begin(trainer.strategy.model, trainer.global_step, callback.result is not None)

            def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
                train.end()
                stretch.after(trainer.global_step - 1, callback.result is not None)

        callback = FlopsProfilerCallback(**options)
        module = Module()
        strategy = DDPStrategy(timeout=TIMEOUT, bucket_cap_mb=bucket)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy,
            max_steps=last, callbacks=[callback, Steps()], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
        result = callback.result
        ddp = stretch.ddp
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    else:
        from transformers import Trainer, TrainerCallback, TrainingArguments

        class HFSteps(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                if clock is not None:  # the Trainer wrapped its model in DDP just before
                    trainer.model_wrapped.register_comm_hook(None, clock.hook)
                stretch.use(trainer.model_wrapped)

            def on_step_begin(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
                if clock is not None:
                    clock.step = state.global_step
                train.begin(trainer.model_wrapped, state.global_step, callback.result is not None)

            def on_step_end(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
                train.end()
                stretch.after(state.global_step - 1, callback.result is not None)

        callback = HFFlopsCallback(**options)
        args = TrainingArguments(
            output_dir=str(out / "hf"), use_cpu=True, ddp_backend="gloo", ddp_bucket_cap_mb=bucket,
            ddp_timeout=int(TIMEOUT.total_seconds()), per_device_train_batch_size=BATCH, max_steps=last,
            save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(
            model=Regressor(width), args=args, train_dataset=data, callbacks=[callback, HFSteps()]
        )
        trainer.train()
        result = callback.result
        ddp = trainer.model_wrapped
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    comm = result.comm if result is not None else None
    hook = clock.seconds(comm.median_step) if clock is not None and comm is not None else None
    if clock is not None:
        clock.step = None  # the outside steps'
    truths = outside(ddp, _loss, optimizer, batches, pairs)
    every: list[Any] = [None] * torch.distributed.get_world_size()
    mine = {  # this rank's figures, seconds (None: not taken): each printed as the ranks' mean
        "true": train.truth(),  # the training step's
        "true_before": train.half(after=False),
        "true_after": train.half(after=True),
        "aligned": train.truth(aligned=True),
        "after": truths.blocks,
        "pairs": truths.pairs,
        "free": truths.free,
        "stretch": stretch.truth(),
        "stretch_free": stretch.truth(free=True),
        "hook": hook,
    }
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() == 0:
        metrics = result.metrics() if result is not None else {}

        def mean(key: str) -> float | None:
            values = [e[key] for e in every]
            return statistics.fmean(values) if None not in values else None

        seen = {
            **{key: mean(key) for key in mine},
            "after_ranks": [e["after"] for e in every],
            "reported": metrics.get(names.EXPOSED_COMM_LATENCY),
            "comm": metrics.get(names.COMM_LATENCY),
            "overlap": metrics.get(names.COMM_OVERLAP),
            "calls": sum(r.calls for r in comm.collectives) if comm is not None else None,
            "steps": len(comm.steps) if comm is not None else None,
            "ranks": list(comm.exposed_range) if comm is not None else None,
            "wait": comm.step.core_wait if comm is not None else None,
        }
        (out / "seen.json").write_text(json.dumps(seen))
    torch.distributed.barrier()
    end_process()  # no interpreter teardown for a gloo thread to abort in (tests/support.py)


def run(
    framework: str,
    width: int,
    bucket: int,
    pairs: int,
    device: str,
    witness: bool = False,
    comm_steps: str = "auto",
    stretch: bool = False,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--worker", framework, str(width), str(bucket), folder, str(pairs),
                   device, str(int(witness)), comm_steps, str(int(stretch))]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.update(PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1")  # a crash's stacks, if one comes
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
        seen = Path(folder) / "seen.json"
        if done.returncode != 0 or not seen.exists():
            kept, log = tempfile.mkstemp(prefix="comm_truth-failed-", suffix=".log")
            with os.fdopen(kept, "w") as file:  # the whole of it: the tail below is torchrun's summary
                file.write(done.stdout + "\n" + done.stderr)
            after = "after" if seen.exists() else "before"  # rank 0 writes it after the measurement
            head = f"(ended {after} the results were written; whole output: {log})"
            return {"error": f"{head} {done.stderr[-800:]}"}
        return json.loads(seen.read_text())


def _setup(device: str) -> str:
    if device == "cpu":
        return f"gloo on CPU, torch {torch.__version__}"
    gpus = torch.cuda.device_count()
    return f"NCCL on {gpus} x {torch.cuda.get_device_name()} (2 ranks), torch {torch.__version__}"


def show_perturbation(pairs: int, repeats: int, device: str, witness: bool) -> None:
    print(f"2-process plain DDP loop over {_setup(device)}; ms, the ranks' mean")
    header = f"{'case':12} {'true':>6} {'profiled':>9} {'exposed':>8} {'ops only':>8}"
    hooks = f" {'hook':>6} {'hook profiled':>13} {'hook, 9 in a row':>16}" if witness else ""
    print(f"{header} {'exposed/true':>12} {'exposed/profiled':>16}{hooks}")
    for case, (width, bucket) in CASES.items():
        for _ in range(repeats):
            seen = run("perturbation", width, bucket, pairs, device, witness)
            if "error" in seen:
                print(f"{case:12} error: {seen['error']}")
                continue
            true, profiled, exposed, ops_only = (seen[k] for k in ("true", "profiled", "exposed", "ops_only"))
            hook = ""
            if witness:
                plain, nine = _medians(seen["hook"])[0], _medians(seen["hook"], of=9)
                hook = (
                    f" {plain * 1e3:6.2f} {_medians(seen['hook_profiled'])[0] * 1e3:13.2f} "
                    f"{min(nine) * 1e3:7.2f} .. {max(nine) * 1e3:5.2f}"
                )
            print(
                f"{case:12} {true * 1e3:6.2f} {profiled * 1e3:9.2f} {exposed * 1e3:8.2f} "
                f"{ops_only * 1e3:8.2f} "
                f"{exposed / true if true > 0 else math.nan:12.2f} "
                f"{exposed / profiled if profiled > 0 else math.nan:16.2f}{hook}"
            )


def _ratio(reported: float | None, true: float | None) -> float:
    """reported / true (NaN where either is missing or ``true`` is not positive)."""
    return reported / true if reported is not None and true is not None and true > 0 else math.nan


def _ms_ratio(true: float | None, reported: float | None, width: int) -> str:
    """``true`` in ms, ``width`` wide, and reported / true."""
    if true is None:
        return f"{'-':>{width}} {'-':>5}"
    return f"{true * 1e3:{width}.2f} {_ratio(reported, true):5.2f}"


def _medians(seconds: list[float], of: int | None = None) -> list[float]:
    """The median of ``seconds`` (``of``: of each run of ``of`` in a row, as a window's steps are);
    NaN where there are too few."""
    of = of or len(seconds)
    if not seconds or len(seconds) < of:
        return [math.nan]
    return [statistics.median(seconds[i : i + of]) for i in range(0, len(seconds) - of + 1, of)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="loop,lightning,hf")
    parser.add_argument("--cases", default="base,slower", help="of: base, slower (the slower comm)")
    parser.add_argument("--pairs", type=int, default=100, help="outside steps of each kind, per truth")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case: the median ratio")
    parser.add_argument(
        "--perturbation", action="store_true",
        help="instead: a plain DDP loop's sync - no_sync without and under torch.profiler (half the pairs)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: NCCL, the model on a GPU (the loop only; ranks share a GPU where there are fewer)",
    )  # fmt: skip
    parser.add_argument(
        "--witness", action="store_true",
        help="time every all-reduce with a DDP comm hook too (module doc): a witness of each step",
    )  # fmt: skip
    parser.add_argument(
        "--comm-steps", default="auto",
        help="the window's communication steps: 'auto' (the default) or an int (a median of more steps)",
    )  # fmt: skip
    parser.add_argument(
        "--stretch", action="store_true",
        help="also time outside blocks after each window step (stretch ms, s.free ms): its steps follow them",
    )  # fmt: skip
    parser.add_argument("--worker", nargs=9, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        framework, width, bucket, out, pairs, device, witness, comm, stretch = args.worker
        if framework == "perturbation":
            return perturbation(int(width), int(bucket), Path(out), int(pairs), device, witness == "1")
        return worker(
            framework,
            int(width),
            int(bucket),
            Path(out),
            int(pairs),
            device,
            witness == "1",
            comm,
            stretch == "1",
        )
    if not set(args.cases.split(",")) <= {"base", "slower"}:
        parser.error(f"--cases takes base, slower or both (comma-separated), got {args.cases!r}")
    if args.comm_steps != "auto" and not (args.comm_steps.isdigit() and int(args.comm_steps) > 0):
        parser.error(f"--comm-steps takes 'auto' or an int >= 1, got {args.comm_steps!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here")
    if args.device == "cuda" and not args.perturbation and args.frameworks != "loop":
        parser.error("--device cuda takes --frameworks loop (Lightning's and HF's DDP take a GPU a rank)")
    if args.device == "cuda" and args.witness:
        parser.error("--witness times gloo's all-reduces on the host: --device cpu")
    if args.perturbation:
        return show_perturbation(args.pairs, args.repeats, args.device, args.witness)
    print(
        f"2-process DDP over {_setup(args.device)}; true = the framework's own training step, "
        "median(sync) - median(no_sync), in blocks around the window"
    )
    hooks = f" {'hook ms':>7} {'comm/hook':>9}" if args.witness else ""
    others = " ".join(f"{label + ' ms':>{width}} {'ratio':>5}" for _, label, width in TRUTHS[1:])
    print(f"{'framework':10} {'case':12} {'steps':>5} {'calls':>5} {'comm ms':>8} {'overlap':>7} "
          f"{'true ms':>8} {'reported ms':>11} {'wait ms':>7} {'ratio':>6} {'ranks ms':>11} {'halves':>6} "
          f"{others}{hooks}")  # fmt: skip
    within: dict[str, list[bool]] = {}  # each truth's runs: within the goal, Lightning's and HF's
    halves_within: list[bool] = []  # the same runs' truth halves: within the goal of each other
    for framework in args.frameworks.split(","):
        for case, (width, bucket) in CASES.items():
            if case.split()[0] not in args.cases.split(","):
                continue
            ratios = []
            for _ in range(args.repeats):
                seen = run(
                    framework,
                    width,
                    bucket,
                    args.pairs,
                    args.device,
                    args.witness,
                    args.comm_steps,
                    args.stretch,
                )
                if "error" in seen:
                    print(f"{framework:10} {case:12} error: {seen['error']}")
                    continue
                reported = seen["reported"]
                hook = ""
                if args.witness:
                    witness = seen["hook"]
                    by_hook = seen["comm"] / witness if witness else math.nan
                    hook = f" {witness * 1e3:7.2f} {by_hook:9.2f}" if witness else f" {'-':>7} {'-':>9}"
                for key, _, _ in TRUTHS:
                    if framework != "loop" and seen[key] is not None:
                        within.setdefault(key, []).append(GOAL[0] <= _ratio(reported, seen[key]) <= GOAL[1])
                halves = _ratio(seen["true_before"], seen["true_after"])
                if framework != "loop" and not math.isnan(halves):
                    halves_within.append(GOAL[0] <= halves <= GOAL[1])
                ratio = _ratio(reported, seen["true"])
                ratios.append(ratio)
                low, high = seen["ranks"] or (math.nan, math.nan)
                ranks = f"{low * 1e3:.2f}-{high * 1e3:.2f}"
                rest = " ".join(_ms_ratio(seen[key], reported, width) for key, _, width in TRUTHS[1:])
                print(
                    f"{framework:10} {case:12} {seen['steps']:>5} {seen['calls']:>5} "
                    f"{seen['comm'] * 1e3:8.2f} {seen['overlap']:7.2f} "
                    f"{(seen['true'] or math.nan) * 1e3:8.2f} "
                    f"{(reported or 0) * 1e3:11.2f} {(seen['wait'] or 0) * 1e3:7.2f} {ratio:6.2f} "
                    f"{ranks:>11} {halves:6.2f} {rest}{hook}"
                )
            if len(ratios) > 1:
                median = statistics.median(ratios)
                print(f"{framework:10} {case:12} median ratio of {len(ratios)} runs: {median:.2f}")
    if within:
        counts = ", ".join(f"{name} {sum(w)} of {len(w)}" for k, name, _ in TRUTHS if (w := within.get(k)))
        print(f"Lightning and HF runs within [{GOAL[0]}, {GOAL[1]}] of each truth: {counts}")
    if halves_within:
        print(
            f"their truth's halves (before / after the window) within [{GOAL[0]}, {GOAL[1]}] of each "
            f"other: {sum(halves_within)} of {len(halves_within)}"
        )


if __name__ == "__main__":
    main()
