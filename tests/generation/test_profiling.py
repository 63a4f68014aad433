"""Generation profiled on real HF models built from configs (a tiny GPT-2, a tiny Llama with grouped-query
attention), batch 2, prompt 64, 32 new tokens, greedy, on CPU; nothing downloaded.

Truth for the work: torch's ``FlopCounterMode`` with SDPA on the math backend around ``generate()`` itself:
``generate(max_new_tokens=1)`` is the prefill's forward, and ``generate(max_new_tokens=k + 1)`` less
``generate(max_new_tokens=k)`` is the k-th decode step's. Dense flops (2 x MACs) must equal it exactly,
total flops (elementwise work added, the package's convention) within 2%. Timing is checked with known
sleeps (a one-layer model whose forward sleeps 100 ms on a prompt and 30 ms per decode step), exactly on
a clock only the sleeps move; the comparison with outside timers on a real model is
``benchmarks/generation_truth.py``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import GenerationProfile, GenerationRun, metrics, profile_decode_loop, profile_generation

transformers = pytest.importorskip("transformers")

# the cache's name in a model's outputs and arguments: ``cache`` from transformers 5.24 (``past_key_values``
# still works there, with a FutureWarning), ``past_key_values`` before
OUTPUT_FIELDS = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
CACHE = "cache" if "cache" in OUTPUT_FIELDS else "past_key_values"

BATCH, PROMPT, NEW = 2, 64, 32
DECODE_STEPS = NEW - 1  # the prefill's forward gives the first token
MIDDLE = (DECODE_STEPS - 1) // 2  # decode step 15: the cache holds PROMPT + 15 positions before it


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=128, bos_token_id=1, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=512,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": gpt2, "llama-gqa": llama}


def prompt(padded: int = 8) -> dict[str, torch.Tensor]:
    """Two prompts of 64 positions, the second left-padded by ``padded`` positions."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (BATCH, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :padded] = 0
    ids[1, :padded] = 0
    return {"input_ids": ids, "attention_mask": mask}


GREEDY = {"do_sample": False, "pad_token_id": 0}


def dense_truth(model: torch.nn.Module, new_tokens: int) -> int:
    """FlopCounterMode's flops of ``generate(max_new_tokens=new_tokens)``, SDPA on the math backend."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.generate(**prompt(), max_new_tokens=new_tokens, **GREEDY)
    return counter.get_total_flops()


def built(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


_PROFILES: dict[str, tuple[GenerationProfile, torch.nn.Module]] = {}


def profiled(name: str) -> tuple[GenerationProfile, torch.nn.Module]:
    if name not in _PROFILES:
        model = built(name)
        result = profile_generation(
            model, **prompt(), max_new_tokens=NEW, **GREEDY, runs=1, peak_flops=1e12, peak_bandwidth=1e11
        )
        _PROFILES[name] = (result, model)
    return _PROFILES[name]


def kv_bytes(model: torch.nn.Module, positions: int) -> int:
    """Keys and values of every layer for ``positions`` positions of the batch (fp32)."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * BATCH * heads * positions * head_dim * 4


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_mid_decode_step_flops_are_flop_counter_modes(name: str) -> None:
    profile, model = profiled(name)
    prefill, decode = profile.result.prefill_work, profile.result.decode_work
    assert prefill is not None and decode is not None and decode.steps == DECODE_STEPS
    truth_prefill = dense_truth(model, 1)
    truth_step = dense_truth(model, MIDDLE + 2) - dense_truth(model, MIDDLE + 1)  # decode step MIDDLE
    assert 2 * prefill.macs == truth_prefill
    assert 2 * decode.macs == truth_step  # the mean over the steps: attention grows linearly with the cache
    m = profile.metrics
    assert 1.0 <= m[metrics.PREFILL_FLOPS] / truth_prefill <= 1.02
    assert 1.0 <= m[metrics.DECODE_FLOPS_PER_TOKEN] / truth_step <= 1.02
    # the tree shown is the middle step's, the cache at mid-length
    assert profile.result.decode_shown == MIDDLE
    assert profile.result.decode is not None and 2 * profile.result.decode.fwd_macs == truth_step


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_bytes_hold_the_weights_and_the_kv_cache_read(name: str) -> None:
    profile, model = profiled(name)
    weights = sum(p.nbytes for p in dict.fromkeys(model.parameters()))
    m = profile.metrics
    assert m[metrics.DECODE_BYTES_PER_TOKEN] >= weights + kv_bytes(model, PROMPT + MIDDLE)
    assert m[metrics.KV_CACHE_BYTES] == kv_bytes(model, PROMPT + NEW - 1)  # the last token is never fed back
    assert m[metrics.PREFILL_BYTES] > weights


