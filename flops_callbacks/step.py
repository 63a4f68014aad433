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

In a multi-process run every rank profiles its own step, and :meth:`StepProfiler.finish` gathers
the ranks' phase latencies (one collective that every rank of the default process group joins):
the result reports the slowest rank's, and the report the spread.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flops_callbacks import metrics as names
from flops_callbacks.clock import PhaseTimer
from flops_callbacks.metrics import step_metrics
from flops_callbacks.options import check_causal_attention, check_flag, check_report_args
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import ENV_VAR, Peak, check_peak_flops, peak_from_env, resolve_peak
from flops_callbacks.profile import Profile
from flops_callbacks.profiler import FlopsProfiler
from flops_callbacks.report import render_profile
from flops_callbacks.units import duration_to_string, flops_to_string, number_to_string, params_to_string

FORWARD, BACKWARD, OPTIMIZER_STEP = "forward", "backward", "optimizer_step"
PHASES = (FORWARD, BACKWARD, OPTIMIZER_STEP)
Latencies = tuple[float, float, float]  # (fwd, bwd, step) seconds


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch, in ``tree_leaves`` order. Written out for the usual containers (this
    runs on every micro-batch once throughput is metered: a third of pytree's time), pytree otherwise."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from batch_tensors(item)
    elif isinstance(batch, (dict, Mapping)):
        for item in batch.values():
            yield from batch_tensors(item)
    elif not isinstance(batch, (int, float, str, bytes, type(None))):
        yield from (leaf for leaf in torch.utils._pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor))


