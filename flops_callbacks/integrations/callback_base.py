"""What both callbacks share above their event maps: their arguments, their session and result, and
the constructor from a DeepSpeed config's ``flops_profiler`` block, as DeepSpeed users write it."""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch

from flops_callbacks.integrations.wrapped_method import WrappedMethod
from flops_callbacks.options import CausalAttention, Options, Report, check_flag
from flops_callbacks.reporting.publish import publish
from flops_callbacks.session.result import WindowResult
from flops_callbacks.session.step_session import StepSession
from flops_callbacks.user_warning import warn

__all__ = ["build_session", "C", "deepspeed_callback_kwargs", "Fn", "input_ids_tokens", "SessionCallback"]

C = TypeVar("C", bound="SessionCallback")
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))  # the callbacks' arguments
Fn = TypeVar("Fn", bound=Callable[..., Any])


def _renamed(function: Fn, qualname: str) -> Fn:
    """A copy of ``function`` whose code says ``qualname`` (Python 3.11+ names the code object in
    argument errors, 3.10 the function)."""
    code = function.__code__
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=qualname)  # type: ignore[call-arg,unused-ignore]
    copy = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__, copy.__annotations__ = function.__kwdefaults__, function.__annotations__
    copy.__doc__, copy.__module__, copy.__qualname__ = function.__doc__, function.__module__, qualname
    return copy  # type: ignore[return-value]


def input_ids_tokens(batch: Any) -> int | None:
    """``input_ids.numel()`` when the batch holds input_ids (the HF Trainer's own token count), else None:
    the default ``tokens_fn`` where batches are model inputs (HF Trainer, StepProfiler)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None  # a dict or a BatchEncoding
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else None


def build_session(
    owner: str,
    arguments: Mapping[str, Any],
    tokens_fn: Callable[[Any], int | None] | None = None,
    own: Sequence[str] = (),
) -> StepSession:
    """The session of an entry point (a callback, :class:`~flops_callbacks.StepProfiler`) from the user's
    option arguments, checked once in :class:`~flops_callbacks.options.Options` and said in the words of
    ``owner``, the class the user called (``own``: its arguments beside the options)."""
    unknown = sorted(set(arguments) - _OPTION_NAMES)
    if unknown:
        meant = [m for name in unknown for m in difflib.get_close_matches(name, [*own, *_OPTION_NAMES], 1)]
        hint = f" (did you mean {', '.join(map(repr, meant))}?)" if meant else ""
        theirs = f"its arguments are {sorted(own)} and " if own else ""
        raise ValueError(
            f"{owner}: unknown argument(s) {unknown}{hint}; {theirs}the options are {sorted(_OPTION_NAMES)}"
        )
    try:
        options = Options(**arguments)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
    return StepSession(options, owner, tokens_fn=tokens_fn, publish=publish)


# The flops_profiler block of a DeepSpeed config: its keys and DeepSpeed's defaults.
_DEEPSPEED_BLOCK = {
    "enabled": False,
    "recompute_fwd_factor": 0.0,
    "profile_step": 1,
    "module_depth": -1,
    "top_modules": 1,
    "detailed": True,
    "output_file": None,
}
_CALLBACK_KEYS = ("profile_step", "module_depth", "top_modules", "detailed", "output_file")


def deepspeed_callback_kwargs(config: Mapping[str, Any] | str | Path) -> dict[str, Any] | None:
    """The training callbacks' keyword arguments from a DeepSpeed config (whole, or its
    ``flops_profiler`` block; or the path of its JSON file, as the HF Trainer's ``deepspeed=`` takes
    it), with DeepSpeed's defaults for absent keys; None where the profiler is not enabled (DeepSpeed's
    default). The values are checked by the callback that receives them. DeepSpeed prints its whole
    profile: ``report="full"``; its ``output_file: ""`` is the console.

    ``recompute_fwd_factor`` is accepted and ignored (recompute is measured), and keys DeepSpeed
    does not know are ignored as DeepSpeed ignores them; each is said once, in one line.
    """
    if isinstance(config, (str, Path)):
        config = _json_config(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a DeepSpeed config or its flops_profiler block, got {config!r}")
    if "flops_profiler" in config:
        block = config["flops_profiler"]
        if not isinstance(block, Mapping):
            raise ValueError(f"config['flops_profiler'] must be a mapping, got {block!r}")
    elif any(key in _DEEPSPEED_BLOCK for key in config):
        block = config
    else:
        return None  # a whole config without the block: DeepSpeed's profiler is off
    settings = {**_DEEPSPEED_BLOCK, **block}
    check_flag("flops_profiler.enabled", settings["enabled"])
    if not settings["enabled"]:
        return None
    unknown = sorted(set(block) - set(_DEEPSPEED_BLOCK))
    if unknown:
        warn(
            f"flops_profiler keys {unknown} are not DeepSpeed's and are ignored "
            f"(DeepSpeed's: {sorted(_DEEPSPEED_BLOCK)})",
        )
    if "recompute_fwd_factor" in block:
        warn(
            "flops_profiler.recompute_fwd_factor is ignored: recompute is measured, not estimated",
        )
    found = {key: settings[key] for key in _CALLBACK_KEYS}
    found["output_file"] = found["output_file"] or None  # DeepSpeed's "": the console
    return {**found, "report": "full"}


def _json_config(path: str | Path) -> Mapping[str, Any]:
    """A DeepSpeed config read from its JSON file; ValueError naming the file where it cannot be."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"config: cannot read a DeepSpeed JSON config from {str(path)!r} ({error})"
        ) from None
    if not isinstance(data, Mapping):
        raise ValueError(f"config: {str(path)!r} holds no JSON object (a DeepSpeed config is one)")
    return data


