"""StepSession: the profile window (counting, module timing, clean steps), what it publishes, and when."""

from __future__ import annotations

import gc
import json
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from flops_callbacks import metrics as names
from flops_callbacks.options import Options
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.reporting.publish import console_text, publish
from flops_callbacks.reporting.window_rows import report_text
from flops_callbacks.session.step_session import StepSession
from flops_callbacks.timing.collector import COLLECTED
from flops_callbacks.timing.hook_cost import MIN_CALLS
from flops_callbacks.units import (
    duration_to_string,
    flops_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from tests.sleepy import Sleepy, SleepySGD
from tests.support import IN, OUT, B, Sink, check_step, first_clean, module_steps, run, window_end


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal language model's own loss on ``ids``."""
    return model(ids, labels=ids).loss


def no_profiler_left() -> bool:
    return not (
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or _get_current_dispatch_mode_stack()
        or _get_current_function_mode_stack()
    )


def test_the_window_counts_then_times_modules_then_times_clean_steps(tmp_path: Path) -> None:
    model = nn.Linear(IN, OUT)
    session = StepSession(
        Options(profile_step=3, clean_steps=2, tokens_fn=lambda b: b.numel(), report="full"),
        "test",
        publish=publish,
    )
    sink = Sink(tmp_path)
    end = window_end(3, 2)
    session.train_start(0, max_steps=end + 3)
    run(session, model, torch.optim.SGD(model.parameters(), lr=0.1), range(0, end), sink, micro_batches=2)
    r = session.result
    assert r is not None and no_profiler_left()
    cleans = (first_clean(3), first_clean(3) + 1)
    assert (r.steps.counting, r.steps.module_timing, r.steps.clean) == (3, module_steps(3), cleans)
    assert r.steps.latency_source == "median of 2 clean step(s)"
    assert r.published_at == end
    fwd = 2 * B * IN * OUT
    bwd = 2 * B * IN * OUT + B * OUT  # weight grad + bias grad (the input needs no grad)
    accumulate = IN * OUT + OUT  # the second micro-batch adds its gradients into .grad
    m = r.metrics()
    assert (m[names.FWD_FLOPS], m[names.BWD_FLOPS]) == (2 * fwd, 2 * bwd + accumulate)
    assert (r.samples, r.tokens, r.micro_batches) == (2 * B, 2 * B * IN, 2)
    assert m[names.ITER_LATENCY] == pytest.approx(
        m[names.FWD_LATENCY] + m[names.BWD_LATENCY] + m[names.STEP_LATENCY], rel=1e-12
    )
    assert m[names.FLOPS_PER_SEC] == pytest.approx((2 * (fwd + bwd) + accumulate) / m[names.ITER_LATENCY])
    assert set(m) == set(names.ALL)
    # logged once, at the window's end; printed once; saved with which step each figure came from
    assert [step for _, step in sink.logged] == [end] and sink.logged[0][0] == m
    assert len(sink.printed) == 1 and "module latencies from" in sink.printed[0]
    data = json.loads((tmp_path / "flops_profile_step3.json").read_text())
    assert data["steps"] == {
        "counting": 3,
        "module_timing": list(module_steps(3)),
        "clean": list(cleans),
        "skipped": [],
        "latency_source": "median of 2 clean step(s)",
        "shape_counting": [check_step(3)],  # a second batch of the counted shape, counted: the table holds
        "shapes": 1,  # one shape, as the steps' first micro-batch and as a later one: both counted
        "shapes_counted": 1,
        "shapes_predicted": 0,
        "module_shapes_match": True,
        "module_trace": r.steps.module_trace,
        "module_trace_by": "nearest",  # a CPU whose clean steps marked the model's own forward
        "model_forward": list(cleans),  # the clean steps that marked the model's own forward
        "model_forward_shapes_match": True,
        "first": 3,  # the window's first step: its counting step (a re-profile window's: its lead-in)
    }
    # what the timing hooks of one module call cost, measured on a CPU clock and taken out
    assert data["hook_cost"]["per_call"] > 0 and data["hook_cost"]["own"] <= data["hook_cost"]["per_call"]
    # (the driver calls the model's two layers one by one: no call inside them to measure on)
    assert data["hook_cost"]["source"] == "probe"
    why = f"not measured in place: 0 module call(s) inside the model's, fewer than {MIN_CALLS}"
    assert data["hook_cost"]["detail"].endswith(why)
    assert (data["samples_per_device"], data["micro_batches"], data["tokens_per_device"]) == (10, 2, 60)
    assert data["metrics"] == m
    assert "Detailed Profile" in (tmp_path / "flops_profile_step3.txt").read_text()  # the file has the tree
    assert "in_features=6, out_features=2, bias=True" in (tmp_path / "flops_profile_step3.txt").read_text()
    assert "Detailed Profile" not in sink.printed[0]  # the console does not (detailed=False)
    html = (tmp_path / "flops_profile_step3.html").read_text()
    assert "<script" in html and "http://" not in html and "https://" not in html
    trace = json.loads((tmp_path / "flops_profile_step3.trace.json").read_text())
    calls = [(e["name"], e["cat"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(calls) == [("(model)", "backward")] + [("(model)", "forward")] * 2  # two micro-batches
    assert [step for *_, step in sink.reports] == [end]


def test_the_report_gives_the_models_own_forward_apart_from_the_loss_around_it(tmp_path: Path) -> None:
    # a forward that sleeps 30 ms, and a loss that sleeps 20 ms outside the model: the forward phase
    # holds both, the model's own forward (its outermost call, marked on the clean steps) only the first
    model = Sleepy(fwd=0.03, bwd=0.0, tiny_ops=2)

    def slow_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = model(batch)
        time.sleep(0.02)
        return out.sum()

    session = StepSession(Options(profile_step=3, clean_steps=2), "test", publish=publish)
    session.train_start(0, max_steps=window_end(3, 2) + 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = range(0, window_end(3, 2))
    run(session, model, optimizer, steps, Sink(tmp_path), torch.randn(B, 4), loss_of=slow_loss)
    r = session.result
    assert r is not None and r.model_forward is not None
    cleans = (first_clean(3), first_clean(3) + 1)
    assert (r.steps.clean, r.steps.model_forward) == (cleans, cleans)
    assert 0.03 <= r.model_forward < 0.04  # the sleep, and a sleep's overshoot
    assert r.fwd_latency >= 0.05 and r.fwd_latency - r.model_forward >= 0.02
    data = json.loads((tmp_path / "flops_profile_step3.json").read_text())
    assert data["model_forward"] == r.model_forward and data["steps"]["model_forward"] == list(cleans)
    assert data["model_forward_high"] == r.model_forward_high >= r.model_forward  # the slower of the two
    share = percent(data["model_forward"], data["metrics"][names.FWD_LATENCY])
    row = next(
        line
        for line in (tmp_path / "flops_profile_step3.txt").read_text().splitlines()
        if "own forward" in line
    )
    assert f"(median of the 2 clean steps): {share} of fwd latency" in row
    assert f"{duration_to_string(data['model_forward'])} (" in row
    page = (tmp_path / "flops_profile_step3.html").read_text()  # the picture's summary above the chart
    assert "own forward (clean steps)" in page and duration_to_string(data["model_forward"]) in page


def test_after_the_counting_step_only_the_young_generations_are_collected() -> None:
    # a full collection costs a fifth of a second on a large heap and slows the next step, the one that
    # times the modules (timing/collector.py); automatic collections are held off, so every collection
    # seen is one somebody asked for
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    model = nn.Linear(IN, OUT)
    session = StepSession(Options(profile_step=1, clean_steps=1), "test", publish=publish)
    session.train_start(0, max_steps=window_end(1, 1) + 3)
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)
    gc.callbacks.append(seen)
    try:
        steps = range(0, window_end(1, 1))
        run(session, model, torch.optim.SGD(model.parameters(), lr=0.1), steps, Sink())
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*thresholds)
    assert session.result is not None and collections == [COLLECTED] == [1]


def test_latencies_come_from_clean_steps_not_from_the_counting_step() -> None:
    """Each phase sleeps a known time around tiny ops that counting slows down: the clean steps report
    the sleeps, the counting step's own phases would not."""
    model = Sleepy(fwd=0.1, bwd=0.1)
    optimizer = SleepySGD(model.parameters(), seconds=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=3), "test", publish=publish)
    session.train_start(0)
    batch = torch.randn(B, 4)
    run(session, model, optimizer, range(0, window_end(0, 3)), Sink(), batch=batch)
    r = session.result
    assert r is not None
    assert r.fwd_latency == pytest.approx(0.1, rel=0.15)
    assert r.bwd_latency == pytest.approx(0.1, rel=0.15)
    assert r.step_latency == pytest.approx(0.1, rel=0.15)
    # the module-timing step's module latencies are the sleeps too
    assert r.profile.modules[""].fwd_latency == pytest.approx(0.1, rel=0.15)
    assert r.profile.modules[""].bwd_latency == pytest.approx(0.1, rel=0.15)


def test_the_window_starts_at_the_first_step_at_or_after_profile_step() -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=3, clean_steps=1), "test", publish=publish)
    session.train_start(0)
    for step in range(0, 2 * window_end(2, 1) + 2, 2):  # two optimizers: the global step goes up 2 a batch
        run(session, model, optimizer, range(step, step + 1), Sink())
    r = session.result
    doubled = tuple(2 * step for step in module_steps(2))  # the window's batches: counting the third
    assert r is not None and (r.steps.counting, r.steps.module_timing, r.steps.clean) == (
        4, doubled, (2 * first_clean(2),)
    )  # fmt: skip


