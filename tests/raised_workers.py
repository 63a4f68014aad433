"""The processes of tests/integrations/test_step_profiler.py's two-rank faults: a DDP loop on gloo under
``torchrun`` with ``StepProfiler`` and ``prof.close()`` in a ``finally``, rank 1 raising its own error in a
window step. Rank 1 writes ``rank1.json`` (the seconds from its raise to ``close()``'s return) and lets its
error end the process; rank 0 waits in the step's all-reduce until torchrun ends it.

With ``go_on STEP``, rank 1 raises after its backward at window step STEP and the loop goes on after the
error (a batch skipped): every rank writes ``rank{r}.json`` (its steps, the profiler's warnings, the
window's result, the hooks left, its seconds).

With ``go_on_accumulated STEP [COUNTS]``, steps of two micro-batches (or, cycling, of each of the
comma-separated COUNTS; all but the last under DDP's ``no_sync()``): rank 1 raises in its first micro-batch
of window step STEP, before its forward, and the loop goes on with the step's next micro-batch (a batch
skipped; no rank's step skipped): every rank writes ``rank{r}.json`` as with ``go_on``.

With ``go_on_forward STEP``, rank 1 raises before its forward at window step STEP and its loop goes on
with one batch more than rank 0's (the skipped batch made up): rank 0 waits in the step's all-reduce,
which rank 1's next batch joins; every rank writes ``rank{r}.json`` as with ``go_on``.

With ``after_step STEP``, rank 1 raises after its optimizer step at STEP, past the window, and its loop
goes on: every rank writes ``rank{r}.json`` (its steps, the steps it logged ``throughput/*`` at, its
seconds).

With ``uneven``, rank 1's loop ends at window step ``RAISES_AT`` (uneven inputs under DDP's ``join()``)
and it closes its profiler inside the ``join()`` while rank 0 goes on to 24 steps: every rank writes
``rank{r}.json`` as with ``go_on``.

``python raised_workers.py DIR [go_on STEP | go_on_accumulated STEP [COUNTS] | go_on_forward STEP |
after_step STEP | uneven]``
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flops_callbacks import StepProfiler  # noqa: E402
from tests.support import comm_steps, end_process  # noqa: E402

PROFILE_STEP = 2
RAISES_AT = comm_steps(PROFILE_STEP)[0]  # a communication step: every rank's window is open
THROUGHPUT = "throughput/samples_per_sec"


def ddp_loop() -> tuple[int, nn.Module, torch.optim.Optimizer, StepProfiler]:
    """This process's rank, its DDP model on gloo, its optimizer and its profiler."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = StepProfiler(model, profile_step=PROFILE_STEP, clean_steps=3, print_profile=False)
    return rank, model, optimizer, prof


