"""What profiling costs: a profiled forward, a profiled training step, and the steps not profiled, for
flops_callbacks (ours), DeepSpeed's flops profiler, FlopCounterMode and Lightning's ThroughputMonitor.

Every variant runs side by side in one process, interleaved round by round (so a noisy shared
machine slows them alike), and the medians are compared as ratios. A "profile" here is everything a
user pays for one: creating the profiler, installing it, the profiled pass, removing it and
reading the results (in a forward profile, DeepSpeed's getters for both; in a training step,
our whole per-module profile). Goals: a forward profile costs no more than DeepSpeed's (ratio
<= 1.0); a full fwd+bwd profile with per-module timing costs <= 1.5x a plain training step of
GPT-2 small on CPU. DeepSpeed is compared when it can be imported, and skipped otherwise; in a
training step it profiles the forward only (as its engine does) and estimates the backward.
Lightning's way is ``measure_flops`` (FlopCounterMode) once, on a meta-device copy, at set-up, and
``ThroughputMonitor`` on every step: the first is timed as a one-off, the second in real
``lightning.Trainer`` runs beside the others attached to the same loop, on the steps they do not
profile (the example GPT of examples/lightning/train.py; runs alternate, their order flips every
round). Torch runs one thread by default: on a shared machine, OpenMP barriers between threads
make timings swing by 100x whenever another process takes a core. With one thread all the work is
the main thread's, so its CPU time (``time.thread_time``) is reported beside wall time: neighbours
on a shared machine inflate wall time, hardly CPU time.

    python benchmarks/overhead.py [--repeats 7] [--seq 128] [--batch 1] [--threads 1] [--runs 8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import flop_counter_step, quiet_trainer, step_timer, window_steps
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import FlopsProfiler


def deepspeed_profiler() -> type | None:
    """DeepSpeed's FlopsProfiler class, or None when deepspeed is not installed."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.profiling.flops_profiler import FlopsProfiler as DeepSpeedProfiler
    except ImportError:
        return None
    return DeepSpeedProfiler


CLOCKS = {"CPU": time.thread_time, "wall": time.perf_counter}  # CPU: this thread's, see the docstring


@dataclass
class Timings:
    """Seconds per round of each variant, on each clock."""

    samples: dict[str, dict[str, list[float]]]  # clock -> variant -> one value per round

    def median(self, clock: str, variant: str) -> float | None:
        values = self.samples[clock].get(variant)
        return None if values is None else statistics.median(values)

    def ratio(self, clock: str, variant: str, base: str) -> float | None:
        """Median over rounds of ``variant / base`` within the round (drift cancels)."""
        a, b = self.samples[clock].get(variant), self.samples[clock].get(base)
        return None if a is None or b is None else statistics.median(x / y for x, y in zip(a, b, strict=True))


def interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> Timings:
    """Each variant timed ``repeats`` times, after one warm-up each, running them in turn every round."""
    for run in variants.values():
        run()
    samples: dict[str, dict[str, list[float]]] = {clock: {name: [] for name in variants} for clock in CLOCKS}
    for _ in range(repeats):
        for name, run in variants.items():
            start = {clock: read() for clock, read in CLOCKS.items()}
            run()
            for clock, read in CLOCKS.items():
                samples[clock][name].append(read() - start[clock])
    return Timings(samples)


def workload_variants(
    model: nn.Module, forward: Callable[[], torch.Tensor], ds_profiler: type | None
) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """(forward variants, training-step variants) of one model, each a zero-argument callable."""

    def plain_forward() -> None:
        with torch.no_grad():
            forward()

    def forward_profile(profiler: type) -> Callable[[], None]:
        """A DeepSpeed-API forward profile: ours and DeepSpeed's make the same calls (a user switches
        the import)."""

        def run() -> None:
            prof = profiler(model)
            prof.start_profile()
            with torch.no_grad():
                forward()
            prof.stop_profile()
            prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()
            prof.end_profile()

        return run

    def flop_counter_forward() -> None:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            forward()
        counter.get_total_flops()

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

    def deepspeed_step() -> None:  # its engine profiles the forward and estimates the backward
        model.zero_grad(set_to_none=True)
        prof = ds_profiler(model)
        prof.start_profile()
        forward().backward()
        prof.stop_profile()
        prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()
        prof.end_profile()

    def flop_counter_step() -> None:
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as counter:
            forward().backward()
        counter.get_total_flops()

    ours_forward = forward_profile(FlopsProfiler)
    forwards: dict[str, Callable[[], object]] = {"plain": plain_forward, "ours": ours_forward}
    steps: dict[str, Callable[[], object]] = {"plain": plain_step, "ours": ours_step}
    if ds_profiler is not None:
        forwards["deepspeed"], steps["deepspeed"] = forward_profile(ds_profiler), deepspeed_step
    forwards["flop_counter"], steps["flop_counter"] = flop_counter_forward, flop_counter_step
    return forwards, steps