def test_clean_steps_of_new_shapes_are_counted_on_steps_of_their_own_then_predicted_and_all_count() -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=2), "test", publish=publish)
    session.train_start(0)
    sink = Sink()
    clean = first_clean(0)  # the first clean step, with the counted shapes
    run(session, model, optimizer, range(0, clean + 1), sink, batch=torch.randn(B, IN))
    for step, size in (
        (clean + 1, B + 3),  # outside the counted sizes: counted before any prediction
        (clean + 2, B + 1),  # inside B .. B + 3, but two points verify no line: counted
        (clean + 3, B + 2),  # the line through three points, verified: predicted
    ):
        run(session, model, optimizer, range(step, step + 1), sink, batch=torch.randn(size, IN))
    r = session.result
    assert r is not None and (r.steps.clean, r.steps.skipped, r.steps.shape_counting) == (
        (clean, clean + 3), (), (check_step(0), clean + 1, clean + 2)
    )  # fmt: skip
    assert (r.steps.shapes, r.steps.shapes_counted, r.steps.shapes_predicted) == (4, 3, 1)

    def flops(size: int) -> int:  # forward, weight and bias gradients (the input needs no grad)
        return 2 * size * IN * OUT + 2 * size * IN * OUT + size * OUT

    figures = r.figures()
    assert figures.counts.model_flops == flops(B) + flops(B + 2)  # the two clean steps' own batches
    assert [s.work.counts.model_flops for s in figures.steps] == [flops(B), flops(B + 2)]
    m = r.metrics()  # the median step of two: their mean (work and times)
    assert r.iter_latency == pytest.approx(sum(figures.iters) / 2, rel=1e-12)
    assert m[names.FLOPS_PER_SEC] == pytest.approx((flops(B) + flops(B + 2)) / 2 / r.iter_latency, rel=1e-6)
    assert m[names.SAMPLES_PER_SEC] == pytest.approx((B + B + 2) / 2 / r.iter_latency)
    assert r.flops_sources is not None and r.flops_sources.sources == ("counted", "predicted")
    assert figures.spreads["iter"].steps == 2


