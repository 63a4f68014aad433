"""Counting one micro-batch's training work under fake tensors: the same engine, no kernel run.

The model's parameters and buffers are swapped for fake tensors of the same shapes (for the call only,
through torch's ``_reparametrize_module``), the micro-batch's tensors too, and the adapter's step function
(forward, loss, backward) runs under ``FakeTensorMode`` with the counting engine on: every aten op is
seen with its shapes, attributed per module and pass as on a real step, and no memory, kernel, random
state or real gradient is touched (the backward fills the fake parameters' ``.grad``; a later
micro-batch's fake parameters start with a gradient, so its accumulation add is counted as on a real
one). Why not counting ``model(batch)`` alone: the loss and the backward are the adapter's and the
user's code, and their ops are part of the step. Why not ``meta`` tensors: ``FakeTensorMode`` keeps
devices, so device-dependent code (SDPA's backend choice) takes the same path as the real step.

The model's modules' own hooks (the user's: a forward hook that keeps a module's output in a dict) do
not run in it: they would keep fake tensors where the user's code reads real ones later. What they add
to the count is in the real step's: the fake count's first use is checked against it (the caller's).

Where it cannot run, :class:`FakeCountUnavailable` says why: parameters sharded behind hooks that
communicate (FSDP, ZeRO-3), an op with no fake kernel, a shape that depends on the data, a real tensor
the step reads that is not the model's nor the batch's. The caller counts such shapes on a real step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
from collections import OrderedDict, UserDict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.user_state import Kept
from flops_callbacks.options import CausalAttention
from flops_callbacks.profile import Counts, Profile
from flops_callbacks.timing.clock import NullClock, module_device

__all__ = ["FakeCountUnavailable", "StepFunction", "fake_count", "fake_profile", "sharded_reason"]

# runs one micro-batch's forward, loss and backward on ``model`` with ``args`` (the adapter's); one with
# an ``owner`` attribute (the trainer whose method it calls) has that object's attributes kept too, and
# one with ``kept`` (a list) those objects' (the optimizers and LR schedulers the user's step may step)
StepFunction = Callable[[torch.nn.Module, Any], Any]


class FakeCountUnavailable(Exception):
    """A fake count cannot run on this model or batch; the message says why, in a few words."""


def sharded_reason(model: torch.nn.Module) -> str | None:
    """Why the model's parameters cannot be swapped for fake ones (None: they can): sharded parameters
    are gathered by hooks that communicate, which a fake step must not reach."""
    for module in model.modules():
        names = {c.__name__ for c in type(module).__mro__}
        if names & {"FullyShardedDataParallel", "FSDPModule"}:
            return "parameters sharded by FSDP"
    for param in itertools.islice(model.parameters(), 64):
        if hasattr(param, "ds_id"):
            return "parameters partitioned by DeepSpeed ZeRO-3"
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            return "parameters distributed as DTensors"
    return None


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _hooks_off(model: torch.nn.Module) -> Iterator[None]:
    """Each module's own hooks set aside for the block, the same tables put back after (module doc)."""
    held = [(m, name, getattr(m, name)) for m in model.modules() for name in _HOOKS if getattr(m, name, None)]
    try:
        for module, name, _ in held:
            setattr(module, name, OrderedDict())
        yield
    finally:
        for module, name, hooks in held:
            setattr(module, name, hooks)


