"""One profiled optimizer step, shared by both framework callbacks.

An adapter only maps its framework's events onto this object:

    profiler.begin(model, parallel)          when the step to profile starts
    profiler.add_batch(batch)                once per micro-batch
    profiler.phase(FORWARD / BACKWARD / OPTIMIZER_STEP)   when each phase starts
    profiler.pause() / profiler.resume()     around anything between micro-batches (optional)
    result = profiler.finish()               when the optimizer step has ended

and gets back a :class:`StepResult` with the profile, the phase latencies, the metrics dict and the
report. Phases are contiguous on one synchronized clock: starting a phase ends the previous one,
so ``iter latency = fwd + bwd + step`` holds exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.clock import PhaseTimer
from flops_callbacks.metrics import step_metrics
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.profile import Profile
from flops_callbacks.profiler import FlopsProfiler, check_causal_attention, check_report_args
from flops_callbacks.report import render_profile
from flops_callbacks.units import duration_to_string, flops_to_string, number_to_string, params_to_string

FORWARD, BACKWARD, OPTIMIZER_STEP = "forward", "backward", "optimizer_step"
PHASES = (FORWARD, BACKWARD, OPTIMIZER_STEP)


def leading_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch`` (any nesting of lists/dicts)."""
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("cannot find the batch size: the batch holds no tensor; pass batch_size_fn")


@dataclass
class StepResult:
    """A profiled optimizer step: the model profile plus what the training loop around it did."""

    step: int
    profile: Profile  # fwd_latency / bwd_latency here are the phase latencies below
    fwd_latency: float
    bwd_latency: float
    step_latency: float
    samples: int  # per device, over all micro-batches
    tokens: int | None
    micro_batches: int
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    # report rows an adapter adds about its framework (label, value), e.g. the HF Trainer's estimate
    extra_lines: list[tuple[str, str]] = field(default_factory=list)

    @property
    def iter_latency(self) -> float:
        return self.fwd_latency + self.bwd_latency + self.step_latency

    def metrics(self) -> dict[str, float]:
        """The ``flops_profiler/*`` metrics of this step (names in :mod:`flops_callbacks.metrics`)."""
        return step_metrics(self)

    def context_lines(self) -> list[tuple[str, str]]:
        mp = self.parallel.model_parallel
        p = self.profile
        return [
            *self.parallel.summary_lines(),
            ("batch size per device (all micro-batches)", str(self.samples)),
            ("micro-batches", str(self.micro_batches)),
            ("params of model = params per device * mp_size", params_to_string(p.params * mp)),
            ("fwd flops of model = fwd flops per device * mp_size", number_to_string(p.fwd_flops * mp)),
        ]

    def timing_lines(self) -> list[tuple[str, str]]:
        metrics = self.metrics()
        flops_per_sec = flops_to_string(metrics[names.FLOPS_PER_SEC])
        lines = [
            ("step latency", duration_to_string(self.step_latency)),
            ("iter latency = fwd + bwd + step latency", duration_to_string(self.iter_latency)),
            ("FLOPS per device = (fwd+bwd flops) / iter latency", flops_per_sec),
            ("samples/second (all data-parallel replicas)", f"{metrics[names.SAMPLES_PER_SEC]:.2f}"),
        ]
        if names.TOKENS_PER_SEC in metrics:
            tokens = f"{metrics[names.TOKENS_PER_SEC]:.2f}"
            lines.append(("tokens/second (all data-parallel replicas)", tokens))
        return lines + self.extra_lines


