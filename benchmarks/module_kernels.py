"""The module tree on a GPU against the device's own kernels, and the device's idle share, in one run.

Each case trains its model twice in one process on the same batch: once under ``StepProfiler`` (a plain
loop: the window's module-timing step times each module by its kernels, ``timing/kernel_clock.py``), once
unhooked: a few steps timed by the loop's own CUDA events at its phase boundaries (fwd, bwd, step), then
one step under ``torch.profiler`` with Python's calls recorded (``with_stack``: each module call is an
``nn.Module: Class_i`` event, no hook of anyone's) and a ``record_function`` range around each phase. The
reference for a module is the device time of the kernels launched inside its calls on that unhooked step;
for a phase, the kernels launched inside its range; its idle share is ``1 - kernel time / phase time``
(the unprofiled steps' CUDA-event medians). The backward's root is the kernels its autograd nodes launched:
the 2-5% of the backward's kernels launched outside any node (autograd's own gradient sums, DDP's bucket
copies) belong to no module, so the root's bwd reads a little under 1.

Printed per case: the tree's root fwd and bwd over the reference's (goal [0.95, 1.05]), the ten modules
of most forward time each over its reference (goal within 10%), whether the report doubts the tree (goal:
no), the idle share of fwd + bwd ours against the reference's (goal within 10 points), and what "bound by"
says (the launch-bound MLP: the host).

``--record DIR`` writes, instead, the real traces the CPU tests read (``tests/timing/test_kernel_clock.py``):
small models' module-timing steps under the kernel clock, Python's calls recorded beside its marks, each
with the timer's marks and the figures the GPU computed: GPU-bound (GPT-2 2 x 1024 at 8 x 1024),
launch-bound (2 x 64 at 2 x 32), checkpointed (2 x 256), and under DDP (one rank over NCCL: the all-reduce's
range is in the trace, no all-reduce kernel). On the H200's traces every module's forward equals the kernels
launched inside its Python calls within 1%, and the backward's root holds 91-99% of the backward phase's
kernels.

    python benchmarks/module_kernels.py [--cases gpt2-124m-8x1024,gpt2-124m-2x128,mlp]
    python benchmarks/module_kernels.py --record tests/timing/kernel_traces
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from flops_callbacks import StepProfiler
from flops_callbacks.reporting.console_summary import _split, bound_by
from flops_callbacks.reporting.tree_check import check_tree
from flops_callbacks.timing.clock import clock_for
from flops_callbacks.timing.kernel_clock import KernelClock, KernelTrace
from flops_callbacks.timing.module_timer import ModuleTimer

Batch = dict[str, torch.Tensor]
PHASES = ("forward", "backward", "optimizer_step")


def mlp(batch: int = 32) -> tuple[nn.Module, Batch]:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers), {"x": torch.randn(batch, 128)}


def gpt2(layers: int, width: int, heads: int, batch: int, seq: int, vocab: int = 50257) -> Callable[[], Any]:
    def build() -> tuple[nn.Module, Batch]:
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab
        )
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": ids, "labels": ids}

    return build


CASES: dict[str, tuple[str, Callable[[], tuple[nn.Module, Batch]], bool]] = {
    "gpt2-124m-8x1024": ("GPT-2 124M, bf16, 8 x 1024", gpt2(12, 768, 12, 8, 1024), True),
    "gpt2-124m-2x128": ("GPT-2 124M, bf16, 2 x 128", gpt2(12, 768, 12, 2, 128), True),
    "mlp": ("24 x Linear(128)+ReLU, batch 32 (launch-bound)", mlp, False),
}


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    if "x" in batch:
        return model(batch["x"]).square().mean()
    return model(**batch).loss


def autocast(bf16: bool) -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def our_run(model: nn.Module, batch: Batch, bf16: bool, root: str) -> Any:
    """The window through StepProfiler on a plain loop; its result."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = StepProfiler(model, profile_step=3, print_profile=False, log_dir=root, clean_steps=5)
    for _ in range(30):
        with prof.step(batch):
            with autocast(bf16):
                loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if prof.result is not None:
            break
    prof.close()
    return prof.result