def test_the_rates_are_the_printed_quotients() -> None:
    profile, _ = profiled("gpt2")
    m = profile.metrics
    assert m[metrics.PREFILL_MFU] == m[metrics.PREFILL_FLOPS] / m[metrics.PREFILL_LATENCY] / 1e12
    assert m[metrics.PREFILL_MBU] == m[metrics.PREFILL_BYTES] / m[metrics.PREFILL_LATENCY] / 1e11
    per_token = m[metrics.DECODE_LATENCY_PER_TOKEN]
    assert m[metrics.DECODE_MFU] == m[metrics.DECODE_FLOPS_PER_TOKEN] / per_token / 1e12
    assert m[metrics.DECODE_MBU] == m[metrics.DECODE_BYTES_PER_TOKEN] / per_token / 1e11
    # ... and from the printed numbers: "<flops> / <latency> / <peak> = <percent>%"
    for rate in ("MFU", "MBU"):
        lines = [line for line in profile.report.splitlines() if line.strip().startswith(f"{rate} =")]
        assert len(lines) == 2  # the prefill's and the decode's
        for line in lines:
            numerator, seconds, peak, printed = parse_rate(line)
            assert numerator / seconds / peak == pytest.approx(printed, rel=0.015)


_SCALE = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def parse_rate(line: str) -> tuple[float, float, float, float]:
    """``MFU = ...: 30.21 Mflops / 4.23 ms / 1 TFLOPS = 0.714%`` as its four numbers, prefixes applied."""
    quantity = r"([\d.]+) ([TGMKmu]?)"
    found = re.search(rf"{quantity}\w* / {quantity}s / {quantity}\w*(?:/s)? = ([\d.e+-]+)%", line)
    assert found is not None, line
    values = [float(found[i]) * _SCALE[found[i + 1]] for i in (1, 3, 5)]
    return values[0], values[1], values[2], float(found[7]) / 100


def test_the_report_says_the_verdict_per_phase_and_decode_is_memory_bound() -> None:
    profile, _ = profiled("gpt2")
    verdicts = profile.result.rooflines()
    assert set(verdicts) == {"prefill", "decode"}
    assert verdicts["decode"].limiter == "memory"
    assert verdicts["decode"].intensity is not None and verdicts["decode"].intensity < 1  # flops per byte
    assert f"roofline: {verdicts['decode'].intensity:.3g} flops/B, {verdicts['decode'].verdict()}" in (
        " ".join(profile.report.split())
    )
    assert "Prefill" in profile.report and f"decode step {MIDDLE + 1} of {DECODE_STEPS}" in profile.report


def test_without_peaks_no_fraction_is_logged_and_the_report_says_why() -> None:
    model = built("gpt2")
    profile = profile_generation(model, **prompt(), max_new_tokens=3, **GREEDY, runs=1, warm_up=0)
    assert not set(metrics.GENERATION_WITH_PEAK) & set(profile.metrics)
    assert set(profile.metrics) == set(metrics.GENERATION)
    assert "no peak FLOPS for a cpu device" in profile.report


# --- timing, with known sleeps ---------------------------------------------------------------------

PREFILL_SLEEP, DECODE_SLEEP = 0.100, 0.030