def gpt2_small(seq: int, batch: int, device: str = "cpu") -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with torch.device(device):
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
) -> tuple[int, int, int | None, int]:
    """(our forward flops, their dense part, DeepSpeed's, FlopCounterMode's) of one forward."""
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
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    return profile.fwd_flops, 2 * profile.fwd_macs, deepspeed, counter.get_total_flops()


def measure_flops_on_meta(seq: int, batch: int) -> tuple[float, int]:
    """Lightning's recommended way, once: a meta-device copy of the model and ``measure_flops`` of a
    training step (FlopCounterMode). Returns (seconds, flops), the build of the copy included."""
    from lightning.fabric.utilities.throughput import measure_flops

    start = time.perf_counter()
    model, forward = gpt2_small(seq, batch, device="meta")
    flops = measure_flops(model, forward, loss_fn=lambda loss: loss)
    return time.perf_counter() - start, flops


# --- unprofiled steps: real lightning.Trainer runs ----------------------------------------------


def lightning_configurations(profile_step: int, ds_profiler: type | None) -> dict[str, Callable[[], list]]:
    """Each configuration: a function making the callbacks of one run (a fresh set per run)."""
    import lightning as L
    from lightning.pytorch.callbacks import ThroughputMonitor

    from flops_callbacks import FlopsProfilerCallback

    class DeepSpeedCallback(L.Callback):
        """DeepSpeed's profiler around one step, as a Lightning user without a DeepSpeed engine writes it."""

        def __init__(self) -> None:
            self.prof: Any = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == profile_step:
                self.prof = ds_profiler(pl_module)
                self.prof.start_profile()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.prof is not None:
                self.prof.stop_profile()
                self.prof.get_total_flops(), self.prof.get_total_macs(), self.prof.get_total_duration()
                self.prof.end_profile()
                self.prof = None

    configurations: dict[str, Callable[[], list]] = {
        "none": lambda: [],
        "ours: FlopsProfilerCallback": lambda: [
            FlopsProfilerCallback(profile_step, clean_steps=0, print_profile=False)
        ],
    }
    if ds_profiler is not None:
        configurations["DeepSpeed profiler (own callback)"] = lambda: [DeepSpeedCallback()]
    configurations["FlopCounterMode (own callback)"] = lambda: [flop_counter_step(profile_step)]
    configurations["Lightning ThroughputMonitor"] = lambda: [
        ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0])
    ]
    return configurations


def lightning_run(
    callbacks: list, steps: int, batch_size: int, flops_per_batch: int, root: str
) -> dict[str, list[float]]:
    """Seconds of each step of one run (from one on_train_batch_start to the next), on each clock."""
    import lightning as L

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lightning"))
    from train import GPT, SyntheticTokens

    L.seed_everything(0, verbose=False)
    model = GPT()
    model.flops_per_batch = flops_per_batch  # what ThroughputMonitor reads; measured at set-up
    timer = step_timer(CLOCKS)
    trainer = quiet_trainer(root, steps, [timer, *callbacks])  # the timer first: its steps hold their hooks
    data = torch.utils.data.DataLoader(SyntheticTokens(batch_size * (steps + 1)), batch_size=batch_size)
    trainer.fit(model, train_dataloaders=data)
    return {clock: timer.step_times(clock) for clock in CLOCKS}


