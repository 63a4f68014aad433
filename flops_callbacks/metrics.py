"""The metric names both callbacks and the generation profile log, in one place (names only: the window's
result computes the dict once, :meth:`flops_callbacks.session.result.WindowResult.metrics`, and a
generation's result its own, :meth:`flops_callbacks.generation.result.GenerationResult.metrics`).

Flops and latencies are per device; ``samples_per_sec`` and ``tokens_per_sec`` count every
data-parallel replica. Latencies are in seconds, rates per second, MFU and HFU fractions of the
device's dense peak FLOPS (logged only when a peak is known: :mod:`flops_callbacks.peaks`).
In a multi-process run the latencies are those of the rank every other waited for (the slow rank's
where one stands out).

The latencies are the median step's: the clean step whose FLOPS (its own flops over its own iter latency)
is the median of the clean steps' (of an even count, the mean of the two middle ones; with batches of one
shape, the step of median iter latency), its forward, backward and optimizer step; ``iter_latency`` is
fwd + bwd + step latency (DeepSpeed's definition). The compute rates are that step's flops (samples,
tokens; each batch with its own exact flops whatever its shapes,
:mod:`flops_callbacks.session.shape_flops`) over its latencies, so one slow step moves none of them.
``fwd_flops`` and ``bwd_flops`` are the module tree's batch (every clean step's, with batches of one
shape). ``flops_per_sec`` and ``mfu`` count model flops (fwd + bwd), ``hardware_flops_per_sec`` and
``hfu`` the recompute too. The wall rates are what the wall did: the clean steps' samples (tokens) over
the sum of their whole wall steps, the wait for data and a slow step included.
"""

from __future__ import annotations

__all__ = [
    "ALL",
    "BWD_BYTES",
    "BWD_FLOPS",
    "BWD_FLOPS_PER_SEC",
    "BWD_LATENCY",
    "CLEAN_STEPS",
    "COMM",
    "COMM_LATENCY",
    "COMM_OVERLAP",
    "DATA_LATENCY",
    "DECODE_BYTES_PER_TOKEN",
    "DECODE_ENERGY_PER_TOKEN",
    "DECODE_FLOPS_PER_TOKEN",
    "DECODE_FORWARD_LATENCY",
    "DECODE_LATENCY_P90",
    "DECODE_LATENCY_PER_TOKEN",
    "DECODE_MBU",
    "DECODE_MFU",
    "DEVICE",
    "DEVICE_BUSY_BWD",
    "DEVICE_BUSY_FWD",
    "DEVICE_BUSY_STEP",
    "DEVICE_IDLE",
    "ENERGY",
    "ENERGY_PER_SAMPLE",
    "ENERGY_PER_STEP",
    "ENERGY_PER_TOKEN",
    "EXPOSED_COMM_LATENCY",
    "FLOPS_PER_SEC",
    "FWD_BYTES",
    "FWD_FLOPS",
    "FWD_FLOPS_PER_SEC",
    "FWD_LATENCY",
    "FWD_MACS",
    "GENERATION",
    "GENERATION_ENERGY",
    "GENERATION_ENERGY_PER_TOKEN",
    "GENERATION_LATENCY",
    "GENERATION_POWER",
    "GENERATION_PREFIX",
    "GENERATION_TOKENS_PER_JOULE",
    "GENERATION_TOKENS_PER_SEC",
    "GENERATION_WITH_PEAK",
    "HARDWARE_FLOPS_PER_SEC",
    "HFU",
    "IDLE_LATENCY",
    "ITER_LATENCY",
    "KV_CACHE_BYTES",
    "MFU",
    "PADDING",
    "PADDING_FRACTION",
    "PARAMS",
    "POWER",
    "PREFILL_BYTES",
    "PREFILL_ENERGY",
    "PREFILL_FLOPS",
    "PREFILL_LATENCY",
    "PREFILL_MBU",
    "PREFILL_MFU",
    "PICTURE",
    "PREFIX",
    "REPORT",
    "REAL_TOKENS_PER_SEC",
    "RECOMPUTE_FLOPS",
    "SAMPLES_PER_SEC",
    "SAVED_ACTIVATION_BYTES",
    "SLOW",
    "SLOW_RANK",
    "SLOW_RANK_EXTRA_LATENCY",
    "SLOW_RANK_WAIT_LATENCY",
    "STEP_LATENCY",
    "THROUGHPUT",
    "THROUGHPUT_ENERGY",
    "THROUGHPUT_FLOPS_PER_SEC",
    "THROUGHPUT_MFU",
    "THROUGHPUT_POWER",
    "THROUGHPUT_PREFIX",
    "THROUGHPUT_PROFILER_SECONDS",
    "THROUGHPUT_SAMPLES_PER_SEC",
    "THROUGHPUT_TOKENS_PER_JOULE",
    "THROUGHPUT_TOKENS_PER_SEC",
    "TIME_TO_FIRST_TOKEN",
    "TOKENS_PER_JOULE",
    "TOKENS_PER_SEC",
    "WALL",
    "WALL_LATENCY",
    "WALL_SAMPLES_PER_SEC",
    "WALL_TOKENS_PER_SEC",
    "WITH_PEAK",
]