class SessionCallback:
    """Builds the :class:`StepSession` of a callback from its arguments.

    Args:
        **options: The fields of :class:`~flops_callbacks.options.Options`, described and checked
            there once.
    """

    # tokens per micro-batch when the user gives no tokens_fn (the HF Trainer's inputs: input_ids)
    default_tokens_fn: ClassVar[Callable[[Any], int | None] | None] = None

    # every default is the Options field's: the one place they are set
    def __init__(
        self,
        profile_step: int = Options.profile_step,
        clean_steps: int | Literal["auto"] = Options.clean_steps,
        module_depth: int = Options.module_depth,
        top_modules: int = Options.top_modules,
        detailed: bool = Options.detailed,
        print_profile: bool = Options.print_profile,
        output_file: str | Path | None = Options.output_file,
        batch_size_fn: Callable[[Any], int] | None = Options.batch_size_fn,
        tokens_fn: Callable[[Any], int | None] | None = Options.tokens_fn,
        causal_attention: CausalAttention = Options.causal_attention,
        throughput: bool = Options.throughput,
        peak_flops: float | Literal["measure"] | None = Options.peak_flops,
        peak_bandwidth: float | None = Options.peak_bandwidth,
        flops_audit: int | Literal["auto"] = Options.flops_audit,
        profile_every: int | None = Options.profile_every,
        report: Report = Options.report,
        comm_steps: int | Literal["auto"] = Options.comm_steps,
    ) -> None:
        super().__init__()
        arguments = {name: value for name, value in locals().items() if name in _OPTION_NAMES}
        self.session = build_session(type(self).__name__, arguments, type(self).default_tokens_fn)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A callback class's ``__init__`` is this one under the callback's own name, so that Python's
        own argument errors (a misspelt keyword) name the class the user called, not this base."""
        super().__init_subclass__(**kwargs)
        if "__init__" not in vars(cls):
            cls.__init__ = _renamed(SessionCallback.__init__, f"{cls.__name__}.__init__")  # type: ignore[method-assign]

    _training_step: WrappedMethod | None = None  # the framework's training_step, wrapped for its next call

    def _unwrap(self) -> None:
        """Put back the wrapped ``training_step`` whose call never came (idempotent)."""
        wrapped, self._training_step = self._training_step, None
        if wrapped is not None:
            wrapped.remove()

    @property
    def result(self) -> WindowResult | None:
        """The profiled window (on every rank), once it has been published."""
        return self.session.result

    @classmethod
    def from_deepspeed_config(cls: type[C], config: Mapping[str, Any] | str | Path, **kwargs: Any) -> C:
        """The callback a DeepSpeed config asks for (the whole config, its ``flops_profiler`` block, or
        its JSON file's path; ``kwargs`` add or override arguments): DeepSpeed's whole report
        (``report="full"``). ``enabled: false`` (DeepSpeed's default) gives a callback
        that does nothing; ``recompute_fwd_factor`` is ignored with a one-line note: recompute is measured.
        """
        found = deepspeed_callback_kwargs(config)
        callback = cls(**{**(found or {}), **kwargs})
        if found is None:
            callback.session.disable()
        return callback