def test_a_run_that_ends_inside_the_window_publishes_what_it_had_and_says_so(tmp_path: Path) -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=1, clean_steps=3, report="full"), "test", publish=publish)
    end, last = first_clean(1) + 1, window_end(1, 3) - 1  # the run ends after one clean step
    with pytest.warns(
        UserWarning, match=rf"window needs steps 1 \.\. {last}.*latencies will rest on 1 clean step"
    ):
        session.train_start(0, max_steps=end)
    sink = Sink(tmp_path)
    run(session, model, optimizer, range(0, end), sink)
    assert session.result is None  # the window has not ended
    session.train_end(end, sink)
    r = session.result
    assert r is not None and (r.steps.counting, r.steps.module_timing, r.steps.clean) == (
        1, module_steps(1), (first_clean(1),)
    )  # fmt: skip
    assert [step for _, step in sink.logged] == [end]
    assert f"median of 1 clean step(s): step {first_clean(1)}" in sink.printed[0]


def test_a_window_with_no_clean_step_says_its_latencies_are_inflated() -> None:
    model = nn.Linear(IN, OUT)
    session = StepSession(Options(profile_step=0, clean_steps=3, report="full"), "test", publish=publish)
    with pytest.warns(UserWarning, match="rest on 0 clean step"):
        session.train_start(0, max_steps=1)
    sink = Sink()
    run(session, model, torch.optim.SGD(model.parameters(), lr=0.1), range(0, 1), sink)
    session.train_end(1, sink)
    assert session.result is not None
    assert session.result.steps.latency_source.startswith("the counting step alone")
    assert "inflated by counting" in sink.printed[0]


