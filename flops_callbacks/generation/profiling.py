"""Generation profiled: ``profile_generation(model, **generate_kwargs)`` for HF ``generate()``, and
``profile_decode_loop(model, loop)`` for a loop of one's own that marks its prefill and decode steps.

Both run the generation several times, as training's window runs steps: warm-up runs, timed runs with
clock marks only (the model's outermost call and each token), a module-timing run (the trees' module
latencies, each of its own step) and one counting run apart, in which the engine counts every op of each
step. ``profile_generation`` is ``profile_decode_loop`` with a loop that
calls ``generate()``: its steps are the model's outermost calls (a pre-hook and a hook on the model
alone) and its tokens are marked by a logits processor, the one place ``generate()`` calls back once
per token on every decoding strategy. The model runs in eval mode and its mode and every ``.grad`` are
given back on every exit path. Why not DeepSpeed's ``get_model_profile(mode="generate")``: it counts the
whole call as one forward, with no prefill / decode split and no latency per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.files import write_text
from flops_callbacks.generation.generate_marks import (
    check_one_call_per_token,
    generate_loop,
    prompt_shape,
    returned_sequences,
)
from flops_callbacks.generation.json_file import generation_json
from flops_callbacks.generation.module_times import (
    COUNTING_RUN_SOURCE,
    MODULE_TIMING_SOURCE,
    step_module_times,
)
from flops_callbacks.generation.report import generation_picture, render_generation
from flops_callbacks.generation.result import CountedStep, GenerationResult
from flops_callbacks.generation.run import GenerationRun
from flops_callbacks.guard import Guard
from flops_callbacks.options import CausalAttention, check_causal_attention, check_int
from flops_callbacks.peaks import (
    check_peak_bandwidth,
    check_peak_flops,
    given_bandwidth,
    given_peak,
    measured_dtype,
    parameters_dtype,
    resolve_bandwidth,
    resolve_peak,
)
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clean_pass import eval_mode, grads_set_aside
from flops_callbacks.timing.clock import Clock, CpuClock, clock_for, module_device
from flops_callbacks.timing.collector import collect_counting_garbage, collector_off
from flops_callbacks.timing.energy import EnergyCounter, energy_counter
from flops_callbacks.timing.hook_probe import hook_cost
from flops_callbacks.timing.module_timer import ModuleTimer, ModuleTimes
from flops_callbacks.user_warning import warn

__all__ = ["GenerationProfile", "profile_decode_loop", "profile_generation"]

OWNER = "flops_callbacks generation profile"


@dataclass(frozen=True)
class GenerationProfile:
    """A profiled generation: ``metrics`` (the ``generation/`` names of :mod:`flops_callbacks.metrics`),
    ``report`` (the text), ``result`` (the plain data), ``output`` (what the last timed run returned:
    ``generate()``'s output), and its JSON and picture, saved with :meth:`save` and :meth:`save_picture`
    (``flops-callbacks show FILE`` prints a saved one again)."""

    result: GenerationResult
    output: Any = None

    @property
    def metrics(self) -> dict[str, float]:
        return self.result.metrics()

    @cached_property
    def report(self) -> str:
        """The text report ("" and a warning if rendering it failed)."""
        text = ""
        with _own_work("rendering the report", "the metrics are kept"):
            text = render_generation(self.result)
        return text

    def json_data(self) -> dict[str, Any]:
        return generation_json(self.result)

    def save(self, path: str | Path) -> Path | None:
        """Write the JSON to ``path``; returns the path, or None and a warning where writing it failed."""
        import json

        written = None
        with _own_work(f"saving {path}", "nothing was written"):
            written = write_text(path, json.dumps(self.json_data(), indent=1) + "\n")
        return written

    def save_picture(self, path: str | Path) -> Path | None:
        """Write the HTML picture (the middle decode step's module tree) to ``path``; returns the path, or
        None and a warning where there is no tree to draw (the counting failed) or drawing it failed."""
        written = None
        with _own_work(f"drawing the picture to {path}", "nothing was written"):
            written = write_text(path, generation_picture(self.result))
        return written


def _own_work(what: str, kept: str) -> AbstractContextManager[None]:
    """The profiler's own work on a finished generation (:meth:`~flops_callbacks.guard.Guard.own_work`):
    a failure is said, and nothing goes on after it."""
    return Guard(OWNER, goes_on="").own_work(what, kept)


def profile_decode_loop(
    model: torch.nn.Module,
    loop: Callable[[GenerationRun], Any],
    *,
    warm_up: int = 1,
    runs: int = 3,
    peak_flops: float | Literal["measure"] | None = None,
    peak_bandwidth: float | None = None,
    batch_size: int | None = None,
    prompt_tokens: int | None = None,
    padding_tokens: int | None = None,
    causal_attention: CausalAttention = "full",
) -> GenerationProfile:
    """Profile a generation loop of one's own: ``loop(run)`` generates once, marking its prefill and each
    decode step on ``run``::

        def loop(run):
            with run.prefill():
                out = model(prompt, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(31):
                with run.decode_step():
                    out = model(token, past_key_values=out.past_key_values, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            run.kv_cache(out.past_key_values)  # optional: the cache's bytes at the end

        profile = profile_decode_loop(model, loop, batch_size=2, peak_bandwidth=3.35e12)

    It is called ``warm_up + runs + 2`` times: warm-up, timed runs (marks only: each token is out at the
    end of its block), a module-timing run and the counting run. ``batch_size`` (sequences) gives tokens
    per second; ``prompt_tokens`` (per sequence) and ``padding_tokens`` (all sequences) are shown in the
    report.
    ``peak_flops`` (a number, or ``"measure"``: the device's matmul rate, measured) and ``peak_bandwidth``
    (per device; else the peak table's or the environment's) give MFU and MBU. What ``loop`` raises
    passes through, with the model as it was.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loop):
        raise ValueError(f"loop must be a callable taking the run, loop(run), got {loop!r}")
    check_int("warm_up", warm_up, 0)
    check_int("runs", runs, 1)
    for name, value, least in (("batch_size", batch_size, 1), ("prompt_tokens", prompt_tokens, 1)):
        if value is not None:
            check_int(name, value, least)
    if padding_tokens is not None:
        check_int("padding_tokens", padding_tokens, 0)
        positions = batch_size * prompt_tokens if batch_size and prompt_tokens else None
        if positions is None:  # a share of the prompts' positions: never shown without them
            raise ValueError(
                "padding_tokens needs batch_size and prompt_tokens (a share of the prompts' positions), got "
                f"padding_tokens={padding_tokens} with batch_size={batch_size}, prompt_tokens={prompt_tokens}"
            )
        if padding_tokens >= positions:
            raise ValueError(
                f"padding_tokens must be fewer than batch_size x prompt_tokens ({positions}: the prompts' "
                f"positions), got {padding_tokens}"
            )
    check_causal_attention(causal_attention)
    check_peak_flops(peak_flops)
    check_peak_bandwidth(peak_bandwidth)
    device = module_device(model)
    clock = clock_for(device)
    timed: list[GenerationRun] = []
    output = None
    counter = _energy_counter(device)
    draws = _SameDraws(device)
    with eval_mode(model), grads_set_aside(model.parameters()):
        for _ in range(warm_up):
            draws.run(loop, GenerationRun(clock))
        collect_counting_garbage()  # the warm-ups': not in a timed run
        with collector_off(), _running(counter):
            for _ in range(runs):
                run = GenerationRun(clock, energy=None if isinstance(counter, str) else counter)
                run.begin()
                output = draws.run(loop, run)
                run.end()
                timed.append(run)
        timer = ModuleTimer(model, clock)  # a run of its own: every module call marked, nothing counted
        timing = GenerationRun(clock, model_calls=lambda: timer.model_calls)
        timer.start()
        try:
            draws.run(loop, timing)
        finally:
            timer.stop()
        counting = GenerationRun(clock, CountingEngine(model, causal_attention=causal_attention))
        counting.begin()
        try:
            draws.run(loop, counting)
        finally:
            counting.end()
    draws.leave()
    _same_tokens(timed, counting)
    _one_step_per_token(counting)
    dtype = measured_dtype(parameters_dtype(model), counting.matmul_dtype)
    peak, no_peak = resolve_peak(given_peak(peak_flops), device, dtype)
    bandwidth, no_bandwidth = resolve_bandwidth(given_bandwidth(peak_bandwidth), device)
    failure = _counting_failure(counting)
    if counting.cache_failure and not failure:
        warn(f"{OWNER}: reading the KV cache's bytes failed ({counting.cache_failure}); the cache's size is "
             "not reported, the flops and bytes are")  # fmt: skip
    profiles = [] if failure else counting.profiles
    first = counting.prefill_steps  # the first decode step's index
    middle = (len(profiles) - first - 1) // 2 if len(profiles) > first else None  # among the decode steps
    prefill = profiles[0] if profiles else None
    decode = profiles[first + middle] if middle is not None else None
    steps = (timing.step_calls(0), timing.step_calls(first + (middle or 0)))
    prefill, decode, module_source = _with_module_times(timer, clock, prefill, decode, steps)
    result = GenerationResult(
        device=str(device),
        compute_dtype=dtype,
        batch_size=batch_size,
        prompt_tokens=prompt_tokens,
        padding_tokens=padding_tokens,
        work=tuple(CountedStep.of(p) for p in profiles),
        prefill=prefill,
        decode=decode,
        decode_shown=middle,
        runs=tuple(run.times() for run in timed),
        warm_up=warm_up,
        kv_cache_bytes=None if failure else counting.kv_cache_bytes,
        peak=peak,
        no_peak_reason=no_peak,
        bandwidth=bandwidth,
        no_bandwidth_reason=no_bandwidth,
        prefill_steps=first,
        counting_failure=failure,
        module_latencies=module_source,
        no_energy_reason=_no_energy(counter, timed),
    )
    return GenerationProfile(result, output)


class _SameDraws:
    """Every run draws the random numbers a first ``generate()`` would draw (sampling makes the same
    tokens in each, so the counting run's flops and the timed runs' latencies are of one generation), and
    the generator is left as one run leaves it. A loop that marks no step is said at its first run."""

    def __init__(self, device: torch.device) -> None:
        self.devices = [device] if device.type == "cuda" else []
        self.start = self._state()
        self.after: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def _state(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices]

    def _set(self, state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        for d, device_state in zip(self.devices, state[1], strict=True):
            torch.cuda.set_rng_state(device_state, d)

    def run(self, loop: Callable[[GenerationRun], Any], run: GenerationRun) -> Any:
        self._set(self.start)
        output = loop(run)
        if self.after is None:
            self.after = self._state()
            if not run.steps:
                raise ValueError(
                    "loop(run) marked no step: mark the prompt's forward in `with run.prefill():` and each "
                    "decode step in `with run.decode_step():`"
                )
        return output

    def leave(self) -> None:
        if self.after is not None:
            self._set(self.after)


def _same_tokens(timed: list[GenerationRun], counting: GenerationRun) -> None:
    """Said where the runs made different numbers of tokens (a loop whose generation changes from run to
    run): the flops are the counting run's, the latencies the timed runs'. (Which tokens is not compared:
    the work of a step depends on how many, not which.)"""
    made = sorted({run.tokens_out for run in [*timed, counting]})
    if len(made) > 1:
        warn(f"{OWNER}: the runs made different numbers of tokens ({', '.join(map(str, made))}): the flops "
             "are the counting run's generation, the latencies the timed runs'")  # fmt: skip


def _one_step_per_token(counting: GenerationRun) -> None:
    """Said where the model's calls after the prefill were not one per token (a logits processor that
    calls the model, a decoding strategy of its own): the decode's figures are then per call."""
    decode_steps, tokens = counting.steps - counting.prefill_steps, counting.tokens_out
    if not counting.failure and tokens and decode_steps != tokens - 1:
        before = counting.prefill_steps
        # a processor's call on the prefill's logits comes before the first token: a "chunk" of the prefill
        prefill = (
            f" (and {before} times before the first token: the prefill holds them all)" if before > 1 else ""
        )
        warn(f"{OWNER}: the model was called {decode_steps} times after the prefill for {tokens - 1} more "
             f"tokens{prefill}: the decode's figures per token are per model call")  # fmt: skip


def _energy_counter(device: torch.device) -> EnergyCounter | str:
    """The device's energy counter for the timed runs, or why there is none (the profiler's own work: a
    failure is a reason, and the generation goes on)."""
    try:
        return energy_counter(device)
    except Exception as error:
        return f"finding the energy counter failed ({type(error).__name__}: {error})"


def _no_energy(counter: EnergyCounter | str, timed: list[GenerationRun]) -> str:
    """Why the timed runs have no energy figure ("": they have one)."""
    if isinstance(counter, str):
        return counter
    return next((run.energy_failure for run in timed if run.energy_failure), "")


@contextmanager
def _running(counter: EnergyCounter | str) -> Iterator[None]:
    """What the counter runs (sampled power's thread) runs through the timed runs, and only then."""
    if isinstance(counter, str):
        yield
        return
    counter.start()
    try:
        yield
    finally:
        counter.stop()


def _with_module_times(
    timer: ModuleTimer,
    clock: Clock,
    prefill: Profile | None,
    decode: Profile | None,
    steps: tuple[range, range],
) -> tuple[Profile | None, Profile | None, str]:
    """The two trees with the module-timing run's latencies of their own steps (``steps``: the model's
    calls in the prefill's step and in the decode step shown, as that run marked them: a marked block may
    hold several), and where the latencies come from. If that fails (the profiler's own work), a warning
    says so and the counting run's stay."""
    try:
        cost = hook_cost() if isinstance(clock, CpuClock) else None  # CUDA events hold no host time
        times = timer.times(timer.fitted(cost) if cost is not None else None)
        tables = step_module_times(times.spans, [call for calls in steps for call in calls])
        pairs = tuple(zip(steps, (prefill, decode), strict=True))
        # a tree whose step the timing run lacks (sampled to an earlier EOS), or made no call of the model's
        short = any(tree is not None and not (calls and set(calls) <= tables.keys()) for calls, tree in pairs)
        if short:  # no tree mixes two sources
            why = (
                "the loop never called the model itself, only its submodules (its own calls are the steps)"
                if timer.model_calls == 0
                else "it made fewer steps than the counting run"
            )
            warn(f"{OWNER}: the module-timing run has no step to time ({why}); the trees keep the counting "
                 "run's module latencies")  # fmt: skip
            return prefill, decode, COUNTING_RUN_SOURCE
        trees = []
        for calls, tree in pairs:
            if tree is not None:
                table: dict[str, float] = {}
                for call in calls:  # a step of several calls holds them all
                    for name, seconds in tables[call].items():
                        table[name] = table.get(name, 0.0) + seconds
                timed = ModuleTimes(table, {}, {}, []).applied_to(tree)
                tree = dataclasses.replace(timed, fwd_latency=table.get("", 0.0))
            trees.append(tree)
        return trees[0], trees[1], MODULE_TIMING_SOURCE
    except Exception as error:  # the profiler's own work: the generation's figures stand without it
        warn(f"{OWNER}: timing the modules failed ({type(error).__name__}: {error}); the trees keep the "
             "counting run's module latencies")  # fmt: skip
        return prefill, decode, COUNTING_RUN_SOURCE


def _counting_failure(run: GenerationRun) -> str:
    """What stopped the counting run's counts ("" when nothing did), said once as a warning."""
    failure = run.failure
    if not failure and run.engine is not None and run.engine.failure is not None:
        what, error = run.engine.failure
        failure = f"{what} ({type(error).__name__}: {error})"
    if failure:
        warn(f"{OWNER}: {failure}; flops and bytes are not reported, the latencies are. Generation went on.")
    return failure


def profile_generation(
    model: torch.nn.Module,
    *,
    warm_up: int = 1,
    runs: int = 3,
    peak_flops: float | Literal["measure"] | None = None,
    peak_bandwidth: float | None = None,
    causal_attention: CausalAttention = "full",
    **generate_kwargs: Any,
) -> GenerationProfile:
    """Profile ``model.generate(**generate_kwargs)`` (a transformers model): prefill and decode measured.

    ``generate()`` is called ``warm_up + runs + 2`` times with ``generate_kwargs`` as given (a
    ``logits_processor`` of the caller's is kept). The prefill is the model's calls before the first token
    (one, or its chunks), each later call a decode step; prompt length and padding are read from
    ``input_ids`` (``inputs``, ``inputs_embeds``) and ``attention_mask``, the batch size (sequences) from
    the sequences ``generate()`` returns (``num_return_sequences`` per prompt). The result's ``output`` is
    the last timed run's output.
    """
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"model must have a generate() (a transformers model), got {type(model).__name__}; "
            "profile a loop of one's own with profile_decode_loop"
        )
    model = _what_generate_calls(model)
    check_one_call_per_token(model, generate_kwargs)
    batch, prompt, padding = prompt_shape(generate_kwargs)
    loop = generate_loop(model, generate_kwargs)
    profile = profile_decode_loop(
        model, loop, warm_up=warm_up, runs=runs, causal_attention=causal_attention,
        peak_flops=peak_flops, peak_bandwidth=peak_bandwidth,
        batch_size=batch, prompt_tokens=prompt, padding_tokens=padding,
    )  # fmt: skip
    rows = returned_sequences(profile.output)
    if batch is None and rows is not None:  # no prompt given (generate() starts from BOS): its rows
        return GenerationProfile(dataclasses.replace(profile.result, batch_size=rows), profile.output)
    if batch is None or rows is None or rows == batch or rows % batch:
        return profile
    # num_return_sequences: each prompt generated several times, each with the prompt's padding
    result = dataclasses.replace(
        profile.result, batch_size=rows, padding_tokens=None if padding is None else padding * (rows // batch)
    )
    return GenerationProfile(result, profile.output)


def _what_generate_calls(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``model.generate()`` calls: a ``torch.compile`` wrapper hands ``generate`` on to the
    module it wraps, which calls itself, uncompiled (the wrapper's hooks never run): that module, said."""
    inner = getattr(model, "_orig_mod", None)
    compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    if not compiled or not isinstance(inner, torch.nn.Module):
        return model
    warn(
        "profile_generation: generate() on a torch.compile wrapper runs the wrapped model uncompiled "
        "(transformers calls the model's own forward): it is profiled as it runs. To generate compiled, "
        "compile the forward (model.forward = torch.compile(model.forward)) or set generate()'s "
        "compile_config"
    )
    return inner
