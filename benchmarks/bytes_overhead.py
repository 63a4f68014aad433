"""What counting bytes moved and saved activations adds to the counting step.

Three variants of one GPT-2 training step run side by side in one process, interleaved round by round
(a noisy shared machine slows them alike), and the medians are compared as ratios:

* plain: the step, no profiler;
* counting, flops only: the counting engine with its byte rules switched off (every op moves nothing,
  no saved tensor read);
* counting, flops + bytes: the engine as shipped.

A counting step is everything a user pays for it: creating the tracer, the profiled forward and
backward, stopping it and building the per-module profile. Torch runs one thread (as
``benchmarks/overhead.py`` explains) and this thread's CPU time is reported beside wall time.

    python benchmarks/bytes_overhead.py [--repeats 7] [--layers 4] [--width 256] [--seq 128] [--batch 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from flops_callbacks.counting import engine as tracer_module
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.saved_activations import SavedActivations


@contextlib.contextmanager
def without_bytes() -> Iterator[None]:
    """The engine with no byte rule and no saved-activation reading: flops only."""
    with (
        mock.patch.object(tracer_module, "bytes_rule", lambda func: None),
        mock.patch.object(SavedActivations, "watch", lambda self, node, ctx: None),
        mock.patch.object(SavedActivations, "enter", lambda self, args, ctx: None),
    ):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=8192,
        n_positions=args.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    def counting() -> None:
        tracer = CountingEngine(model)
        tracer.start()
        try:
            step()
        finally:
            tracer.stop()
        tracer.profile()

    def counting_without_bytes() -> None:
        with without_bytes():
            counting()

    variants: dict[str, Callable[[], None]] = {
        "plain step": step,
        "counting, flops only": counting_without_bytes,
        "counting, flops + bytes": counting,
    }
    for run in variants.values():  # warm-up: imports, allocator, first-call caches
        run()
    times: dict[str, dict[str, list[float]]] = {name: {"CPU": [], "wall": []} for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            cpu, wall = time.thread_time(), time.perf_counter()
            run()
            times[name]["CPU"].append(time.thread_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    med = {name: {clock: statistics.median(v) for clock, v in t.items()} for name, t in times.items()}
    print(
        f"GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.seq}, {args.threads} thread(s), "
        f"median of {args.repeats}; torch {torch.__version__}"
    )
    print("| variant | CPU s | wall s | CPU / plain | wall / plain |")
    print("|---|---:|---:|---:|---:|")
    plain = med["plain step"]
    for name, m in med.items():
        print(
            f"| {name} | {m['CPU']:.3f} | {m['wall']:.3f} | {m['CPU'] / plain['CPU']:.2f} | "
            f"{m['wall'] / plain['wall']:.2f} |"
        )
    base, full = med["counting, flops only"], med["counting, flops + bytes"]
    cpu, wall = full["CPU"] / base["CPU"] - 1, full["wall"] / base["wall"] - 1
    print(f"bytes add {cpu:+.1%} CPU time, {wall:+.1%} wall time to the counting step")


if __name__ == "__main__":
    main()