def module_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Python's module calls in a trace (``nn.Module: Class_i``), in time order."""
    return sorted(
        (e for e in events if e.get("cat") == "python_function" and str(e["name"]).startswith("nn.Module: ")),
        key=lambda e: e["ts"],
    )


def first_seen(model: nn.Module, calls: Callable[[], Any]) -> dict[str, list[str]]:
    """Each module class's instances by name, in the order their first call came (Python's trace numbers
    them so): one plain forward with pre-hooks, removed after."""
    order: dict[str, list[str]] = {}
    names = {id(m): n for n, m in model.named_modules()}

    def seen(module: nn.Module, *_: Any) -> None:
        each = order.setdefault(type(module).__name__, [])
        if names[id(module)] not in each:
            each.append(names[id(module)])

    handles = [m.register_forward_pre_hook(seen) for m in model.modules()]
    try:
        with torch.no_grad():
            calls()
    finally:
        for h in handles:
            h.remove()
    return order


def module_reference(
    events: list[dict[str, Any]], trace: KernelTrace, order: dict[str, list[str]]
) -> dict[str, float]:
    """Each module's forward kernel seconds: the kernels launched inside its Python calls (their thread)."""
    out: dict[str, float] = {}
    for e in module_events(events):
        cls, index = str(e["name"])[len("nn.Module: ") :].rsplit("_", 1)
        names = order.get(cls, [])
        if int(index) >= len(names):
            continue
        name = names[int(index)]
        seconds = trace.launched(e["ts"], e["ts"] + e["dur"], (e.get("pid"), e.get("tid")))
        out[name] = out.get(name, 0.0) + seconds
    return out


