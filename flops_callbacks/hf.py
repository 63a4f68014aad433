"""Hugging Face Trainer adapter: ``HFFlopsCallback`` turns Trainer events into :class:`StepProfiler` events.

Everything measured lives in :mod:`flops_callbacks.step`; this module only knows which Trainer event
(or model hook, where the Trainer has no event) starts which phase, where the parallel sizes are, and
how the metrics reach the Trainer's reporting callbacks.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as err:  # the core needs only torch; the HF callback is an extra
    raise ImportError("HFFlopsCallback needs transformers: pip install 'flops-callbacks[hf]'") from err

from flops_callbacks import metrics as names
from flops_callbacks.options import check_flag
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.peaks import BF16, FP8, FP16, parameters_dtype
from flops_callbacks.step import BACKWARD, FORWARD, OPTIMIZER_STEP, StepProfiler, StepResult
from flops_callbacks.throughput import ThroughputMeter
from flops_callbacks.units import number_to_string

logger = logging.getLogger(__name__)


def _size(value: Any) -> int:
    """A parallel size as an int; 1 for anything unset, "auto" or not positive."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _field(config: Any, name: str) -> Any:
    """``config.name`` or ``config[name]`` (configs arrive as objects or as dicts), None if absent."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def parallel_sizes(args: Any, model: Any = None, accelerator_state: Any = None) -> ParallelSizes:
    """How the run is split, read from every place transformers and accelerate keep it; 1 where unused.

    World size from ``args.world_size``; data, tensor and context parallel sizes from accelerate's
    ``ParallelismConfig`` (``dp_replicate x dp_shard``, ``tp``, ``cp x sp``: sequence parallelism
    splits each sequence across ranks as context parallelism does); tensor parallelism also from
    the DeepSpeed plugin (``tensor_parallel.autotp_size``), accelerate's torch TP plugin, the Megatron
    plugin (with its pipeline size) and the model (``tp_size``, ``config.distributed_config``).
    Without a ``ParallelismConfig`` the data-parallel size is the world over the model-parallel size.
    """
    state = accelerator_state
    config = getattr(args, "parallelism_config", None) or getattr(state, "parallelism_config", None)
    distributed = _field(getattr(model, "config", None), "distributed_config")
    megatron = getattr(state, "megatron_lm_plugin", None)
    tensor_parallel = max(
        _size(_field(config, "tp_size")),
        _size(_field(distributed, "tp_size")),
        _size(getattr(model, "tp_size", None)),
        _size(getattr(getattr(state, "torch_tp_plugin", None), "tp_size", None)),
        _size(getattr(megatron, "tp_degree", None)),
        _deepspeed_autotp_size(state),
    )
    pipeline_parallel = max(
        _size(_field(distributed, "pp_size")),
        _size(getattr(megatron, "pp_degree", None)),
    )
    context_parallel = _size(_field(config, "cp_size")) * _size(_field(config, "sp_size"))
    world = _size(getattr(args, "world_size", 1))
    if config is None:
        data_parallel = max(world // (tensor_parallel * pipeline_parallel * context_parallel), 1)
    else:
        data_parallel = _size(_field(config, "dp_replicate_size")) * _size(_field(config, "dp_shard_size"))
    return ParallelSizes(
        world_size=world,
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
    )


def _deepspeed_autotp_size(accelerator_state: Any) -> int:
    """DeepSpeed's AutoTP size (``tensor_parallel.autotp_size`` of the config), over all its plugins."""
    plugins = getattr(accelerator_state, "deepspeed_plugins", None) or {}
    if not isinstance(plugins, dict):
        plugins = {"default": plugins}
    configs = (getattr(plugin, "deepspeed_config", None) for plugin in plugins.values())
    return max((_size(_field(_field(c, "tensor_parallel"), "autotp_size")) for c in configs), default=1)


def compute_dtype(args: Any, model: torch.nn.Module, accelerator: Any = None) -> str | None:
    """What the matmuls run in: fp8 under accelerate's fp8 mixed precision, bf16 / fp16 with
    ``args.bf16`` / ``args.fp16``, else the model's parameter dtype (a model loaded in bf16 trains in
    bf16; fp32 is tf32 when torch allows it, as ``args.tf32`` sets it)."""
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed == "fp8":
        return FP8
    if getattr(args, "bf16", False) or mixed == "bf16":
        return BF16
    if getattr(args, "fp16", False) or mixed == "fp16":
        return FP16
    return parameters_dtype(model)