def test_warnings_come_at_train_start_not_after_the_run() -> None:
    with pytest.warns(UserWarning, match=r"profile_step=10 is never reached: the run has 5 optimizer steps"):
        StepSession(Options(profile_step=10), "test", publish=publish).train_start(0, max_steps=5)
    with pytest.warns(UserWarning, match="resumed at step 12, past profile_step=10: no profile runs"):
        StepSession(Options(profile_step=10), "test", publish=publish).train_start(12)
    with pytest.warns(UserWarning, match="a window ran before the checkpoint"):
        StepSession(Options(profile_step=10), "test", publish=publish).train_start(12, profiled_before=True)
    with pytest.warns(UserWarning, match=r"step 9 was profiled before the checkpoint \(flops_profile_step9"):
        StepSession(Options(profile_step=10), "test", publish=publish).train_start(
            12, profiled_before=True, profiled_step=9
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StepSession(Options(profile_step=2, clean_steps=1), "test", publish=publish).train_start(
            0, max_steps=window_end(2, 1) + 1
        )


def test_a_second_run_profiles_again() -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=0), "test", publish=publish)
    for _ in range(2):
        session.train_start(0)
        sink = Sink()
        run(session, model, optimizer, range(0, window_end(0, 0) + 1), sink)
        profiles = [step for metrics, step in sink.logged if names.FWD_FLOPS in metrics]
        assert session.result is not None and profiles == [window_end(0, 0)]


def test_close_inside_any_window_step_leaves_nothing_and_the_next_run_counts_the_same() -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(B, IN)
    for failing in (0, *module_steps(0), first_clean(0)):  # the counting, each module-timing, a clean step
        session = StepSession(Options(profile_step=0, clean_steps=1), "test", publish=publish)
        session.train_start(0)
        run(session, model, optimizer, range(0, failing), Sink(), batch=batch)
        session.step_start(failing, model)
        session.micro_batch_start(batch)
        out = model(batch)
        session.close()  # an exception: the adapter closes the session
        assert no_profiler_left() and not out.grad_fn.metadata
        assert session.result is None and not session.window_open
    session = StepSession(Options(profile_step=0, clean_steps=0), "test", publish=publish)
    session.train_start(0)
    run(session, model, optimizer, range(0, window_end(0, 0)), Sink(), batch=batch)
    assert session.result is not None
    assert session.result.profile.bwd_flops == 2 * B * IN * OUT + B * OUT


def test_throughput_is_logged_after_the_window_at_logging_steps() -> None:
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps=0, peak_flops=1e9), "test", publish=publish)
    session.train_start(0)
    sink = Sink()
    batch = torch.randn(B, IN)
    end = window_end(0, 0)  # published there; metered from there
    run(session, model, optimizer, range(0, end + 3), sink, batch=batch)
    steps = [step for metrics, step in sink.logged if names.THROUGHPUT_SAMPLES_PER_SEC in metrics]
    assert steps == [end + 1, end + 2, end + 3]
    flops = 2 * B * IN * OUT + 2 * B * IN * OUT + B * OUT
    for metrics, _ in sink.logged[1:]:
        assert metrics[names.THROUGHPUT_MFU] == pytest.approx(metrics[names.THROUGHPUT_FLOPS_PER_SEC] / 1e9)
        seconds = B / metrics[names.THROUGHPUT_SAMPLES_PER_SEC]
        assert metrics[names.THROUGHPUT_FLOPS_PER_SEC] == pytest.approx(flops / seconds)


