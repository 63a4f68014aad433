"""The package's shape: layers and feature rooms as subpackages that import one way, no import cycle between
modules (type-checking imports included), no module over 500 lines, ``__all__`` in every module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flops_callbacks"
# Lowest first: a module may import its own layer or room and those before it. The base is the package's
# top-level modules (plain data, units, options, the guard); the layers and the rooms are its subpackages;
# the entry points sit above them all.
ORDER = (
    "base",
    "timing",
    "counting",
    "communication",  # a room: recorded by the session's communication steps, held in its result
    "session",
    "reporting",
    "generation",  # a room: its report and file reuse the reporting layer's sections, picture and reader
    "integrations",
    "entry",
)
ROOMS = ("communication", "generation")  # a feature that crosses the layers, each in one folder
# The package's entry points: its __init__ (the public names), ``python -m``'s __main__ and the command line.
ENTRY_POINTS = {"flops_callbacks", "flops_callbacks.__main__", "flops_callbacks.cli"}
MAX_LINES = 500  # a module's cap, as docs/architecture.md says


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in ENTRY_POINTS:
        return "entry"
    parts = module.split(".")
    subpackage = len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir())
    return parts[1] if subpackage else "base"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The package modules a module imports, at any level, type-checking imports included (the package
    itself left out: ``from flops_callbacks import metrics`` imports ``metrics``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flops_callbacks"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flops_callbacks"))
    return (found & known) - {"flops_callbacks"}


def graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known)
    return {name: module_imports(path, names) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports in ``edges`` (module -> modules it imports), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(edges.get(module, ())):
            cycle = visit(imported, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next((c for m in sorted(edges) if (c := visit(m, []))), None)


def upward_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a layer imports a layer above it."""
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(
        (module, imported)
        for module, imports in edges.items()
        for imported in imports
        if rank[layer(imported)] > rank[layer(module)]
    )


def test_no_module_imports_itself_through_others_not_even_for_type_checking() -> None:
    assert find_cycle(graph()) is None


def test_the_cycle_check_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_layers_and_rooms_are_the_subpackages_and_import_only_downward() -> None:
    edges = graph()
    assert {layer(m) for m in modules()} == set(ORDER)
    assert upward_imports(edges) == []


def test_the_layer_check_sees_an_upward_import() -> None:
    edges = {"flops_callbacks.counting.engine": {"flops_callbacks.session.meter", "flops_callbacks.profile"}}
    assert upward_imports(edges) == [("flops_callbacks.counting.engine", "flops_callbacks.session.meter")]
    edges = {"flops_callbacks.session.result": {"flops_callbacks.generation.result"}}
    assert upward_imports(edges) == [("flops_callbacks.session.result", "flops_callbacks.generation.result")]


def test_every_module_of_a_feature_is_in_its_room_and_each_room_says_what_it_owns_in_two_lines() -> None:
    features = ("comm", "generation")
    outside = [
        name
        for name in modules()
        if layer(name) not in ROOMS and any(word in name.rsplit(".", 1)[-1] for word in features)
    ]
    assert outside == []
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
        assert doc is not None and len(doc.splitlines()) == 2, room


def test_no_module_is_over_500_lines() -> None:
    sizes = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
    }
    assert max(sizes.values()) <= MAX_LINES, {name: n for name, n in sizes.items() if n > MAX_LINES}


def test_every_module_says_what_it_exports() -> None:
    missing = [
        name
        for name, path in modules().items()
        if path.name != "__init__.py"
        and not any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            for node in ast.parse(path.read_text()).body
        )
    ]
    assert missing == []