def _calling_trainer() -> transformers.Trainer | None:
    """The Trainer whose callback event is running: the first ``self`` up the stack that is one.

    Callback events receive args, state, control and a few objects, never the Trainer itself, and
    the adapter needs it twice: to log through it and to see exceptions of its training step.
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _input_ids_tokens(batch: Any) -> int:
    return int(batch["input_ids"].numel())


def _has_input_ids(batch: Any) -> bool:
    return isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor)


def _inputs_of(args: tuple, kwargs: dict) -> Any:
    """The ``inputs`` of a ``Trainer.training_step(model, inputs, num_items_in_batch)`` call."""
    return args[1] if len(args) > 1 else kwargs.get("inputs")


class HFFlopsCallback(TrainerCallback):
    """Profiles one optimizer step of a ``transformers.Trainer`` run: DeepSpeed-style report, metrics
    in every reporting backend of the Trainer.

    ``Trainer(..., callbacks=[HFFlopsCallback(profile_step=10)])`` profiles the optimizer step that
    starts when ``state.global_step == profile_step`` (DeepSpeed's convention), all
    ``gradient_accumulation_steps`` micro-batches of it. The world process zero prints the report
    (or writes it to ``output_file``) and writes it and a JSON of the full profile as
    ``flops_profile_step{N}.txt/.json`` into ``args.logging_dir`` (``args.output_dir`` in
    transformers 5, which has no logging dir). The ``flops_profiler/*`` metrics
    (:mod:`flops_callbacks.metrics`) are logged once through the Trainer's own log path at step
    ``profile_step``: they are in ``state.log_history`` under those names, and the Trainer's
    TensorBoard / W&B / MLflow ... callbacks write them as they write every training log, under
    ``train/flops_profiler/*``. Nothing is registered on the model outside the profiled step.

    After that step, at every logging step (``logging_steps``), the world process zero logs the
    ``throughput/*`` metrics of the interval since the previous one the same way, from the flops
    measured per batch shape (:mod:`flops_callbacks.throughput`): no hooks and no counting on those
    steps, one device synchronize per logging interval, evaluation time left out. The Trainer has no
    event that carries the batch, so for this the adapter wraps the Trainer's ``training_step`` (an
    instance attribute, as during the profiled step; the model gets nothing) from the end of the
    profiled step to the end of training, or until an exception passes through it; an exception
    elsewhere leaves it until the Trainer's next ``train()``. ``batch_size_fn`` and ``tokens_fn`` then
    receive the Trainer's ``inputs`` dict.

    Phases, on the device's synchronized clock, as transformers 5 runs a step (``on_step_begin``
    once, then per micro-batch ``training_step`` with the model's forward and ``accelerator.backward``
    followed by ``on_substep_end``, except after the last one: gradient clipping,
    ``on_pre_optimizer_step``, ``optimizer.step()``, ``on_optimizer_step``). The Trainer has no event
    between forward and backward, so hooks on the model, registered for the profiled step only, mark
    the end of each forward:

    * forward: from the start of each micro-batch (``on_step_begin``, then ``on_substep_end`` of the
      previous one) to the end of the model's forward: ``model.train()``, moving the inputs to the
      device, and the forward, with the loss when the model computes it (``labels`` in the inputs).
    * backward: from the end of the model's forward to the end of the micro-batch: a loss computed
      outside the model (``compute_loss_func``, label smoothing), the scaling for accumulation,
      ``accelerator.backward`` (with the gradient all-reduce), the Trainer's bookkeeping of the
      micro-batch (loss sum, token count, ``total_flos``) and, after the last micro-batch, gradient
      clipping and the grad-norm, up to ``on_pre_optimizer_step``.
    * optimizer step: ``on_pre_optimizer_step`` -> ``on_optimizer_step``: ``optimizer.step()`` only;
      the LR scheduler and ``zero_grad`` run after ``on_optimizer_step``, outside the step.
      Under DeepSpeed through accelerate, ``accelerator.backward`` runs the engine's backward *and*
      its optimizer step, and the Trainer's ``optimizer.step()`` does nothing: the update's time and
      flops are then in the backward phase and the step phase is near zero. We report what ran, and
      do not invent a split.

    Not part of the step: fetching the batches (the Trainer fetches all of a step's micro-batches
    before ``on_step_begin``), the LR scheduler, logging, evaluation and checkpointing. Work outside
    the model's modules (a loss outside the model, the optimizer's arithmetic) is in the profile's
    ``outside_model`` section, not in the model's totals.

    Samples are counted per micro-batch from what the model is called with: ``batch_size_fn`` and
    ``tokens_fn`` receive the model's keyword arguments (the Trainer's ``inputs`` dict as the model
    gets it), or its positional arguments when it has none. Without ``tokens_fn``, inputs with an
    ``input_ids`` tensor count ``input_ids.numel()`` tokens (padding included, as the Trainer's own
    ``num_input_tokens_seen`` and ``total_flos`` do); pass ``tokens_fn`` (e.g.
    ``lambda inputs: int(inputs["attention_mask"].sum())``) to count real tokens only.

    For models the Trainer estimates flops for (``Trainer.floating_point_ops``: 6 x non-embedding
    params x tokens, what ``total_flos`` sums), the report prints that estimate beside the measured
    fwd + bwd flops (recompute excluded: the estimate counts model flops) and their difference.

    Exceptions: the Trainer has no exception event, so for the profiled step only the adapter wraps
    the Trainer's ``training_step``: an exception in a forward or backward stops the profile and
    propagates unchanged. An exception after the last backward (in gradient clipping or
    ``optimizer.step()``) leaves the profile running until this callback's next event
    (``on_train_begin``, ``on_prediction_step`` or ``on_train_end``), which stops it.

    Args:
        profile_step: global step (optimizer steps done) at which the profiled step starts.
        module_depth: depth of the aggregated profile (-1: all depths).
        top_modules: modules shown per depth in the aggregated profile.
        detailed: print the per-module tree.
        print_profile: print the report on the world process zero (it is written to the output dir
            either way).
        output_file: write the report to this file instead of printing it.
        batch_size_fn: samples in a micro-batch (default: leading dim of the first tensor).
        tokens_fn: tokens in a micro-batch (default: ``input_ids.numel()`` when there are input_ids);
            adds ``flops_profiler/tokens_per_sec``.
        causal_attention: "full" counts all of QK^T and AV for causal attention (FlopCounterMode,
            DeepSpeed, PaLM MFU); "half" only the unmasked part.
        throughput: log ``throughput/*`` at every logging step after the profiled one.
        peak_flops: dense peak FLOPS of one device, for ``flops_profiler/mfu``, ``hfu`` and
            ``throughput/mfu``. Default: the ``FLOPS_CALLBACKS_PEAK_FLOPS`` environment variable, else
            the table of :mod:`flops_callbacks.peaks` for the GPU and the training arguments' compute dtype
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
        self._tokens_fn = tokens_fn
        self.meter = (
            ThroughputMeter(self.profiler.batch_size_fn, self._meter_tokens, causal_attention)
            if throughput
            else None
        )
        self._metering = False  # this process meters throughput (the world process zero)
        self._meter_pending: tuple[StepResult, torch.nn.Module] | None = None
        self._trainer: weakref.ref[transformers.Trainer] | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._guarded: transformers.Trainer | None = None  # the Trainer whose training_step is wrapped
        self._guard: Callable[..., Any] | None = None  # the wrapper: the profiled step's guard or the meter's
        self._shadowed: Callable[..., Any] | None = None  # a user's own instance-level training_step
        self._batches: list[Any] = []  # the micro-batches of the profiled step, as the model got them
        self._batch_counted = False  # whether the current micro-batch's forward has been seen
        self._resumed_past = False

    @property
    def result(self) -> StepResult | None:
        """The profiled step (on every process), once it has run."""
        return self.profiler.result

    # --- Trainer events ----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._stop_unfinished()
        self._stop_metering()
        trainer = _calling_trainer()
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        step, profile_step = state.global_step, self.profiler.profile_step
        self._resumed_past = step > profile_step and self.profiler.result is None
        if not self._resumed_past or not state.is_world_process_zero:
            return
        if any(e.get("step") == profile_step and names.FWD_FLOPS in e for e in state.log_history):
            logger.info(
                f"HFFlopsCallback: resumed at step {step}; step {profile_step} was profiled before the "
                f"checkpoint (flops_profile_step{profile_step}.txt in that run's output dir). "
                "No profile runs in this run."
            )
        else:
            warnings.warn(
                f"HFFlopsCallback: resumed at step {step}, past profile_step={profile_step}: no profile "
                "runs in this run. Set profile_step >= the step you resume from.",
                stacklevel=2,
            )

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        sp = self.profiler
        if model is None or not sp.due(state.global_step):
            return
        trainer = self._trainer() if self._trainer is not None else None
        accelerator = getattr(trainer, "accelerator", None)
        parallel = parallel_sizes(args, model, getattr(accelerator, "state", None))
        self._batches, self._batch_counted = [], False
        self._metering = self.meter is not None and state.is_world_process_zero
        # Registered before the profiler's own hooks so that they run first: counting the batch is
        # not work of the model.
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
        ]
        try:
            if trainer is not None:
                self._guard_training_step(trainer)
            sp.begin(model, parallel, compute_dtype(args, model, accelerator))
        except BaseException:
            self._release()
            raise

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler.active:  # the next micro-batch starts
            self._batch_counted = False
            self.profiler.phase(FORWARD)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.profiler.active:
            self.profiler.phase(OPTIMIZER_STEP)
            self._unguard_training_step()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sp = self.profiler
        if not sp.active:
            return
        batches, self._batches = self._batches, []
        try:
            result = sp.finish(sp.profile_step)
        finally:
            self._release()
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            result.extra_lines.extend(_estimate_lines(trainer, batches, result))
        if state.is_world_process_zero:
            sp.publish(result, getattr(args, "logging_dir", None) or args.output_dir)
        self._log(trainer, result.metrics())
        model = kwargs.get("model")
        if self._metering and trainer is not None and model is not None:
            self._meter_pending = (result, model)  # the first interval starts when this step ends

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        meter, pending, self._meter_pending = self.meter, self._meter_pending, None
        trainer = self._trainer() if self._trainer is not None else None
        if meter is None or trainer is None:
            return
        if pending is not None:
            result, model = pending
            meter.start(result, model)
            self._wrap_training_step(trainer, lambda step: self._metered(step, meter, model))
        elif meter.started:
            meter.end_step()
            # DefaultFlowCallback, first in the list, has decided by now whether this step logs
            metrics = meter.metrics() if control.should_log else {}
            if metrics:
                self._log(trainer, metrics)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.meter is not None:
            self.meter.resume()

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._stop_unfinished()
        if self.meter is not None:
            self.meter.pause(evaluating=True)  # evaluation time is not training throughput

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._stop_unfinished()
        self._stop_metering()
        self._trainer = None
        sp = self.profiler
        if sp.result is None and not self._resumed_past and state.is_world_process_zero:
            warnings.warn(
                f"HFFlopsCallback: no optimizer step started at global step profile_step={sp.profile_step} "
                f"(training ended at global step {state.global_step}): no profile ran. "
                "Use a profile_step below max_steps.",
                stacklevel=2,
            )

    # --- model hooks (profiled step only) ----------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch._C._current_autograd_node() is not None:
            return  # the model re-run by activation checkpointing inside the backward
        sp = self.profiler
        sp.phase(FORWARD)
        if self._batch_counted:
            return  # the model called again in the same micro-batch
        self._batch_counted = True
        batch = kwargs or args
        if not self._batches and self._tokens_fn is None:
            sp.tokens_fn = _input_ids_tokens if _has_input_ids(batch) else None
        self._batches.append(batch)
        sp.add_batch(batch)

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch._C._current_autograd_node() is None:
            self.profiler.phase(BACKWARD)

    # --- exceptions of the profiled step ------------------------------------------------------------

    def _guard_training_step(self, trainer: transformers.Trainer) -> None:
        """Wrap ``trainer.training_step`` (an instance attribute, removed at the step's end) so that
        an exception in a forward or backward stops the profile before it propagates."""

        def guard(training_step: Callable[..., Any]) -> Callable[..., Any]:
            def guarded_training_step(*args: Any, **kwargs: Any) -> Any:
                if self._metering and self.meter is not None:
                    self.meter.observe(_inputs_of(args, kwargs))
                try:
                    return training_step(*args, **kwargs)
                except BaseException:
                    self.profiler.abort()
                    self._release()
                    raise

            return guarded_training_step

        self._wrap_training_step(trainer, guard)

    def _metered(
        self, training_step: Callable[..., Any], meter: ThroughputMeter, model: torch.nn.Module
    ) -> Callable[..., Any]:
        """``training_step`` telling the throughput meter each micro-batch (it measures new shapes)."""

        def metered_training_step(*args: Any, **kwargs: Any) -> Any:
            meter.begin_micro_batch(_inputs_of(args, kwargs), model)
            try:
                loss = training_step(*args, **kwargs)
            except BaseException:
                self._stop_metering()
                raise
            meter.end_micro_batch()
            return loss

        return metered_training_step

    def _wrap_training_step(
        self, trainer: transformers.Trainer, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Set ``trainer.training_step`` (an instance attribute) to ``wrap(training_step)``."""
        wrapper = wrap(trainer.training_step)
        self._shadowed = trainer.__dict__.get("training_step")
        self._guard = wrapper
        trainer.training_step = wrapper
        self._guarded = trainer

    def _stop_metering(self) -> None:
        """End continuous throughput: a measurement in progress stops, the training_step wrapper goes."""
        self._meter_pending = None
        if self.meter is not None and self.meter.started:
            self.meter.close()
            self._unguard_training_step()

    def _meter_tokens(self, batch: Any) -> int | None:
        if self._tokens_fn is not None:
            return self._tokens_fn(batch)
        return _input_ids_tokens(batch) if _has_input_ids(batch) else None

    def _unguard_training_step(self) -> None:
        trainer, self._guarded = self._guarded, None
        if trainer is None or trainer.__dict__.get("training_step") is not self._guard:
            return
        if self._shadowed is None:
            del trainer.training_step
        else:
            trainer.training_step = self._shadowed

    def _release(self) -> None:
        """Remove the adapter's hooks and its training-step guard (the profiler removes its own)."""
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()
        self._unguard_training_step()

    def _stop_unfinished(self) -> None:
        """Stop a profile left running by an exception after the last backward of the step."""
        if self.profiler.active:
            self.profiler.abort()
            self._release()
            self._batches = []
            warnings.warn(
                f"HFFlopsCallback: the step at profile_step={self.profiler.profile_step} did not finish "
                "(an exception?): no profile.",
                stacklevel=3,
            )

    # --- results -------------------------------------------------------------------------------------

    def _log(self, trainer: transformers.Trainer | None, metrics: dict[str, float]) -> None:
        # Why through Trainer.log, right after the step: the reporting callbacks (TensorBoard, W&B,
        # ...) come before user callbacks in the Trainer's list and all get the same `logs` dict in
        # on_log, so keys added in our own on_log arrive after they have written. Moving ourselves to
        # the front of the list and adding keys to the Trainer's next log would only work when a log
        # falls on the profiled step, and setting control.should_log to get one would add loss logs
        # the run would not have had. Trainer.log hands our dict to every callback the user has, in
        # their order, and appends it to state.log_history, at step profile_step (global_step counts
        # up after on_optimizer_step). The base class's log, not a subclass's: TRL's log, e.g., merges
        # and clears its accumulated metrics, which would then be folded into ours. The Trainer's
        # on_log clears control.should_log; we restore it, so that the loss is logged at exactly the
        # steps it would be without us. Callbacks get no reference to their Trainer: on_train_begin
        # finds it on the call stack (_calling_trainer).
        if trainer is None:
            warnings.warn(
                "HFFlopsCallback: no Trainer found calling this callback: the flops_profiler/* metrics "
                "are in the report and its JSON only.",
                stacklevel=3,
            )
            return
        should_log = trainer.control.should_log
        transformers.Trainer.log(trainer, dict(metrics))
        trainer.control.should_log = should_log


def _estimate_lines(
    trainer: transformers.Trainer, batches: list[Any], result: StepResult
) -> list[tuple[str, str]]:
    """The Trainer's own flops estimate of the step's micro-batches beside the measured flops."""
    estimate = sum(trainer.floating_point_ops(b) for b in batches if isinstance(b, dict))
    if not estimate:
        return []
    measured = result.profile.fwd_flops + result.profile.bwd_flops
    return [
        ("Trainer's estimate (6 x non-embedding params x tokens)", number_to_string(estimate)),
        ("measured fwd + bwd flops vs Trainer's estimate", f"{(measured - estimate) / estimate * 100:+.1f}%"),
    ]