class VirtualTime:
    """A clock that only the model's sleeps move: every mark the profiler takes reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class SleepyGPT2(transformers.GPT2LMHeadModel):
    """A GPT-2 whose forward sleeps 100 ms on a prompt and 30 ms on a decode step (``clock.sleep``)."""

    clock: Any = time

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        assert input_ids is not None
        type(self).clock.sleep(PREFILL_SLEEP if input_ids.shape[1] > 1 else DECODE_SLEEP)
        return super().forward(input_ids, **kwargs)


def sleepy() -> SleepyGPT2:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=512, n_positions=128)
    return SleepyGPT2(config).eval()


def test_latencies_are_the_known_sleeps_on_a_clock_only_the_sleeps_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import flops_callbacks.timing.clock as clock_module

    virtual = VirtualTime()
    monkeypatch.setattr(clock_module, "time", virtual)
    monkeypatch.setattr(SleepyGPT2, "clock", virtual)
    profile = profile_generation(sleepy(), **prompt(), max_new_tokens=6, **GREEDY, runs=3)
    runs = profile.result.runs
    for run in runs:  # the same to the last bit but the float sums' rounding
        assert run.steps == pytest.approx((PREFILL_SLEEP, *[DECODE_SLEEP] * 5))
        assert run.token_gaps == pytest.approx([DECODE_SLEEP] * 5)
        assert (run.first_token, run.tokens) == (pytest.approx(PREFILL_SLEEP), 6)
    # the trees' latencies: the module-timing run's, each of its own step (the hooks' real cost taken out)
    assert profile.result.prefill is not None and profile.result.decode is not None
    assert profile.result.prefill.model.fwd_latency == pytest.approx(PREFILL_SLEEP, abs=0.005)
    assert profile.result.decode.model.fwd_latency == pytest.approx(DECODE_SLEEP, abs=0.005)
    assert profile.metrics == pytest.approx(
        {
            **{name: profile.metrics[name] for name in (metrics.PREFILL_FLOPS, metrics.PREFILL_BYTES)},
            **{
                name: profile.metrics[name]
                for name in (metrics.DECODE_FLOPS_PER_TOKEN, metrics.DECODE_BYTES_PER_TOKEN)
            },
            metrics.KV_CACHE_BYTES: profile.metrics[metrics.KV_CACHE_BYTES],
            metrics.PREFILL_LATENCY: PREFILL_SLEEP,
            metrics.TIME_TO_FIRST_TOKEN: PREFILL_SLEEP,
            metrics.DECODE_LATENCY_PER_TOKEN: DECODE_SLEEP,
            metrics.DECODE_LATENCY_P90: DECODE_SLEEP,
            metrics.DECODE_FORWARD_LATENCY: DECODE_SLEEP,
            metrics.GENERATION_LATENCY: PREFILL_SLEEP + 5 * DECODE_SLEEP,
            metrics.GENERATION_TOKENS_PER_SEC: BATCH * 6 / (PREFILL_SLEEP + 5 * DECODE_SLEEP),
        }
    )


ENCODER_SLEEP = 0.060


class SleepyT5(transformers.T5ForConditionalGeneration):
    """A T5 whose forward sleeps 30 ms and whose encoder sleeps 60 ms (``clock.sleep``), on every call."""

    clock: Any = time

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        type(self).clock.sleep(DECODE_SLEEP)
        return super().forward(*args, **kwargs)


def test_an_encoder_decoders_prefill_tree_holds_its_encoders_time_and_the_root_both_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``generate()`` calls the encoder before the model's first call: its time is the prefill tree's too,
    and the tree's root is the two calls' (the host's time between them is no module's)."""
    import flops_callbacks.timing.clock as clock_module

    virtual = VirtualTime()
    monkeypatch.setattr(clock_module, "time", virtual)
    monkeypatch.setattr(SleepyT5, "clock", virtual)
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=512, decoder_start_token_id=0
    )
    model = SleepyT5(config).eval()
    encoder_forward = model.encoder.forward

    def sleeping_encoder(*args: Any, **kwargs: Any) -> Any:
        virtual.sleep(ENCODER_SLEEP)
        return encoder_forward(*args, **kwargs)

    monkeypatch.setattr(model.encoder, "forward", sleeping_encoder)
    profile = profile_generation(model, **prompt(), max_new_tokens=4, do_sample=False, runs=1, warm_up=0)
    result = profile.result
    assert result.module_latencies.startswith("a run of their own")
    prefill, decode = result.prefill, result.decode
    assert prefill is not None and decode is not None
    assert prefill.modules["encoder"].fwd_latency == pytest.approx(ENCODER_SLEEP, abs=0.005)
    assert prefill.model.fwd_latency == pytest.approx(ENCODER_SLEEP + DECODE_SLEEP, abs=0.005)
    assert profile.metrics[metrics.PREFILL_LATENCY] == pytest.approx(ENCODER_SLEEP + DECODE_SLEEP, abs=1e-9)
    assert decode.modules["encoder"].fwd_latency == 0  # called once, before the first token
    assert decode.model.fwd_latency == pytest.approx(DECODE_SLEEP, abs=0.005)


