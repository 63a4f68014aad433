"""The package's shape: no import cycle between its modules, no module over about 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flops_callbacks"


def module_imports(path: Path) -> set[str]:
    """The package modules a module imports at run time: every import of ``flops_callbacks.*``, at any
    level, except those only for type checking."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for inner in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flops_callbacks"):
            if node.module == "flops_callbacks":
                found.update(f"flops_callbacks.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flops_callbacks."))
    modules = {f"flops_callbacks.{p.stem}" for p in PACKAGE.glob("*.py")}
    return found & modules


def graph() -> dict[str, set[str]]:
    return {
        f"flops_callbacks.{path.stem}": module_imports(path)
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }


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


def test_no_module_imports_itself_through_others() -> None:
    assert find_cycle(graph()) is None


def test_the_cycle_check_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_about_450_lines() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert max(sizes.values()) <= 460, {name: n for name, n in sizes.items() if n > 460}