PREFIX = "flops_profiler/"

REPORT = PREFIX + "report"  # the full report as Markdown text (TensorBoard's Text tab), at the window's end
PICTURE = PREFIX + "profile"  # the profile picture as HTML media (W&B), at the window's end

FWD_FLOPS = PREFIX + "fwd_flops"  # forward flops, measured: the module tree's batch
BWD_FLOPS = PREFIX + "bwd_flops"  # backward flops, measured (not 2 x fwd)
RECOMPUTE_FLOPS = PREFIX + "recompute_flops"  # forward work redone in the backward: checkpointing, attention
FWD_MACS = PREFIX + "fwd_macs"  # forward multiply-accumulates (matmul, conv, attention)
# bytes the forward's ops read and write (each op's inputs and outputs)
FWD_BYTES = PREFIX + "fwd_bytes"
BWD_BYTES = PREFIX + "bwd_bytes"  # bytes the backward's ops read and write (recompute apart)
# saved for the backward, params excluded, per micro-batch (the step's over its micro-batches)
SAVED_ACTIVATION_BYTES = PREFIX + "saved_activation_bytes"
PARAMS = PREFIX + "params"  # parameters on this device
FWD_LATENCY = PREFIX + "fwd_latency"  # seconds in the forward phase(s) of the median step
BWD_LATENCY = PREFIX + "bwd_latency"  # seconds in the backward phase(s)
STEP_LATENCY = PREFIX + "step_latency"  # seconds in the optimizer step
ITER_LATENCY = PREFIX + "iter_latency"  # fwd + bwd + step latency
CLEAN_STEPS = PREFIX + "clean_steps"  # clean steps the latencies rest on (0: none ran, latencies inflated)
# Achieved FLOPS: the median step's own flops over its latencies (the printed report's rates are these:
# flops_callbacks.session.result.phase_rates). Model flops (fwd + bwd) unless named hardware.
FWD_FLOPS_PER_SEC = PREFIX + "fwd_flops_per_sec"  # the median step's model fwd flops / fwd latency
BWD_FLOPS_PER_SEC = PREFIX + "bwd_flops_per_sec"  # the median step's model bwd flops / bwd latency
# the median step's model flops (fwd + bwd, on the real tokens: padding apart) / iter latency
FLOPS_PER_SEC = PREFIX + "flops_per_sec"
# the median step's (fwd + bwd + recompute flops, as run: padding in) / iter latency
HARDWARE_FLOPS_PER_SEC = PREFIX + "hardware_flops_per_sec"
SAMPLES_PER_SEC = PREFIX + "samples_per_sec"  # the median step's samples per device x dp size / iter latency
# the median step's tokens per device x dp size / iter latency (if known)
TOKENS_PER_SEC = PREFIX + "tokens_per_sec"
MFU = PREFIX + "mfu"  # flops_per_sec / peak FLOPS (model flops: recompute excluded)
HFU = PREFIX + "hfu"  # hardware_flops_per_sec / peak FLOPS

