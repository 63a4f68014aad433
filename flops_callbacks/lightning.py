"""Lightning adapter: ``FlopsProfilerCallback`` turns Trainer hooks into :class:`StepProfiler` events.

Everything measured lives in :mod:`flops_callbacks.step`; this module only knows which Lightning hook
starts which phase, where the parallel sizes are, and where the results go (``trainer.loggers`` and
the log directory).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
except ImportError as err:  # the core needs only torch; the Lightning callback is an extra
    raise ImportError(
        "FlopsProfilerCallback needs Lightning: pip install 'flops-callbacks[lightning]'"
    ) from err

from flops_callbacks.options import check_flag
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import BF16, FP8, FP16, parameters_dtype
from flops_callbacks.step import BACKWARD, FORWARD, OPTIMIZER_STEP, StepProfiler, StepResult
from flops_callbacks.throughput import ThroughputMeter


def parallel_sizes(trainer: pl.Trainer) -> ParallelSizes:
    """How ``trainer``'s strategy splits the run; every size is 1 where that parallelism is not used."""
    strategy = trainer.strategy
    sampler_kwargs = trainer.distributed_sampler_kwargs or {}
    data_parallel = int(sampler_kwargs.get("num_replicas", 1))
    tensor_parallel = pipeline_parallel = 1
    if isinstance(strategy, ModelParallelStrategy):
        mesh = strategy.device_mesh
        if "tensor_parallel" in (mesh.mesh_dim_names or ()):
            tensor_parallel = mesh["tensor_parallel"].size()
    elif isinstance(strategy, DeepSpeedStrategy):
        engine = strategy.model  # the DeepSpeedEngine (a PipelineEngine under pipeline parallelism)
        data_parallel = int(getattr(engine, "dp_world_size", data_parallel))
        tensor_parallel = int(getattr(engine, "mp_world_size", 1))
        pipeline_parallel = int(getattr(engine, "num_stages", 1))
    return ParallelSizes(
        world_size=trainer.world_size,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
    )


