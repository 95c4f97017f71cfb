"""The project's import graph, read from the source with ast: no module imports itself through
others, no two subpackages import each other, and the layers import one way only, each from those
below it: transport < runtime < api < actors < benchmarks. Every import statement counts, inside a
function or under TYPE_CHECKING too, so a circle cannot hide behind a late import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("transport", "runtime", "api", "actors", "benchmarks")  # each may import only from itself and those before it


def _modules() -> dict[str, Path]:
    """Dotted name -> file, packages by their __init__.py."""
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path) -> set[str]:
    """The dotted names one module's import statements name: `from a.b import c` names a.b.c (a
    module or, where no such module is, something of a.b's)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module
            names.update(f"{base.rstrip('.')}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports."""
    modules = _modules()

    def owner(dotted: str) -> str | None:  # the longest prefix that is one of our modules
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    return {name: {m for d in _imported(name, path) if (m := owner(d)) and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as the nodes along it, the first repeated at the end; [] where there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return path[path.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        path.pop()
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_cycle_finder_finds_a_cycle_and_only_one_that_exists() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    assert find_cycle(import_graph()) == []


def test_no_two_subpackages_import_each_other() -> None:
    """runtime.engine, runtime.models, runtime.attention and the like: a package above them (runtime/
    itself) may serve them all, but none may reach back into one that imports it."""
    graph = import_graph()
    modules = _modules()

    def package(name: str) -> str:
        return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]

    subpackages: dict[str, set[str]] = {}
    for name, imported in graph.items():
        outside = {package(m) for m in imported} - {package(name)}
        if "." in package(name):
            subpackages.setdefault(package(name), set()).update(p for p in outside if "." in p)
    assert find_cycle(subpackages) == []


def test_layers_import_only_from_below() -> None:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted(
        f"{name} -> {m}" for name, imported in import_graph().items() for m in imported if rank[m.split(".")[0]] > rank[name.split(".")[0]]
    )
    assert upward == []
