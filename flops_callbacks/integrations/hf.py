"""Hugging Face Trainer adapter: ``HFFlopsCallback`` maps Trainer events onto a :class:`StepSession`.

Everything measured lives in :mod:`flops_callbacks.session.step_session`; this module only knows which
Trainer event
(or call of the Trainer's, where it has no event) starts which phase, where the parallel sizes and
the compute dtype are, and how the metrics reach the Trainer's reporting callbacks.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
from typing_extensions import override

try:
    import transformers
    from tqdm.auto import tqdm
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import TensorBoardCallback, WandbCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
except ImportError as err:  # the core needs only torch; the HF callback is an extra
    raise ImportError(
        "HFFlopsCallback needs transformers: pip install transformers accelerate "
        "(from a checkout of flops_callbacks: pip install '.[hf]')"
    ) from err

from flops_callbacks import metrics as names
from flops_callbacks.integrations.accelerate_state import compute_dtype, parallel_sizes
from flops_callbacks.integrations.callback_base import SessionCallback, input_ids_tokens
from flops_callbacks.integrations.wrapped_method import WrappedMethod, silenced
from flops_callbacks.metrics import FWD_FLOPS
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.profile import Profile
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.off_clock import Replay
from flops_callbacks.units import number_to_string, params_to_string
from flops_callbacks.user_warning import warn

__all__ = ["compute_dtype", "HFFlopsCallback", "parallel_sizes"]


def _calling_trainer() -> transformers.Trainer | None:
    """The Trainer whose callback event is running: the first ``self`` up the stack that is one.

    Callback events receive args, state, control and a few objects, never the Trainer itself, and
    the adapter needs it twice: to log through it and to see exceptions of its training step.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


class _Sink:
    """Where the session's results go in the HF Trainer: its log path, its output dir, its console."""

    def __init__(self, trainer: transformers.Trainer | None, args: Any, state: TrainerState) -> None:
        self.trainer = trainer
        self.args = args
        self.is_logging_rank = state.is_world_process_zero

    def log_dir(self) -> str | None:
        return getattr(self.args, "logging_dir", None) or self.args.output_dir

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Why as Trainer.log logs: the reporting callbacks (TensorBoard, W&B, ...) come before user
        # callbacks and all get the same `logs` dict in on_log, so keys added in our own on_log arrive
        # after they have written. Trainer.log appends the dict to state.log_history at the current
        # global step and hands it to every callback, in their order; its two lines are run here, not
        # Trainer.log itself, which adds `epoch` and `num_input_tokens_seen` (the reporters logged
        # those at this step already: a second point each, a second W&B row), nor a subclass's (TRL's
        # merges its own accumulated metrics into any log). The console printers are left out of the
        # call (their one long dict line per log is noise; the report says it), and should_log is
        # restored so the loss is logged at exactly the steps it would be.
        trainer = self.trainer
        if trainer is None:
            warn(
                "HFFlopsCallback: no Trainer found calling this callback: the metrics are in the report "
                "and its JSON only.",
            )
            return
        handler, should_log = trainer.callback_handler, trainer.control.should_log
        callbacks = handler.callbacks
        handler.callbacks = [c for c in callbacks if not isinstance(c, (ProgressCallback, PrinterCallback))]
        try:
            logs, state = dict(metrics), trainer.state
            state.log_history.append({**logs, "step": state.global_step})
            trainer.control = handler.on_log(trainer.args, state, trainer.control, logs)
        finally:
            handler.callbacks = callbacks
            trainer.control.should_log = should_log

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        callbacks = self.trainer.callback_handler.callbacks if self.trainer is not None else []
        for callback in callbacks:
            writer = getattr(callback, "tb_writer", None)  # TensorBoardCallback, once training began
            if isinstance(callback, TensorBoardCallback) and writer is not None and markdown is not None:
                writer.add_text(names.REPORT, markdown, global_step=step)
            wandb: Any = getattr(callback, "_wandb", None)  # WandbCallback: the wandb module, once set up
            if isinstance(callback, WandbCallback) and getattr(wandb, "run", None) is not None and html:
                wandb.log({names.PICTURE: wandb.Html(html)}, commit=False)

    def console(self, text: str) -> None:
        tqdm.write(text)  # above the Trainer's progress bar, which stays intact