def test_a_marked_step_of_several_model_calls_has_their_module_latencies_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop's prefill block prefills its prompt by hand in two calls (100 ms each): the prefill's tree
    holds both calls' latencies, as it holds their flops, and the decode tree its own step's (the trees
    were read by the model's calls: the prefill's tree held its first call's 100 ms, each decode tree the
    call one step before its own)."""
    import flops_callbacks.timing.clock as clock_module

    virtual = VirtualTime()
    monkeypatch.setattr(clock_module, "time", virtual)
    monkeypatch.setattr(SleepyGPT2, "clock", virtual)
    model, ids = sleepy(), torch.randint(0, 512, (BATCH, 16))

    def loop(run: GenerationRun) -> None:
        with torch.no_grad():
            with run.prefill():
                out = model(input_ids=ids[:, :8], use_cache=True)
                out = model(input_ids=ids[:, 8:], past_key_values=getattr(out, CACHE), use_cache=True)
            for _ in range(3):
                with run.decode_step():
                    token = out.logits[:, -1:].argmax(-1)
                    out = model(input_ids=token, past_key_values=getattr(out, CACHE), use_cache=True)

    profile = profile_decode_loop(model, loop, runs=1, warm_up=0, batch_size=BATCH)
    prefill, decode = profile.result.prefill, profile.result.decode
    assert prefill is not None and decode is not None
    assert prefill.model.fwd_latency == pytest.approx(2 * PREFILL_SLEEP, abs=0.005)  # the hooks' fit out
    assert profile.metrics[metrics.PREFILL_LATENCY] == pytest.approx(2 * PREFILL_SLEEP, abs=1e-9)
    assert decode.model.fwd_latency == pytest.approx(DECODE_SLEEP, abs=0.005)


def test_a_module_timing_run_shorter_than_the_counting_run_leaves_the_trees_the_counting_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sampling may end a run earlier (its EOS): where the module-timing run has no call of the step the
    decode tree shows, neither tree takes its latencies from it, and the report and a warning say so."""
    calls = {"generate": 0}
    original = transformers.GPT2LMHeadModel.generate

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["generate"] += 1
        if calls["generate"] == 3:  # warm-up, timed, then the module-timing run: two new tokens only
            kwargs = {**kwargs, "max_new_tokens": 2}
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "generate", generate)
    with pytest.warns(UserWarning, match="it made fewer steps than the counting run"):
        profile = profile_generation(built("gpt2"), **prompt(), max_new_tokens=8, **GREEDY, runs=1)
    assert profile.result.module_latencies.startswith("the counting run")
    assert "Module latencies below: the counting run (inflated by counting" in profile.report


def test_latencies_hold_the_real_sleeps() -> None:
    """On the real clock (a loaded machine delays a wake-up by up to hundreds of ms: lower bounds only)."""
    profile = profile_generation(sleepy(), **prompt(), max_new_tokens=6, **GREEDY, runs=2)
    m, runs = profile.metrics, profile.result.runs
    assert [len(run.steps) for run in runs] == [6, 6] and [run.tokens for run in runs] == [6, 6]
    assert PREFILL_SLEEP <= m[metrics.PREFILL_LATENCY] <= m[metrics.TIME_TO_FIRST_TOKEN]
    assert DECODE_SLEEP <= m[metrics.DECODE_FORWARD_LATENCY] <= m[metrics.DECODE_LATENCY_PER_TOKEN]
    assert m[metrics.DECODE_LATENCY_PER_TOKEN] <= m[metrics.DECODE_LATENCY_P90]
    assert m[metrics.GENERATION_LATENCY] >= PREFILL_SLEEP + 5 * DECODE_SLEEP
    assert m[metrics.GENERATION_TOKENS_PER_SEC] == pytest.approx(2 * BATCH * 6 / sum(r.total for r in runs))


# --- a loop of one's own ---------------------------------------------------------------------------


def own_loop(model: torch.nn.Module, steps: int = NEW) -> Callable[[GenerationRun], Any]:
    inputs = prompt()

    def loop(run: GenerationRun) -> torch.Tensor:
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            with run.prefill():
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = [token]
            for _ in range(steps - 1):
                mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
                positions = positions[:, -1:] + 1
                with run.decode_step():
                    out = model(
                        input_ids=token,
                        attention_mask=mask,
                        position_ids=positions,
                        **{CACHE: getattr(out, CACHE)},
                        logits_to_keep=1,
                    )
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
            run.kv_cache(getattr(out, CACHE))
        return torch.cat(tokens, dim=-1)

    return loop


