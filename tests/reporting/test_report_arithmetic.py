"""The printed report checked as a user checks it: every row that states a formula, recomputed from the
values printed in the same report (to their display precision), on real HF Trainer runs of a tiny Llama:
gradient checkpointing, gradient accumulation (micro-batch 1 x 4), and one clean step slowed 3x by a
sleep in the model. The headline FLOPS is held against a median of per-step rates computed here, the
``throughput/*`` series after the window against the window's FLOPS, and a window the run cut short
logs ``clean_steps`` 0.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback
from tests.support import first_clean, window_end

VOCAB, SEQ, BATCH = 97, 128, 4
PROFILE_STEP, CLEAN_STEPS, PEAK = 2, 5, 1e11
WINDOW_END = window_end(PROFILE_STEP, CLEAN_STEPS)
SLOW_STEP = first_clean(PROFILE_STEP) + 2  # the third clean step: two before it give the step's usual time
TOLERANCE = 0.02  # the printed values carry 3 to 4 significant digits


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int = 256) -> None:
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=SEQ, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class StepClock(TrainerCallback):
    """The global step being run (the global step it started at: the profiler's numbering) and each step's
    wall seconds."""

    def __init__(self) -> None:
        self.current, self.seconds, self._start = 0, {}, 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.current, self._start = state.global_step, time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds[self.current] = time.perf_counter() - self._start


class Hiccup(torch.nn.Module):
    """The Llama, whose forward on step ``SLOW_STEP`` first sleeps twice the two steps before it took:
    that step takes about 3x a clean step, as if the machine had stalled."""

    def __init__(self, clock: StepClock) -> None:
        super().__init__()
        self.llama, self.clock = llama(), clock

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        if self.clock.current == SLOW_STEP and self.training:
            before = [self.clock.seconds[SLOW_STEP - i] for i in (1, 2)]
            time.sleep(2 * sum(before) / len(before))
        return self.llama(input_ids=input_ids, labels=labels)


def run(
    tmp_path: Path, model: torch.nn.Module, max_steps: int = WINDOW_END + 6, **overrides: Any
) -> dict[str, Any]:
    """Train with the profiler (a peak given, so MFU and HFU are printed); the report, JSON, log history."""
    profiler = HFFlopsCallback(
        profile_step=PROFILE_STEP, clean_steps=CLEAN_STEPS, peak_flops=PEAK, print_profile=False
    )
    clock = getattr(model, "clock", StepClock())
    settings = {
        "output_dir": str(tmp_path), "use_cpu": True, "max_steps": max_steps,
        "per_device_train_batch_size": BATCH, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "disable_tqdm": True, "seed": 0,
    }  # fmt: skip
    args = TrainingArguments(**{**settings, **overrides})
    trainer = Trainer(model=model, args=args, callbacks=[clock, profiler], train_dataset=Tokens())
    trainer.train()
    stem = tmp_path / f"flops_profile_step{PROFILE_STEP}"
    return {
        "report": stem.with_suffix(".txt").read_text(),
        "json": json.loads(stem.with_suffix(".json").read_text()),
        "history": trainer.state.log_history,
    }


# --- reading the report as text -------------------------------------------------------------------------

_ROW = re.compile(r"^(.*?):\s{2,}(\S.*?)\s*$")  # DeepSpeed's row: the label and ': ' padded, the value
_PREFIX = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def summary_rows(report: str) -> dict[str, str]:
    """The summary's rows, label -> value (each label once)."""
    summary = report.split("Profile Summary", 1)[1].split("\n\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in summary.splitlines():
        match = _ROW.match(line)
        if match and match[1] not in rows:
            rows[match[1]] = match[2]
    return rows


def number(text: str) -> float:
    """A printed number with DeepSpeed's prefix (``48.47 M``, ``1.3 GFLOPS``, ``879.5 us``, ``17.67%``)."""
    match = re.match(r"(-?[\d.]+)\s*([TGMKmu]?)(?=[A-Za-z%]|\s|$)", text.strip())
    assert match, f"not a number: {text!r}"
    if text.strip().endswith("%"):
        return float(match[1]) / 100
    if match[2] == "B" or text.strip().endswith(" B"):  # params say B for billions
        return float(match[1]) * 1e9
    return float(match[1]) * _PREFIX[match[2]]


def formulas(rows: dict[str, str]) -> dict[str, Callable[[Callable[[str], float]], float]]:
    """Every formula a report may state, by its label, as arithmetic on the printed values (``v(label)``).
    Where the clean steps had other batch shapes than the counting step, the rates divide a clean step's
    flops (their median), printed in a row of their own and named in the labels."""
    clean = next((label for label in rows if label.startswith("clean step's fwd / bwd / recompute")), None)
    of = "clean step's " if clean else ""
    padded = next((label for label in rows if label.startswith(f"{of}model fwd / bwd flops")), None)
    m = "model " if padded else ""

    def model_flops(v: Callable[[str], float], name: str) -> float:
        """The model's work on the real tokens (padding or packing: printed apart), else the run's."""
        if padded is not None and name != "recompute":
            return number(rows[padded].split(" / ")[("fwd", "bwd").index(name)])
        return flops(v, name)

    def flops(v: Callable[[str], float], name: str) -> float:
        if clean is not None:
            return number(rows[clean].split(" / ")[("fwd", "bwd", "recompute").index(name)])
        label = {"fwd": "fwd flops per GPU", "bwd": "bwd flops per GPU (measured)"}.get(name)
        return (
            v(label) if label else (v("recompute flops per GPU") if "recompute flops per GPU" in rows else 0)
        )

    def iter_latency(v: Callable[[str], float]) -> float:
        return v("fwd latency") + v("bwd latency") + v("step latency")

    def fwd_bwd(v: Callable[[str], float]) -> float:
        return model_flops(v, "fwd") + model_flops(v, "bwd")

    def hardware(v: Callable[[str], float]) -> float:
        return flops(v, "fwd") + flops(v, "bwd") + flops(v, "recompute")

    def per_dp(v: Callable[[str], float], label: str) -> float:
        return v(label) * (v("data parallel size") if "data parallel size" in rows else 1) / iter_latency(v)

    peak = "peak FLOPS per device (peak_flops argument)"
    return {
        "params of model = params per GPU * mp_size": lambda v: (
            v("params per GPU") * v("model parallel size")
        ),
        "fwd flops of model = fwd flops per GPU * mp_size": lambda v: (
            v("fwd flops per GPU") * v("model parallel size")
        ),
        f"fwd FLOPS per GPU = {of}{m}fwd flops per GPU / fwd latency": lambda v: (
            model_flops(v, "fwd") / v("fwd latency")
        ),
        f"bwd FLOPS per GPU = {of}{m}bwd flops per GPU / bwd latency": lambda v: (
            model_flops(v, "bwd") / v("bwd latency")
        ),
        f"fwd+bwd FLOPS per GPU = {of}{m}fwd+bwd flops per GPU / (fwd+bwd latency)": lambda v: (
            fwd_bwd(v) / (v("fwd latency") + v("bwd latency"))
        ),
        "iter latency": iter_latency,  # the notations' definition: fwd + bwd + step latency
        f"FLOPS per GPU = {of}{m}fwd+bwd flops per GPU / iter latency": lambda v: (
            fwd_bwd(v) / iter_latency(v)
        ),
        f"hardware FLOPS per GPU = {of}fwd+bwd+recompute flops per GPU / iter latency": lambda v: (
            hardware(v) / iter_latency(v)
        ),
        "samples/second = batch size per GPU * dp_size / iter latency": lambda v: per_dp(
            v, "batch size per GPU"
        ),
        "samples/second = samples per step per GPU * dp_size / iter latency": lambda v: per_dp(
            v, "samples per step per GPU"
        ),
        "tokens/second = tokens per step per GPU * dp_size / iter latency": lambda v: per_dp(
            v, "tokens per step per GPU"
        ),
        "bwd / fwd flops": lambda v: v("bwd flops per GPU (measured)") / v("fwd flops per GPU"),
        f"MFU = ({of}{m}fwd+bwd flops) / iter latency / peak": lambda v: (
            fwd_bwd(v) / iter_latency(v) / v(peak)
        ),
        f"HFU = ({of}fwd+bwd+recompute flops) / iter latency / peak": lambda v: (
            hardware(v) / iter_latency(v) / v(peak)
        ),
    }


def check_arithmetic(report: str) -> dict[str, str]:
    """Every formula row equals its formula on the printed values, and every row that states a formula
    (an ``=`` in its label) is one of the known ones; the summary's rows."""
    rows = summary_rows(report)

    def v(label: str) -> float:
        return number(rows[label])

    known = formulas(rows)
    stated = [label for label in rows if " = " in label and not label.startswith("fwd / bwd / step")]
    unknown = [label for label in stated if label not in known]
    assert not unknown, f"formula rows this check does not know: {unknown}"
    checked = [label for label in known if label in rows]
    for label in checked:
        assert number(rows[label]) == pytest.approx(known[label](v), rel=TOLERANCE), label
    musts = [
        "iter latency",
        "FLOPS per GPU = ",
        *(["MFU = "] if any(r.startswith("peak FLOPS") for r in rows) else []),
    ]
    for must in musts:
        assert any(label.startswith(must) for label in checked), must
    # the wall step's parts are the printed latencies, and add up to it
    wall = rows["wall step (previous step's end -> its end) of the median step"]
    parts = dict(re.findall(r"(data|fwd|bwd|step|other) ([\d.]+ [mu]?s)", wall))
    for phase in ("fwd", "bwd", "step"):
        assert number(parts[phase]) == v(f"{phase} latency")
    assert sum(number(p) for p in parts.values()) == pytest.approx(
        number(wall.split(" = ")[0]), rel=TOLERANCE
    )
    return rows


def logged(history: list[dict[str, Any]], name: str) -> list[float]:
    return [entry[name] for entry in history if name in entry]


# --- the runs ---------------------------------------------------------------------------------------------


def test_a_checkpointed_llama_report_adds_up_and_its_flops_leave_recompute_to_hfu(tmp_path: Path) -> None:
    model = llama()
    model.gradient_checkpointing_enable()
    out = run(tmp_path, model)
    rows = check_arithmetic(out["report"])
    metrics = out["json"]["metrics"]
    assert metrics[names.RECOMPUTE_FLOPS] > 0.5 * metrics[names.FWD_FLOPS]  # the layers ran again
    model_flops = metrics[names.FWD_FLOPS] + metrics[names.BWD_FLOPS]
    iter_latency = metrics[names.ITER_LATENCY]
    assert (
        iter_latency == metrics[names.FWD_LATENCY] + metrics[names.BWD_LATENCY] + metrics[names.STEP_LATENCY]
    )
    assert metrics[names.FLOPS_PER_SEC] == pytest.approx(model_flops / iter_latency, rel=1e-9)
    hardware = (model_flops + metrics[names.RECOMPUTE_FLOPS]) / iter_latency
    assert metrics[names.HARDWARE_FLOPS_PER_SEC] == pytest.approx(hardware, rel=1e-9)
    assert metrics[names.MFU] == pytest.approx(model_flops / iter_latency / PEAK, rel=1e-9)
    assert metrics[names.HFU] == pytest.approx(hardware / PEAK, rel=1e-9)
    # the metric of each printed row's name is the printed value
    assert number(rows["FLOPS per GPU = fwd+bwd flops per GPU / iter latency"]) == pytest.approx(
        metrics[names.FLOPS_PER_SEC], rel=0.005
    )
    # one iter latency in the report: no other row calls a figure "iter latency"
    assert sum("iter latency" in label and " = " not in label for label in rows) == 1
    # the series after the window counts the same model flops: per sample, exactly the window's (the rates'
    # times differ: the wall between logging steps there, fwd + bwd + step here; on a quiet machine the
    # series read 0.94-0.98x the window's FLOPS, a timing left to benchmarks, not to a test)
    ((window_flops,),) = [logged(out["history"], names.FLOPS_PER_SEC)]
    ((window_samples,),) = [logged(out["history"], names.SAMPLES_PER_SEC)]
    flops = logged(out["history"], names.THROUGHPUT_FLOPS_PER_SEC)
    samples = logged(out["history"], names.THROUGHPUT_SAMPLES_PER_SEC)
    assert len(flops) == len(samples) >= 4
    for f, n in zip(flops, samples, strict=True):
        assert f / n == pytest.approx(window_flops / window_samples, rel=1e-9)
    assert logged(out["history"], names.CLEAN_STEPS) == [CLEAN_STEPS]
    assert out["json"]["clean_steps"] == CLEAN_STEPS


def test_an_accumulated_run_prints_the_micro_batch_as_batch_size_per_gpu(tmp_path: Path) -> None:
    out = run(tmp_path, llama(), per_device_train_batch_size=1, gradient_accumulation_steps=4)
    rows = check_arithmetic(out["report"])
    assert rows["batch size per GPU"] == "1"  # DeepSpeed's meaning: the micro-batch
    assert rows["micro-batches per step (gradient accumulation)"] == "4"
    assert rows["samples per step per GPU"] == "4"
    assert rows["tokens per step per GPU"] == str(4 * SEQ)
    # saved activations of one micro-batch: the counted step's over its 4 micro-batches
    saved = out["json"]["profile"]["modules"][""]["saved_bytes"]
    label = "activations saved for bwd per GPU per micro-batch (params excluded; 4's mean)"
    assert number(rows[label]) == pytest.approx(saved / 4, rel=0.005)
    assert out["json"]["metrics"][names.SAVED_ACTIVATION_BYTES] == saved / 4
    samples = out["json"]["metrics"][names.SAMPLES_PER_SEC]
    assert samples == pytest.approx(4 / out["json"]["metrics"][names.ITER_LATENCY], rel=1e-9)


def test_one_clean_step_slowed_3x_moves_no_headline_and_shows_in_the_range(tmp_path: Path) -> None:
    clock = StepClock()
    model = Hiccup(clock)
    out = run(tmp_path, model, max_steps=WINDOW_END)
    rows = check_arithmetic(out["report"])
    data = out["json"]
    assert data["steps"]["clean"] == list(range(first_clean(PROFILE_STEP), WINDOW_END))
    iters = data["clean_totals"]["iter_seconds_per_step"]
    slow = data["steps"]["clean"].index(SLOW_STEP)
    others = [t for i, t in enumerate(iters) if i != slow]
    assert iters[slow] >= 2.5 * statistics.median(others)  # the sleep made that step ~3x
    # the range row shows it
    low, high = (
        rows["fwd+bwd+step / data / wall of the 5 clean step(s): min .. max"].split(" / ")[0].split(" .. ")
    )
    assert number(high) == pytest.approx(iters[slow], rel=0.01)
    # against the median of the per-step rates, computed here from each step's time and flops
    counts = data["clean_median_step"]["counts"]
    flops = counts["fwd_flops"] + counts["bwd_flops"]
    outside = statistics.median(flops / t for t in iters)
    printed = number(rows["FLOPS per GPU = fwd+bwd flops per GPU / iter latency"])
    assert printed == pytest.approx(outside, rel=0.07)
    assert data["metrics"][names.FLOPS_PER_SEC] == pytest.approx(outside, rel=1e-9)  # the median step's
    # the wall rate keeps what the wall did: the slow step's time is in it
    metrics = data["metrics"]
    assert metrics[names.WALL_SAMPLES_PER_SEC] < 0.85 * metrics[names.SAMPLES_PER_SEC]


def test_a_window_the_run_cut_short_logs_zero_clean_steps(tmp_path: Path) -> None:
    out = run(tmp_path, llama(), max_steps=first_clean(PROFILE_STEP) - 1)
    assert logged(out["history"], names.CLEAN_STEPS) == [0]
    assert out["json"]["clean_steps"] == 0 and out["json"]["steps"]["clean"] == []
    check_arithmetic(out["report"])
