"""What the counting step costs in memory: the peak of one counted fwd+bwd over its start, against the
same fwd+bwd unprofiled, with activation checkpointing and without.

The model is a transformers Llama built from a config (nothing downloaded). Each row: the median over
``--repeats`` of each step's peak above its start, unprofiled and counted (the two alternate, after one
warm-up step of each), and their ratio. The goal is a ratio <= 1.05: the counting engine holds no
tensor beyond what autograd holds (under checkpointing it once held every recomputed activation to
the step's end, 1.76x). ``tests/counting/test_memory.py`` runs ``--quick`` and asserts it.

How the peak is read:

* CUDA: ``torch.cuda.max_memory_allocated`` over ``memory_allocated`` at the start (the caching
  allocator's own high-water mark of bytes in tensors).
* CPU: torch keeps no statistics of its CPU allocator (``torch.cpu`` has no ``memory_stats``; c10
  reports CPU allocations only to the profiler), ``tracemalloc`` does not see it, and ``mallinfo2``
  says what is in use now, not the peak (sampling it from a thread misses short peaks). So: glibc's
  mmap threshold is fixed at 128 KiB (``mallopt``), which puts every tensor of that size or more in a
  mapping of its own, unmapped when the tensor is freed, so that the resident set follows the heap in
  use (Python's objects included); the kernel keeps the resident set's high-water mark (``VmHWM``),
  which ``/proc/self/clear_refs`` resets at the step's start: an exact peak, without sampling. The
  free heap glibc keeps resident (blocks under the threshold) is given back first (``malloc_trim``):
  else a step reuses what the step before it freed, and reads 30 or 39 MB by what ran before it.
  Needs Linux with glibc.

    python benchmarks/counting_memory.py             # Llama 6 x 512, batch 4 x 512 tokens, 3 repeats
    python benchmarks/counting_memory.py --quick     # a small Llama, 3 repeats (the test's)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import warnings
from collections.abc import Callable

import torch

from flops_callbacks.counting.engine import CountingEngine

__all__ = ["main", "peak_meter", "step_peaks"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MB = 1e6


def _rss_peak_meter() -> tuple[Callable[[], None], Callable[[], int]]:
    """(reset, peak above the reset) of the process's resident set, as the module doc says why."""
    libc = ctypes.CDLL("libc.so.6")
    if not libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024):
        raise SystemExit("counting_memory: mallopt(M_MMAP_THRESHOLD) failed: needs glibc")

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    start = 0

    def reset() -> None:
        nonlocal start
        libc.malloc_trim(0)  # every step starts from its live bytes, not what the last one left free
        start = status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set now

    return reset, lambda: status("VmHWM:") - start


def _cuda_peak_meter(device: torch.device) -> tuple[Callable[[], None], Callable[[], int]]:
    start = 0

    def reset() -> None:
        nonlocal start
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)

    def peak() -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start

    return reset, peak


def peak_meter(device: torch.device) -> tuple[Callable[[], None], Callable[[], int]]:
    """(reset, peak bytes above the reset) for ``device``."""
    return _cuda_peak_meter(device) if device.type == "cuda" else _rss_peak_meter()


def llama(layers: int, hidden: int, vocab: int, checkpointing: str) -> torch.nn.Module:
    """A Llama from a config, its head width 64; ``checkpointing``: "off", "non-reentrant", "reentrant"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 64, 1)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    if checkpointing != "off":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' rename notice of gradient_checkpointing_enable
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    return model


def step_peaks(
    model: torch.nn.Module, ids: torch.Tensor, repeats: int, first: bool = True
) -> tuple[list[int], list[int]]:
    """Peaks (bytes above the step's start) of ``repeats`` unprofiled and counted fwd+bwd, alternating,
    after a warm-up: a model's first step pages in code and fills caches (a few MB), the process's
    first counted step too (``first``)."""
    device = ids.device
    reset, peak = peak_meter(device)

    def one(counted: bool) -> int:
        model.zero_grad(set_to_none=True)  # both steps allocate their gradients
        gc.collect()
        tracer = CountingEngine(model) if counted else None
        reset()
        if tracer is not None:
            tracer.start()
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            if tracer is not None:
                tracer.stop()
        return peak()

    one(False)
    if first:
        one(True)
    plain, counted = [], []
    for _ in range(repeats):
        plain.append(one(False))
        counted.append(one(True))
    return plain, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Llama, 3 repeats, no reentrant row")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.batch, args.seq, args.vocab, args.repeats = 4, 256, 4, 256, 1000, 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "resident set high-water mark"
    print(
        f"Peak memory of one fwd+bwd above its start ({how}), median of {args.repeats}; Llama "
        f"{args.layers} x {args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens; "
        f"{device.type}, torch {torch.__version__}\n"
    )
    print("| checkpointing | unprofiled MB | counted MB | counted / unprofiled |")
    print("|---|---:|---:|---:|")
    kinds = ("off", "non-reentrant") if args.quick else ("off", "non-reentrant", "reentrant")
    for i, checkpointing in enumerate(kinds):
        model = llama(args.layers, args.hidden, args.vocab, checkpointing).to(device)
        plain, counted = step_peaks(model, ids, args.repeats, first=i == 0 or not args.quick)
        a, b = statistics.median(plain), statistics.median(counted)
        print(f"| {checkpointing} | {a / MB:.1f} | {b / MB:.1f} | {b / a:.3f} |", flush=True)
        del model
        gc.collect()


if __name__ == "__main__":
    main()