def main(directory: Path) -> None:
    rank, model, optimizer, prof = ddp_loop()
    raised = 0.0
    try:
        for step in range(20):
            with prof.step(torch.ones(8, 16)):
                if rank == 1 and step == RAISES_AT:
                    raised = time.perf_counter()
                    raise ValueError("rank 1's own error")
                model(torch.ones(8, 16)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        prof.close()
        if raised:
            closed = {"close_seconds": time.perf_counter() - raised}
            (directory / f"rank{rank}.json").write_text(json.dumps(closed))


def going_on(directory: Path, raises_at: int) -> None:
    def loop(rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, prof: StepProfiler) -> int:
        steps = 0
        for step in range(24):
            try:
                with prof.step(torch.ones(8, 16)):
                    model(torch.ones(8, 16)).sum().backward()
                    if rank == 1 and step == raises_at:
                        raise ValueError("rank 1's own error")
                    optimizer.step()
                    optimizer.zero_grad()
                    steps += 1
            except ValueError:
                optimizer.zero_grad()
        return steps

    run_going_on(directory, loop)


def going_on_forward(directory: Path, raises_at: int) -> None:
    def loop(rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, prof: StepProfiler) -> int:
        steps = 0
        for step in range(25 if rank == 1 else 24):
            try:
                with prof.step(torch.ones(8, 16)):
                    if rank == 1 and step == raises_at:
                        raise ValueError("rank 1's own error")
                    model(torch.ones(8, 16)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    steps += 1
            except ValueError:
                pass
        return steps

    run_going_on(directory, loop)


def going_on_accumulated(directory: Path, raises_at: int, pattern: tuple[int, ...] = (2,)) -> None:
    import contextlib

    def loop(rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, prof: StepProfiler) -> int:
        steps = 0
        for step in range(24):
            count = pattern[step % len(pattern)]  # micro-batches in this step
            for micro_batch in range(count):
                last = micro_batch == count - 1
                try:
                    with prof.step(torch.ones(8, 16)), contextlib.ExitStack() as stack:
                        if not last:
                            stack.enter_context(model.no_sync())
                        if rank == 1 and step == raises_at and not last:
                            raise ValueError("rank 1's own error")
                        model(torch.ones(8, 16)).sum().backward()
                        if last:
                            optimizer.step()
                            optimizer.zero_grad()
                            steps += 1
                except ValueError:
                    pass
        return steps

    run_going_on(directory, loop)


def run_going_on(
    directory: Path, loop: Callable[[int, nn.Module, torch.optim.Optimizer, StepProfiler], int]
) -> None:
    """One of the runs whose loop goes on after rank 1's error: ``loop`` (given this rank, its DDP model,
    optimizer and profiler; returning the optimizer steps it ran) with the warnings recorded and the
    profiler closed after it, then :func:`write_ran`."""
    import warnings

    rank, model, optimizer, prof = ddp_loop()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            steps = loop(rank, model, optimizer, prof)
        finally:
            prof.close()
    write_ran(directory, rank, model, prof, steps, said, start)


def write_ran(
    directory: Path, rank: int, model: nn.Module, prof: StepProfiler, steps: int, said: list, start: float
) -> None:
    """``rank{r}.json``: the steps this rank ran, the profiler's warnings, whether its window published,
    the hooks left on the model, its seconds; then the process ends."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    ran = {
        "steps": steps,
        "said": [str(w.message) for w in said if "StepProfiler" in str(w.message)],
        "result": prof.result is not None,
        "hooks": hooks,
        "seconds": time.perf_counter() - start,
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(ran))
    end_process()  # a gloo job left to the interpreter's teardown aborts now and then


def after_step(directory: Path, raises_at: int) -> None:
    """Rank 1 raises after its optimizer step at ``raises_at``, past the window, and its loop goes on: the
    step ran, and counts on every rank alike (their ``throughput/*`` exchanges at the same steps)."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[int] = []
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=3, comm_steps=3, print_profile=False,
        log_every_n_steps=4, log=lambda metrics, step: logged.append(step) if THROUGHPUT in metrics else None,
    )  # fmt: skip
    start = time.perf_counter()
    try:
        for step in range(24):
            try:
                with prof.step(torch.ones(8, 16)):
                    model(torch.ones(8, 16)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if rank == 1 and step == raises_at:
                        raise ValueError("rank 1's own error")
            except ValueError:
                pass
    finally:
        prof.close()
    ran = {"steps": prof.global_step, "logged": logged, "result": prof.result is not None}
    (directory / f"rank{rank}.json").write_text(json.dumps({**ran, "seconds": time.perf_counter() - start}))
    end_process()


def uneven(directory: Path) -> None:
    import warnings

    rank, model, optimizer, prof = ddp_loop()
    start, steps = time.perf_counter(), 0
    with warnings.catch_warnings(record=True) as said, model.join():
        warnings.simplefilter("always")
        for _ in range(RAISES_AT if rank == 1 else 24):
            with prof.step(torch.ones(8, 16)):
                model(torch.ones(8, 16)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        prof.close()  # rank 1's, in a window step of rank 0's
    ran = {
        "steps": steps,
        "said": [str(w.message) for w in said if "StepProfiler" in str(w.message)],
        "result": prof.result is not None,
        "seconds": time.perf_counter() - start,
    }
    (directory / f"rank{rank}.json").write_text(json.dumps(ran))
    end_process()


if __name__ == "__main__":
    if sys.argv[2:3] == ["uneven"]:
        uneven(Path(sys.argv[1]))
    elif sys.argv[2:3] == ["go_on"]:
        going_on(Path(sys.argv[1]), int(sys.argv[3]))
    elif sys.argv[2:3] == ["go_on_forward"]:
        going_on_forward(Path(sys.argv[1]), int(sys.argv[3]))
    elif sys.argv[2:3] == ["go_on_accumulated"]:
        pattern = tuple(int(n) for n in sys.argv[4].split(",")) if len(sys.argv) > 4 else (2,)
        going_on_accumulated(Path(sys.argv[1]), int(sys.argv[3]), pattern)
    elif sys.argv[2:3] == ["after_step"]:
        after_step(Path(sys.argv[1]), int(sys.argv[3]))
    else:
        main(Path(sys.argv[1]))