class HFFlopsCallback(SessionCallback, TrainerCallback):
    """Profiles a short window of optimizer steps of a ``transformers.Trainer`` run: a console summary,
    the full DeepSpeed-style report in the log dir, metrics in every reporting backend of the Trainer.

    ``Trainer(..., callbacks=[HFFlopsCallback(profile_step=10)])``. The window starts at the first
    optimizer step at or after ``state.global_step == profile_step`` (all its
    ``gradient_accumulation_steps`` micro-batches); its steps are laid out in the docs' "How counting and
    timing work" page. At its end the world process zero prints the summary above the progress bar (or
    writes the report to ``output_file``), writes the report, a JSON, a picture and a trace as
    ``flops_profile_step{N}.*`` into ``args.logging_dir`` (``args.output_dir`` in transformers 5), and
    logs the ``flops_profiler/*`` metrics once as ``Trainer.log`` logs, at that global step: they are in
    ``state.log_history`` and the Trainer's TensorBoard / W&B / MLflow callbacks write them as
    ``train/flops_profiler/*``. After the window, at every logging event of the run, ``throughput/*``,
    evaluation left out from its first instruction to its last.

    The Trainer has no event that carries the batch, none between forward and backward, and none for
    an exception, so for each micro-batch of a window step (and of metered steps) the adapter sets
    ``trainer.training_step`` to a wrapper, an instance attribute that removes itself when the call
    starts (:class:`~flops_callbacks.integrations.wrapped_method.WrappedMethod`); inside it,
    ``trainer.compute_loss`` likewise marks the start and the end of the forward. Everything the
    profiler runs lives inside that call and is removed in its ``finally``: an exception anywhere
    (forward, backward, clipping, ``optimizer.step()``, another callback) leaves nothing behind, but for
    one case: a callback after ours that raises in ``on_step_begin`` (or ``on_substep_end``, where ours
    wraps the next micro-batch) leaves the wrapper itself (docs: "When something fails").
    ``batch_size_fn`` and ``tokens_fn`` receive the Trainer's ``inputs`` dict; without ``tokens_fn``,
    inputs with an ``input_ids`` tensor count ``input_ids.numel()`` tokens (padding included, as the
    Trainer's ``num_input_tokens_seen`` does).

    Phases, on the device's synchronized clock:

    * forward: ``compute_loss`` (the forward and the loss). ``training_step``'s work before it
      (``model.train()``, which walks every module, and the move of the inputs) is no phase's.
    * backward: from there to ``on_pre_optimizer_step``: ``accelerator.backward`` (with the gradient
      all-reduce), the Trainer's bookkeeping of the micro-batch, gradient clipping.
    * optimizer step: ``on_pre_optimizer_step`` -> ``on_optimizer_step``: ``optimizer.step()`` only.
      Under DeepSpeed through accelerate, ``accelerator.backward`` runs the engine's optimizer step
      too: the update's time is in the backward phase. We report what ran.

    For models the Trainer estimates flops for (``Trainer.floating_point_ops``: 6 x non-embedding
    params x tokens), the report prints that estimate beside the measured fwd + bwd flops.

    Args:
        **options: The fields of :class:`~flops_callbacks.options.Options`, described there once.
    """

    default_tokens_fn = staticmethod(input_ids_tokens)  # type: ignore[assignment]
    _trainer: weakref.ref[transformers.Trainer] | None = None
    _held = 0  # on_evaluate (one per evaluation set) and on_save events to come before the clocks resume
    _ended_step: int | None = None  # the global step whose on_step_end came last (None: a step runs)
    _logged_step: int | None = None  # the global step throughput/* was logged at last
    _ended = False  # the run's last step ended it (its window published): on_train_end has nothing to end

    def _current_trainer(self) -> transformers.Trainer | None:
        return self._trainer() if self._trainer is not None else None

    def _sink(self, args: Any, state: TrainerState) -> _Sink:
        return _Sink(self._current_trainer(), args, state)

    # --- Trainer events ----------------------------------------------------------------------------

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._unwrap()
        self._ended, self._held, self._ended_step, self._logged_step = False, 0, None, None
        trainer = _calling_trainer()
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        profile_step = self.session.options.profile_step
        profiled_before = any(e.get("step", -1) >= profile_step and FWD_FLOPS in e for e in state.log_history)
        self.session.train_start(
            state.global_step,
            max_steps=state.max_steps or None,
            profiled_before=profiled_before,
            is_logging_rank=state.is_world_process_zero,
            log_dir=self._sink(args, state).log_dir(),
        )
        if (
            self.session.meter is not None
            and getattr(args, "logging_strategy", "steps") == "no"  # a str enum ("IntervalStrategy.NO")
            and state.is_world_process_zero
        ):
            warn(
                "HFFlopsCallback: logging_strategy='no': the run never logs, so throughput/* is never "
                "logged. Pass throughput=False to silence this, or log by steps or epochs.",
            )

    @override
    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self._evaluated()
        self._ended_step = None
        trainer = self._current_trainer()
        if model is None or trainer is None:
            return
        self.session.step_start(
            state.global_step,
            model,
            lambda: _context(trainer, args, model),
            runs=getattr(trainer, "model_wrapped", None),  # accelerate's compiled / parallel wrapper
        )
        self._wrap_next_micro_batch(trainer)

    @override
    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self._current_trainer()
        if trainer is not None:
            self._wrap_next_micro_batch(trainer)

    @override
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.phase(OPTIMIZER_STEP)

    @override
    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.stop_timing()  # the LR scheduler and zero_grad are not part of the step

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._unwrap()
        # DefaultFlowCallback, first in the list, has decided by now whether this step logs / evaluates
        sink = self._sink(args, state)
        self._ended_step = state.global_step  # a window's step logs nothing (nor its last: the meter starts)
        logs = control.should_log or self.session.window_open
        self._logged_step = state.global_step if logs else self._logged_step
        self.session.step_end(state.global_step, sink, logs=control.should_log)
        last = control.should_training_stop or 0 < state.max_steps <= state.global_step
        if last and self.session.window_open:
            # a window the run's end cut short is published now, while the reporting callbacks still log
            # (theirs on_train_end, before ours, ends an MLflow run, closes a TensorBoard writer)
            self._ended = True
            self.session.train_end(state.global_step, sink)
        self._hold(control)

    @override
    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The step's log is written (the reporting backends' ``on_log`` come before ours): the wait for the
        next batch starts here, the writing is the step's other (an evaluation's or a save's log is in its
        pause already). The step's training log (its ``loss``) where ours logged nothing: a callback after
        ours set ``should_log`` at the step's end; ``throughput/*`` is logged now."""
        self._publish_if_stopping(args, state, control)  # the run's last log: before the reporters' train end
        logs = kwargs.get("logs")
        step = state.global_step
        if isinstance(logs, Mapping) and "loss" in logs and self._ended_step == step != self._logged_step:
            self._logged_step = step
            self.session.log_throughput(step, self._sink(args, state))
        if not self._held:
            self.session.fetching()

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._publish_if_stopping(args, state, control)
        if control.should_log:  # logging_strategy="epoch"
            self._logged_step = state.global_step
            self.session.log_throughput(state.global_step, self._sink(args, state))
        self._hold(control)

    def _hold(self, control: TrainerControl) -> None:
        """An evaluation and a checkpoint's save are not the run's training (nor a window step's data or
        wall): the clocks pause until the last ``on_evaluate`` (one per evaluation set: a dict of them is
        evaluated set by set) and the ``on_save`` that follow. One decided after this (by a callback after
        ours, or a save by the evaluation: ``save_strategy="best"``) is taken out when it ends
        (:meth:`_release`)."""
        held = 0
        if control.should_evaluate:
            sets = getattr(self._current_trainer(), "eval_dataset", None)
            held = len(sets) if isinstance(sets, Mapping) and sets else 1
        held += 1 if control.should_save else 0
        if held:
            self._held = held
            self.session.pause_throughput()

    @override
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._release()
        self._publish_if_stopping(args, state, control)

    @override
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._release()
        self._publish_if_stopping(args, state, control)

    def _publish_if_stopping(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> None:
        """A stop decided after our ``on_step_end`` (``EarlyStoppingCallback`` at an evaluation, at a step's
        or an epoch's end; a callback after ours): a window it cut short is published at our next event, at
        the latest the run's last log, while the reporting callbacks still log (their ``on_train_end`` comes
        before ours: it ends an MLflow run and closes a TensorBoard writer, and a later log opens others)."""
        if control.should_training_stop and self.session.window_open and not self._ended:
            self._ended = True
            self.session.train_end(state.global_step, self._sink(args, state))

    def _release(self) -> None:
        """An evaluation (of one set) or a save ended. One not announced at our ``on_step_end`` ran from
        there (or from the last one's end) to here: that span is paused after the fact."""
        if self._held > 0:
            self._held -= 1
            if not self._held:
                self.session.resume_throughput()
        elif self._ended_step is not None:  # between steps (not an evaluation before the first, nor after)
            self.session.pause_throughput(late=True)
            self.session.resume_throughput()

    def _evaluated(self) -> None:
        """A step starts: any evaluation or save before it has ended (resumed here where their events fell
        short: an evaluation loop of a subclass's own)."""
        if self._held:
            self._held = 0
            self.session.resume_throughput()

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._unwrap()
        if not self._ended:  # a run ended before its last step (an exception's is closed, not ended)
            self.session.train_end(state.global_step, self._sink(args, state))
        self._trainer, self._ended, self._ended_step = None, False, None

    # --- the micro-batch scope -----------------------------------------------------------------------

    def _wrap_next_micro_batch(self, trainer: transformers.Trainer) -> None:
        """Wrap ``trainer.training_step`` for one call when the session wants the micro-batch."""
        self._unwrap()
        if self.session.wants_batches:
            self._training_step = WrappedMethod(
                trainer, "training_step", lambda step, a, kw: self._micro_batch(trainer, step, a, kw)
            )

    def _micro_batch(
        self, trainer: transformers.Trainer, training_step: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        session = self.session

        def forward_then_backward(compute_loss: Callable[..., Any], a: tuple, kw: dict) -> Any:
            session.phase(FORWARD)  # model.train() and the move of the inputs before it are no phase's
            out = compute_loss(*a, **kw)
            session.phase(BACKWARD)
            return out

        marked: WrappedMethod | None = None  # compute_loss, wrapped for the whole training_step
        try:
            inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
            session.micro_batch_start(
                inputs, _replay(trainer, inputs, args[2:3] or (kwargs.get("num_items_in_batch"),))
            )
            if session.window_open:
                marked = WrappedMethod(trainer, "compute_loss", forward_then_backward, once=False)
            return training_step(*args, **kwargs)
        except BaseException:
            session.guard.closing(session.close)
            raise
        finally:
            if marked is not None:
                marked.remove()
            session.micro_batch_end(pause=False)


def _replay(trainer: transformers.Trainer, inputs: Any, rest: tuple) -> Replay | str:
    """The Trainer's own ``training_step`` (forward, ``compute_loss``, the accelerator's backward) on
    one micro-batch again, with the unwrapped model (a wrapper's hooks would communicate); or why not."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "the DeepSpeed engine runs the backward"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "parameters sharded by FSDP"
    if "lomo" in str(getattr(trainer.args, "optim", "")).lower():
        return "a LOMO optimizer steps inside the backward"
    return Replay(_TrainingStep(trainer), (inputs, *rest))


class _TrainingStep:
    """``trainer.training_step(model, inputs, num_items_in_batch)``, as a step function: ``self.log`` says
    nothing of it (its values are fake; a log is written to the reporters and ``log_history`` at once)."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = self.owner = trainer  # owner: its attributes kept (fake_count)

    @property
    def kept(self) -> list[Any]:
        """What a ``compute_loss`` may change besides the model and the trainer, kept too (fake_count): the
        trainer's state (a counter of one's own on ``self.state``) and control."""
        return [self.trainer.state, self.trainer.control]

    def __call__(self, model: torch.nn.Module, args: tuple) -> Any:
        quiet = WrappedMethod(self.trainer, "log", silenced, once=False)
        try:
            return self.trainer.training_step(model, *args)
        finally:
            quiet.remove()


def _context(trainer: transformers.Trainer, args: Any, model: torch.nn.Module) -> TrainingContext:
    accelerator = getattr(trainer, "accelerator", None)
    return TrainingContext(
        parallel_sizes(args, model, getattr(accelerator, "state", None)),
        compute_dtype(args, model, accelerator),
        extra_lines=lambda batches, profile: _estimate_lines(trainer, batches, profile),
    )


def _estimate_lines(
    trainer: transformers.Trainer, batches: list[Any], profile: Profile
) -> list[tuple[str, str]]:
    """The Trainer's own flops estimate of the counting step's micro-batches beside the measured flops."""
    estimate = sum(trainer.floating_point_ops(dict(b)) for b in batches if isinstance(b, Mapping))
    if not estimate:
        return []
    measured = profile.fwd_flops + profile.bwd_flops
    value = number_to_string(estimate)
    # the numbers it is made of: its N leaves every table out, a token table tied to the LM head too
    # (which the "6 x non-embedding params x tokens" row keeps: the head multiplies by it)
    count = getattr(trainer.model, "num_parameters", None)
    params = count(exclude_embeddings=True) if callable(count) else 0
    if isinstance(params, int) and params > 0 and estimate % (6 * params) == 0:
        value += f" = 6 x {params_to_string(params)} x {estimate // (6 * params)}"
    return [
        ("Trainer's estimate (floating_point_ops: 6 x params less every embedding table x tokens)", value),
        ("measured fwd + bwd flops vs Trainer's estimate", f"{(measured - estimate) / estimate * 100:+.1f}%"),
    ]