def example_gpt_flops_per_batch(batch_size: int) -> int:
    """``measure_flops`` of one training step of the example GPT on the meta device (Lightning's docs)."""
    from lightning.fabric.utilities.throughput import measure_flops

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "lightning"))
    from train import CONTEXT, GPT, VOCAB

    with torch.device("meta"):
        model = GPT()
        tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT))
    return measure_flops(model, lambda: model(tokens), loss_fn=torch.Tensor.sum)


def unprofiled_steps(
    runs: int, steps: int, warmup: int, profile_step: int, batch_size: int, ds_profiler: type | None
) -> list[tuple[str, dict[str, float], dict[str, float], float | None]]:
    """Per configuration: its name, median step and median ratio to no callback (per clock), and the
    median CPU time of the profiled step. A ratio is the median over rounds of the ratio of two runs'
    median step times."""
    configurations = lightning_configurations(profile_step, ds_profiler)
    flops_per_batch = example_gpt_flops_per_batch(batch_size)
    times: dict[str, list[dict[str, list[float]]]] = {name: [] for name in configurations}
    for logger in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: ..." on every run
        logging.getLogger(logger).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|FlopsProfilerCallback|ThroughputMonitor).*")
        for repeat in range(runs):
            order = list(configurations) if repeat % 2 == 0 else list(reversed(configurations))
            for name in order:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    callbacks = configurations[name]()
                    times[name].append(lightning_run(callbacks, steps, batch_size, flops_per_batch, root))

    window = window_steps(profile_step)  # ours (clean_steps=0): the counting and module-timing steps

    def kept(step_times: list[float]) -> list[float]:
        return [t for step, t in enumerate(step_times) if step >= warmup and step not in window]

    rows = []
    for name, name_runs in times.items():
        median, ratio_to_none = {}, {}
        for clock in CLOCKS:
            values = [statistics.median(kept(run[clock])) for run in name_runs]
            base = [statistics.median(kept(run[clock])) for run in times["none"]]
            median[clock] = statistics.median(values)
            ratio_to_none[clock] = statistics.median(a / b for a, b in zip(values, base, strict=True))
        profiled = None
        if name not in ("none", "Lightning ThroughputMonitor"):
            profiled = statistics.median(run["CPU"][profile_step] for run in name_runs)
        rows.append((name, median, ratio_to_none, profiled))
    return rows


# --- output --------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def times_plain(timings: Timings, clock: str, variant: str) -> str:
    """ "ms (x plain)" for one cell: the variant's median and its median ratio to plain."""
    seconds = timings.median(clock, variant)
    return "-" if seconds is None else f"{ms(seconds)} ({timings.ratio(clock, variant, 'plain'):.2f}x)"


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