def compute_dtype(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """What the matmuls run in, from the precision plugin: ``bf16-*`` -> bf16, ``16-*`` -> fp16,
    Transformer Engine -> fp8, ``32-true`` -> the parameters' dtype (tf32 when torch allows it)."""
    precision = str(trainer.precision)
    if precision.startswith("transformer-engine"):
        return FP8
    if precision.startswith("bf16"):
        return BF16
    if precision.startswith("16"):
        return FP16
    if precision.startswith("32"):
        return parameters_dtype(pl_module)
    return None  # 64-true: the peak table has no fp64 column


class FlopsProfilerCallback(pl.Callback):
    """Profiles one optimizer step of a Lightning run: DeepSpeed-style report, metrics in every logger.

    ``Trainer(callbacks=[FlopsProfilerCallback(profile_step=10)])`` profiles the optimizer step that
    starts when ``trainer.global_step == profile_step`` (DeepSpeed's convention): all
    ``accumulate_grad_batches`` micro-batches of it, in automatic or manual optimization. Rank 0
    prints the report (or writes it to ``output_file``), writes it and a JSON of the full profile as
    ``flops_profile_step{N}.txt/.json`` into ``trainer.log_dir``, and logs the ``flops_profiler/*``
    metrics (:mod:`flops_callbacks.metrics`) once, at step ``profile_step``, to every logger of the
    Trainer. After that step, at every logging step (``global_step % log_every_n_steps == 0``), rank 0
    logs the ``throughput/*`` metrics of the interval since the previous one, from the flops measured
    per batch shape (:mod:`flops_callbacks.throughput`): no hooks and no counting on those steps, one
    device synchronize per logging interval, validation time left out.

    Phases, on the device's synchronized clock, as Lightning 2.6 calls the hooks (every precision
    plugin, AMP's GradScaler and DeepSpeed included, runs the closure with forward and backward
    *before* ``on_before_optimizer_step``):

    * forward: ``on_train_batch_start`` -> ``on_before_backward``: ``training_step`` (forward and
      loss, under autocast with mixed precision) and, in automatic optimization, ``zero_grad``.
    * backward: ``on_before_backward`` -> ``on_before_optimizer_step`` (or the end of a micro-batch
      that only accumulates): loss scaling, the backward with its gradient all-reduce,
      ``on_after_backward`` hooks and GradScaler's unscale. Phases are contiguous within a
      micro-batch, so ``iter latency = fwd + bwd + step`` leaves none of it out; in manual
      optimization the code of ``training_step`` between ``manual_backward`` and ``optimizer.step()``
      is counted here too.
    * optimizer step: ``on_before_optimizer_step`` -> ``on_train_batch_end``: gradient clipping,
      the optimizer update (``engine.step()`` under DeepSpeed), LR schedulers, and in manual
      optimization the rest of ``training_step``.

    Not part of the step, neither counted nor timed: loading and moving a batch (before
    ``on_train_batch_start``) and anything between micro-batches, such as a validation run.
    Flops are measured per module of the LightningModule. On one device, work in ``training_step``
    outside its submodules (the loss, usually) and the optimizer's arithmetic are in the profile's
    ``outside_model`` section, not in the model's totals. Strategies that wrap the model (DDP, FSDP,
    DeepSpeed) make Lightning run ``training_step`` as the LightningModule's forward, so there the
    loss is in the model's counts, and DDP's gradient averaging (1 flop per parameter) in its bwd.

    Args:
        profile_step: global step (optimizer steps done) at which the profiled step starts.
        module_depth: depth of the aggregated profile (-1: all depths).
        top_modules: modules shown per depth in the aggregated profile.
        detailed: print the per-module tree.
        print_profile: print the report on rank 0 (it is written to the log dir either way).
        output_file: write the report to this file instead of printing it.
        batch_size_fn: samples in a batch (default: leading dim of its first tensor).
        tokens_fn: tokens in a batch; adds ``flops_profiler/tokens_per_sec``.
        causal_attention: "full" counts all of QK^T and AV for causal attention (FlopCounterMode,
            DeepSpeed, PaLM MFU); "half" only the unmasked part.
        throughput: log ``throughput/*`` at every logging step after the profiled one.
        peak_flops: dense peak FLOPS of one device, for ``flops_profiler/mfu``, ``hfu`` and
            ``throughput/mfu``. Default:
            the ``FLOPS_CALLBACKS_PEAK_FLOPS`` environment variable, else the table of
            :mod:`flops_callbacks.peaks` for the GPU and the precision plugin's compute dtype
            (:func:`compute_dtype`). On a CPU or an unknown device there is no MFU; the report says so.
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
        throughput: bool = True,
        peak_flops: float | None = None,
    ) -> None:
        super().__init__()
        check_flag("throughput", throughput)
        self.profiler = StepProfiler(
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            print_profile=print_profile,
            output_file=output_file,
            batch_size_fn=batch_size_fn,
            tokens_fn=tokens_fn,
            causal_attention=causal_attention,
            peak_flops=peak_flops,
        )
        self.meter = (
            ThroughputMeter(self.profiler.batch_size_fn, tokens_fn, causal_attention) if throughput else None
        )
        self._metering: ThroughputMeter | None = None  # the meter, on the rank that logs
        self._step_at_batch_start = 0
        self._profiled_step: int | None = None  # kept in checkpoints: a resumed run knows it ran
        self._resumed_past = False

    @property
    def result(self) -> StepResult | None:
        """The profiled step (on every rank), once it has run."""
        return self.profiler.result

    def state_dict(self) -> dict[str, Any]:
        return {"profiled_step": self._profiled_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._profiled_step = state_dict.get("profiled_step")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # metered where its metrics go somewhere: on rank 0, with a logger
        self._metering = self.meter if trainer.is_global_zero and trainer.loggers else None
        step, profile_step = trainer.global_step, self.profiler.profile_step
        self._resumed_past = step > profile_step
        if not self._resumed_past:
            return
        if self._profiled_step == profile_step:
            rank_zero_info(
                f"FlopsProfilerCallback: resumed at step {step}; step {profile_step} was profiled before the "
                f"checkpoint (flops_profile_step{profile_step}.txt in that run's log dir). "
                "No profile runs in this run."
            )
        else:
            rank_zero_warn(
                f"FlopsProfilerCallback: resumed at step {step}, past profile_step={profile_step}: "
                "no profile runs in this run. Set profile_step >= the step you resume from."
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        sp, meter = self.profiler, self._metering
        self._step_at_batch_start = step = trainer.global_step
        if sp.active:  # the next micro-batch of the profiled step
            if meter is not None:
                meter.observe(batch)
            sp.resume(FORWARD)
        elif sp.due(step):
            if meter is not None:
                meter.observe(batch)
            sp.begin(pl_module, parallel_sizes(trainer), compute_dtype(trainer, pl_module))
        elif meter is not None and meter.started:
            meter.begin_micro_batch(batch, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.profiler.active:
            self.profiler.phase(BACKWARD)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.profiler.active:
            self.profiler.phase(OPTIMIZER_STEP)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sp, meter = self.profiler, self._metering
        if not sp.active:
            if meter is not None and meter.started:
                self._meter_step_end(trainer, meter)
            return
        sp.pause()  # validation may run before the next micro-batch
        sp.add_batch(batch)
        if trainer.global_step == sp.profile_step:
            return  # gradients are accumulating: the optimizer step has not run yet
        result = sp.finish(sp.profile_step)
        self._profiled_step = result.step
        log_dir = trainer.log_dir or trainer.default_root_dir  # on every rank: log_dir broadcasts
        if trainer.is_global_zero:
            sp.publish(result, log_dir)
            metrics = result.metrics()
            # Straight to the loggers: pl_module.log would re-emit the one-shot value at later steps.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=result.step)
                logger.save()
        if meter is not None:
            meter.start(result, pl_module)

    def _meter_step_end(self, trainer: pl.Trainer, meter: ThroughputMeter) -> None:
        meter.end_micro_batch()
        if trainer.global_step == self._step_at_batch_start:
            return  # accumulating: the optimizer step has not run yet
        meter.end_step()
        every = trainer.log_every_n_steps
        if every and trainer.global_step % every == 0:
            metrics = meter.metrics()
            for logger in trainer.loggers if metrics else ():
                logger.log_metrics(metrics, step=trainer.global_step)
                logger.save()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.meter is not None and not trainer.sanity_checking:
            self.meter.pause(evaluating=True)  # validation time is not training throughput

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.meter is not None and not trainer.sanity_checking:
            self.meter.resume()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # An epoch cut short by on_train_batch_start returning -1 ends inside the profiled step.
        self.profiler.pause()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.profiler.abort()  # Lightning re-raises the exception itself
        if self.meter is not None:
            self.meter.close()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.meter is not None:
            self.meter.close()
        sp = self.profiler
        if sp.active:
            sp.abort()
            rank_zero_warn(
                f"FlopsProfilerCallback: training ended inside the step at profile_step={sp.profile_step} "
                "before its optimizer step ran: no profile."
            )
        elif sp.result is None and not self._resumed_past:
            rank_zero_warn(
                f"FlopsProfilerCallback: no optimizer step started at global step "
                f"profile_step={sp.profile_step} (training ended at global step {trainer.global_step}): "
                "no profile ran. Use a profile_step below max_steps."
            )
