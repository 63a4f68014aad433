"""What the profiler's votes between ranks cost the window's figures: two ranks of a DDP loop on gloo (CPU)
with ``StepProfiler``, side by side in one run.

The window's ranks vote at each clean step's micro-batches and at its end (docs/several-processes.md):
here one micro-batch a step, so two votes, both in its wall time. The reported wall step leaves each
vote's own time out (its least over the ranks); this prints it against the loop's own clock:

* "reported / after": the reported ``wall_latency`` over the loop's median step after the window (the
  training's step, with the throughput meter, 1.01x at most of a run without the profiler);
* "votes kept / after": the same figure with the votes left in (the job's clean steps of the ranks' rows
  as they were exchanged, read at the window's end);
* "window / after": the loop's own median clean step over its median step after the window: what the
  window's steps cost the run (the votes, and the profiler's work in each step);
* "iter / after": the reported fwd + bwd + step over the same (the phases hold no vote);
* "votes ms": the votes' own time a step taken out.

``python benchmarks/rank_votes.py [--rounds 3] [--width 512]`` (runs ``torchrun`` itself; each round is a run
of its own, killed past ``--timeout`` seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS, PROFILE_STEP, CLEAN, BATCH, LAYERS = 50, 5, 10, 64, 6
ROOT = Path(__file__).resolve().parents[1]


def rank_main(directory: Path, width: int) -> None:
    """One rank: train, keep the rows the window exchanged, write what the round prints."""
    import torch

    import flops_callbacks.session.builder as builder
    from flops_callbacks import StepProfiler
    from flops_callbacks import metrics as names

    exchanged: list[Any] = []
    without_votes = builder.without_votes

    def keep(rows: Any) -> Any:  # the rows as exchanged, read beside the figures (nothing changes)
        exchanged.append(rows)
        return without_votes(rows)

    builder.without_votes = keep
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    prof = StepProfiler(
        model, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False, comm_steps=0
    )
    marks = []
    for _ in range(STEPS):
        marks.append(time.perf_counter())
        x = torch.randn(BATCH, width)
        with prof.step({"x": x}):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    marks.append(time.perf_counter())
    prof.close()
    result = prof.result
    assert result is not None and exchanged
    loop = [end - start for start, end in zip(marks, marks[1:], strict=False)]
    clean = list(result.steps.clean)
    kept = builder.job_figures(exchanged[-1]).median_step().latency("wall")
    reported = result.metrics()[names.WALL_LATENCY]
    seen = {
        "iter": result.metrics()[names.ITER_LATENCY],
        "reported": reported,
        "kept": kept,
        "window": statistics.median(loop[s] for s in clean),
        "after": statistics.median(loop[max(clean) + 3 :]),
    }
    if rank == 0:
        (directory / "round.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no gloo thread left to free tensors while the interpreter finalizes (an abort)


def run_round(width: int, timeout: float) -> dict[str, float]:
    """One 2-rank run under ``torchrun`` in a session of its own, killed whole past ``timeout``."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--rank-dir", directory, "--width", str(width)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise SystemExit(f"a round hung: killed after {timeout} s") from None
        if process.returncode != 0:
            raise SystemExit(f"a round failed:\n{err[-4000:]}")
        return json.loads((Path(directory) / "round.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rank-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_dir:
        rank_main(Path(args.rank_dir), args.width)
        return
    print(f"2 ranks (gloo), {LAYERS} x Linear({args.width}) at batch {BATCH}, {CLEAN} clean steps\n")
    columns = ("step after (ms)", "reported / after", "votes kept / after", "window / after", "iter / after")
    print(f"| round | {' | '.join(columns)} | votes ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(args.rounds):
        r = run_round(args.width, args.timeout)
        after = r["after"]
        print(
            f"| {i + 1} | {after * 1e3:.1f} | {r['reported'] / after:.3f} | {r['kept'] / after:.3f} | "
            f"{r['window'] / after:.3f} | {r['iter'] / after:.3f} | {(r['kept'] - r['reported']) * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