VARIANTS = {"ours": "ours", "deepspeed": "DeepSpeed", "flop_counter": "FlopCounterMode"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per variant (median)")
    parser.add_argument("--seq", type=int, default=128, help="GPT-2 sequence length")
    parser.add_argument("--batch", type=int, default=1, help="GPT-2 batch size")
    parser.add_argument("--mlp-repeats", type=int, default=30, help="timed rounds for the 200-layer MLP")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--runs", type=int, default=8, help="Lightning runs per configuration")
    parser.add_argument("--steps", type=int, default=25, help="steps per Lightning run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of every Lightning run left out")
    parser.add_argument("--profile-step", type=int, default=10, help="the step Lightning runs profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ds_profiler = deepspeed_profiler()

    gpt2, gpt2_forward = gpt2_small(args.seq, args.batch)
    forwards, steps = workload_variants(gpt2, gpt2_forward, ds_profiler)
    gpt2_fwd, gpt2_step = interleaved(forwards, args.repeats), interleaved(steps, args.repeats)
    gpt2_flops = forward_flops(gpt2, gpt2_forward, ds_profiler)
    del gpt2, forwards, steps
    meta_seconds, meta_flops = measure_flops_on_meta(args.seq, args.batch)

    mlp, mlp_forward = narrow_mlp()
    calls = module_calls(mlp, mlp_forward)
    forwards, steps = workload_variants(mlp, mlp_forward, ds_profiler)
    mlp_fwd, mlp_step = interleaved(forwards, args.mlp_repeats), interleaved(steps, args.mlp_repeats)

    lightning_rows = unprofiled_steps(args.runs, args.steps, args.warmup, args.profile_step, 2, ds_profiler)

    name = f"GPT-2 124M, batch {args.batch}, seq {args.seq}"
    rows = [
        (f"{name}: forward profile", gpt2_fwd),
        (f"{name}: training-step profile", gpt2_step),
        ("200-layer MLP (width 32): forward profile", mlp_fwd),
        ("200-layer MLP (width 32): training-step profile", mlp_step),
    ]
    print(
        f"Profiling cost; torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s); medians of "
        f"{args.repeats} (GPT-2) / {args.mlp_repeats} (MLP) interleaved rounds; x plain: median over rounds "
        "of the ratio within the round"
    )
    if ds_profiler is None:
        print("DeepSpeed is not installed: its columns are skipped (pip install flops-callbacks[bench]).")
    for clock in CLOCKS:
        print()
        print(f"{clock} time:")
        print()
        print(
            "| workload | plain (ms) | " + " | ".join(f"{v} (ms, x plain)" for v in VARIANTS.values()) + " |"
        )
        print("|---|---:|" + "---:|" * len(VARIANTS))
        for label, timings in rows:
            cells = [times_plain(timings, clock, variant) for variant in VARIANTS]
            print(f"| {label} | {ms(timings.median(clock, 'plain'))} | " + " | ".join(cells) + " |")
    print()
    print("| goal | CPU time | wall time | target |")
    print("|---|---:|---:|---|")
    goals = (
        ("GPT-2 forward profile, ours / DeepSpeed", gpt2_fwd, "deepspeed", "<= 1.0"),
        ("GPT-2 training-step profile, ours / plain step", gpt2_step, "plain", "<= 1.5"),
    )
    for label, timings, base, target in goals:
        cpu, wall = (number(timings.ratio(clock, "ours", base)) for clock in CLOCKS)
        print(f"| {label} | {cpu} | {wall} | {target} |")
    ours_flops, dense_flops, ds_flops, fcm_flops = gpt2_flops
    plain_step = gpt2_step.median("wall", "plain")
    print()
    print(
        f"GPT-2 forward flops counted: ours {ours_flops:,} (matmul/attention {dense_flops:,}), "
        f"DeepSpeed {'-' if ds_flops is None else f'{ds_flops:,}'}, FlopCounterMode {fcm_flops:,}"
    )
    print(
        f"Lightning measure_flops on a meta-device GPT-2 (training step, once at set-up): "
        f"{ms(meta_seconds)} ms wall ({meta_seconds / plain_step:.2f}x a plain step), {meta_flops:,} flops"
    )
    print()
    print(f"Per module call, 200-layer MLP ({calls} module calls per pass), CPU time:")
    print()
    print("| profiler, pass | overhead per module call (us) |")
    print("|---|---:|")
    for pass_name, timings in (("forward", mlp_fwd), ("training step", mlp_step)):
        for variant, label in VARIANTS.items():
            seconds = timings.median("CPU", variant)
            plain = timings.median("CPU", "plain")
            cost = "-" if seconds is None else f"{1e6 * (seconds - plain) / calls:.1f}"
            print(f"| {label}, {pass_name} | {cost} |")
    window = window_steps(args.profile_step)
    print()
    print(
        f"Unprofiled steps: lightning.Trainer, example GPT, batch 2, CPU; {args.runs} runs per configuration "
        f"x {args.steps} steps, alternating; left out: the first {args.warmup} steps of every run and the "
        f"counting and module-timing steps of our window (global steps {window.start}-{window.stop - 1})"
    )
    print()
    print(
        "| attached to the loop | CPU: median step (ms) | CPU: ratio to none | wall: median step (ms) "
        "| wall: ratio to none | profiled step (CPU ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, median, ratio_to_none, profiled in lightning_rows:
        print(
            f"| {label} | {ms(median['CPU'])} | {ratio_to_none['CPU']:.3f} | {ms(median['wall'])} "
            f"| {ratio_to_none['wall']:.3f} | {ms(profiled)} |"
        )


if __name__ == "__main__":
    main()