def test_a_loop_of_ones_own_counts_what_generate_counts() -> None:
    generated, model = profiled("llama-gqa")
    profile = profile_decode_loop(model, own_loop(model), runs=1, warm_up=0, batch_size=BATCH)
    assert profile.result.work == generated.result.work  # the same steps, op for op
    assert profile.metrics[metrics.KV_CACHE_BYTES] == generated.metrics[metrics.KV_CACHE_BYTES]
    expected = model.generate(**prompt(), max_new_tokens=NEW, **GREEDY)[:, PROMPT:]
    assert torch.equal(profile.output, expected)
    assert profile.result.runs[0].tokens == NEW and len(profile.result.runs[0].token_gaps) == NEW - 1


def test_a_compiled_wrappers_generate_is_the_wrapped_models_profiled_as_it_runs_and_said() -> None:
    """``torch.compile(model).generate()`` runs the wrapped model's own calls, uncompiled: its hooks mark
    them (the wrapper's never run), and a warning says how to generate compiled."""
    generated, model = profiled("llama-gqa")
    wrapper = torch.compile(model, backend="eager")
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks), dict(wrapper._forward_pre_hooks))
    with pytest.warns(UserWarning, match=r"generate\(\) on a torch.compile wrapper runs the wrapped model "):
        profile = profile_generation(wrapper, **prompt(), max_new_tokens=NEW, **GREEDY, runs=1)
    assert profile.result.work == generated.result.work  # the same steps, op for op
    assert torch.equal(profile.output, generated.output)
    assert (
        dict(model._forward_pre_hooks),
        dict(model._forward_hooks),
        dict(wrapper._forward_pre_hooks),
    ) == hooks


def test_a_decode_step_before_the_prefill_is_refused() -> None:
    model = built("gpt2")

    def loop(run: GenerationRun) -> None:
        with run.decode_step():
            pass

    with pytest.raises(RuntimeError, match="after the run's prefill"):
        profile_decode_loop(model, loop)


# --- the model as it was --------------------------------------------------------------------------


def test_the_model_keeps_its_modes_grads_and_hooks_also_when_generate_raises() -> None:
    model = built("gpt2").train()
    model.transformer.h[0].eval()  # a mixed mode, given back as it was
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    grads = {name: p.grad for name, p in model.named_parameters()}
    modes = {name: m.training for name, m in model.named_modules()}

    def as_it_was() -> None:
        assert {name: m.training for name, m in model.named_modules()} == modes
        assert all(p.grad is grads[name] for name, p in model.named_parameters())
        assert all(torch.all(p.grad == 0.5) for p in model.parameters() if p.grad is not None)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())

    profile_generation(model, **prompt(), max_new_tokens=3, **GREEDY, runs=1, warm_up=0)
    as_it_was()

    # each run makes 2 tokens: the warm-up's, the timed run's, the module-timing run's, the counting run's
    for failing_call in (5, 7):  # the module-timing run's first token, the counting run's
        calls: list[int] = []

        def fails(
            input_ids: torch.Tensor, scores: torch.Tensor, at: int = failing_call, calls: list[int] = calls
        ) -> torch.Tensor:
            calls.append(1)
            if len(calls) == at:
                raise ValueError("the user's processor")
            return scores

        processors = transformers.LogitsProcessorList([fails])
        with pytest.raises(ValueError, match="the user's processor"):
            profile_generation(
                model, **prompt(), max_new_tokens=2, **GREEDY, logits_processor=processors, runs=1, warm_up=1
            )
        assert len(calls) == failing_call
        as_it_was()


def test_a_failure_of_the_profiler_warns_and_the_latencies_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from flops_callbacks.counting.engine import CountingEngine

    def broken(self: CountingEngine) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(CountingEngine, "profile", broken)
    model = built("gpt2")
    with pytest.warns(UserWarning, match="injected.*latencies are"):
        profile = profile_generation(model, **prompt(), max_new_tokens=3, **GREEDY, runs=1, warm_up=0)
    assert metrics.PREFILL_FLOPS not in profile.metrics and metrics.PREFILL_LATENCY in profile.metrics
    assert "NOT COUNTED" in profile.report


