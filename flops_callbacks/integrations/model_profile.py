"""DeepSpeed's ``get_model_profile`` on our engine: one call of a model (forward, ``generate`` or any
method; with ``backward=True`` a step) counted, then timed on clean passes, in eval mode, with the
model's modes and every ``.grad`` left as they were: the loop of warm-up, counting pass and clean passes
(``FlopsProfiler``, :mod:`.deepspeed_api`, only starts and stops).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from flops_callbacks.integrations.deepspeed_api import FlopsProfiler, check_model, check_module_types
from flops_callbacks.options import (
    CausalAttention,
    check_causal_attention,
    check_flag,
    check_output_file,
    check_report_args,
)
from flops_callbacks.timing.clean_pass import CLEAN_PASS_SOURCE, eval_mode, grads_set_aside, time_clean
from flops_callbacks.units import macs_to_string, number_to_string, params_to_string

__all__ = ["EVAL_MODE_NOTE", "MODES", "ModelProfileResult", "get_model_profile"]

MODES = ("forward", "generate")
# the mode get_model_profile profiles and times in, as its report and its return say
EVAL_MODE_NOTE = (
    "eval (model.eval(), as DeepSpeed's get_model_profile: dropout off, batch norm on its running "
    "stats; a training forward differs: StepProfiler times training steps)"
)


class ModelProfileResult(tuple[int | str, int | str, int | str]):
    """``(flops, macs, params)`` as DeepSpeed returns them (it unpacks as that 3-tuple), and ``mode``:
    the train/eval mode the model was profiled and timed in ("eval")."""

    mode: str = "eval"


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | Path | None = None,
    ignore_modules: Iterable[type] | None = None,
    mode: str = "forward",
    *,
    backward: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    causal_attention: CausalAttention = "full",
) -> ModelProfileResult:
    """Profile one call of ``model`` in eval mode and return ``(flops, macs, params)`` as DeepSpeed does
    (strings: ``('1.34 K', '670 MACs', '120')``; the result's ``mode`` and the report say "eval").
    Nothing of the call stays: the caller's train/eval mode of every submodule and every ``.grad`` (the
    parameters' and those of input tensors that require one) are as they were, bitwise, also when the
    model raises.

    ``mode`` is "forward" (``model(*args, **kwargs)``), "generate", or the name of any method of the
    model. With ``backward=True`` a step is profiled: the output is reduced to a loss by ``loss_fn``
    (default: ``output.loss`` if the output has one, else the sum of its first floating tensor) and
    back-propagated; the returned flops and MACs are then forward + backward (+ recompute).
    """
    check_model(model)
    check_report_args(module_depth, top_modules)
    check_causal_attention(causal_attention)
    for name, flag in (("print_profile", print_profile), ("detailed", detailed), ("as_string", as_string)):
        check_flag(name, flag)
    check_flag("backward", backward)
    check_output_file(output_file)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable taking the model's output, got {loss_fn!r}")
    if loss_fn is not None and not backward:
        raise ValueError("loss_fn is used with backward=True only (the forward alone needs no loss)")
    ignore_types = check_module_types("ignore_modules", ignore_modules)
    if input_shape is not None and not (
        isinstance(input_shape, (tuple, list))
        and input_shape
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in input_shape)
    ):
        raise ValueError(f"input_shape must be a tuple of ints > 0 such as (2, 128), got {input_shape!r}")
    if args is not None and not isinstance(args, (list, tuple)):
        raise TypeError(
            f"args must be a list or tuple of the model's positional inputs, got {type(args).__name__}"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of the model's keyword inputs, got {type(kwargs).__name__}")
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"warm_up must be an int >= 0, got {warm_up!r}")
    if input_shape is not None and args:
        raise ValueError("give either input_shape or args, not both")
    if input_shape is None and not args and not kwargs:
        raise ValueError("give the model's input: input_shape, args or kwargs")
    if not isinstance(mode, str) or not callable(getattr(model, mode, None)):
        raise ValueError(
            f"mode must be one of {MODES} or the name of a method of {type(model).__name__}, got {mode!r}"
        )
    if input_shape is not None:
        reference = next(iter(model.parameters()), torch.empty(()))
        args = [torch.ones(tuple(input_shape), dtype=reference.dtype, device=reference.device)]
    call_args, call_kwargs = list(args or []), dict(kwargs or {})
    run = model if mode == "forward" else getattr(model, mode)  # __call__, so hooks run

    def run_once() -> torch.Tensor | None:
        """One call of the model in the caller's grad mode, as DeepSpeed's (a forward may take gradients
        itself: a force field's, a gradient penalty's); the loss to back-propagate with ``backward``."""
        output = run(*call_args, **call_kwargs)
        return _loss(output, loss_fn) if backward else None

    prof = FlopsProfiler(model, causal_attention=causal_attention)
    inputs = torch.utils._pytree.tree_leaves((call_args, call_kwargs))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    with eval_mode(model), grads_set_aside([*model.parameters(), *leaves]):
        for _ in range(warm_up):
            run(*call_args, **call_kwargs)
        prof.start_profile(ignore_list=list(ignore_types))
        try:
            loss = run_once()
            if loss is not None:
                loss.backward()
            prof.stop_profile()
            profile = prof.get_profile()
            if print_profile:  # we own the loop: latencies from clean passes, not the counting one's
                profile = time_clean(profile, model, run_once)
                args = (warm_up, module_depth, top_modules, detailed, output_file)
                prof._print(profile, CLEAN_PASS_SOURCE, *args, [("model mode", EVAL_MODE_NOTE)])
        finally:
            prof.end_profile()
    if backward:
        flops, macs = profile.hardware_flops, profile.fwd_macs + profile.bwd_macs + profile.recompute_macs
    else:
        flops, macs = profile.fwd_flops, profile.fwd_macs
    values: tuple[int | str, int | str, int | str] = (flops, macs, profile.params)
    if as_string:
        values = (number_to_string(flops), macs_to_string(macs), params_to_string(profile.params))
    return ModelProfileResult(values)


def _loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for leaf in torch.utils._pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.float().sum()
    raise ValueError("backward=True needs a loss: the output has no floating tensor; pass loss_fn")
