"""What profiling costs: profiled forward and training step vs plain, and vs DeepSpeed's profiler.

Every variant runs side by side in one process, interleaved round by round (so a noisy shared
machine slows them alike), and the medians are compared as ratios. A "profile" here is everything a
user pays for one: creating the profiler, installing it, the profiled pass, removing it and
reading the results. Goals (issue 2): a forward profile costs no more than DeepSpeed's (ratio
<= 1.0); a full fwd+bwd profile with per-module timing costs <= 1.5x a plain training step of
GPT-2 small on CPU. DeepSpeed is compared when it can be imported, and skipped otherwise.
Torch runs one thread by default: on a shared machine, OpenMP barriers between threads make
timings swing by 100x whenever another process takes a core.

    python benchmarks/overhead.py [--repeats 7] [--seq 128] [--batch 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from flops_callbacks import FlopsProfiler


def deepspeed_profiler() -> type | None:
    """DeepSpeed's FlopsProfiler class, or None when deepspeed is not installed."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.profiling.flops_profiler import FlopsProfiler as DeepSpeedProfiler
    except ImportError:
        return None
    return DeepSpeedProfiler


def interleaved_medians(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, after one warm-up each, running them in turn every round."""
    for run in variants.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def workload_variants(
    model: nn.Module, forward: Callable[[], torch.Tensor], ds_profiler: type | None
) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """(forward variants, training-step variants) of one model, each a zero-argument callable."""

    def plain_forward() -> None:
        with torch.no_grad():
            forward()

    def ours_forward() -> None:
        prof = FlopsProfiler(model)
        prof.start_profile()
        with torch.no_grad():
            forward()
        prof.stop_profile()
        prof.get_profile()
        prof.end_profile()

    def deepspeed_forward() -> None:
        prof = ds_profiler(model)
        prof.start_profile()
        with torch.no_grad():
            forward()
        prof.stop_profile()
        prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()
        prof.end_profile()

    def plain_step() -> None:
        model.zero_grad(set_to_none=True)
        forward().backward()

    def ours_step() -> None:
        model.zero_grad(set_to_none=True)
        prof = FlopsProfiler(model)
        prof.start_profile()
        forward().backward()
        prof.stop_profile()
        prof.get_profile()
        prof.end_profile()

    forwards: dict[str, Callable[[], object]] = {"plain": plain_forward, "ours": ours_forward}
    if ds_profiler is not None:
        forwards["deepspeed"] = deepspeed_forward
    return forwards, {"plain": plain_step, "ours": ours_step}


def gpt2_small(seq: int, batch: int) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).train()  # 124M, dropout on as in training
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, lambda: model(tokens, labels=tokens).loss


def narrow_mlp(layers: int = 200, width: int = 32, batch: int = 4) -> tuple[nn.Module, Callable]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    x = torch.randn(batch, width)
    return model, lambda: model(x).sum()


def module_calls(model: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Module forward calls in one pass (counted with the profiler itself)."""
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        forward()
    prof.stop_profile()
    calls = sum(m.calls for m in prof.get_profile().modules.values())
    prof.end_profile()
    return calls


def forward_flops(
    model: nn.Module, forward: Callable[[], torch.Tensor], ds_profiler: type | None
) -> tuple[int, int, int | None]:
    """(our forward flops, their dense part, DeepSpeed's forward flops) of one forward."""
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        forward()
    prof.stop_profile()
    profile = prof.get_profile()
    prof.end_profile()
    deepspeed = None
    if ds_profiler is not None:
        ds = ds_profiler(model)
        ds.start_profile()
        with torch.no_grad():
            forward()
        ds.stop_profile()
        deepspeed = ds.get_total_flops()
        ds.end_profile()
    return profile.fwd_flops, 2 * profile.fwd_macs, deepspeed


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per variant (median)")
    parser.add_argument("--seq", type=int, default=128, help="GPT-2 sequence length")
    parser.add_argument("--batch", type=int, default=1, help="GPT-2 batch size")
    parser.add_argument("--mlp-repeats", type=int, default=30, help="timed rounds for the 200-layer MLP")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ds_profiler = deepspeed_profiler()
    rows = []
    per_call: dict[str, float | None] = {}

    gpt2, gpt2_forward = gpt2_small(args.seq, args.batch)
    forwards, steps = workload_variants(gpt2, gpt2_forward, ds_profiler)
    fwd = interleaved_medians(forwards, args.repeats)
    step = interleaved_medians(steps, args.repeats)
    name = f"GPT-2 124M, batch {args.batch}, seq {args.seq}"
    rows += [
        (f"{name}: forward profile", fwd["plain"], fwd["ours"], fwd.get("deepspeed"), "ours/DS <= 1.0"),
        (f"{name}: fwd+bwd profile (train step)", step["plain"], step["ours"], None, "ours/plain <= 1.5"),
    ]
    gpt2_flops = forward_flops(gpt2, gpt2_forward, ds_profiler)
    del gpt2, forwards, steps

    mlp, mlp_forward = narrow_mlp()
    calls = module_calls(mlp, mlp_forward)
    forwards, steps = workload_variants(mlp, mlp_forward, ds_profiler)
    fwd = interleaved_medians(forwards, args.mlp_repeats)
    step = interleaved_medians(steps, args.mlp_repeats)
    rows += [
        ("200-layer MLP (width 32): forward profile", fwd["plain"], fwd["ours"], fwd.get("deepspeed"), ""),
        ("200-layer MLP (width 32): fwd+bwd profile", step["plain"], step["ours"], None, ""),
    ]
    per_call["ours, forward"] = (fwd["ours"] - fwd["plain"]) / calls
    per_call["ours, fwd+bwd"] = (step["ours"] - step["plain"]) / calls
    per_call["DeepSpeed, forward"] = (fwd["deepspeed"] - fwd["plain"]) / calls if "deepspeed" in fwd else None

    print(
        f"flops_callbacks (ours) vs plain and DeepSpeed; torch {torch.__version__}, CPU, "
        f"{torch.get_num_threads()} thread(s); medians of {args.repeats} (GPT-2) / {args.mlp_repeats} (MLP) "
        "interleaved rounds"
    )
    if ds_profiler is None:
        print("DeepSpeed is not installed: its columns are skipped (pip install deepspeed to compare).")
    print()
    print("| workload | plain (ms) | ours (ms) | ours / plain | DeepSpeed (ms) | ours / DS | goal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, plain, ours, deepspeed, goal in rows:
        print(
            f"| {label} | {ms(plain)} | {ms(ours)} | {ratio(ours, plain)} | {ms(deepspeed)} "
            f"| {ratio(ours, deepspeed)} | {goal} |"
        )
    ours_flops, dense_flops, ds_flops = gpt2_flops
    print()
    print(
        f"GPT-2 forward flops counted: ours {ours_flops:,} (matmul/attention {dense_flops:,}), "
        f"DeepSpeed {'-' if ds_flops is None else f'{ds_flops:,}'}"
    )
    print()
    print(f"Per module call, 200-layer MLP ({calls} module calls per pass):")
    print()
    print("| profiler, pass | overhead per module call (us) |")
    print("|---|---:|")
    for label, seconds in per_call.items():
        print(f"| {label} | {'-' if seconds is None else f'{1e6 * seconds:.1f}'} |")


if __name__ == "__main__":
    main()