def test_a_failure_reading_the_cache_keeps_the_counts_and_a_failed_picture_or_file_only_warns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from flops_callbacks.generation import run

    def unreadable(output: Any) -> int | None:
        raise RuntimeError("a cache of its own kind")

    monkeypatch.setattr(run, "output_cache_bytes", unreadable)
    model = built("gpt2")
    with pytest.warns(UserWarning, match="reading the KV cache's bytes failed .*a cache of its own kind"):
        profile = profile_generation(model, **prompt(), max_new_tokens=3, **GREEDY, runs=1, warm_up=0)
    assert profile.metrics[metrics.PREFILL_FLOPS] > 0 and metrics.KV_CACHE_BYTES not in profile.metrics
    assert profile.save_picture(tmp_path / "kept.html") == tmp_path / "kept.html"

    counted = dataclasses.replace(profile.result, work=(), prefill=None, decode=None, counting_failure="x")
    failed = GenerationProfile(counted)
    assert "(1 from the prefill, 2 from decode steps)" in failed.report  # the timed run's steps
    with pytest.warns(UserWarning, match="drawing the picture .*no module tree to draw.*nothing was written"):
        assert failed.save_picture(tmp_path / "none.html") is None
    assert not (tmp_path / "none.html").exists()
    (tmp_path / "taken").write_text("a file where a folder should be")
    with pytest.warns(UserWarning, match="saving .*nothing was written"):
        assert failed.save(tmp_path / "taken" / "generation.json") is None


@pytest.mark.parametrize(
    "arguments",
    [
        {"prompt_lookup_num_tokens": 3},
        {"guidance_scale": 1.5},
        {"assistant_model": "draft"},
        {"generation_config": "prompt_lookup_num_tokens"},
    ],
    ids=["prompt-lookup", "guidance", "assistant", "in-a-config"],
)
def test_a_generate_that_calls_the_model_other_than_once_per_token_is_refused_before_it_runs(
    arguments: dict[str, Any],
) -> None:
    """Assisted decoding checks several tokens per call (its processor runs per candidate), guidance calls
    the model twice per token: counted as steps and tokens they gave 31 tokens for 10, or half the flops
    per token."""
    model = built("gpt2")
    if arguments.get("assistant_model") == "draft":
        arguments = {"assistant_model": built("gpt2")}
    if arguments.get("generation_config"):
        config = transformers.GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=4, **GREEDY)
        arguments = {"generation_config": config}
    named = next(iter({"generation_config": "prompt_lookup_num_tokens"}.get(k, k) for k in arguments))
    with pytest.raises(ValueError, match=f"{named}=.* is not profiled: its model calls are not one per"):
        profile_generation(model, **prompt(), max_new_tokens=4, **GREEDY, **arguments)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_cache_object_of_the_callers_is_refused_and_left_as_it_was() -> None:
    """Every generate() call shared it: the first filled it, the next failed deep in transformers ("cannot
    reshape tensor of 0 elements") and the caller's cache held the runs' positions."""
    model = built("llama-gqa")
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(ValueError, match=f"{CACHE} is not profiled: profile_generation calls generate"):
        profile_generation(model, **prompt(), max_new_tokens=4, **GREEDY, **{CACHE: cache})
    assert cache.get_seq_length() == 0


def test_a_static_caches_bytes_are_its_keys_and_values_and_the_decode_tree_is_named_from_one() -> None:
    """A static cache keeps its length in an int64 tensor per layer, which counted as the cache's (16
    bytes more); the decode tree shown is the middle step, said counting from 1; generate()'s own work
    between the model calls is said as such, not as a loss and an optimizer step."""
    model = built("llama-gqa")
    settings = {**prompt(padded=0), "max_new_tokens": 6, **GREEDY, "cache_implementation": "static"}
    profile = profile_generation(model, **settings, runs=1)
    out = model.generate(**settings, return_dict_in_generate=True)
    cache = getattr(out, CACHE, None) or out.past_key_values
    keys_and_values = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert profile.metrics[metrics.KV_CACHE_BYTES] == keys_and_values
    assert profile.result.decode_shown == 2  # of decode steps 0 .. 4: the third
    assert "Decode (decode step 3 of 5: the cache at mid-length)" in profile.report
    assert "(generate()'s own between model calls: choosing tokens)." in profile.report
    assert "the optimizer step" not in profile.report


def test_guidance_is_left_to_a_model_whose_own_generate_batches_it() -> None:
    """MusicGen and Janus override generate(), batch the unconditional rows and call the model once a
    token: their checkpoints' guidance_scale (3.0) was refused. The base generate() calls it twice."""
    from flops_callbacks.generation.generate_marks import check_one_call_per_token

    class OwnGenerate(transformers.GPT2LMHeadModel):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            return super().generate(*args, **kwargs)

    config = built("gpt2").config
    check_one_call_per_token(OwnGenerate(config), {"guidance_scale": 3.0})
    with pytest.raises(ValueError, match="guidance_scale=3.0"):
        check_one_call_per_token(transformers.GPT2LMHeadModel(config), {"guidance_scale": 3.0})