# The wall step: from the end of the previous optimizer step to the end of this one (medians); with several
# ranks, less the profiler's votes' own time (docs/several-processes.md).
WALL_LATENCY = PREFIX + "wall_latency"  # the whole step on the wall clock: data + fwd + bwd + step + other
# the wait for data: previous step's end -> first forward's start, and each later micro-batch's wait
DATA_LATENCY = PREFIX + "data_latency"
WALL_SAMPLES_PER_SEC = PREFIX + "wall_samples_per_sec"  # clean steps' samples x dp size / their wall time
WALL_TOKENS_PER_SEC = PREFIX + "wall_tokens_per_sec"  # the same of tokens, if known
# Padding, when the batches show it (an attention_mask, or position_ids ending in zeros): tokens_per_sec
# counts positions, padding included.
PADDING_FRACTION = PREFIX + "padding_fraction"  # padding positions / all positions (clean steps)
# the median step's non-padding tokens x dp size / iter latency
REAL_TOKENS_PER_SEC = PREFIX + "real_tokens_per_sec"

# With several ranks, the communication steps (three to 25 under torch.profiler, every rank; of their median
# step by exposed time, the ranks' mean):
COMM_LATENCY = PREFIX + "comm_latency"  # seconds of communication in the step (union of streams, threads)
EXPOSED_COMM_LATENCY = PREFIX + "exposed_comm_latency"  # communication while no compute runs: waited on
# (on a CPU, compute waiting for a core beside communication does not run: docs/communication.md)
COMM_OVERLAP = PREFIX + "comm_overlap"  # communication under compute / communication, 0..1
IDLE_LATENCY = PREFIX + "idle_latency"  # seconds of the step with neither compute nor communication

# With several ranks, the rank the others wait for (docs/several-processes.md), from every rank's own time in
# each part of its step (data, forward, backward, optimizer step: the part less its waiting):
SLOW_RANK = PREFIX + "slow_rank"  # the rank the others wait for; -1: none stands out beyond the ranks' noise
# the slow rank's own seconds a step in the part where it stands out, beyond the other ranks' median (0: none)
SLOW_RANK_EXTRA_LATENCY = PREFIX + "slow_rank_extra_latency"
# seconds a step each other rank waits for the slow rank, their mean: the job's time lost a step (0: none)
SLOW_RANK_WAIT_LATENCY = PREFIX + "slow_rank_wait_latency"

# On a CUDA device, the device's kernels launched in each phase of a module-timing step (torch.profiler's
# activity records) over the phase's latency: how busy the device is (fractions, 0..1; the same batch shapes)
DEVICE_BUSY_FWD = PREFIX + "device_busy_fwd"  # kernel time launched in the forward / fwd latency
DEVICE_BUSY_BWD = PREFIX + "device_busy_bwd"  # kernel time launched in the backward / bwd latency
DEVICE_BUSY_STEP = PREFIX + "device_busy_step"  # kernel time launched in the optimizer step / step latency
# 1 - kernel time / latency of fwd + bwd: the share the device waits for the host (launches, Python)
DEVICE_IDLE = PREFIX + "device_idle"

# Energy over the clean steps, where the device's energy counter can be read (NVML's on a GPU, RAPL's
# package and DRAM on a CPU: docs/energy.md): the job's, every GPU and every host counted once.
ENERGY_PER_STEP = PREFIX + "energy_per_step"  # joules of one clean step: the job's devices, its wall step
ENERGY_PER_SAMPLE = PREFIX + "energy_per_sample"  # energy_per_step / the job's samples per step
ENERGY_PER_TOKEN = PREFIX + "energy_per_token"  # energy_per_step / the job's tokens per step (if known)
TOKENS_PER_JOULE = PREFIX + "tokens_per_joule"  # the job's tokens per step / energy_per_step (if known)
POWER = PREFIX + "power"  # mean watts of the job's devices over the clean steps

