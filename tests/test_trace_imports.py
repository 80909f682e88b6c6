"""The modules of fastverify/trace/ import each other without a circle.

The graph is read from the source (``ast``), counting every import: at module top and inside
functions alike, since a function-level import is how a circle usually hides.
"""

from __future__ import annotations

import ast
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "fastverify" / "trace"
PACKAGE = "fastverify.trace"


def _modules() -> dict[str, Path]:
    """Module name within the package (``load``; ``__init__`` for the package) -> file."""
    return {p.stem: p for p in sorted(TRACE.glob("*.py"))}


def _targets(node: ast.AST, names: set[str]) -> set[str]:
    """The modules of the package (names in ``names``) one import statement imports."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE:
                found.add("__init__")
            elif alias.name.startswith(PACKAGE + "."):
                found.add(alias.name[len(PACKAGE) + 1 :].split(".")[0])
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from . import x / from .x import y (all inside this package)
            base = node.module.split(".")[0] if node.module else None
        elif node.module == PACKAGE:
            base = None
        elif node.module and node.module.startswith(PACKAGE + "."):
            base = node.module[len(PACKAGE) + 1 :].split(".")[0]
        else:
            return found
        if base is not None:
            found.add(base)
        else:  # from fastverify.trace import load: the submodule, or a name of __init__
            for alias in node.names:
                found.add(alias.name if alias.name in names else "__init__")
    return {t for t in found if t in names}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    names = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {t for node in ast.walk(tree) for t in _targets(node, names)} - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``; None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_is_read_from_every_trace_module():
    graph = _graph()
    assert {"load", "decode", "columns", "build"} <= set(graph)
    # the shared internals are imported by each reader, and import none of them
    for reader in ("load", "columns", "build"):
        assert "decode" in graph[reader], reader
    assert not graph["decode"] - {"classify", "__init__"}


def test_the_cycle_finder_finds_a_circle_and_a_function_level_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def f():\n    from fastverify.trace.load import x\n    from . import cpu\n")
    got = {t for node in ast.walk(tree) for t in _targets(node, {"load", "cpu"})}
    assert got == {"load", "cpu"}


def test_trace_modules_import_each_other_without_a_circle():
    graph = _graph()
    assert _cycle(graph) is None, f"import circle in fastverify/trace: {' -> '.join(_cycle(graph))}"
