"""``StepProfiler``: the profile window and the throughput meter for a training loop of one's own
(plain PyTorch, accelerate, Lightning Fabric): an adapter onto the callbacks' session.

The loop wraps each iteration (one micro-batch) in ``with prof.step(batch):`` and writes nothing else;
the profiler finds the phases itself, with hooks that live only inside that block:

* forward: from the block's start, and again when the model is called after a backward or an
  optimizer step (a second micro-batch or model in the same block);
* backward: where the loop calls ``accelerator.backward`` / ``fabric.backward``, else where autograd
  starts: ``torch.autograd.backward``, which ``loss.backward()`` calls, so the loss's own backward is
  the backward's whatever computed the loss (each call marked,
  :class:`~flops_callbacks.integrations.wrapped_method.WrappedMethod`); else (``torch.autograd.grad``) where
  autograd first reaches the model's output (a hook on each output tensor; none on a model compiled in
  place, ``model.compile()``, whose hooks dynamo would trace: a second forward in a block is unseen too);
* optimizer step: the optimizer's ``step`` (torch's global optimizer step pre- and post-hooks), or the
  wrapper of it where the loop calls that (``AcceleratedOptimizer.step``, Fabric's strategy's
  ``optimizer_step``, a plain loop's ``GradScaler.step``: their work before the inner ``step`` is the
  step's, and a step they skipped still ends it), up to the block's end (``zero_grad``, an LR scheduler).

An iteration whose block ran no optimizer ``step`` is a micro-batch of the step that ends at the next
one (gradient accumulation). Why wrap ``torch.autograd.backward`` (in the window's blocks only): torch
has no event for the engine's start, and the loss, whose node runs first, is known only at that call;
a ``TorchFunctionMode`` would see it too, but would slow every op of the forward. Why hooks on the
output tensors and not autograd's saved-tensor hooks: those make ``torch.func`` inside a model raise
and replace autograd's in-place check (:mod:`flops_callbacks.counting.saved_activations`). Why not a
hook on the output's node: the module timer arms its node hooks when the backward starts, and a
node's pre-hooks may not grow while autograd runs them; a tensor's hooks are another list.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flops_callbacks.integrations.callback_base import build_session, input_ids_tokens
from flops_callbacks.integrations.loop_adapters import (
    LogFn,
    LoopAdapter,
    accelerate_adapter,
    fabric_adapter,
    plain_adapter,
)
from flops_callbacks.integrations.wrapped_method import WrappedMethod
from flops_callbacks.module_tree import compiled_in_place
from flops_callbacks.options import check_int
from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.session.result import WindowResult
from flops_callbacks.timing.phases import check_phase
from flops_callbacks.user_warning import warn

__all__ = ["StepProfiler"]

_ENDED = "ended"  # an optimizer step ended; what runs next is said by the next event
# blocks in a row without an optimizer step after which the loop is told (its step() may lie outside the
# blocks: then no step ends, and a counting step counts on); more micro-batches to a step than any usual
_UNSTEPPED = 128


# the arguments StepProfiler takes beside the options (named with them where one is unknown)
_OWN_ARGUMENTS = ("model", "accelerator", "fabric", "log", "log_dir", "log_every_n_steps", "max_steps")

# the classes the loop adapters take, by package (the packages that ship it) and name
_ACCELERATOR = (("accelerate",), "Accelerator")
_FABRIC = (("lightning", "lightning_fabric"), "Fabric")


def _is_a(value: Any, kind: tuple[tuple[str, ...], str]) -> bool:
    """Whether ``value`` is an instance of the class ``kind`` (packages, name), a subclass included, told
    without importing the package (an optional extra)."""
    packages, name = kind
    mro = value.__class__.__mro__  # a proxy's or a spec'd mock's class, as isinstance sees it
    return any(c.__name__ == name and c.__module__.split(".")[0] in packages for c in mro)


class StepProfiler:
    """Profiles a short window of optimizer steps of any training loop, as the callbacks do.

    ::

        prof = StepProfiler(model, profile_step=10, log=fn, log_dir="runs/loop")  # or accelerator= / fabric=
        for batch in loader:
            with prof.step(batch):
                loss = model(**batch).loss
                loss.backward()          # or accelerator.backward(loss) / fabric.backward(loss)
                optimizer.step(); optimizer.zero_grad()
        prof.close()

    The window (laid out in the docs' "Counting and timing" page), the console summary, the
    files and the ``flops_profiler/*`` metrics are the callbacks' (:mod:`flops_callbacks.session.
    step_session`); after it, every ``log_every_n_steps`` optimizer steps, ``throughput/*``. Metrics go to
    ``log(metrics, step)`` and to ``accelerator.log`` / ``fabric.log_dict``, on the logging rank only.

    Args:
        model: the model the loop calls, as the loop holds it (``accelerator.prepare``'s, ``fabric.setup``'s
            and DDP's wrappers are seen through: the profile's root is the model inside).
        accelerator: the loop's ``accelerate.Accelerator``: sizes, distributed type, mixed precision,
            trackers and logging dir from it.
        fabric: the loop's ``lightning.Fabric``: sizes and precision from its strategy, its loggers.
        log: called as ``log(metrics, step)`` with the window's metrics and ``throughput/*`` after it.
        log_dir: where the report, JSON, picture and trace go (default: the accelerator's logging dir or
            Fabric's logger's log dir; none for a plain loop).
        log_every_n_steps: optimizer steps between ``throughput/*`` logs after the window.
        max_steps: optimizer steps the loop will run, if known (a window it cannot reach is said at once).
        **options: The fields of :class:`~flops_callbacks.options.Options`, described there once
            (``tokens_fn`` defaults to ``input_ids.numel()`` of a dict batch).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        accelerator: Any = None,
        fabric: Any = None,
        log: LogFn | None = None,
        log_dir: str | Path | None = None,
        log_every_n_steps: int = 50,
        max_steps: int | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"StepProfiler: model must be a torch.nn.Module, got {type(model).__name__}")
        if accelerator is not None and fabric is not None:
            raise ValueError("StepProfiler: give accelerator or fabric, not both")
        for name, value, kind in (("accelerator", accelerator, _ACCELERATOR), ("fabric", fabric, _FABRIC)):
            if value is not None and not _is_a(value, kind):
                expected = f"{kind[0][0]}.{kind[1]}"
                raise ValueError(f"StepProfiler: {name} must be {expected} or None, got {value!r}")
        if log is not None and not callable(log):
            raise ValueError(f"StepProfiler: log must be a callable taking (metrics, step), got {log!r}")
        if log_dir is not None and not isinstance(log_dir, (str, Path)):
            raise ValueError(f"StepProfiler: log_dir must be a path (str or Path) or None, got {log_dir!r}")
        try:
            check_int("log_every_n_steps", log_every_n_steps, 1)
            if max_steps is not None:
                check_int("max_steps", max_steps, 0)
        except ValueError as error:
            raise ValueError(f"StepProfiler: {error}") from None
        self.session = build_session(type(self).__name__, options, input_ids_tokens, own=_OWN_ARGUMENTS)
        if accelerator is not None:
            self.adapter: LoopAdapter = accelerate_adapter(accelerator, model, log, log_dir)
        elif fabric is not None:
            self.adapter = fabric_adapter(fabric, model, log, log_dir)
        else:
            self.adapter = plain_adapter(model, log, log_dir)
        self.log_every_n_steps, self.max_steps = log_every_n_steps, max_steps
        self.global_step = 0  # optimizer steps done (DeepSpeed's profile_step counts these)
        self._running = False  # the run started (train_start), and close() has not ended it
        self._raised = False  # the last block raised
        self._in_step = False  # an optimizer step has started: its micro-batches so far ran no step()
        self._blocks = 0  # blocks of the optimizer step in progress so far
        self._step_blocks = 0  # the most blocks an optimizer step took so far (0: none ended yet)
        self._unstepped = 0  # blocks in a row that ran no optimizer step (said once at _UNSTEPPED)
        self._iteration: _Iteration | None = None
        self._ended = self._said_ended = False  # close() ended the run: a later block runs unprofiled

    # --- results -------------------------------------------------------------------------------------

    @property
    def result(self) -> WindowResult | None:
        """The profiled window, once published (None before)."""
        return self.session.result

    @property
    def metrics(self) -> dict[str, float] | None:
        """The window's ``flops_profiler/*`` metrics, as logged (None before the window ends)."""
        result = self.session.result
        return None if result is None else result.metrics()

    # --- the loop ------------------------------------------------------------------------------------

    def step(self, batch: Any = None, optimizer_step: bool | None = None) -> _Iteration:
        """One iteration of the loop (one micro-batch) as a ``with`` block. ``optimizer_step`` says
        whether it ends an optimizer step, for loops whose optimizer is no ``torch.optim.Optimizer``
        (default: whether an optimizer's ``step`` ran in it)."""
        if optimizer_step is not None and not isinstance(optimizer_step, bool):
            raise ValueError(
                f"StepProfiler.step: optimizer_step must be True, False or None, got {optimizer_step!r}"
            )
        if self._ended and not self._said_ended:
            self._said_ended = True
            warn(
                "StepProfiler: a block after close(), which ended this profiler's run: it runs unprofiled, "
                "and prof.result keeps the run's window. Make a new StepProfiler to profile another loop."
            )
        return _Iteration(self, batch, optimizer_step)

    def mark(self, phase: str) -> None:
        """Say where a phase starts, inside ``prof.step``, for a loop whose phases the hooks cannot
        see: "backward" (a loss computed outside the model), "optimizer_step", or "forward" (the
        model's work starts here: what ran before it in the block is no phase's)."""
        try:
            check_phase(phase)
        except ValueError as error:
            raise ValueError(f"StepProfiler.mark: {error}") from None
        if self._iteration is not None:
            self._iteration.enter_phase(phase, explicit=True)

    def pause(self) -> None:
        """Evaluation (or anything else that is not training) starts: its time is not throughput."""
        self.session.pause_throughput()

    def resume(self) -> None:
        self.session.resume_throughput()

    def close(self) -> None:
        """The loop ended: publish a window it cut short (or say that none ran); nothing stays."""
        if self._iteration is not None:
            self._iteration.remove_hooks()
        if self._running:
            self._running, self._ended = False, True
            if (
                0 < self._unstepped < _UNSTEPPED
                and not self.global_step
                and self.adapter.sink.is_logging_rank
            ):
                warn(  # else the session's "training ended at global step 0" says no more than that
                    f"StepProfiler: {self._unstepped} blocks ran and none ran an optimizer step, so no step "
                    "ended and no profile ran. Call the optimizer's step() inside `with prof.step(...)`, or "
                    "pass optimizer_step=True to the block that ends a step."
                )
            if not self._raised:  # else its ranks may wait in the step's collectives: no exchange now
                self.session.train_end(self.global_step, self.adapter.sink)
        self.session.close()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is None:
            self.close()
        else:  # the loop raised: drop the window, leave nothing, let the exception pass
            self._running = False
            if self._iteration is not None:
                self._iteration.remove_hooks()
            self.session.guard.closing(self.session.close)

    # --- what an iteration reports -------------------------------------------------------------------

    def _begin(self, batch: Any) -> None:
        session = self.session
        if not self._running:
            self._running = True
            sink = self.adapter.sink
            sink.at_run_start()
            session.train_start(
                self.global_step,
                max_steps=self.max_steps,
                is_logging_rank=sink.is_logging_rank,
                log_dir=sink.log_dir(),
            )
        if not self._in_step:
            self._in_step, self._blocks = True, 0
            adapter = self.adapter
            session.step_start(self.global_step, adapter.model, adapter.context, runs=adapter.runs)
        self._blocks += 1
        session.micro_batch_start(batch)

    def _end(self, stepped: bool) -> None:
        session = self.session
        self._raised = False
        session.micro_batch_end(pause=True)  # what runs until the next block is not part of the step
        self._unstepped = 0 if stepped else self._unstepped + 1
        if self._unstepped == _UNSTEPPED:
            warn(
                f"StepProfiler: {_UNSTEPPED} blocks in a row ran no optimizer step: they are micro-batches "
                "of one step that has not ended, and no profile window goes on while it runs. Call the "
                "optimizer's step() inside `with prof.step(...)`, or pass optimizer_step=True to the block "
                "that ends a step; with this many micro-batches a step, as intended."
            )
        if stepped:
            self._in_step, self._step_blocks = False, max(self._step_blocks, self._blocks)
            self.global_step += 1
            logs = self.global_step % self.log_every_n_steps == 0
            session.step_end(self.global_step, self.adapter.sink, logs=logs)

    def _abandon_iteration(self, phase: str = FORWARD) -> None:
        """The block raised in ``phase``: the window is dropped, on every rank at the next vote should the
        loop go on, and a ``close()`` before another block ran exchanges nothing. The ranks' votes stay in
        step with their collectives (gradient all-reduces): a block before its step's last (fewer than the
        most a step took: a micro-batch skipped) leaves the step going on as on the other ranks, voting with
        them; the last one raised in its forward leaves it going on too, the next block giving the
        all-reduce the others wait in, voting only at its end; raised later, the step ended here for this
        rank (its optimizer did not step), and its next block starts the next one, casting the end vote it
        owes first."""
        lockstep = self._in_step and self._blocks < self._step_blocks
        goes_on = self._in_step and not lockstep and phase == FORWARD
        self._in_step, self._raised = lockstep or goes_on, True
        self.session.guard.closing(lambda: self.session.close(raised=True, goes_on=goes_on))


class _Iteration:
    """One ``with prof.step(batch)`` block: the hooks it needs, installed at its start, removed at its
    end whatever happens (module doc)."""

    def __init__(self, profiler: StepProfiler, batch: Any, optimizer_step: bool | None) -> None:
        self.profiler, self.batch, self.optimizer_step = profiler, batch, optimizer_step
        self.stepped = False
        self.phase: str = FORWARD
        self._handles: list[Any] = []
        self._calls: list[WrappedMethod] = []  # autograd's and the framework's backward, its optimizer step
        self._thread = threading.get_ident()  # the loop's: autograd called from another is not its
        self._marks = False  # a step of the window: its phases are marked

    def __enter__(self) -> _Iteration:
        profiler = self.profiler
        if profiler._ended:  # a block after close(): nothing of the profiler runs in it
            return self
        if profiler._iteration is not None:
            raise RuntimeError("StepProfiler.step: a block is already open (blocks do not nest)")
        with profiler.session.own():  # out of the window steps' data, phases and wall
            return self._enter(profiler)

    def _enter(self, profiler: StepProfiler) -> _Iteration:
        try:
            profiler._begin(self.batch)  # a user's batch_size_fn or tokens_fn may raise here
            profiler._iteration = self
            adapter = profiler.adapter
            self._handles.append(register_optimizer_step_post_hook(self._step_ended))
            for owner, name in adapter.step_calls():  # also outside the window: they say a step ended
                self._calls.append(WrappedMethod(owner, name, self._framework_step, once=False))
            self._marks = profiler.session.window_open
            if self._marks:
                self._handles.append(register_optimizer_step_pre_hook(self._step_starts))
                if not compiled_in_place(
                    adapter.model
                ):  # its hooks run in the frame: dynamo would trace ours
                    self._handles.append(adapter.model.register_forward_pre_hook(self._model_called))
                    self._handles.append(adapter.model.register_forward_hook(self._model_returned))
                autograd = WrappedMethod(torch.autograd, "backward", self._autograd_backward, once=False)
                self._calls.append(autograd)
                if adapter.backward_owner is not None:
                    owner = adapter.backward_owner
                    self._calls.append(WrappedMethod(owner, "backward", self._framework_backward, once=False))
                profiler.session.phase(FORWARD)  # the loop's own code starts now, past these hooks
        except BaseException:
            self.remove_hooks()
            profiler._abandon_iteration()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.profiler._ended:
            return
        with self.profiler.session.own():  # out of the window steps' data, phases and wall
            self._exit(error)

    def _exit(self, error: BaseException | None) -> None:
        self.profiler.session.stop_timing()  # the block's code ended: removing the hooks is no phase's
        self.remove_hooks()
        if error is not None and not isinstance(error, StopIteration):
            self.profiler._abandon_iteration(self.phase if self._marks else BACKWARD)
            if self.stepped and self.optimizer_step is not False:  # after the optimizer's step: the step ran
                self.profiler._end(True)  # and ends here, as on every other rank (its end vote, its log)
            return  # the exception passes unchanged
        # StopIteration: the loop's data ran out in the block (``next(it)`` inside it): a block that ran no
        # step, and the window what it has (``close()`` publishes it); the exception passes unchanged
        stepped = error is None and (self.stepped if self.optimizer_step is None else self.optimizer_step)
        self.profiler._end(stepped)

    def remove_hooks(self) -> None:
        """Remove every hook of this block (idempotent)."""
        if self.profiler._iteration is self:
            self.profiler._iteration = None
        handles, self._handles = self._handles, []
        calls, self._calls = self._calls, []
        try:
            for handle in handles:
                handle.remove()
        finally:
            for call in calls:  # never raises: puts an attribute back
                call.remove()

    # --- phases --------------------------------------------------------------------------------------

    def enter_phase(self, phase: str, explicit: bool = False) -> None:
        """Phase ``phase`` starts (once: a second sign of the running phase is no new start)."""
        if phase == self.phase and not (explicit and phase == FORWARD):
            return
        self.phase = phase
        self.profiler.session.phase(phase)

    def _model_called(self, module: torch.nn.Module, args: Any) -> None:
        if self.phase in (BACKWARD, _ENDED):  # a new forward after a backward or an optimizer step
            self.enter_phase(FORWARD)

    def _model_returned(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for leaf in torch.utils._pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                self._handles.append(leaf.register_hook(self._reached_output))

    def _reached_output(self, grad: torch.Tensor) -> None:
        if self.phase == FORWARD:
            self.enter_phase(BACKWARD)

    def _autograd_backward(self, backward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Autograd's engine is about to run from the loss: the backward starts here (module doc)."""
        if self.phase == FORWARD and threading.get_ident() == self._thread:
            self.enter_phase(BACKWARD)
        return backward(*args, **kwargs)

    def _framework_backward(self, backward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.enter_phase(BACKWARD)
        return backward(*args, **kwargs)

    def _framework_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The framework's optimizer step (module doc): the step starts at its call, and ends with it
        when the framework says it stepped, whether or not the inner optimizer's ``step`` ran."""
        if self._marks:
            self.enter_phase(OPTIMIZER_STEP)
        out = step(*args, **kwargs)
        if self.profiler.adapter.stepped():
            self._step_ended(None, args, kwargs)
        return out

    def _step_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.enter_phase(OPTIMIZER_STEP)

    def _step_ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stepped = True
        if self.phase == OPTIMIZER_STEP:
            self.phase = _ENDED
            self.profiler.session.phase_end()