def test_parallel_sizes_scale_samples_per_second_by_the_data_parallel_size() -> None:
    model = nn.Linear(IN, OUT)
    session = StepSession(Options(profile_step=0, clean_steps=1, throughput=False), "test", publish=publish)
    session.train_start(0)
    parallel = ParallelSizes(world_size=4, data_parallel=4)
    batch = torch.randn(B, IN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run(session, model, optimizer, range(0, window_end(0, 1)), Sink(), batch, 1, parallel)
    r = session.result
    assert r is not None and r.parallel == parallel
    assert r.metrics()[names.SAMPLES_PER_SEC] == pytest.approx(B * 4 / r.iter_latency)


def test_with_activation_checkpointing_the_printed_logged_and_saved_rates_agree(tmp_path: Path) -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Linear(16, OUT))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    model = Checkpointed()
    full = Options(profile_step=0, clean_steps=1, throughput=False, report="full")
    session = StepSession(full, "test", publish=publish)
    session.train_start(0)
    sink = Sink(tmp_path)
    run(session, model, torch.optim.SGD(model.parameters(), lr=0.1), range(0, window_end(0, 1)), sink)
    r = session.result
    assert r is not None and r.profile.recompute_flops > 0
    logged = sink.logged[0][0]
    saved = json.loads((tmp_path / "flops_profile_step0.json").read_text())["metrics"]
    assert saved == logged
    printed = dict(
        (label.strip(), value.strip())
        for label, _, value in (line.partition(": ") for line in sink.printed[0].splitlines())
    )
    assert printed["bwd FLOPS per GPU = bwd flops per GPU / bwd latency"] == flops_to_string(
        logged[names.BWD_FLOPS_PER_SEC]
    )
    assert printed["FLOPS per GPU = fwd+bwd flops per GPU / iter latency"] == flops_to_string(
        logged[names.FLOPS_PER_SEC]
    )
    assert printed[
        "hardware FLOPS per GPU = fwd+bwd+recompute flops per GPU / iter latency"
    ] == flops_to_string(logged[names.HARDWARE_FLOPS_PER_SEC])
    # model flops in the bwd and FLOPS rows; the forward re-run in the backward only in hardware FLOPS
    assert logged[names.BWD_FLOPS_PER_SEC] == pytest.approx(r.profile.bwd_flops / r.bwd_latency)
    assert logged[names.FLOPS_PER_SEC] == pytest.approx(r.profile.model_flops / r.iter_latency)
    assert logged[names.HARDWARE_FLOPS_PER_SEC] == pytest.approx(r.profile.hardware_flops / r.iter_latency)


def test_an_moe_models_report_says_what_six_n_d_claims_with_all_and_active_parameters() -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    tokens = torch.randint(1, 256, (2, 16))
    session = StepSession(
        Options(profile_step=0, clean_steps=0, tokens_fn=lambda b: b.numel(), report="full"),
        "test",
        publish=publish,
    )
    session.train_start(0)
    sink = Sink()
    run(
        session,
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        range(0, 2),
        sink,
        tokens,
        loss_of=lm_loss,
    )
    session.train_end(2, sink)
    r = session.result
    assert r is not None
    rows = dict(r.extra_lines)
    params = r.profile.params - 256 * 64  # the token table (vocab x hidden) does no arithmetic
    experts = sum(m.params for m in r.profile.modules.values() if m.name.endswith("experts"))
    active = params - experts + experts * 2 // 4  # top-2 of 4 experts
    claimed = 6 * params * 32  # 2 x 16 tokens
    ratio = r.profile.model_flops / claimed
    expected = (
        f"{number_to_string(claimed)}flops = 6 x {params_to_string(params)} x 32, embedding tables left out: "
        f"{params_to_string(256 * 64)} (measured fwd+bwd flops: {ratio:.2f}x this)"
    )
    assert rows["6 x non-embedding params x tokens"] == expected
    assert rows["experts per token"] == "2 of 4"
    assert rows["active non-embedding params per token"] == params_to_string(active)
    assert rows["6 x active non-embedding params x tokens"].startswith(
        number_to_string(6 * active * 32) + "flops"
    )
    # PaLM's attention term from the config and the batch: 12 x L x H x Q x T a token, T = 16
    attention = 12 * 2 * 4 * 16 * 16 * 32
    palm = rows["6 x active non-embedding params x tokens + 12 x L x H x Q x T x tokens (PaLM)"]
    assert palm.startswith(f"{number_to_string(6 * active * 32 + attention)}flops = ")
    assert f" + {number_to_string(attention)}flops of attention, L=2, H=4, Q=16, T=16 (measured" in palm
    assert "6 x non-embedding params x tokens" in sink.printed[0]