@contextlib.contextmanager
def _torch_quiet() -> Iterator[None]:
    """Fake tensors' own logger off: an op whose meta kernel fails (``aten._grouped_mm`` in fp32, an MoE's
    experts on a CPU) logs its traceback at ERROR before it raises, 22 lines on the console for a fake
    count that is said not to run (:class:`FakeCountUnavailable`, in the report) and a step that trains on."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was


def _copied(batch: Any, clones: list[torch.Tensor]) -> Any:
    """The micro-batch as the replay gets it: each tensor cloned (each clone appended to ``clones``) and
    each container its own, those pytree does not know too (a dataclass, a ``UserDict`` such as
    transformers' ``BatchEncoding``, a dict's subclass), so that the step's writes to its batch
    (``batch.x = batch.x * 2``) do not reach the real step's. Another mutable mapping, whose copy may share
    its storage (a view, a shelf), raises :class:`FakeCountUnavailable`: no replay. Why not
    ``copy.deepcopy``: a batch may hold a tokenizer or a dataset, which stay shared."""
    done: dict[int, Any] = {}

    def leaf(value: Any) -> Any:
        if id(value) in done:
            return done[id(value)]
        if isinstance(value, torch.Tensor):
            clone = done[id(value)] = value.detach().clone()
            clones.append(clone)
            return clone
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            instance = done[id(value)] = copy.copy(value)
            for field in dataclasses.fields(value):
                object.__setattr__(instance, field.name, tree_map(leaf, getattr(value, field.name)))
            return instance
        # a UserDict (BatchEncoding) or a dict's subclass, which pytree leaves whole: copy.copy copies items
        if isinstance(value, (UserDict, dict)):
            mapping = done[id(value)] = copy.copy(value)
            for key in list(value.keys()):
                mapping[key] = tree_map(leaf, value[key])
            return mapping
        if isinstance(value, MutableMapping):  # its copy may share its storage: the replay's writes would too
            raise FakeCountUnavailable(f"a batch's {type(value).__name__} cannot be copied for a replay")
        return value

    return tree_map(leaf, batch)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def fake_count(
    model: torch.nn.Module,
    step: StepFunction,
    args: Any,
    *,
    later: bool = False,
    causal_attention: CausalAttention = "full",
) -> Counts:
    """The model's counts of one micro-batch: ``step(model, fake_args)`` run under fake tensors with the
    counting engine on (module doc); ``later``: a later micro-batch of its optimizer step (its gradients
    add to the ones before). Raises :class:`FakeCountUnavailable` with the reason when it cannot run; the
    model's parameters, gradients, modes, attributes and the random state are as before, on every exit
    path."""
    return _fake_engine(model, step, [(args, later)], causal_attention).totals()[0]


def fake_profile(
    model: torch.nn.Module,
    step: StepFunction,
    calls: list[tuple[Any, bool]],
    *,
    causal_attention: CausalAttention = "full",
) -> Profile:
    """The profile (every module's counts) of a step's micro-batches, each ``(args, later)``, counted
    under fake tensors as :func:`fake_count` counts one: a timed step's module tree, its batch's own."""
    return _fake_engine(model, step, calls, causal_attention).profile()


def _fake_engine(
    model: torch.nn.Module,
    step: StepFunction,
    calls: list[tuple[Any, bool]],
    causal_attention: CausalAttention,
) -> CountingEngine:
    """An engine that has seen ``step`` run on each call's arguments under fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    reason = sharded_reason(model)
    if reason is not None:
        raise FakeCountUnavailable(reason)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        made = memo.get(id(tensor))
        if made is None:
            made = memo[id(tensor)] = mode.from_tensor(tensor.detach()).requires_grad_(tensor.requires_grad)
        return made

    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    training = [(module, module.training) for module in model.modules()]
    try:
        state = {name: fake(tensor) for name, tensor in named}
        clones: list[torch.Tensor] = []
        batches = [(_copied(args, clones), later) for args, later in calls]
    except FakeCountUnavailable:
        raise
    except Exception as error:  # noqa: BLE001  (a tensor fake tensors cannot stand for)
        why = _first_line(error)
        raise FakeCountUnavailable(f"the batch or parameters cannot be faked ({why})") from None
    leaves = [t for t in state.values() if t.requires_grad and t.is_leaf]
    engine = CountingEngine(model, causal_attention=causal_attention, clock=NullClock(), fake=True)
    engine.made.add(clones)  # the batch's copies: the step may write to them
    engine.made.fake_mode = mode
    device = module_device(model)
    devices = [device] if device.type == "cuda" else []
    owner = getattr(step, "owner", None)
    saved: Kept | None = None
    try:
        # the user's code in the step changes nothing that stays (counting.user_state); the batch's own ops
        # run for real (the engine): one drawing random numbers draws from a fork
        kept = [*([owner] if owner is not None else []), *getattr(step, "kept", ())]
        saved = Kept([*model.modules(), *kept])
        if saved.incomplete:  # a container it could not keep could keep a fake tensor: no replay
            raise FakeCountUnavailable(f"{saved.incomplete}: too many to put back after a replay")
        with (
            torch.random.fork_rng(devices),
            _reparametrize_module(model, state, tie_weights=True),
            _hooks_off(model),
            _torch_quiet(),
            mode,
        ):
            for batch, later in batches:
                if later:
                    for leaf in leaves:
                        if leaf.grad is None:
                            leaf.grad = torch.empty_like(leaf)  # as the micro-batches before left them
                engine.start()
                try:
                    step(model, batch)
                finally:
                    engine.stop()
    except FakeCountUnavailable:
        raise
    except Exception as error:  # noqa: BLE001  (no fake kernel, data-dependent shapes, a real tensor read)
        raise FakeCountUnavailable(_first_line(error)) from None
    finally:
        if saved is not None:
            saved.restore()  # after the parameters are the real ones again
        for module, was in training:
            module.training = was
    if saved is not None and saved.unrestored:
        which = "; ".join(saved.unrestored[:3])
        raise FakeCountUnavailable(f"the step changed what cannot be put back: {which}")
    if engine.failure is not None:
        what, failed = engine.failure
        raise FakeCountUnavailable(f"{what}: {_first_line(failed)}")
    return engine
