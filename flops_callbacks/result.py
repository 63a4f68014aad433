"""The result of a profile window: plain data that the metrics, the report, the JSON and the picture read."""

from __future__ import annotations

from dataclasses import dataclass, field

from flops_callbacks.distributed import Latencies
from flops_callbacks.metrics import window_metrics
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import Bandwidth, Peak
from flops_callbacks.profile import Profile
from flops_callbacks.roofline import Roofline, module_rooflines
from flops_callbacks.shape_flops import BatchCounts
from flops_callbacks.trace import ModuleSpan
from flops_callbacks.window_steps import CleanFigures, Spread


@dataclass(frozen=True)
class WindowSteps:
    """Which global step each figure comes from.

    ``counting``: flops, MACs, params, coverage. ``module_timing``: the per-module latencies (None when
    the run ended before it). ``clean``: the steps whose phase latencies were used (their median);
    ``skipped``: clean steps left out because their batches had other shapes than the counting step's.
    ``latency_source`` names where fwd / bwd / step latency come from in words.
    ``shape_counting``: steps counted (not timed) because their batch shapes' flops were neither counted
    nor predictable yet. ``shapes``: distinct micro-batch shape signatures the window's counted and
    clean steps saw, and how their flops were obtained (counted, predicted from counted ones).
    ``module_shapes_match``: whether the module-timing step's batches had the counting step's shapes
    (else its per-module latencies are left out: with another batch's flops they would mix two batches).
    """

    counting: int
    module_timing: int | None
    clean: tuple[int, ...]
    skipped: tuple[int, ...]
    latency_source: str
    shape_counting: tuple[int, ...] = ()
    shapes: int = 1
    shapes_counted: int = 1
    shapes_predicted: int = 0
    module_shapes_match: bool = True


@dataclass
class WindowResult:
    """A profiled window: the model's profile plus what the training loop around it did.

    ``profile``'s per-module latencies are the module-timing step's; its ``fwd_latency`` and
    ``bwd_latency`` (like the fields below) are the phase latencies of the clean steps.
    """

    profile: Profile
    steps: WindowSteps
    fwd_latency: float
    bwd_latency: float
    step_latency: float
    samples: int | None  # per device, per optimizer step (all its micro-batches); None: not found
    tokens: int | None
    micro_batches: int
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    compute_dtype: str | None = None
    peak: Peak | None = None  # the device's dense peak FLOPS that MFU is computed against
    no_peak_reason: str = ""  # why there is none (said once, in the report)
    bandwidth: Bandwidth | None = None  # the device's peak memory bandwidth: the roofline's memory roof
    no_bandwidth_reason: str = ""
    # every rank's (fwd, bwd, step) latencies, by rank; the latencies above are the slowest rank's
    rank_latencies: list[Latencies] = field(default_factory=list)
    # parameters of the whole model when they are sharded (FSDP2/TP DTensors, ZeRO-3): global sizes
    sharded_model_params: int | None = None
    # report rows an adapter adds about its framework (label, value), e.g. the HF Trainer's estimate
    extra_lines: list[tuple[str, str]] = field(default_factory=list)
    spans: list[ModuleSpan] = field(default_factory=list)  # module calls of the module-timing step
    # peak device memory allocated in each phase (forward, backward, optimizer_step) over the clean
    # steps, in bytes; None where the device keeps no such counter (only CUDA does)
    peak_memory: dict[str, int] | None = None
    published_at: int = 0  # the global step at which the result was published and logged
    # the clean steps' sums and spreads (the slowest rank's); None: the single step of the latencies above
    clean: CleanFigures | None = None

    @property
    def step(self) -> int:
        """The counting step (``profile_step``, or the first step after it that ran)."""
        return self.steps.counting

    @property
    def iter_latency(self) -> float:
        return self.fwd_latency + self.bwd_latency + self.step_latency

    @property
    def no_roofline_reason(self) -> str:
        """Why no module has a roofline ("" when both peaks are known)."""
        if self.peak is None:
            return self.no_peak_reason
        return self.no_bandwidth_reason if self.bandwidth is None else ""

    def rooflines(self) -> dict[str, dict[str, Roofline]]:
        """Each module's forward and backward roofline (module-timing step latencies), by module name;
        empty unless both peaks are known."""
        if self.peak is None or self.bandwidth is None:
            return {}
        return module_rooflines(self.profile, self.peak.flops, self.bandwidth.bytes_per_sec)

    def figures(self) -> CleanFigures:
        """The clean steps' figures; a result built without them stands for one step of the latencies
        above doing the profile's flops."""
        if self.clean is not None:
            return self.clean
        seconds = {"fwd": self.fwd_latency, "bwd": self.bwd_latency, "step": self.step_latency}
        seconds |= {"iter": self.iter_latency, "data": 0.0, "wall": 0.0}
        return CleanFigures(
            counts=BatchCounts.of(self.profile),
            samples=self.samples,
            tokens=self.tokens,
            real_tokens=None,
            positions=None,
            sums={k: v for k, v in seconds.items() if k != "iter"},
            spreads={k: Spread(v, v, v, 1) for k, v in seconds.items()},
        )

    def metrics(self) -> dict[str, float]:
        """The ``flops_profiler/*`` metrics (names in :mod:`flops_callbacks.metrics`)."""
        return window_metrics(self)