def test_a_12_layer_gpt2s_console_is_a_summary_of_25_lines_and_report_full_its_90_line_report(
    tmp_path: Path,
) -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    session = StepSession(
        Options(profile_step=0, clean_steps=1, tokens_fn=lambda b: b.numel()), "test", publish=publish
    )
    session.train_start(0)
    sink = Sink(tmp_path)
    run(
        session, model, torch.optim.SGD(model.parameters(), lr=0.0), range(0, window_end(0, 1)), sink, ids,
        loss_of=lm_loss,
    )  # fmt: skip
    assert session.result is not None
    summary = sink.printed[0].splitlines()
    assert 15 <= len(summary) <= 25, len(summary)
    assert summary[1].endswith(f"(full report: {tmp_path / 'flops_profile_step0.txt'})")
    assert "Aggregated Profile" not in sink.printed[0]
    assert len((tmp_path / "flops_profile_step0.txt").read_text().splitlines()) > 300  # the whole tree
    # the same window with report="full": the summary rows and the aggregated profile, not the tree
    whole = report_text(session.result, Options(), detailed=True)
    full = console_text(session.result, Options(report="full"), whole, details="")
    console = full.splitlines()
    # a module-timing step slowed by another process adds up to 4 lines saying so (tree_check)
    console = [line for line in console if not line.startswith("module latencies in doubt")]
    assert len(console) <= 90, len(console)
    # the module tree is not on the console unless detailed=True (a doubt row may name the module it doubts)
    assert "Aggregated Profile" in full and "h.11" not in "\n".join(console)


def test_a_warning_points_at_the_users_line_and_an_unreachable_step_is_said_once(tmp_path: Path) -> None:
    session = StepSession(Options(profile_step=10), "test", publish=publish)
    with pytest.warns(UserWarning, match="never reached") as said:
        session.train_start(0, max_steps=5)  # this line is the user's (outside the frameworks)
    assert said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session.train_end(5, Sink(tmp_path))  # said at the start: not again at the end


@pytest.mark.parametrize("behind", [0, 1, 2])
def test_an_auto_window_reads_only_the_clean_steps_the_device_has_finished(
    monkeypatch: pytest.MonkeyPatch, behind: int
) -> None:
    """The auto stop reads no step the device has not finished (a synchronize, which would drain the queue
    the host keeps ahead of a GPU): a device ``behind`` steps lags the stop by as many clean steps."""
    from flops_callbacks.session import window_plan
    from flops_callbacks.timing.clock import CpuClock

    def queued(mark: float) -> bool:  # marked after the end of the last step the device has finished
        ends = [s.end_mark for s in session._steps if s.ended]
        return behind > 0 and (len(ends) <= behind or mark > ends[-behind - 1])

    read_queued: list[int] = []  # the steps at which a queued mark's seconds were read (a synchronize)

    def seconds(self: CpuClock, start: float, end: float) -> float:
        if queued(end):
            read_queued.append(step)
        return end - start

    monkeypatch.setattr(CpuClock, "done", lambda self, mark: not queued(mark))
    monkeypatch.setattr(CpuClock, "seconds", seconds)
    monkeypatch.setattr(window_plan, "median_known", lambda values: True)  # stop at CLEAN_MIN read
    model = nn.Linear(IN, OUT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = StepSession(Options(profile_step=0, clean_steps="auto"), "test", publish=publish)
    session.train_start(0)
    step = start = first_clean(0)
    run(session, model, optimizer, range(0, start), Sink())
    read_queued.clear()  # before the clean steps: the counting and module-timing steps read theirs
    step = start
    while session.result is None and step < start + window_plan.CLEAN_MAX:
        run(session, model, optimizer, range(step, step + 1), Sink())
        step += 1
    assert session.result is not None
    assert len(session.result.steps.clean) == window_plan.CLEAN_MIN + behind
    # a queued step is read only once the window has ended, to build its result
    assert set(read_queued) <= {step - 1} and (behind == 0) == (not read_queued)