def leading_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch`` (any nesting of lists/dicts)."""
    for tensor in batch_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
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
    peak: Peak | None = None  # the device's dense peak FLOPS that MFU is computed against
    no_peak_reason: str = ""  # why there is no peak (said once, in the report)
    # every rank's (fwd, bwd, step) latencies, by rank; the latencies above are the slowest rank's
    rank_latencies: list[Latencies] = field(default_factory=list)
    # parameters of the whole model when they are DTensors (their global sizes); None otherwise
    sharded_model_params: int | None = None

    @property
    def iter_latency(self) -> float:
        return self.fwd_latency + self.bwd_latency + self.step_latency

    def metrics(self) -> dict[str, float]:
        """The ``flops_profiler/*`` metrics of this step (names in :mod:`flops_callbacks.metrics`)."""
        return step_metrics(self)

    def context_lines(self) -> list[tuple[str, str]]:
        mp = self.parallel.model_parallel
        p = self.profile
        if self.sharded_model_params is None:
            params = ("params of model = params per device * mp_size", params_to_string(p.params * mp))
        else:  # replicated parameters of a tensor-parallel model are not mp_size times in the model
            params = (
                "params of model (global sizes of its DTensors)",
                params_to_string(self.sharded_model_params),
            )
        return [
            *self.parallel.summary_lines(),
            ("batch size per device (all micro-batches)", str(self.samples)),
            ("micro-batches", str(self.micro_batches)),
            params,
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
        if len(self.rank_latencies) > 1:
            iters = [sum(latencies) for latencies in self.rank_latencies]
            spread = f"{duration_to_string(min(iters))} .. {duration_to_string(max(iters))}"
            lines.append((f"iter latency over {len(iters)} ranks, min .. max (slowest shown)", spread))
        if self.peak is None:
            lines.append(("MFU", f"n/a: {self.no_peak_reason}"))
        else:
            lines += [
                (f"peak FLOPS per device ({self.peak.source})", flops_to_string(self.peak.flops)),
                ("MFU = (fwd+bwd flops) / iter latency / peak", f"{100 * metrics[names.MFU]:.2f}%"),
                ("HFU = (fwd+bwd+recompute flops) / iter latency / peak", f"{100 * metrics[names.HFU]:.2f}%"),
            ]
        return lines + self.extra_lines


def gather_latencies(local: Latencies, device: torch.device) -> list[Latencies]:
    """Every rank's ``(fwd, bwd, step)`` latencies, by rank: an all-gather that every rank of the default
    process group must join (just ``[local]`` without one).

    The tensor lives where the backend can move it: on the CPU for gloo / MPI, on the model's device
    otherwise (this rank's GPU for NCCL).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [local]
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend:
        device = torch.device("cpu")
    elif device.type == "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(local, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [(float(f), float(b), float(s)) for f, b, s in torch.stack(every).tolist()]


def _dtensor_params(model: torch.nn.Module) -> int | None:
    """Parameters of the whole model if they are DTensors (sharded: numel is the global size), else None."""
    params = list(dict.fromkeys(model.parameters()))
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not any(isinstance(p, dtensor) for p in params):
        return None
    return sum(p.numel() for p in params)


def _given_peak(peak_flops: Any) -> Peak | None:
    """The user's peak: the argument, else the environment variable (both validated now)."""
    value = check_peak_flops(peak_flops)
    if value is not None:
        return Peak(value, "peak_flops argument")
    value = peak_from_env()
    return Peak(value, f"{ENV_VAR} environment variable") if value is not None else None


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
        peak_flops: float | None = None,
    ) -> None:
        if isinstance(profile_step, bool) or not isinstance(profile_step, int) or profile_step < 0:
            raise ValueError(f"profile_step must be an int >= 0, got {profile_step!r}")
        check_report_args(module_depth, top_modules)
        check_flag("detailed", detailed)
        check_flag("print_profile", print_profile)
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
        self.given_peak = _given_peak(peak_flops)
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

    def begin(
        self, model: torch.nn.Module, parallel: ParallelSizes | None = None, compute_dtype: str | None = None
    ) -> None:
        """Start counting on ``model``; the forward phase starts now. ``compute_dtype`` (a
        :data:`flops_callbacks.peaks.DTYPES` name: what the matmuls run in) picks the device's peak."""
        self._parallel = parallel or ParallelSizes()
        self._compute_dtype = compute_dtype
        self._sharded_model_params = _dtensor_params(model)
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
        """End the step: stop counting, remove everything from the model, and build the result.

        With several processes, every rank must call this at the same step: the ranks' latencies are
        gathered (after the optimizer step, with nothing of the profiler left on the model), and the
        result holds the slowest rank's. A rank that raised during the profiled step never gets here:
        the others fail in the gather as soon as the backend sees that rank's process gone (gloo at
        once, when it exits), at worst after the process group's timeout, as they would in the
        framework's own next collective.
        """
        profiler, timer = self._profiler, self._timer
        if profiler is None or timer is None:
            raise RuntimeError("finish() without begin()")
        try:
            if self._phase is not None:
                timer.stop(self._phase)
            profiler.stop_profile()
            profile = profiler.get_profile()
            local = (timer.seconds(FORWARD), timer.seconds(BACKWARD), timer.seconds(OPTIMIZER_STEP))
        finally:
            self.abort()
        device = torch.device(profile.device)
        ranks = gather_latencies(local, device)
        fwd, bwd, opt = max(ranks, key=sum)
        peak, no_peak_reason = resolve_peak(self.given_peak, device, self._compute_dtype)
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
            peak=peak,
            no_peak_reason=no_peak_reason,
            rank_latencies=ranks,
            sharded_model_params=self._sharded_model_params,
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
            data = {
                "step": result.step,
                "metrics": result.metrics(),
                "parallel": dataclasses.asdict(result.parallel),
                "rank_latencies": result.rank_latencies,  # (fwd, bwd, step) seconds, by rank
                "peak": dataclasses.asdict(result.peak) if result.peak else {"none": result.no_peak_reason},
                "profile": result.profile.to_dict(),
            }
            (directory / f"flops_profile_step{result.step}.json").write_text(json.dumps(data, indent=2))
        return text
