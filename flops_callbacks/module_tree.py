"""The profiled model's module tree: qualified names, ancestors, and parameter counts per module; and
whether (and how) any of it was ``torch.compile``d, with the switch that runs it eagerly meanwhile.

Built once per trace from one walk of the model. Why not ``named_modules(remove_duplicate=False)``:
it yields the same through one generator per level, which costs several times this walk, and a
trace is set up for every profiled step.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Container, Iterable

import torch

from flops_callbacks.parallel import stored_numel

__all__ = [
    "dynamo_compiled_anything",
    "eager_compiled_code",
    "compiled_in_place",
    "has_compiled",
    "ModuleTree",
    "ancestors",
    "depth_of",
    "fill_uncalled",
    "parent_in",
]


_CONTAINER_FORWARDS = (torch.nn.Module.forward, torch.nn.Sequential.forward)


class ModuleTree:
    """Names, ancestors and parameter holders of ``model``'s modules (except ``ignore_types``).

    A shared module is profiled under its first name; ``torch.compile``'s wrapper (an
    ``OptimizedModule``) is left out, the module it wraps named in its place; a module of an ignored
    type is not profiled (``ignored``): its own work counts towards its nearest profiled ancestor, its
    children are profiled.

    Args:
        model: the model whose modules are named.
        ignore_types: module types that get no record of their own.
    """

    def __init__(self, model: torch.nn.Module, ignore_types: tuple[type, ...] = ()) -> None:
        self.paths = _module_paths(model)
        self.modules: dict[str, torch.nn.Module] = {}  # profiled modules by name, parents first
        self.names: dict[int, str] = {}  # by id(module)
        self.ignored: dict[str, torch.nn.Module] = {}  # modules of an ignored type by name, parents first
        for name, module in self.paths:
            if name and _own_type(module) in ignore_types:  # the type itself (DeepSpeed), not a subclass
                self.ignored.setdefault(name, module)
                continue
            wrapper = self.modules.get(name)
            if wrapper is not None and wrapper._modules.get("_orig_mod") is module:
                del self.names[id(wrapper)]  # torch.compile's wrapper: its name is the model's it wraps
            elif id(module) in self.names or name in self.modules:
                continue  # a module seen under an earlier name
            self.names[id(module)] = name
            self.modules[name] = module
        self.ancestors: dict[str, list[str]] = {}
        for name in self.modules:  # walk order: every parent before its children
            self.ancestors[name] = self.ancestors_of(name)
        # ancestors whose children may be called past them: those that cannot be called (ModuleList,
        # ModuleDict) and those whose forward only calls their children (nn.Sequential: looped over, cut by
        # checkpoint_sequential); a module with a forward of its own called past keeps to its own calls
        containers = {name for name, m in self.modules.items() if type(m).forward in _CONTAINER_FORWARDS}
        self.container_ancestors = {
            name: [a for a in ancestors if a in containers] for name, ancestors in self.ancestors.items()
        }
        self._param_holders: list[tuple[torch.nn.Parameter, tuple[str, ...]]] | None = None  # when read

    def ancestors_of(self, name: str) -> list[str]:
        """Profiled modules above ``name``, outermost first (each derived from its parent's, once).

        Args:
            name: a module's qualified name.
        """
        found = self.ancestors.get(name)
        if found is not None:
            return found
        if not name:
            return []
        parent = name.rpartition(".")[0]
        above = self.ancestors_of(parent)
        return above + [parent] if parent in self.modules else above

    def between(self, outer: str | None, name: str) -> list[str]:
        """The modules a call of ``name`` made inside a call of ``outer`` is in without entering them: the
        containers between the two (``ModuleList``, ``ModuleDict``, an ``nn.Sequential`` looped over, as
        DeepSpeed's sums over the tree hold them); none where ``name`` is not below ``outer`` (a shared
        module called from outside its own parent: no static path); with no call open (``outer`` None: a
        submodule called from outside the model), every module above it. The counting engine gives them
        its work, the module timer its backward.

        Args:
            outer: the innermost call open around it, or None.
            name: the module called.
        """
        if outer is None:
            return self.ancestors[name]
        containers = self.container_ancestors[name]
        if not containers or (outer and not name.startswith(outer + ".")):
            return []
        return [a for a in containers if a.startswith(outer + ".") or (not outer and a)]

    def holders(self, called: Container[str]) -> Callable[[tuple[str, ...]], tuple[str, ...]]:
        """The modules that hold the work or time given to some modules in a step: them, and every module
        above one of them never ``called`` in it. What submodules did, called past their parent
        (``vgg.features(x)``: the backbone's forward never ran), is the parent's too, as in DeepSpeed's
        sums over the tree (:func:`fill_uncalled` gives it their time). Answers are kept per modules."""

        @functools.cache
        def held(names: tuple[str, ...]) -> tuple[str, ...]:
            found = dict.fromkeys(names)
            for name in names:
                for above in self.ancestors.get(name, ()):
                    if above not in called:
                        found[above] = None
            return tuple(found)

        return held

    def param_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Parameters (all, trainable) under each module, each tensor once per module (tied ones
        count in every module that holds them); a sharded parameter counts this device's shard."""
        params = dict.fromkeys(self.modules, 0)
        trainable = dict.fromkeys(self.modules, 0)
        if self._param_holders is None:
            self._param_holders = self._holders_of_params()
        for param, holders in self._param_holders:
            numel = stored_numel(param)
            for name in holders:
                params[name] += numel
                if param.requires_grad:
                    trainable[name] += numel
        return params, trainable

    def _holders_of_params(self) -> list[tuple[torch.nn.Parameter, tuple[str, ...]]]:
        """Each parameter with the profiled modules that hold it (its owners and their ancestors)."""
        holders: dict[int, tuple[torch.nn.Parameter, dict[str, None]]] = {}
        for owner, module in self.paths:
            params = [p for p in module._parameters.values() if p is not None]
            if not params:
                continue
            names = [n for n in (*self.ancestors_of(owner), owner) if n in self.modules]
            for param in params:
                holders.setdefault(id(param), (param, {}))[1].update(dict.fromkeys(names))
        return [(param, tuple(names)) for param, names in holders.values()]

    def has_compiled(self) -> bool:
        """Whether any module was ``torch.compile``d (without importing dynamo if unused)."""
        return has_compiled(module for _, module in self.paths)


def _module_paths(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (qualified name, module) of ``model``, parents first, a shared module under each of its
    names; ``torch.compile``'s ``_orig_mod`` wrapper level is left out of the names."""
    paths: list[tuple[str, torch.nn.Module]] = []
    pending = [("", model)]
    while pending:
        name, module = pending.pop()
        paths.append((name, module))
        children = [
            (name if child == "_orig_mod" else f"{name}.{child}" if name else child, sub)
            for child, sub in module._modules.items()
            if sub is not None
        ]
        pending.extend(reversed(children))
    return paths


def dynamo_compiled_anything() -> bool:
    """Whether dynamo compiled any graph in this process (a compiled function that calls modules
    leaves no mark on them; hooks put on them would then change what dynamo guards on)."""
    return bool(_dynamo_count("stats", "unique_graphs"))


def dynamo_frames() -> int:
    """The frames dynamo has compiled (or tried to) in this process: one more is a compile."""
    return _dynamo_count("frames", "total")


def _dynamo_count(group: str, name: str) -> int:
    """One of dynamo's counters (0 where dynamo is not loaded: it is never imported here)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters[group].get(name, 0))


def has_compiled(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether any of ``modules`` was ``torch.compile``d, in any of the ways that leave a mark on it:
    wrapped (``torch.compile(module)``: an ``OptimizedModule``), in place (``module.compile()``), or
    through a compiled method set on the instance (``module.forward = torch.compile(module.forward)``,
    which is what Lightning's ``from_compiled`` does to a compiled LightningModule). Dynamo is never
    imported here: if it is not loaded, nothing can be compiled.

    Args:
        modules: the modules to look at.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    optimized = eval_frame.OptimizedModule
    return any(
        isinstance(m, optimized)
        or compiled_in_place(m)
        or any(_compiled_function(v) for v in vars(m).values())
        for m in modules
    )


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled it: its own call runs compiled, its hooks inside the frame.

    Args:
        module: the module to look at.
    """
    return getattr(module, "_compiled_call_impl", None) is not None


def _compiled_function(value: object) -> bool:
    """A function ``torch.compile`` wrapped (``torch._dynamo.disable`` leaves the same mark, and a flag)."""
    return hasattr(value, "_torchdynamo_orig_callable") and not getattr(value, "_torchdynamo_disable", False)


def eager_compiled_code() -> contextlib.AbstractContextManager[None]:
    """While a profiler's hooks and modes are on, compiled code runs eagerly: every op is seen, and
    dynamo never traces the hooks (it would recompile each compiled frame for them, once per module
    type, and hit its recompile limit). Entered whenever dynamo is loaded, compiled or not: a compiled
    function that calls modules leaves no mark on them. ``set_stance`` is not part of dynamo's guards,
    so the compiled graphs run again, unchanged, once it is left (torch >= 2.6 has it)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _own_type(module: torch.nn.Module) -> type:
    """The class ``module`` was made as: FSDP2's ``fully_shard`` swaps a block's class for one made on the
    fly (``FSDPBlock``, bases ``FSDPModule`` and ``Block``), which ``ignore_list=[Block]`` means too."""
    cls = type(module)
    bases = cls.__bases__
    return bases[1] if len(bases) == 2 and bases[0].__name__ == "FSDPModule" else cls


def ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b"]``: the names above a module, the model first.

    Args:
        name: a module's qualified name.
    """
    if not name:
        return []
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def depth_of(name: str) -> int:
    """0 for the model (``""``), 1 for its children, and so on.

    Args:
        name: a module's qualified name.
    """
    return name.count(".") + 1 if name else 0


def fill_uncalled(table: dict[str, float]) -> None:
    """Seconds by module: a module never called (a ``ModuleList``, one whose submodules were called past
    it) takes the sum of its nearest called submodules' (:meth:`ModuleTree.holders`).

    Args:
        table: seconds by the name of each module called; filled in place.
    """
    own = set(table)
    for name in sorted(own, key=lambda n: -n.count(".")):
        for above in reversed(ancestors(name)):
            if above in own:
                break
            table[above] = table.get(above, 0.0) + table[name]


def parent_in(name: str, known: Container[str]) -> str:
    """The nearest ancestor of ``name`` among ``known`` names (the model, ``""``, when none is).

    Args:
        name: a module's qualified name.
        known: the names that may be its parent.
    """
    return next((a for a in reversed(ancestors(name)) if a in known), "")