class StepProfiler:
    """Profiles the optimizer step that starts at ``global_step == profile_step``; framework-free.

    Arguments are the callbacks' own (validated here, at construction): see their docstrings.
    """

    def __init__(
        self,
        profile_step: int = 10,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        print_profile: bool = True,
        output_file: str | Path | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        causal_attention: str = "full",
        ignore_modules: Iterable[type] | None = None,
    ) -> None:
        if isinstance(profile_step, bool) or not isinstance(profile_step, int) or profile_step < 0:
            raise ValueError(f"profile_step must be an int >= 0, got {profile_step!r}")
        check_report_args(module_depth, top_modules)
        check_causal_attention(causal_attention)
        for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a callable taking the batch, got {fn!r}")
        self.profile_step = profile_step
        self.module_depth = module_depth
        self.top_modules = top_modules
        self.detailed = detailed
        self.print_profile = print_profile
        self.output_file = output_file
        self.batch_size_fn = batch_size_fn or leading_batch_size
        self.tokens_fn = tokens_fn
        self.causal_attention = causal_attention
        self.ignore_modules = tuple(ignore_modules or ())
        self.result: StepResult | None = None
        self._profiler: FlopsProfiler | None = None
        self._timer: PhaseTimer | None = None
        self._phase: str | None = None

    @property
    def active(self) -> bool:
        """True between :meth:`begin` and :meth:`finish` / :meth:`abort`."""
        return self._profiler is not None

    def due(self, global_step: int) -> bool:
        """Whether the step starting at ``global_step`` is the one to profile."""
        return global_step == self.profile_step and self.result is None and not self.active

    def begin(self, model: torch.nn.Module, parallel: ParallelSizes | None = None) -> None:
        """Start counting on ``model``; the forward phase starts now."""
        self._parallel = parallel or ParallelSizes()
        self._samples, self._tokens, self._micro_batches = 0, None, 0
        self._profiler = FlopsProfiler(model, causal_attention=self.causal_attention)
        self._timer = PhaseTimer(self._profiler.clock)
        self._profiler.start_profile(ignore_list=self.ignore_modules)
        self._phase = None
        self.phase(FORWARD)

    def add_batch(self, batch: Any) -> None:
        """Count one micro-batch's samples (and tokens, with ``tokens_fn``)."""
        self._micro_batches += 1
        self._samples += int(self.batch_size_fn(batch))
        if self.tokens_fn is not None:
            self._tokens = (self._tokens or 0) + int(self.tokens_fn(batch))

    def phase(self, name: str) -> None:
        """End the current phase and start ``name`` on the same clock mark."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        if self._timer is None or name == self._phase:
            return
        if self._phase is None:
            self._timer.start(name)
        else:
            self._timer.switch(self._phase, name)
        self._phase = name

    def pause(self) -> None:
        """Stop counting and timing until :meth:`resume`: what runs between micro-batches (data
        loading, a validation run) is not part of the step."""
        if self._profiler is None or self._timer is None:
            return
        if self._phase is not None:
            self._timer.stop(self._phase)
            self._phase = None
        self._profiler.stop_profile()

    def resume(self, phase: str = FORWARD) -> None:
        """Count and time again after :meth:`pause`, starting ``phase``."""
        if self._profiler is None:
            raise RuntimeError("resume() without begin()")
        self._profiler.resume_profile()
        self.phase(phase)

    def finish(self, step: int | None = None) -> StepResult:
        """End the step: stop counting, remove everything from the model, and build the result."""
        profiler, timer = self._profiler, self._timer
        if profiler is None or timer is None:
            raise RuntimeError("finish() without begin()")
        try:
            if self._phase is not None:
                timer.stop(self._phase)
            profiler.stop_profile()
            profile = profiler.get_profile()
            fwd, bwd, opt = (timer.seconds(p) for p in PHASES)
        finally:
            self.abort()
        self.result = StepResult(
            step=self.profile_step if step is None else step,
            profile=dataclasses.replace(profile, fwd_latency=fwd, bwd_latency=bwd),
            fwd_latency=fwd,
            bwd_latency=bwd,
            step_latency=opt,
            samples=self._samples,
            tokens=self._tokens,
            micro_batches=self._micro_batches,
            parallel=self._parallel,
        )
        return self.result

    def abort(self) -> None:
        """Stop and drop the profile in progress (on an exception): nothing stays on the model."""
        profiler, self._profiler, self._timer, self._phase = self._profiler, None, None, None
        if profiler is not None:
            profiler.end_profile()

    def report(self, result: StepResult) -> str:
        """The DeepSpeed-style report of ``result`` with the step's context and rates."""
        return render_profile(
            result.profile,
            profile_step=result.step,
            module_depth=self.module_depth,
            top_modules=self.top_modules,
            detailed=self.detailed,
            context_lines=result.context_lines(),
            timing_lines=result.timing_lines(),
        )

    def publish(self, result: StepResult, log_dir: str | Path | None) -> str:
        """Print the report (or write it to ``output_file``) and save report + JSON in ``log_dir``.

        Call on the rank that logs. Returns the report text.
        """
        text = self.report(result)
        if self.output_file is not None:
            path = Path(self.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        elif self.print_profile:
            print(text)
        if log_dir is not None:
            directory = Path(log_dir)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"flops_profile_step{result.step}.txt").write_text(text + "\n")
            data = {"step": result.step, "metrics": result.metrics(), "profile": result.profile.to_dict()}
            (directory / f"flops_profile_step{result.step}.json").write_text(json.dumps(data, indent=2))
        return text