# Continuous throughput, at every logging step after the profile window (flops_callbacks.session.meter):
# rates over the wall time since the previous logging step, flops from the measured flops per batch. A
# logging step whose interval held only an audited step (out of the metered time) logs none.
THROUGHPUT_PREFIX = "throughput/"
THROUGHPUT_SAMPLES_PER_SEC = THROUGHPUT_PREFIX + "samples_per_sec"  # all data-parallel replicas
THROUGHPUT_TOKENS_PER_SEC = THROUGHPUT_PREFIX + "tokens_per_sec"  # all replicas, when tokens are known
THROUGHPUT_FLOPS_PER_SEC = THROUGHPUT_PREFIX + "flops_per_sec"  # model flops (fwd + bwd) per device per sec
THROUGHPUT_MFU = THROUGHPUT_PREFIX + "mfu"  # flops_per_sec / peak FLOPS, when a peak is known
# seconds the profiler's own counting took in the interval (new shapes and sequence lengths, counted off the
# clock: not in the rates above), the slowest rank's
THROUGHPUT_PROFILER_SECONDS = THROUGHPUT_PREFIX + "profiler_seconds"
# where the counter is cheap to read (RAPL, NVML's total energy: one read per interval; not sampled power)
# and the interval spans 20 of its resolutions, with no pause learned of when it ended (an HF Trainer's save
# a callback after ours asked for: the counter was not read where it began)
THROUGHPUT_POWER = THROUGHPUT_PREFIX + "power"  # mean watts of the job's devices over the interval
THROUGHPUT_TOKENS_PER_JOULE = THROUGHPUT_PREFIX + "tokens_per_joule"  # throughput tokens_per_sec / power

WALL = (WALL_LATENCY, DATA_LATENCY, WALL_SAMPLES_PER_SEC, WALL_TOKENS_PER_SEC)  # with a step before
PADDING = (PADDING_FRACTION, REAL_TOKENS_PER_SEC)  # when the batches show padding (as above)
THROUGHPUT = (
    THROUGHPUT_SAMPLES_PER_SEC,
    THROUGHPUT_TOKENS_PER_SEC,
    THROUGHPUT_FLOPS_PER_SEC,
    THROUGHPUT_MFU,
    THROUGHPUT_PROFILER_SECONDS,
)
WITH_PEAK = (MFU, HFU)  # at the window's end, only when a peak is known
COMM = (COMM_LATENCY, EXPOSED_COMM_LATENCY, COMM_OVERLAP, IDLE_LATENCY)  # when communication steps ran
SLOW = (SLOW_RANK, SLOW_RANK_EXTRA_LATENCY, SLOW_RANK_WAIT_LATENCY)  # with several ranks and clean steps
ENERGY = (ENERGY_PER_STEP, ENERGY_PER_SAMPLE, ENERGY_PER_TOKEN, TOKENS_PER_JOULE, POWER)  # with a counter
THROUGHPUT_ENERGY = (THROUGHPUT_POWER, THROUGHPUT_TOKENS_PER_JOULE)  # with a cheap counter
DEVICE = (DEVICE_BUSY_FWD, DEVICE_BUSY_BWD, DEVICE_BUSY_STEP, DEVICE_IDLE)  # CUDA, modules timed by kernels

# At the window's end, always (samples_per_sec and wall_samples_per_sec only when the batch size is known,
# tokens_per_sec and wall_tokens_per_sec only when tokens are; the WALL ones when the timed steps had a
# step before them, as clean steps always have).
ALL = (
    FWD_FLOPS,
    BWD_FLOPS,
    RECOMPUTE_FLOPS,
    FWD_MACS,
    FWD_BYTES,
    BWD_BYTES,
    SAVED_ACTIVATION_BYTES,
    PARAMS,
    FWD_LATENCY,
    BWD_LATENCY,
    STEP_LATENCY,
    ITER_LATENCY,
    CLEAN_STEPS,
    FWD_FLOPS_PER_SEC,
    BWD_FLOPS_PER_SEC,
    FLOPS_PER_SEC,
    HARDWARE_FLOPS_PER_SEC,
    SAMPLES_PER_SEC,
    TOKENS_PER_SEC,
    *WALL,
)


