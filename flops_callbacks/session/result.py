"""The result of a profile window: plain data that the metrics, the report, the JSON and the picture read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from flops_callbacks.communication.figures import CommFigures
from flops_callbacks.communication.slow_rank import SlowRank
from flops_callbacks.metrics import (
    BWD_BYTES,
    BWD_FLOPS,
    BWD_FLOPS_PER_SEC,
    BWD_LATENCY,
    CLEAN_STEPS,
    COMM_LATENCY,
    COMM_OVERLAP,
    DATA_LATENCY,
    DEVICE_BUSY_BWD,
    DEVICE_BUSY_FWD,
    DEVICE_BUSY_STEP,
    DEVICE_IDLE,
    EXPOSED_COMM_LATENCY,
    FLOPS_PER_SEC,
    FWD_BYTES,
    FWD_FLOPS,
    FWD_FLOPS_PER_SEC,
    FWD_LATENCY,
    FWD_MACS,
    HARDWARE_FLOPS_PER_SEC,
    HFU,
    IDLE_LATENCY,
    ITER_LATENCY,
    MFU,
    PADDING_FRACTION,
    PARAMS,
    REAL_TOKENS_PER_SEC,
    RECOMPUTE_FLOPS,
    SAMPLES_PER_SEC,
    SAVED_ACTIVATION_BYTES,
    STEP_LATENCY,
    TOKENS_PER_SEC,
    WALL_LATENCY,
    WALL_SAMPLES_PER_SEC,
    WALL_TOKENS_PER_SEC,
)
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.phase_names import STEP_PHASES
from flops_callbacks.profile import Profile
from flops_callbacks.roofline import Roofline, module_rooflines
from flops_callbacks.session.energy_reads import energy_metrics
from flops_callbacks.session.flops_sources import FlopsSources
from flops_callbacks.session.shape_flops import BatchCounts
from flops_callbacks.session.window_steps import CleanFigures, CleanStep, StepSeconds, StepWork
from flops_callbacks.timing.energy_figures import EnergySpan
from flops_callbacks.timing.hook_cost import HookCost
from flops_callbacks.timing.spans import ModuleSpan

Latencies = tuple[float, float, float]  # (fwd, bwd, step) seconds

__all__ = [
    "Latencies",
    "phase_rates",
    "PhaseRates",
    "window_metrics",
    "window_rates",
    "WindowResult",
    "WindowSteps",
]


class BatchLayout(NamedTuple):
    """The clean steps' token batches as laid out (this rank's): rows, the sequences in them, their real
    tokens and all positions; ``not_apart``: why the model's work could not be told from the run's
    ("" where it was, or nothing separates them); ``decoder_padding``: an encoder-decoder's batches held
    decoder tensors whose spans were not read, so each sequence was counted with its row's whole decoder
    (its padding in; where they were read, each row is counted as its pair of encoder and decoder)."""

    rows: int
    sequences: int
    real_tokens: int
    positions: int
    not_apart: str = ""
    decoder_padding: bool = False

    @property
    def packed(self) -> bool:
        return self.sequences > self.rows

    @property
    def padding(self) -> float:
        """Padding positions / all positions."""
        return 1 - self.real_tokens / self.positions if self.positions else 0.0


class AfterWindow(NamedTuple):
    """The profiler's own counting after a window (shapes and sequences the table could not give,
    counted off the clock): how many times, and its seconds, out of ``throughput/*``'s clock."""

    counts: int = 0
    seconds: float = 0.0

    def plus(self, seconds: float) -> AfterWindow:
        return AfterWindow(self.counts + 1, self.seconds + seconds)


@dataclass(frozen=True)
class WindowSteps:
    """Which global step each figure comes from.

    ``counting``: flops, MACs, params, coverage. ``module_timing``: the steps that timed the modules
    (empty when the run ended before them); ``module_trace``: the one of them whose per-module latencies
    and spans are reported, chosen as ``module_trace_by`` says. ``clean``: the steps whose
    phase latencies were used (their median); ``skipped``: clean steps left out because their batches
    had other shapes than the counting step's. ``latency_source`` names where fwd / bwd / step latency
    come from in words.
    ``shape_counting``: steps counted (not timed) because their batch shapes' flops were neither counted
    nor predictable yet. ``shapes``: distinct micro-batch shape signatures the window's counted and
    clean steps saw, and how their flops were obtained (counted, predicted from counted ones).
    ``module_shapes_match``: whether the module-timing steps' batches had the counting step's shapes
    (else their per-module latencies are left out: with another batch's flops they would mix two
    batches; a step with other shapes is left out of the median).
    ``first``: the window's first step (None: ``counting``, as in files written before re-profiling); a
    re-profile window (``profile_every``) counted and timed no module itself: its ``counting``,
    ``module_timing`` and ``module_trace`` are earlier steps, of the window it reuses; its ``first`` step
    is a lead-in (untouched: its end is where the first clean step's wall and data time start).
    """

    counting: int
    module_timing: tuple[int, ...]
    clean: tuple[int, ...]
    skipped: tuple[int, ...]
    latency_source: str
    shape_counting: tuple[int, ...] = ()
    shapes: int = 1
    shapes_counted: int = 1
    shapes_predicted: int = 0
    module_shapes_match: bool = True
    module_trace: int | None = None
    # how module_trace was chosen: "nearest" the clean steps' own forward (a CPU clock, the same batch
    # shapes), "median" by the model's forward + backward, or of the median "batch" size (batches of other
    # shapes than the counting step's)
    module_trace_by: str = "median"
    model_forward: tuple[int, ...] = ()  # the clean steps that marked the model's own forward
    model_forward_shapes_match: bool = False  # whether they had the module-timing steps' batch shapes
    first: int | None = None
    communication: tuple[int, ...] = ()  # the communication steps (several ranks only: Options.comm_steps)
    # the module-timing step whose batches the profile counted off the clock (None: the counting step's):
    # its module-timing steps had other batch shapes than the counting step
    profile_step: int | None = None
    # the module latencies are the device's kernels launched in each call (a CUDA device, torch.profiler's
    # activity records), not the clock between the hooks
    module_kernels: bool = False
    compiled: tuple[int, ...] = ()  # clean steps left out: torch.compile compiled in them (a new shape)
    eager_tree: bool = False  # compiled code: the modules timed eagerly, the clean steps compiled

    @property
    def profiled(self) -> int:
        """The step whose batches the profile (flops, MACs, the module tree) counted."""
        return self.counting if self.profile_step is None else self.profile_step

    @property
    def reused(self) -> bool:
        """Whether the counts and module tree come from an earlier window (a re-profile window's)."""
        return self.first is not None and self.first > self.counting


@dataclass
class WindowResult:
    """A profiled window: the model's profile plus what the training loop around it did.

    ``profile``'s per-module latencies are one module-timing step's (``steps.module_trace``); its
    ``fwd_latency`` and ``bwd_latency`` (like the fields below) are the phase latencies of the median
    clean step (the one of the median FLOPS: :mod:`flops_callbacks.session.window_steps`).
    """

    profile: Profile
    steps: WindowSteps
    fwd_latency: float
    bwd_latency: float
    step_latency: float
    # per device (the ranks' mean), per optimizer step (all its micro-batches); None: not found
    samples: int | float | None
    tokens: int | float | None
    micro_batches: int
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    compute_dtype: str | None = None
    peak: Peak | None = None  # the device's dense peak FLOPS that MFU is computed against
    no_peak_reason: str = ""  # why there is none (said once, in the report)
    bandwidth: Bandwidth | None = None  # the device's peak memory bandwidth: the roofline's memory roof
    no_bandwidth_reason: str = ""
    # every rank's (fwd, bwd, step) latencies, by rank; the latencies above are the slowest rank's
    rank_latencies: list[Latencies] = field(default_factory=list)
    # every rank's counting-step totals (fwd_flops, ..., saved_bytes), by rank: per GPU is their mean
    rank_counts: list[dict[str, int]] = field(default_factory=list)
    # parameters of the whole model when they are sharded (FSDP2/TP DTensors, ZeRO-3): global sizes
    sharded_model_params: int | None = None
    # report rows an adapter adds about its framework (label, value), e.g. the HF Trainer's estimate
    extra_lines: list[tuple[str, str]] = field(default_factory=list)
    spans: list[ModuleSpan] = field(default_factory=list)  # one module-timing step's (steps.module_trace)
    # peak device memory allocated in each phase (forward, backward, optimizer_step) over the clean
    # steps, in bytes; None where the device keeps no such counter (only CUDA does)
    peak_memory: dict[str, int] | None = None
    published_at: int = 0  # the global step at which the result was published and logged
    # the clean steps' sums and spreads (the slowest rank's); None: the single step of the latencies above
    clean: CleanFigures | None = None
    hook_cost: HookCost | None = None  # what one module call's timing hooks cost, out of module latencies
    # the model's own forward on the clean steps (its outermost module calls, seconds, median; this
    # rank's): the forward phase less the loss and the framework's work; None: not marked (see ``hook_cost``)
    model_forward: float | None = None
    model_forward_high: float | None = None  # the slowest of those clean steps' (what one step may read)
    # where each clean step's flops come from (counted, predicted, estimated) and how sure the total is
    flops_sources: FlopsSources | None = None
    counting_iter: float | None = None  # the counting step's fwd + bwd + step seconds (what counting costs)
    comm: CommFigures | None = None  # where the communication steps' time went (several ranks only)
    slow_rank: SlowRank | None = None  # the rank the others wait for, or none (several ranks only)
    layout: BatchLayout | None = None  # the clean steps' padding and packing (token batches only)
    after: AfterWindow = field(default_factory=lambda: AfterWindow())  # the profiler's own work since
    # a CUDA device's kernel seconds launched in each phase (forward, backward, optimizer_step) of the
    # module-timing step whose tree is shown, read from its kernels; None: not read (timing/kernel_clock.py)
    device_busy: dict[str, float] | None = None
    # every rank's energy counter over its clean steps, by rank (:mod:`flops_callbacks.session.energy_reads`)
    energy: tuple[EnergySpan, ...] = ()
    no_energy_reason: str = ""  # why there are none (said in one line of the summary and of the report)
    _metrics: dict[str, float] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def step(self) -> int:
        """The window's first step: its counting step (``profile_step``, or the first step after it that
        ran), or a re-profile window's first (its files are ``flops_profile_step{step}.*``)."""
        return self.steps.counting if self.steps.first is None else self.steps.first

    @property
    def iter_latency(self) -> float:
        """fwd + bwd + step latency (DeepSpeed's definition): the one iter latency of a window."""
        return self.fwd_latency + self.bwd_latency + self.step_latency

    @property
    def micro_batch_size(self) -> int | float | None:
        """Samples per micro-batch per device (DeepSpeed's "batch size per GPU"): the counting step's
        samples over its micro-batches."""
        if self.samples is None:
            return None
        size = self.samples / max(self.micro_batches, 1)
        return int(size) if size == int(size) else size

    @property
    def no_roofline_reason(self) -> str:
        """Why no module has a roofline ("" when both peaks are known)."""
        if self.peak is None:
            return self.no_peak_reason
        return self.no_bandwidth_reason if self.bandwidth is None else ""

    def per_gpu_profile(self) -> Profile:
        """The profile whose totals are per GPU: the ranks' mean counting-step work (this rank's module
        tree below them; with one rank, the profile itself)."""
        if len(self.rank_counts) < 2:
            return self.profile
        world = len(self.rank_counts)
        means = {name: round(sum(c[name] for c in self.rank_counts) / world) for name in self.rank_counts[0]}
        root = dataclasses.replace(self.profile.model, **cast(dict[str, Any], means))
        return dataclasses.replace(self.profile, modules={**self.profile.modules, "": root})

    def rank_range(self, name: str) -> tuple[int, int] | None:
        """The least and most of a counted total over the ranks (None with one rank)."""
        if len(self.rank_counts) < 2:
            return None
        values = [c[name] for c in self.rank_counts]
        return min(values), max(values)

    def rooflines(self) -> dict[str, dict[str, Roofline]]:
        """Each module's forward and backward roofline (module-timing steps' latencies), by module name;
        empty unless both peaks are known."""
        if self.peak is None or self.bandwidth is None:
            return {}
        return module_rooflines(self.profile, self.peak.flops, self.bandwidth.bytes_per_sec)

    def figures(self) -> CleanFigures:
        """The clean steps' figures; a result built without them stands for one step of the latencies
        above doing the profile's flops."""
        if self.clean is not None:
            return self.clean
        seconds = StepSeconds(self.fwd_latency, self.bwd_latency, self.step_latency, 0.0, 0.0)  # no wall
        return CleanFigures(
            (CleanStep(StepWork(BatchCounts.of(self.profile), self.samples, self.tokens), seconds),)
        )

    def device_idle(self) -> float | None:
        """The share of fwd + bwd the device sits idle (waiting for the host): 1 - the kernels' time
        launched in them over their latency (None: not read)."""
        busy, latency = self.device_busy, self.fwd_latency + self.bwd_latency
        if busy is None or latency <= 0:
            return None
        return max(0.0, 1.0 - (busy.get("forward", 0.0) + busy.get("backward", 0.0)) / latency)

    def metrics(self) -> dict[str, float]:
        """The ``flops_profiler/*`` metrics (names in :mod:`flops_callbacks.metrics`), computed once:
        the report, the JSON, the picture and the loggers all read this dict."""
        if self._metrics is None:
            self._metrics = window_metrics(self)
        return dict(self._metrics)


def _per_sec(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class PhaseRates:
    """Achieved FLOPS of each phase (0 where a latency is 0): the one definition the report and the
    metrics both use. Model flops (fwd, bwd: on the real tokens) except ``hardware``: as the kernels ran,
    padding and recompute included."""

    fwd: float  # model fwd flops / fwd latency
    bwd: float  # model bwd flops / bwd latency
    fwd_bwd: float  # (fwd + bwd flops) / (fwd + bwd latency)
    iter: float  # (fwd + bwd flops) / iter latency: FLOPS, MFU's numerator
    hardware: float  # (fwd + bwd + recompute flops) / iter latency: HFU's numerator


def phase_rates(
    profile: Profile | BatchCounts, fwd_latency: float, bwd_latency: float, step_latency: float
) -> PhaseRates:
    """One step's flops (``profile``'s, a batch as run) over its phases' latencies."""
    iter_latency = fwd_latency + bwd_latency + step_latency
    counts = profile if isinstance(profile, BatchCounts) else BatchCounts.of(profile)
    return PhaseRates(
        fwd=_per_sec(counts.model_fwd_flops, fwd_latency),
        bwd=_per_sec(counts.model_bwd_flops, bwd_latency),
        fwd_bwd=_per_sec(counts.model_flops, fwd_latency + bwd_latency),
        iter=_per_sec(counts.model_flops, iter_latency),
        hardware=_per_sec(counts.hardware_flops, iter_latency),
    )


def window_rates(step: WindowResult) -> PhaseRates:
    """Each phase's FLOPS on the median clean step: its flops over its latencies (the window's)."""
    counts = step.figures().median_step().work.counts
    return phase_rates(counts, step.fwd_latency, step.bwd_latency, step.step_latency)


def window_metrics(step: WindowResult) -> dict[str, float]:
    """The metrics dict of a profile window (``tokens_per_sec`` only when tokens are known)."""
    p = step.per_gpu_profile()
    c = step.figures()
    median = c.median_step()
    each, total = median.work, c.total()
    dp = step.parallel.data_parallel
    seconds, wall = step.iter_latency, c.sums["wall"]
    rates = window_rates(step)
    metrics = {
        FWD_FLOPS: float(p.fwd_flops),
        BWD_FLOPS: float(p.bwd_flops),
        RECOMPUTE_FLOPS: float(p.recompute_flops),
        FWD_MACS: float(p.fwd_macs),
        FWD_BYTES: float(p.fwd_bytes),
        BWD_BYTES: float(p.bwd_bytes),
        SAVED_ACTIVATION_BYTES: p.saved_bytes / max(step.micro_batches, 1),
        PARAMS: float(p.params),
        FWD_LATENCY: step.fwd_latency,
        BWD_LATENCY: step.bwd_latency,
        STEP_LATENCY: step.step_latency,
        ITER_LATENCY: step.iter_latency,
        CLEAN_STEPS: float(len(step.steps.clean)),
        FWD_FLOPS_PER_SEC: rates.fwd,
        BWD_FLOPS_PER_SEC: rates.bwd,
        FLOPS_PER_SEC: rates.iter,
        HARDWARE_FLOPS_PER_SEC: rates.hardware,
    }
    if each.samples is not None:
        metrics[SAMPLES_PER_SEC] = _per_sec(each.samples * dp, seconds)
    if each.tokens is not None:
        metrics[TOKENS_PER_SEC] = _per_sec(each.tokens * dp, seconds)
    if wall > 0:
        metrics[WALL_LATENCY] = median.latency("wall")  # the median step's, as the latencies above
        metrics[DATA_LATENCY] = median.latency("data")
        if total.samples is not None:
            metrics[WALL_SAMPLES_PER_SEC] = _per_sec(total.samples * dp, wall)
        if total.tokens is not None:
            metrics[WALL_TOKENS_PER_SEC] = _per_sec(total.tokens * dp, wall)
    if total.positions:
        metrics[PADDING_FRACTION] = 1 - (total.real_tokens or 0) / total.positions
        metrics[REAL_TOKENS_PER_SEC] = _per_sec((each.real_tokens or 0) * dp, seconds)
    if step.peak is not None:
        metrics[MFU] = rates.iter / step.peak.flops
        metrics[HFU] = rates.hardware / step.peak.flops
    if step.comm is not None:
        split = step.comm.step
        metrics[COMM_LATENCY] = split.comm
        metrics[EXPOSED_COMM_LATENCY] = split.exposed
        metrics[COMM_OVERLAP] = split.overlap if split.overlap is not None else 1.0
        metrics[IDLE_LATENCY] = split.idle
    if step.slow_rank is not None:
        metrics.update(step.slow_rank.metrics())
    idle = step.device_idle()
    if step.device_busy is not None and idle is not None:
        latencies = (step.fwd_latency, step.bwd_latency, step.step_latency)
        for name, phase, latency in zip(
            (DEVICE_BUSY_FWD, DEVICE_BUSY_BWD, DEVICE_BUSY_STEP), STEP_PHASES, latencies, strict=True
        ):
            metrics[name] = _per_sec(step.device_busy.get(phase, 0.0), latency)
        metrics[DEVICE_IDLE] = idle
    n = len(c.steps)  # the job's tokens and samples in one clean step (every replica's), for its energy
    tokens = None if total.tokens is None else total.tokens * dp / n
    samples = None if total.samples is None else total.samples * dp / n
    metrics.update(energy_metrics(step.energy, tokens, samples))
    return metrics
