"""DeepSpeed's flops profiler API on our engine: ``FlopsProfiler``, ``get_model_profile``, ``get_module_*``.

Switching from DeepSpeed 0.19.8 is one import: method names, arguments, return values, strings,
``started`` and the ``flops`` / ``macs`` / ``params`` attributes are DeepSpeed's, and a DeepSpeed
engine passed as ``ds_engine`` gives the report DeepSpeed's engine rows. What differs is underneath:
flops are measured per aten op (backward included) by :mod:`flops_callbacks.counting.engine`, nothing is
patched globally, and nothing is written onto the user's modules: ``get_module_flops(module)`` finds
the module's record through a weak registry instead of a ``__flops__`` attribute, so a profile can
never leave state on a model (DeepSpeed's attributes stay behind when a profiled step raises).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.files import write_text
from flops_callbacks.module_tree import ModuleTree
from flops_callbacks.options import (
    CausalAttention,
    check_causal_attention,
    check_flag,
    check_output_file,
    check_report_args,
)
from flops_callbacks.parallel import ParallelSizes
from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.reporting.profile_report import EngineRows, render_profile
from flops_callbacks.reporting.profile_sections import render_aggregated
from flops_callbacks.units import duration_to_string, macs_to_string, number_to_string, params_to_string
from flops_callbacks.user_warning import warn

__all__ = [
    "check_model",
    "check_module_types",
    "COUNTING_PASS_SOURCE",
    "FlopsProfiler",
    "get_module_duration",
    "get_module_flops",
    "get_module_macs",
]

COUNTING_PASS_SOURCE = (
    "the counting pass (instrumented: every op runs through Python, several times a clean pass on a "
    "model of small ops); clean times of training steps: StepProfiler (any loop) or the Lightning / HF "
    "callbacks"
)

# DeepSpeed's engine timer names (deepspeed.utils.timer); their elapsed() is in milliseconds.
_ENGINE_TIMERS = {"fwd_latency": "fwd", "bwd_latency": "bwd", "step_latency": "step"}
# what the report reads of a DeepSpeed engine (:meth:`FlopsProfiler._run_context`)
_ENGINE_ATTRIBUTES = ("world_size", "mp_world_size", "train_micro_batch_size_per_gpu", "wall_clock_breakdown")


def check_model(model: Any) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_module_types(name: str, types: Any) -> tuple[type, ...]:
    """``ignore_list`` / ``ignore_modules``: None or a list of module classes (a name or an instance
    would match nothing, silently)."""
    if types is None:
        return ()
    found = tuple(types) if isinstance(types, (list, tuple, set, frozenset)) else None
    if found is None or not all(isinstance(t, type) and issubclass(t, torch.nn.Module) for t in found):
        raise TypeError(
            f"{name} must be None or a list of torch.nn.Module classes (nn.Dropout), got {types!r}"
        )
    return found


# module -> the profilers that profile it, each with the module's name in its profile, the latest started
# last (a profile of a submodule inside a profile of its model: when it ends, the model's answers again).
# Weak on both sides: the registry keeps neither a model nor a profiler alive, and nothing is stored on
# the module itself.
_REGISTRY: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[weakref.ref[FlopsProfiler], str]]] = (
    weakref.WeakKeyDictionary()
)


def _record(module: torch.nn.Module, getter: str) -> ModuleProfile | None:
    """The module's record in the current profile of the latest started profiler of it not ended; None
    for a module of the profiled model that has no record of its own (its type was in ``ignore_list``)."""
    for ref, name in reversed(_REGISTRY.get(module, [])):
        profiler = ref()
        if profiler is not None and profiler._engine is not None:
            return profiler.get_profile().modules.get(name)
    raise ValueError(
        f"{getter}: module {type(module).__name__} has no profile: call it between start_profile() "
        "and end_profile() of a FlopsProfiler of its model"
    )


def _register(profiler: FlopsProfiler, names: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """``profiler`` profiles these modules now (``names`` empty: no more), the latest of their profilers."""
    me = weakref.ref(profiler)
    for module in profiler.model.modules():
        entries = [e for e in _REGISTRY.get(module, []) if e[0]() not in (None, profiler)]
        if entries:
            _REGISTRY[module] = entries
        else:
            _REGISTRY.pop(module, None)
    for name, module in names:
        _REGISTRY.setdefault(module, []).append((me, name))


def get_module_flops(module: torch.nn.Module) -> int:
    """Forward flops of ``module`` and its children in its profiler's current profile (DeepSpeed's);
    a module in ``ignore_list`` has none of its own (its work is its parent's)."""
    record = _record(module, "get_module_flops")
    return record.fwd_flops if record else 0


def get_module_macs(module: torch.nn.Module) -> int:
    """Forward MACs of ``module`` and its children in its profiler's current profile (DeepSpeed's)."""
    record = _record(module, "get_module_macs")
    return record.fwd_macs if record else 0


def get_module_duration(module: torch.nn.Module) -> float:
    """Forward seconds of ``module`` in its profiler's current profile; for a module that was never
    called itself (a ``ModuleList``), the sum of its children's, as DeepSpeed. Under
    :class:`FlopsProfiler` these are times of the counting pass (inflated: see
    :meth:`FlopsProfiler.get_total_duration`); :class:`~flops_callbacks.StepProfiler` gives clean ones."""
    record = _record(module, "get_module_duration")
    duration = record.fwd_latency if record else 0.0
    if duration == 0:
        duration = sum(get_module_duration(child) for child in module.children())
    return duration


def _profiled_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name in the profile, module) for every module of ``model``; ``torch.compile``'s ``_orig_mod``
    level is not part of the names (the module tree's names, as the counting engine's)."""
    yield from reversed(ModuleTree(model).paths)  # reversed: a shared module keeps its first name


class FlopsProfiler:
    """Measures flops, MACs, params and latency of every module of ``model``.

    Usage as DeepSpeed's::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch).loss; loss.backward()
        prof.stop_profile()
        prof.print_model_profile(profile_step=1)
        prof.end_profile()

    or ``with FlopsProfiler(model) as prof: ...``. Unlike DeepSpeed, a backward run while profiling is
    counted from its real ops (``get_profile().bwd_flops``) and activation-checkpointing recompute is
    reported apart (``recompute_flops``). ``recompute_fwd_factor`` enters DeepSpeed's backward
    estimate only where the backward was timed by ``ds_engine`` but not profiled.

    ``causal_attention="half"`` counts only the unmasked part of attention kernels called with
    ``is_causal=True``; the default ``"full"`` counts the whole QK^T and AV, as FlopCounterMode,
    DeepSpeed and the PaLM MFU definition do.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        *,
        causal_attention: CausalAttention = "full",
    ) -> None:
        self.model = check_model(model)
        check_causal_attention(causal_attention)
        missing = [a for a in _ENGINE_ATTRIBUTES if ds_engine is not None and not hasattr(ds_engine, a)]
        if missing:
            raise TypeError(
                f"ds_engine must be None or a DeepSpeed engine, got {ds_engine!r} (no {missing[0]})"
            )
        if isinstance(recompute_fwd_factor, bool) or not isinstance(recompute_fwd_factor, (int, float)):
            raise ValueError(f"recompute_fwd_factor must be a number, got {recompute_fwd_factor!r}")
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.causal_attention = causal_attention
        self.started = False
        self._engine: CountingEngine | None = None
        self._said_failure = False  # the engine's count failure was said (once a profile)

    # --- DeepSpeed lifecycle ---------------------------------------------------------------------

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting (and reset earlier counts). Modules whose type is in ``ignore_list`` get no
        record of their own; their work counts towards their parent."""
        ignore_types = check_module_types("ignore_list", ignore_list)
        self.stop_profile()
        self._engine = CountingEngine(
            self.model,
            ignore_types=ignore_types,
            causal_attention=self.causal_attention,
        )
        self._engine.start()
        self.started, self._said_failure = True, False
        _register(self, _profiled_names(self.model))

    def stop_profile(self) -> None:
        """Stop counting and remove every hook and mode; the counts stay readable and ``started`` stays
        True until :meth:`end_profile` (as DeepSpeed). Refused, with nothing changed, while a mode entered
        after :meth:`start_profile` is on (another profile's, a ``FlopCounterMode``): torch takes modes off
        last in, first out, so stopping would take that one's off, and it would count nothing after."""
        if self._engine is None:
            return
        above = self._engine.entered_after()
        if above:
            kind = type(above[-1])
            mode = f"{kind.__module__}.{kind.__qualname__}"
            if kind.__module__.startswith("flops_callbacks."):
                mode = "another profile of flops_callbacks (a FlopsProfiler started later)"
            raise RuntimeError(
                f"stop_profile: {mode} was entered after start_profile and is still on; torch's modes leave "
                "last in, first out: leave it (or stop that profile) first"
            )
        self._engine.stop()

    def reset_profile(self) -> None:
        """Zero the counts (profiling continues if it was on)."""
        if self._engine is not None:
            self._engine.reset()

    def end_profile(self) -> None:
        """Stop and drop everything (DeepSpeed's end: nothing of the profiler stays)."""
        self.stop_profile()
        self._engine = None
        self.started = False
        _register(self, ())

    def __enter__(self) -> FlopsProfiler:
        self.start_profile()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_profile()

    # --- results ---------------------------------------------------------------------------------

    def get_profile(self) -> Profile:
        """The structured result: totals, every module, per-functional breakdown and coverage."""
        return self._traced().profile()

    def _traced(self) -> CountingEngine:
        """The engine read, its failure said once (a formula that raised: nothing was counted after it)."""
        if self._engine is None:
            raise RuntimeError("no profile: call start_profile() and run the model first")
        failure = self._engine.failure
        if failure is not None and not self._said_failure:
            self._said_failure = True
            what, error = failure
            warn(
                f"FlopsProfiler: {what} failed ({type(error).__name__}: {error}); counting stopped there: "
                "this profile holds only the work before it."
            )
        return self._engine

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops of the model (DeepSpeed's meaning); backward is in :meth:`get_profile`."""
        flops = self._traced().totals()[0].fwd_flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._traced().totals()[0].fwd_macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = sum(p.numel() for p in dict.fromkeys(self.model.parameters()))
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the model in seconds, timed on the counting pass itself: every op runs
        through Python there, so on a model of small ops it reads several times the training forward.
        Clean latencies of training steps: :class:`~flops_callbacks.StepProfiler` (any loop) or the
        callbacks."""
        duration = self._traced().totals()[1]
        return duration_to_string(duration) if as_string else duration

    def _run_context(self) -> EngineRows:
        """DeepSpeed's engine rows, read from ``ds_engine`` as DeepSpeed reads them."""
        engine = self.ds_engine
        if not engine:
            return EngineRows(recompute_fwd_factor=self.recompute_fwd_factor)
        dp = engine.dp_world_size
        if dp is None:  # sequence parallelism folds data parallelism into its own group
            dp = engine.seq_dp_world_size
        parallel = ParallelSizes(
            world_size=engine.world_size, data_parallel=dp, tensor_parallel=engine.mp_world_size
        )
        batch_size = engine.train_micro_batch_size_per_gpu()
        if not engine.wall_clock_breakdown():
            return EngineRows(parallel, batch_size, recompute_fwd_factor=self.recompute_fwd_factor)
        timers = engine.timers
        latencies = {key: timers(timer).elapsed(False) / 1000.0 for key, timer in _ENGINE_TIMERS.items()}
        iter_latency = sum(latencies.values())
        return EngineRows(
            parallel,
            batch_size,
            **latencies,
            samples_per_second=batch_size * engine.world_size / iter_latency if iter_latency > 0 else None,
            recompute_fwd_factor=self.recompute_fwd_factor,
        )

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | Path | None = None,
    ) -> str | None:
        """Print DeepSpeed's report (to ``output_file`` if given, never touching ``sys.stdout``) and set
        ``self.flops``, ``self.macs`` and ``self.params``; return the text. Before
        :meth:`start_profile` or after :meth:`end_profile` it prints nothing and returns None (as
        DeepSpeed)."""
        check_report_args(module_depth, top_modules)
        check_flag("detailed", detailed)
        check_output_file(output_file)
        if not self.started or self._engine is None:
            return None
        args = (profile_step, module_depth, top_modules, detailed, output_file)
        return self._print(self.get_profile(), COUNTING_PASS_SOURCE, *args)

    def _print(
        self,
        profile: Profile,
        latency_source: str,
        profile_step: int,
        module_depth: int,
        top_modules: int,
        detailed: bool,
        output_file: str | Path | None,
        extra_lines: Sequence[tuple[str, str]] = (),
    ) -> str:
        self.flops, self.macs, self.params = profile.fwd_flops, profile.fwd_macs, profile.params
        text = render_profile(
            profile,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            timing_lines=[("latencies from", latency_source), *extra_lines],
            run=self._run_context(),
            tree_depth=-1,  # DeepSpeed prints the whole model whatever module_depth is
        )
        if output_file:  # DeepSpeed treats "" as stdout too
            write_text(output_file, text + "\n")
        else:
            print(text)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str | None:
        """Print the top modules per depth; nothing (and None) without a profile."""
        check_report_args(module_depth, top_modules)
        if self._engine is None:
            return None
        text = render_aggregated(self.get_profile(), module_depth=module_depth, top_modules=top_modules)
        print(text)
        return text
