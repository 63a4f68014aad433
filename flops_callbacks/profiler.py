"""DeepSpeed-compatible profiler API: ``FlopsProfiler`` and ``get_model_profile``.

Switching from DeepSpeed is one import: the method names, arguments and ``get_total_*`` meanings
are DeepSpeed's. What differs is underneath: flops are measured per aten op (backward included)
by :mod:`flops_callbacks.tracer`, nothing is patched globally, and nothing stays on the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from flops_callbacks.clock import Clock, clock_for, module_device
from flops_callbacks.options import check_causal_attention, check_report_args
from flops_callbacks.profile import Counts, Profile
from flops_callbacks.report import render_aggregated, render_profile
from flops_callbacks.tracer import Tracer
from flops_callbacks.units import duration_to_string, flops_to_string, macs_to_string, params_to_string


def check_model(model: Any) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


class FlopsProfiler:
    """Measures flops, MACs, params and latency of every module of ``model``.

    Usage as DeepSpeed's::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch).loss; loss.backward()
        prof.stop_profile()
        prof.print_model_profile(profile_step=1)
        prof.end_profile()

    or ``with FlopsProfiler(model) as prof: ...``. Unlike DeepSpeed, the backward is counted from
    the real backward ops (``get_profile().bwd_flops``) and activation-checkpointing recompute is
    reported apart (``recompute_flops``).

    ``causal_attention="half"`` counts only the unmasked part of attention kernels called with
    ``is_causal=True``; the default ``"full"`` counts the whole QK^T and AV, as FlopCounterMode,
    DeepSpeed and the PaLM MFU definition do. ``ds_engine`` and ``recompute_fwd_factor`` are
    accepted for drop-in compatibility: the first is kept for the report's parallel sizes, the
    second is not needed because recompute is measured.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        *,
        causal_attention: str = "full",
    ) -> None:
        self.model = check_model(model)
        check_causal_attention(causal_attention)
        if recompute_fwd_factor:
            warnings.warn(
                "recompute_fwd_factor is ignored: flops_callbacks measures recomputation "
                "(see get_profile().recompute_flops)",
                stacklevel=2,
            )
        self.ds_engine = ds_engine
        self.causal_attention = causal_attention
        self.started = False
        self._tracer: Tracer | None = None

    # --- DeepSpeed lifecycle ---------------------------------------------------------------------

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting (and reset earlier counts). Modules whose type is in ``ignore_list`` get no
        record of their own; their work counts towards their parent."""
        self.stop_profile()
        self._tracer = Tracer(
            self.model,
            ignore_types=tuple(ignore_list or ()),
            causal_half=self.causal_attention == "half",
        )
        self._tracer.start()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and remove every hook and mode; the counts stay readable."""
        if self._tracer is not None:
            self._tracer.stop()
        self.started = False

    def resume_profile(self) -> None:
        """Count again after :meth:`stop_profile`, adding to the counts so far (not in DeepSpeed's API:
        a training step pauses it between micro-batches so that validation run there is not counted)."""
        if self._tracer is None:
            raise RuntimeError("resume_profile() without start_profile()")
        self._tracer.start()
        self.started = True

    def reset_profile(self) -> None:
        """Zero the counts (profiling continues if it was on)."""
        if self._tracer is not None:
            self._tracer.reset()

    def end_profile(self) -> None:
        """Stop and drop everything (DeepSpeed's end: nothing of the profiler stays)."""
        self.stop_profile()
        self._tracer = None

    def __enter__(self) -> FlopsProfiler:
        self.start_profile()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_profile()

    @property
    def clock(self) -> Clock:
        """The synchronized clock of the model's device (phases of a step are timed on it too)."""
        return self._tracer.clock if self._tracer is not None else clock_for(module_device(self.model))

    # --- results ---------------------------------------------------------------------------------

    def get_profile(self) -> Profile:
        """The structured result: totals, every module, per-functional breakdown and coverage."""
        if self._tracer is None:
            raise RuntimeError("no profile: call start_profile() and run the model first")
        return self._tracer.profile(self.causal_attention)

    def _totals(self) -> tuple[Counts, float]:
        if self._tracer is None:
            raise RuntimeError("no profile: call start_profile() and run the model first")
        return self._tracer.totals()

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops of the model (DeepSpeed's meaning); backward is in :meth:`get_profile`."""
        flops = self._totals()[0].fwd_flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._totals()[0].fwd_macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = sum(p.numel() for p in dict.fromkeys(self.model.parameters()))
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the model in seconds."""
        duration = self._totals()[1]
        return duration_to_string(duration) if as_string else duration

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | Path | None = None,
        context_lines: Sequence[tuple[str, str]] = (),
        timing_lines: Sequence[tuple[str, str]] = (),
    ) -> str:
        """Print DeepSpeed's report (to ``output_file`` if given, never touching ``sys.stdout``).

        ``context_lines`` and ``timing_lines`` are extra summary rows (label, value) that the
        training callbacks add: parallel sizes and batch first, step/iter latency and rates last.
        """
        check_report_args(module_depth, top_modules)
        text = render_profile(
            self.get_profile(),
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            context_lines=context_lines,
            timing_lines=timing_lines,
        )
        _emit(text, output_file)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str:
        check_report_args(module_depth, top_modules)
        text = render_aggregated(self.get_profile(), module_depth=module_depth, top_modules=top_modules)
        print(text)
        return text


def _emit(text: str, output_file: str | Path | None) -> None:
    if output_file is None:
        print(text)
    else:
        path = Path(output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


MODES = ("forward", "generate")


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
    causal_attention: str = "full",
) -> tuple[int | str, int | str, int | str]:
    """Profile one call of ``model`` and return ``(flops, macs, params)`` as DeepSpeed does.

    ``mode`` is "forward" (``model(*args, **kwargs)``), "generate", or the name of any method of the
    model. With ``backward=True`` a training step is profiled: the output is reduced to a loss by
    ``loss_fn`` (default: ``output.loss`` if the output has one, else the sum of its first tensor)
    and back-propagated; the returned flops and MACs are then forward + backward (+ recompute).
    """
    check_model(model)
    check_report_args(module_depth, top_modules)
    check_causal_attention(causal_attention)
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"warm_up must be an int >= 0, got {warm_up!r}")
    if input_shape is not None and args is not None:
        raise ValueError("give either input_shape or args, not both")
    if input_shape is None and args is None and not kwargs:
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

    for _ in range(warm_up):
        with torch.no_grad():
            run(*call_args, **call_kwargs)

    prof = FlopsProfiler(model, causal_attention=causal_attention)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        if backward:
            output = run(*call_args, **call_kwargs)
            _loss(output, loss_fn).backward()
        else:
            with torch.no_grad():
                run(*call_args, **call_kwargs)
    finally:
        prof.stop_profile()
    profile = prof.get_profile()
    if print_profile:
        prof.print_model_profile(
            profile_step=1,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if backward:
        flops, macs = profile.hardware_flops, profile.fwd_macs + profile.bwd_macs + profile.recompute_macs
    else:
        flops, macs = profile.fwd_flops, profile.fwd_macs
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(profile.params)
    return flops, macs, profile.params


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