def test_a_processor_that_calls_the_model_is_said_to_make_the_decode_figures_per_call() -> None:
    model = built("gpt2")

    def second_opinion(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        model(input_ids[:, -1:])  # a second model call for each token
        return scores

    processors = transformers.LogitsProcessorList([second_opinion])
    said = r"called 6 times after the prefill for 3 more tokens \(and 2 times before the first token: the "
    with pytest.warns(
        UserWarning, match=said + r"prefill holds them all\): the decode's figures .*per model"
    ):
        profile_generation(
            model, **prompt(), max_new_tokens=4, **GREEDY, logits_processor=processors, runs=1, warm_up=0
        )


def test_a_generation_under_autocast_takes_the_peak_of_the_autocast_dtype() -> None:
    """The parameters stay fp32; the matmuls run in bf16, whose peak is 15x fp32's on an H100."""
    model = built("gpt2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profile = profile_generation(model, **prompt(), max_new_tokens=2, **GREEDY, runs=1, warm_up=0)
    assert profile.result.compute_dtype == "bf16"
    plain = profile_generation(model, **prompt(), max_new_tokens=2, **GREEDY, runs=1, warm_up=0)
    assert plain.result.compute_dtype == "fp32"


def test_a_loop_that_calls_only_the_models_submodules_is_said_so() -> None:
    model = built("gpt2")
    inputs = prompt()

    def loop(run: GenerationRun) -> None:
        with run.prefill():
            hidden = model.transformer(**inputs).last_hidden_state
            token = model.lm_head(hidden[:, -1:]).argmax(-1)
        with run.decode_step():
            model.lm_head(model.transformer(token).last_hidden_state)

    with pytest.warns(UserWarning, match="the loop never called the model itself, only its submodules"):
        profile_decode_loop(model, loop, runs=1, warm_up=0)


def test_an_encoder_decoders_prefill_is_its_encoder_and_first_decoder_call() -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=512, decoder_start_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    inputs = prompt()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
    profile = profile_generation(model, **inputs, max_new_tokens=4, do_sample=False, runs=1, warm_up=0)
    prefill = profile.result.prefill_work
    assert prefill is not None and 2 * prefill.macs == counter.get_total_flops()  # the encoder's included
    m = profile.metrics
    assert m[metrics.PREFILL_LATENCY] <= m[metrics.TIME_TO_FIRST_TOKEN]
    assert [len(run.steps) for run in profile.result.runs] == [4]  # the encoder opened the first step


def test_a_prefill_in_chunks_is_every_call_before_the_first_token() -> None:
    model = built("gpt2")
    chunked = {"prefill_chunk_size": 16}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.generate(**prompt(), max_new_tokens=1, **GREEDY, **chunked)
    profile = profile_generation(model, **prompt(), max_new_tokens=4, **GREEDY, **chunked, runs=1, warm_up=0)
    result = profile.result
    assert result.prefill_steps == 4 and result.runs[0].prefill_steps == 4  # 64 positions in chunks of 16
    assert result.prefill_work is not None and 2 * result.prefill_work.macs == counter.get_total_flops()
    assert result.decode_work is not None and result.decode_work.steps == 3
    assert "in 4 chunks" in profile.report


def test_num_return_sequences_makes_each_returned_sequence_count_in_the_batch_and_the_tokens() -> None:
    """Three samples of each of the two prompts: six sequences decoded and returned, each with its prompt's
    padding; tokens per second are theirs, not the prompts' (3x more)."""
    model, new = built("gpt2"), 4
    sampled = {"do_sample": True, "num_return_sequences": 3, "min_new_tokens": new, "pad_token_id": 0}
    profile = profile_generation(model, **prompt(), max_new_tokens=new, **sampled, runs=2, warm_up=0)
    result = profile.result
    assert profile.output.shape == (3 * BATCH, PROMPT + new)
    assert (result.batch_size, result.padding_tokens, result.new_tokens) == (3 * BATCH, 3 * 8, new)
    rate = 3 * BATCH * new * len(result.runs) / sum(run.total for run in result.runs)
    assert profile.metrics[metrics.GENERATION_TOKENS_PER_SEC] == pytest.approx(rate, rel=1e-12)
    assert re.search(r"^batch size \(sequences\): +6$", profile.report, re.MULTILINE)
    assert "64 per sequence, 24 of 384 positions padding" in profile.report


def test_a_generation_from_bos_alone_has_the_returned_sequences_as_its_batch_and_their_tokens_rate() -> None:
    """``generate()`` with no prompt starts from the BOS token: one sequence returned, its batch (it had
    none: no tokens per second, no batch line)."""
    model, new = built("gpt2"), 4
    start = {"bos_token_id": 1, "min_new_tokens": new}
    profile = profile_generation(model, max_new_tokens=new, **GREEDY, **start, runs=2, warm_up=0)
    result = profile.result
    assert profile.output.shape == (1, 1 + new) and result.batch_size == 1
    rate = new * len(result.runs) / sum(run.total for run in result.runs)
    assert profile.metrics[metrics.GENERATION_TOKENS_PER_SEC] == pytest.approx(rate, rel=1e-12)
    assert re.search(r"^batch size \(sequences\): +1$", profile.report, re.MULTILINE)


def test_sampling_makes_the_same_generation_in_every_run_and_leaves_the_generator_as_one_generate() -> None:
    """With sampling and a reachable end of sequence, seeded runs of one generate() stop at different
    lengths: every profiled run starts from the caller's random state, so the counting run's steps and
    the timed runs' tokens are of one generation, the output is the first seeded generate()'s, and the
    random state after is as after that one call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=32,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[2] = 0  # the end of sequence: a logit of 0 among the others, reachable
    sampled = {"input_ids": torch.randint(3, 32, (1, 6)), "max_new_tokens": 20, "do_sample": True}
    torch.manual_seed(7)
    lengths = [model.generate(**sampled).shape[1] - 6 for _ in range(6)]
    assert len(set(lengths)) > 1  # the generations differ from call to call
    torch.manual_seed(7)
    first = model.generate(**sampled)
    after_one = torch.get_rng_state()
    torch.manual_seed(7)
    profile = profile_generation(model, **sampled, runs=3, warm_up=1)
    result = profile.result
    assert torch.equal(profile.output, first)
    assert torch.equal(torch.get_rng_state(), after_one)
    new = first.shape[1] - 6
    assert [run.tokens for run in result.runs] == [new] * 3 and len(result.work) == new
    assert result.decode_work is not None and result.decode_work.steps == new - 1


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"batch_size": "2"}, "batch_size must be an int >= 1, got '2'"),
        ({"prompt_tokens": -5}, "prompt_tokens must be an int >= 1, got -5"),
        ({"padding_tokens": -1}, "padding_tokens must be an int >= 0, got -1"),
        ({"batch_size": 2, "prompt_tokens": 5, "padding_tokens": 10}, "padding_tokens must be fewer than"),
        ({"padding_tokens": 5}, "padding_tokens needs batch_size and prompt_tokens"),  # accepted, never shown
    ],
)
def test_a_decode_loops_sizes_are_checked_before_it_runs(arguments: dict[str, Any], named: str) -> None:
    calls: list[GenerationRun] = []
    with pytest.raises(ValueError, match=re.escape(named)):
        profile_decode_loop(torch.nn.Linear(2, 2), calls.append, **arguments)
    assert not calls


def test_a_loop_that_is_no_callable_or_marks_no_step_and_a_model_without_generate_are_refused() -> None:
    with pytest.raises(ValueError, match="loop must be a callable taking the run"):
        profile_decode_loop(torch.nn.Linear(2, 2), 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="marked no step: mark the prompt's forward in `with run.prefill"):
        profile_decode_loop(torch.nn.Linear(2, 2), lambda run: None)
    with pytest.raises(ValueError, match="model must have a generate.*got Linear; .* profile_decode_loop"):
        profile_generation(torch.nn.Linear(2, 2), input_ids=torch.ones(1, 2, dtype=torch.long))


def test_the_callers_own_pre_hook_on_the_model_is_in_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-hook of the caller's on the model runs inside the model's call: its time is the step's."""
    import flops_callbacks.timing.clock as clock_module

    virtual = VirtualTime()
    monkeypatch.setattr(clock_module, "time", virtual)
    monkeypatch.setattr(SleepyGPT2, "clock", virtual)
    model, hook = sleepy(), 0.040
    handle = model.register_forward_pre_hook(lambda module, args: virtual.sleep(hook))
    try:
        profile = profile_generation(model, **prompt(), max_new_tokens=3, **GREEDY, runs=1, warm_up=0)
    finally:
        handle.remove()
    (run,) = profile.result.runs
    assert run.steps == pytest.approx((PREFILL_SLEEP + hook, DECODE_SLEEP + hook, DECODE_SLEEP + hook))
