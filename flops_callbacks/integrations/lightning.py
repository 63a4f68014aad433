"""Lightning adapter: ``FlopsProfilerCallback`` maps Trainer hooks onto a :class:`StepSession`.

Everything measured lives in :mod:`flops_callbacks.session.step_session`; this module only knows which
Lightning
hook starts which phase, where the parallel sizes and the compute dtype are, and where the results go
(``trainer.loggers``, the log directory and the progress bar's console).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

import torch
from typing_extensions import override

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as err:  # the core needs only torch; the Lightning callback is an extra
    raise ImportError(
        "FlopsProfilerCallback needs Lightning: pip install lightning "
        "(from a checkout of flops_callbacks: pip install '.[lightning]')"
    ) from err

from flops_callbacks import metrics as names
from flops_callbacks.integrations.callback_base import SessionCallback
from flops_callbacks.integrations.strategy_state import precision_dtype, strategy_sizes
from flops_callbacks.integrations.wrapped_method import WrappedMethod, silenced
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.session.adapter_api import TrainingContext
from flops_callbacks.session.off_clock import Replay
from flops_callbacks.user_warning import warn

__all__ = ["compute_dtype", "FlopsProfilerCallback", "parallel_sizes"]


def parallel_sizes(trainer: pl.Trainer) -> ParallelSizes:
    """How ``trainer``'s strategy splits the run (:func:`~flops_callbacks.integrations.strategy_state.
    strategy_sizes`): the sampler's replicas, ``ModelParallelStrategy``'s mesh, DeepSpeed's engine."""
    strategy = trainer.strategy
    mesh = strategy.device_mesh if isinstance(strategy, ModelParallelStrategy) else None
    # the DeepSpeedEngine (a PipelineEngine under pipeline parallelism)
    engine = strategy.model if isinstance(strategy, DeepSpeedStrategy) else None
    return strategy_sizes(trainer.world_size, trainer.distributed_sampler_kwargs, mesh, engine)


def compute_dtype(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """What the matmuls run in, from the precision plugin (:func:`~flops_callbacks.integrations.
    strategy_state.precision_dtype`)."""
    return precision_dtype(str(trainer.precision), pl_module)


def _logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers plot this batch's metrics at: the batches that stepped before it (at
    ``on_train_batch_end``, one behind ``global_step`` after an optimizer step; one a batch however many
    optimizers step in it). No public property holds it; Lightning's ``LearningRateMonitor`` reads the
    same counter. ``global_step`` where a Lightning lacks it."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) else trainer.global_step


def _logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning's loggers log this batch's metrics, asked at ``on_train_batch_end``, as its logger
    connector decides right after it (every ``log_every_n_steps`` batches that stepped by its count, and
    each batch once training should stop; manual optimization's batches log whether or not one stepped);
    the count alone where a Lightning lacks the property."""
    found = getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", None)
    if isinstance(found, bool):
        return found
    every = trainer.log_every_n_steps
    return bool(every) and (_logging_step(trainer) + 1) % every == 0


class _Sink:
    """Where the session's results go in Lightning: the Trainer's loggers (at Lightning's own logging
    step, :func:`_logging_step`, so that our points line up with the run's), its log dir, its console."""

    def __init__(self, trainer: pl.Trainer, ended: bool = False) -> None:
        self.trainer = trainer
        self.is_logging_rank = trainer.is_global_zero
        # at the run's end the counter has passed its last batch: Lightning logs its epoch-end metrics one
        # back too, at the last batch's step (its fit loop's ``on_advance_end``)
        self._back = int(ended)

    def _step(self) -> int:
        return max(_logging_step(self.trainer) - self._back, 0)

    def log_dir(self) -> str | None:
        return self.trainer.log_dir or self.trainer.default_root_dir

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Straight to the loggers: pl_module.log would re-emit a one-shot value at later steps.
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self._step())
            logger.save()

    def log_report(self, markdown: str | None, html: str | None, step: int) -> None:
        for logger in self.trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and markdown is not None:
                logger.experiment.add_text(names.REPORT, markdown, global_step=self._step())
            elif isinstance(logger, WandbLogger) and html is not None:
                import wandb

                logger.experiment.log({names.PICTURE: wandb.Html(html)}, commit=False)

    def console(self, text: str) -> None:
        bar: Any = self.trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            bar.print(text)  # tqdm.write for TQDM, the Rich console for Rich: the bar stays intact
        else:
            print(text)


class FlopsProfilerCallback(SessionCallback, pl.Callback):
    """Profiles a short window of optimizer steps of a Lightning run: a console summary, the full
    DeepSpeed-style report in the log dir, metrics in every logger.

    ``Trainer(callbacks=[FlopsProfilerCallback(profile_step=10)])``. The window starts at the first
    optimizer step at or after ``trainer.global_step == profile_step`` (all its
    ``accumulate_grad_batches`` micro-batches, automatic or manual optimization); its steps are laid
    out in the docs' "Counting and timing" page. At its end rank 0 prints the summary through
    the progress bar (or writes the report to ``output_file``), writes the report, a JSON, a picture and
    a trace as ``flops_profile_step{N}.*`` into ``trainer.log_dir``, and logs the ``flops_profiler/*``
    metrics (:mod:`flops_callbacks.metrics`) once, at that global step, to every logger. After the
    window, at every logging step, rank 0 logs ``throughput/*``.

    Phases, on the device's synchronized clock, as Lightning 2.6 calls the hooks:

    * forward: the strategy's ``training_step`` (the user's forward and loss, in the precision's
      autocast), wrapped for one call (:class:`~flops_callbacks.integrations.wrapped_method.WrappedMethod`).
      Lightning's work around it (the optimizer's closure, ``zero_grad``) is no phase's.
    * backward: ``on_before_backward`` -> ``on_before_optimizer_step`` (or the end of a micro-batch
      that only accumulates): the backward with its gradient all-reduce, ``on_after_backward``,
      GradScaler's unscale.
    * optimizer step: ``on_before_optimizer_step`` -> the strategy's ``optimizer_step`` returns (automatic
      optimization; manual: ``training_step`` returns): clipping, the update.
    * data: from Lightning's start of the next batch's fetch (its data fetcher's profiler start) to its
      forward; what runs after our ``on_train_batch_end`` before it (later callbacks' such as
      ``ModelCheckpoint``'s save, logging) is the step's other.

    In automatic optimization the strategy's ``backward`` and ``optimizer_step`` are wrapped for a window
    micro-batch too (instance attributes, removed at its end): what those calls raise (but a
    ``dataloader_iter``'s ``StopIteration``) closes the window at once, before any callback's
    ``on_exception``, which Lightning calls in turn with no ``try``; other exceptions reach ours there
    (docs: "When something fails").

    In manual optimization, a backward starts at ``on_before_backward`` (``manual_backward``) or, for a plain
    ``loss.backward()``, where ``torch.autograd.backward`` is called (wrapped for a window micro-batch, as
    ``StepProfiler`` does); ``on_after_backward`` and the end of each ``optimizer.step()`` end a phase,
    and the next event says what ran in between: a backward starting next means a forward ran (a GAN's
    second model, a second chunk); otherwise the phase continues (:mod:`flops_callbacks.timing.phases`).

    Args:
        **options: The fields of :class:`~flops_callbacks.options.Options`, described there once.
    """

    _step_at_batch_start: int | None = None  # the global step of the optimizer step in progress
    _step_hooks: tuple[Any, ...] | list[Any] = ()  # manual optimization: optimizer step post hooks
    _profiled_step: int | None = None  # kept in checkpoints: a resumed run knows it ran
    _guards: tuple[WrappedMethod, ...] = ()  # a window micro-batch's wrapped calls (strategy, autograd)
    _in_manual_backward = False  # between on_before_backward and on_after_backward
    _thread: int | None = None  # the thread of the window micro-batch (manual optimization)
    _module_hook: WrappedMethod | None = None  # the module's on_train_batch_start, wrapped till it returns
    _iterating = False  # training_step(dataloader_iter): the step fetches its own batches
    _fetched: Any = None  # then: the last batch Lightning handed our hook (an epoch's first step hands None)
    _unseen: int | None = None  # then: the run's first step, handed no batch: its global step, unprofiled

    def state_dict(self) -> dict[str, Any]:
        return {"profiled_step": self._profiled_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._profiled_step = state_dict.get("profiled_step")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_step()
        step = pl_module.training_step  # Lightning's own test for the flavour (its data fetcher's choice)
        self._iterating = is_param_in_hook_signature(step, "dataloader_iter", explicit=True)
        self._fetched = self._unseen = None
        if self._iterating and trainer.is_global_zero:
            warn(
                f"{self.session.owner}: training_step(dataloader_iter) fetches its batches inside the step, "
                "where no callback sees them: samples and tokens count the batch Lightning hands "
                "on_train_batch_start (the last one fetched before the step), one a step. A step that "
                "fetches k batches: pass batch_size_fn (and tokens_fn) returning k times a batch's."
            )
        self.session.train_start(
            trainer.global_step,
            max_steps=_run_length(trainer),
            profiled_before=self._profiled_step is not None,
            profiled_step=self._profiled_step,
            is_logging_rank=trainer.is_global_zero,
            # manual optimization: every optimizer's step() adds one to global_step
            steps_per_batch=1 if pl_module.automatic_optimization else max(len(trainer.optimizers), 1),
            log_dir=_Sink(trainer).log_dir(),  # a collective: every rank asks
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if is_overridden("on_train_batch_start", pl_module):
            # the module's own hook comes after ours and may return -1: the epoch's rest is skipped, this
            # batch never trains. The micro-batch starts once the hook has returned anything else.
            around = partial(self._unless_skipped, trainer, pl_module, batch, batch_idx)
            self._module_hook = WrappedMethod(pl_module, "on_train_batch_start", around)
        else:
            self._batch_start(trainer, pl_module, batch, batch_idx)

    def _unless_skipped(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        hook: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        response = hook(*args, **kwargs)
        if not (isinstance(response, int) and response == -1):  # Lightning's own test: ``response == -1``
            self._batch_start(trainer, pl_module, batch, batch_idx)
        return response

    def _batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        session = self.session
        first = batch is None and self._fetched is None  # the run's first step: no batch, none before it
        if self._iterating and (first or self._unseen == trainer.global_step):
            self._unseen = trainer.global_step  # unseen, all its micro-batches (a window starts after it)
            return
        if self._step_at_batch_start is None:  # the first micro-batch of an optimizer step
            self._step_at_batch_start = trainer.global_step
            session.step_start(trainer.global_step, pl_module, lambda: _context(trainer, pl_module))
            if session.window_open and not pl_module.automatic_optimization:
                hooks = [opt.register_step_post_hook(self._after_step) for opt in trainer.optimizers]
                self._step_hooks = hooks
        if self._iterating:  # an epoch's first step is handed None: the batch before it stands for it
            batch = self._fetched = self._fetched if batch is None else batch
            session.micro_batch_start(batch, "training_step(dataloader_iter) fetches its own batches")
        else:
            session.micro_batch_start(batch, _replay(trainer, pl_module, batch, batch_idx))
        self._unwrap()
        self._unguard()
        if session.window_open:
            strategy = trainer.strategy
            self._training_step = WrappedMethod(strategy, "training_step", self._user_code)
            # automatic optimization: the backward and the optimizer step are Lightning's (manual: the user's
            # training_step calls them and may catch what they raise; its own guard sees what it does not)
            if pl_module.automatic_optimization:
                # the calls its work runs in besides training_step (the backward, the optimizer step with
                # clipping and the closure): what they raise closes the window there; the step's return ends
                # the timed part
                self._guards = tuple(
                    WrappedMethod(strategy, name, around, once=False)
                    for name, around in (("backward", self._closing), ("optimizer_step", self._stepping))
                )
            else:  # a plain ``loss.backward()`` calls no hook of Lightning's: where autograd starts is seen
                self._thread = threading.get_ident()
                autograd = WrappedMethod(torch.autograd, "backward", self._autograd_backward, once=False)
                self._guards = (autograd,)

    def _user_code(self, training_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The strategy's ``training_step``: the forward restarts at the user's code and the phases stop
        when it returns; the optimizer's closure around it and ``zero_grad`` after it are no phase's.
        What it raises closes the window here, before any callback's ``on_exception``: Lightning calls
        those in turn with no ``try``, so one that raises before ours would leave our hooks and modes."""
        self.session.phase(FORWARD)
        out = self._closing(training_step, args, kwargs)
        self.session.stop_timing()
        return out

    def _closing(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The strategy's call, run; what it raises closes the window first (:meth:`_user_code`), but for
        ``StopIteration``: a ``training_step(dataloader_iter)``'s end of data, which Lightning catches to
        end the epoch, and the run goes on."""
        try:
            return call(*args, **kwargs)
        except StopIteration:
            raise
        except BaseException:
            self.session.guard.closing(self._close)
            raise

    def _stepping(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The strategy's optimizer step (its closure runs the forward and backward first): the step's timed
        part ends where it returns; Lightning's LR schedulers and the callbacks before ours are its other."""
        out = self._closing(call, args, kwargs)
        self.session.stop_timing()
        return out

    def _autograd_backward(self, backward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Manual optimization: autograd starts outside ``manual_backward`` (a plain ``loss.backward()``,
        which Lightning's docs advise against and users write): the backward starts here, as there. It
        read 0 s, its time the forward's."""
        if not self._in_manual_backward and threading.get_ident() == self._thread:
            self.session.phase(BACKWARD)
        return backward(*args, **kwargs)

    def _watch_fetch(self, trainer: pl.Trainer) -> None:
        """Until the next micro-batch starts: mark where Lightning starts fetching it, so that the wait for
        data starts there, not at our batch end (the callbacks after ours, a checkpoint's save, logging: the
        step's other). Lightning has no event there: its data fetcher's profiler start, an instance
        attribute its epoch loop sets (one it sets again at an epoch's start puts ours away)."""
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if self.session.window_open and "_start_profiler" in getattr(fetcher, "__dict__", {}):
            self._guards = (*self._guards, WrappedMethod(fetcher, "_start_profiler", self._fetching))

    def _fetching(self, start: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.session.fetching()
        return start(*args, **kwargs)

    def _unguard(self) -> None:
        guards, self._guards = self._guards, ()
        for guard in guards:
            guard.remove()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.session.phase_end()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._in_manual_backward = True
        self.session.phase(BACKWARD)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_manual_backward = False
        self.session.phase_end()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.session.phase(OPTIMIZER_STEP)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._unguard()
        session = self.session
        session.micro_batch_end(pause=True)  # validation may run before the next micro-batch
        if self._unseen is not None:  # a micro-batch of the unseen first step
            self._unseen = self._unseen if trainer.global_step == self._unseen else None
            return self._watch_fetch(trainer)
        if trainer.global_step == self._step_at_batch_start:  # gradients accumulate: no optimizer step yet
            if not pl_module.automatic_optimization:  # Lightning logs such a batch too
                if _logs(trainer):
                    session.log_throughput(trainer.global_step, _Sink(trainer))
                else:
                    self._watch_logging(trainer)
            return self._watch_fetch(trainer)
        self._end_step()
        logs = _logs(trainer)
        session.step_end(trainer.global_step, _Sink(trainer), logs=logs)
        if session.result is not None and self._profiled_step is None:
            self._profiled_step = session.result.step
        if not logs:
            self._watch_logging(trainer)
        self._watch_fetch(trainer)

    def _watch_logging(self, trainer: pl.Trainer) -> None:
        """A batch Lightning does not log by its count: logged all the same where a callback after ours (or
        the module's hook) tells training to stop at its end (``max_time``'s Timer), as Lightning decides
        in its logger connector's next call, wrapped for it (no event between the hooks and it)."""
        connector = getattr(trainer, "_logger_connector", None)
        if trainer.log_every_n_steps and hasattr(connector, "update_train_step_metrics"):
            step = trainer.global_step
            around = partial(self._log_if_logged, trainer, connector, step)
            self._guards = (*self._guards, WrappedMethod(connector, "update_train_step_metrics", around))

    def _log_if_logged(
        self,
        trainer: pl.Trainer,
        connector: Any,
        step: int,
        update: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        if connector.should_update_logs is True:
            self.session.log_throughput(step, _Sink(trainer))
        return update(*args, **kwargs)

    def _end_step(self) -> None:
        self._unwrap()
        self._unguard()
        if self._module_hook is not None:  # a fault between our hook and the module's left it wrapped
            self._module_hook.remove()
        self._step_at_batch_start = None
        hooks, self._step_hooks = self._step_hooks, ()
        for handle in hooks:
            handle.remove()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.session.pause_throughput()  # validation time is not training throughput

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.session.resume_throughput()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.session.guard.closing(self._close)  # Lightning re-raises the exception itself

    def _close(self) -> None:
        """An exception ends the run: nothing of the profiler's stays (idempotent)."""
        try:
            self.session.close()
        finally:
            self._end_step()
            self._fetched = None  # the user's data is not held

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_step()
        self._fetched = None
        self.session.train_end(trainer.global_step, _Sink(trainer, ended=True))
        if self.session.result is not None and self._profiled_step is None:
            self._profiled_step = self.session.result.step


def _context(trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainingContext:
    return TrainingContext(parallel_sizes(trainer), compute_dtype(trainer, pl_module))


def _run_length(trainer: pl.Trainer) -> int | None:
    """Optimizer steps the run will take, when Lightning knows it at train start."""
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        return int(trainer.max_steps)
    try:
        steps = trainer.estimated_stepping_batches
    except Exception:  # an iterable dataset of unknown length: the length is not known
        return None
    # an iterable dataset of no length with max_epochs: Lightning gives max_steps, -1 (and inf for no limit)
    return int(steps) if steps != float("inf") and steps >= 0 else None


def _replay(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Replay | str:
    """The module's ``training_step`` on one micro-batch again, its loss over the accumulated batches and
    its backward, as the automatic optimization's closure runs them; or why not."""
    if not pl_module.automatic_optimization:
        return "manual optimization: training_step steps the optimizers itself"
    return Replay(_TrainingStep(trainer), (batch, batch_idx))  # made at every micro-batch: nothing read


class _TrainingStep:
    """The step function of :func:`_replay`: ``self.log`` says nothing of it (its values are fake), the
    precision's context is the real step's."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = self.owner = trainer  # owner: its attributes kept (fake_count)

    @property
    def kept(self) -> list[Any]:
        """What a ``training_step`` may step besides the model and the trainer, kept too (fake_count): the
        optimizers and LR schedulers (a warmup stepped by hand: ``self.lr_schedulers().step()``)."""
        schedulers = [s for config in self.trainer.lr_scheduler_configs for s in _within(config.scheduler)]
        return [*self.trainer.optimizers, *schedulers]

    def __call__(self, model: torch.nn.Module, args: tuple) -> None:
        module = cast(pl.LightningModule, model)
        if not is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2):
            args = args[:1]
        quiet = [WrappedMethod(module, name, silenced, once=False) for name in ("log", "log_dict")]
        try:
            with self.trainer.precision_plugin.train_step_context():
                out = module.training_step(*args)
        finally:
            for patch in quiet:
                patch.remove()
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if isinstance(loss, torch.Tensor):
            (loss / self.trainer.accumulate_grad_batches).backward()


def _within(scheduler: Any) -> list[Any]:
    """A scheduler and those it steps (``SequentialLR``'s and ``ChainedScheduler``'s ``_schedulers``)."""
    return [scheduler, *(s for inner in getattr(scheduler, "_schedulers", ()) for s in _within(inner))]