# Generation (flops_callbacks.profile_generation, GenerationProfiler): a prefill (the prompt's forward)
# then decode steps, each one token for every sequence of the batch. "Per token" is per decode step;
# flops and bytes are the counting run's, op by op, as mean over its decode steps; latencies the timed
# runs' (medians), rates of all sequences. MFU / MBU: achieved FLOPS / bytes per second over the peaks.
GENERATION_PREFIX = "generation/"
PREFILL_FLOPS = GENERATION_PREFIX + "prefill_flops"  # the prefill forward's flops, measured
PREFILL_BYTES = GENERATION_PREFIX + "prefill_bytes"  # bytes the prefill's ops read and write
PREFILL_LATENCY = GENERATION_PREFIX + "prefill_latency"  # seconds of the prefill forward
TIME_TO_FIRST_TOKEN = GENERATION_PREFIX + "time_to_first_token"  # seconds from the call to the first token
DECODE_FLOPS_PER_TOKEN = GENERATION_PREFIX + "decode_flops_per_token"  # flops of a decode step (mean)
# bytes a decode step's ops read and write (mean): the weights, the KV cache read, activations
DECODE_BYTES_PER_TOKEN = GENERATION_PREFIX + "decode_bytes_per_token"
# inter-token latency: median seconds between consecutive tokens (the decode step and the loop around it)
DECODE_LATENCY_PER_TOKEN = GENERATION_PREFIX + "decode_latency_per_token"
DECODE_LATENCY_P90 = GENERATION_PREFIX + "decode_latency_p90"  # 90th percentile of the same gaps
DECODE_FORWARD_LATENCY = GENERATION_PREFIX + "decode_forward_latency"  # median seconds of a decode forward
GENERATION_LATENCY = GENERATION_PREFIX + "latency"  # seconds of the whole generation (median run)
GENERATION_TOKENS_PER_SEC = GENERATION_PREFIX + "tokens_per_sec"  # a run's tokens of all sequences / latency
KV_CACHE_BYTES = GENERATION_PREFIX + "kv_cache_bytes"  # bytes the KV cache holds at the end
PREFILL_MFU = GENERATION_PREFIX + "prefill_mfu"  # prefill flops / prefill latency / peak FLOPS
PREFILL_MBU = GENERATION_PREFIX + "prefill_mbu"  # prefill bytes / prefill latency / peak bandwidth
DECODE_MFU = GENERATION_PREFIX + "decode_mfu"  # decode flops per token / latency per token / peak FLOPS
DECODE_MBU = GENERATION_PREFIX + "decode_mbu"  # decode bytes per token / latency per token / peak bandwidth
# Energy of the timed runs, where the device's energy counter can be read; a phase's only where it spans 20
# of the counter's resolutions (the report says when it does not)
GENERATION_POWER = GENERATION_PREFIX + "power"  # mean watts over the timed runs
GENERATION_ENERGY_PER_TOKEN = GENERATION_PREFIX + "energy_per_token"  # joules per new token of all sequences
GENERATION_TOKENS_PER_JOULE = GENERATION_PREFIX + "tokens_per_joule"  # new tokens of all sequences per joule
PREFILL_ENERGY = GENERATION_PREFIX + "prefill_energy"  # joules of the prefill (start -> first token)
DECODE_ENERGY_PER_TOKEN = GENERATION_PREFIX + "decode_energy_per_token"  # joules of a decode step (mean)

# Always (flops and bytes unless counting failed, the KV cache's when the model returns one; tokens_per_sec
# when the batch size is known), and the four fractions each when its peak is known.
GENERATION = (
    PREFILL_FLOPS,
    PREFILL_BYTES,
    PREFILL_LATENCY,
    TIME_TO_FIRST_TOKEN,
    DECODE_FLOPS_PER_TOKEN,
    DECODE_BYTES_PER_TOKEN,
    DECODE_LATENCY_PER_TOKEN,
    DECODE_LATENCY_P90,
    DECODE_FORWARD_LATENCY,
    GENERATION_LATENCY,
    GENERATION_TOKENS_PER_SEC,
    KV_CACHE_BYTES,
)
GENERATION_WITH_PEAK = (PREFILL_MFU, PREFILL_MBU, DECODE_MFU, DECODE_MBU)
GENERATION_ENERGY = (
    GENERATION_POWER,
    GENERATION_ENERGY_PER_TOKEN,
    GENERATION_TOKENS_PER_JOULE,
    PREFILL_ENERGY,
    DECODE_ENERGY_PER_TOKEN,
)  # with a counter