def unhooked(
    model: nn.Module, batch: Batch, bf16: bool, order: dict[str, list[str]], device: str
) -> dict[str, Any]:
    """The reference: phases by the loop's CUDA events on plain steps, then one step's kernels under
    torch.profiler (Python's calls recorded, no hook)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(mark: Callable[[str], None]) -> None:
        mark("forward")
        with autocast(bf16):
            loss = loss_of(model, batch)
        mark("backward")
        loss.backward()
        mark("optimizer_step")
        optimizer.step()
        optimizer.zero_grad()
        mark("")

    latencies: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer_step": []}
    clock = clock_for(device)
    for i in range(13):
        events: list[tuple[str, Any]] = []
        step(lambda name, events=events: events.append((name, clock.mark())))  # type: ignore[misc]
        clock.synchronize()
        if i >= 3:
            for (name, a), (_, b) in zip(events, events[1:], strict=False):
                latencies[name].append(clock.seconds(a, b))
    ranges: list[Any] = []

    def annotate(name: str) -> None:
        if ranges:
            ranges.pop().__exit__(None, None, None)
        if name:
            r = torch.profiler.record_function(f"ref#{name}")
            r.__enter__()
            ranges.append(r)

    from torch.profiler import ProfilerActivity, profile

    clock.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(annotate)
        clock.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.json"
        prof.export_chrome_trace(str(path))
        events_json = json.loads(path.read_text())["traceEvents"]
    trace = KernelTrace(events_json)
    phases = {}
    for e in events_json:
        if e.get("cat") == "user_annotation" and str(e["name"]).startswith("ref#"):
            phases[e["name"][4:]] = trace.launched(e["ts"], e["ts"] + e["dur"])
    return {
        "latency": {k: statistics.median(v) for k, v in latencies.items()},
        "kernels": phases,
        "modules": module_reference(events_json, trace, order),
    }


def framework_run(
    framework: str, build: Callable[[], tuple[nn.Module, Batch]], bf16: bool, device: str
) -> Any:
    """The window through the Lightning or the HF Trainer callback (``timing_truth.py``'s runs); its result,
    its module names as the reference's (Lightning's module holds the model as ``model``)."""
    import timing_truth

    model, batch = build()
    args = argparse.Namespace(device=device, bf16=bf16, steps=20, profile_step=3)
    run = timing_truth.run_lightning if framework == "lightning" else timing_truth.run_hf
    result, _ = run(lambda: (model, lambda i: batch, 1), args)
    if framework == "lightning" and result is not None:

        def named(n: str) -> str:
            return n[len("model.") :] if n.startswith("model.") else "" if n == "model" else "~" + n

        modules = {named(n): dataclasses.replace(m, name=named(n)) for n, m in result.profile.modules.items()}
        result = dataclasses.replace(result, profile=dataclasses.replace(result.profile, modules=modules))
    return result


def check_case(name: str, device: str, framework: str = "loop") -> None:
    words, build, bf16 = CASES[name]
    bf16 = bf16 and device == "cuda"
    torch.manual_seed(0)
    if framework == "loop":
        model, batch = build()
        model = model.to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if framework == "loop":
            result = our_run(model, batch, bf16, root)
        else:
            result = framework_run(framework, build, bf16, device)
    for said in dict.fromkeys(str(w.message) for w in caught if "flops_callbacks" in str(w.message)):
        print(f"warned: {said}")
    if framework != "loop":  # the reference on a model of its own, the same shapes
        model, batch = build()
        model = model.to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
    order = first_seen(model, lambda: loss_of(model, batch))
    ref = unhooked(model, batch, bf16, order, device)
    print(f"\n## {words} ({framework})")
    if result is None:
        print("no result (the window did not end)")
        return
    root = result.profile.model
    kernels = ref["kernels"]
    print(f"module latencies from: kernels = {result.steps.module_kernels}")
    print("| figure | ours | reference | ratio | goal |\n|---|---:|---:|---:|---|")
    ref_fwd = ref["modules"].get("", kernels.get("forward", 0.0))
    for label, ours, theirs in (
        ("root fwd (kernels)", root.fwd_latency, ref_fwd),
        ("root bwd (kernels)", root.bwd_latency, kernels.get("backward", 0.0)),
    ):
        ratio = ours / theirs if theirs else float("nan")
        print(f"| {label} | {ours * 1e3:.3f} ms | {theirs * 1e3:.3f} ms | {ratio:.3f} | [0.95, 1.05] |")
    top = sorted(
        (m for n, m in result.profile.modules.items() if n and n in ref["modules"]),
        key=lambda m: m.fwd_latency,
        reverse=True,
    )[:10]
    worst = 0.0
    for m in top:
        theirs = ref["modules"][m.name]
        ratio = m.fwd_latency / theirs if theirs else float("nan")
        worst = max(worst, abs(ratio - 1))
        cells = f"{m.fwd_latency * 1e3:.3f} ms | {theirs * 1e3:.3f} ms | {ratio:.3f}"
        print(f"| fwd {m.name} | {cells} | within 10% |")
    print(f"| top-10 modules' largest deviation | | | {worst:.3f} | < 0.10 |")
    latency = ref["latency"]
    ref_idle = 1 - (kernels.get("forward", 0) + kernels.get("backward", 0)) / (
        latency["forward"] + latency["backward"]
    )
    ours_idle = result.device_idle()
    ours_text = "n/a" if ours_idle is None else f"{ours_idle:.1%}"
    points = "n/a" if ours_idle is None else f"{100 * abs(ours_idle - ref_idle):.1f} points"
    print(f"| device idle, fwd + bwd | {ours_text} | {ref_idle:.1%} | {points} | within 10 points |")
    ours_latency = dict(
        zip(PHASES, (result.fwd_latency, result.bwd_latency, result.step_latency), strict=True)
    )
    for phase in PHASES:
        busy = (result.device_busy or {}).get(phase)
        busy_text = "n/a" if busy is None else f"{busy * 1e3:.3f} ms"
        print(
            f"| {phase}: kernels launched | {busy_text} | {kernels.get(phase, 0) * 1e3:.3f} ms | "
            f"latency ours {ours_latency[phase] * 1e3:.3f} ms, loop's {latency[phase] * 1e3:.3f} ms | |"
        )
    doubts = check_tree(result.profile, result.fwd_latency, result.bwd_latency, result.steps.module_timing)
    print(f"tree doubts: {doubts.notes or 'none'} (goal: none)")
    print(f"bound by: {bound_by(_split(result.metrics()), result)}")


def record(folder: Path, device: str) -> None:
    """The traces the CPU tests read (module doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = {
        "gpu_bound": (gpt2(2, 1024, 16, 8, 1024, vocab=8192), True, False, False),
        "launch_bound": (gpt2(2, 64, 4, 2, 32, vocab=512), False, False, False),
        "checkpointed": (gpt2(2, 256, 4, 4, 256, vocab=2048), True, True, False),
        "ddp": (gpt2(2, 256, 4, 4, 256, vocab=2048), False, False, True),
    }
    for name, (build, bf16, checkpointed, ddp) in shapes.items():
        bf16 = bf16 and device == "cuda"
        torch.manual_seed(0)
        model, batch = build()
        model = model.to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        runs: nn.Module = model
        if ddp:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
            runs = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(3):  # warm: the step recorded is a steady one
            with autocast(bf16):
                loss = loss_of(runs, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        clock = KernelClock(torch.device(device))
        timer = ModuleTimer(model, clock)
        events = clock_for(device)  # the phases' latencies on this step, beside its kernels
        marks: list[Any] = []

        def phase(
            name: str, clock: KernelClock = clock, marks: list[Any] = marks, events: Any = events
        ) -> None:
            clock.phase(name)
            marks.append(events.mark())

        clock.begin(with_stack=True, export=True)
        phase("forward")
        timer.start()
        with autocast(bf16):
            loss = loss_of(runs, batch)
        phase("backward")
        timer.arm()
        loss.backward()
        timer.release()
        phase("optimizer_step")
        optimizer.step()
        optimizer.zero_grad()
        phase("")
        timer.stop()
        clock.end()
        latency = dict(
            zip(PHASES, (events.seconds(a, b) for a, b in zip(marks, marks[1:], strict=False)), strict=True)
        )
        path = folder / f"{name}.json.gz"
        clock.export(path)
        times = timer.times()
        state = {
            "model": name,
            "config": model.config.to_dict(),
            "checkpointed": checkpointed,
            "ddp": ddp,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "fwd_spans": [list(s[:5]) + [bool(s[5])] for s in timer._fwd_spans],
            "node_spans": [list(s) for s in timer._node_spans],
            "origin": timer._origin,
            "phases": clock._phases,
            "times": {"fwd": times.fwd, "bwd": times.bwd, "recompute": times.recompute},
            "phase_seconds": clock.phase_seconds(),
            "latency": latency,  # the step's phases by CUDA events (a profiled step: its host slower)
        }
        (folder / f"{name}.state.json").write_text(json.dumps(state))
        fwd, bwd = times.fwd[""] * 1e3, times.bwd.get("", 0.0) * 1e3
        print(f"{name}: {path.stat().st_size / 1e3:.0f} kB; root fwd {fwd:.3f} ms, bwd {bwd:.3f} ms")
        if ddp:
            torch.distributed.destroy_process_group()
        with gzip.open(path, "rt") as f:
            assert json.load(f)["traceEvents"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--record", type=Path, default=None, help="write the CPU tests' traces here instead")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only tries the script (no kernels)")
    parser.add_argument("--frameworks", default="loop", help="loop (StepProfiler), lightning, hf")
    args = parser.parse_args()
    if args.record is not None:
        record(args.record, args.device)
        return
    for framework in args.frameworks.split(","):
        for name in args.cases.split(","):
            check_case(name, args.device, framework)


if __name__ == "__main__":
    main()
