"""Comments and docstrings in ``fastverify/`` stand on their own: none cites a file outside the
package (``STYLE.md``, ``../shared/...``, ``shared/research/...``) or a numbered issue of this
project's tracker. Public sources are fine (``SGLang 0.5.23 srt/...``, ``NVIDIA/nccl#1027``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastverify"
FORBIDDEN = re.compile(r"STYLE\.md|\.\./shared|shared/research|\bissue \d+", re.IGNORECASE)

# Files allowed to cite such documents: none.
_PENDING: frozenset[str] = frozenset()


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in ``source``."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _hits() -> dict[str, list[str]]:
    hits: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for line, text in _texts(path.read_text(encoding="utf-8")):
            for m in FORBIDDEN.finditer(text):
                hits.setdefault(rel, []).append(f"{rel}:{line}: {m.group(0)!r}")
    return hits


def test_no_comment_cites_outside_files_or_issue_numbers():
    bad = [h for rel, found in _hits().items() if rel not in _PENDING for h in found]
    assert not bad, "comments/docstrings must stand on their own:\n" + "\n".join(bad)



MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _kept_whole_file(tree: ast.Module) -> bool:
    doc = ast.get_docstring(tree) or ""
    return "kept whole:" in doc.split("\n", 1)[0].lower()


def _kept_whole_function(node: ast.AST) -> bool:
    doc = ast.get_docstring(node) or ""
    return any(line.strip().startswith("Kept whole:") for line in doc.splitlines())


def test_files_and_functions_hold_one_job_or_say_why_not():
    """Every module is at most 500 lines and every function at most 80 (docstring included), unless
    the module docstring's first line says ``kept whole: <why>`` or the function's docstring has a
    line ``Kept whole: <why>``."""
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        n = len(source.splitlines())
        if n > MAX_FILE_LINES and not _kept_whole_file(tree):
            long_files.append(f"{rel}: {n} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                k = node.end_lineno - node.lineno + 1
                if k > MAX_FUNCTION_LINES and not _kept_whole_function(node):
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {k} lines")
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports when it is imported (module body, not inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in known and m != me}


def test_no_import_circle_at_import_time():
    """No two modules of the package import each other, directly or round a longer circle, when
    imported (module-level imports; a lazy import of a heavy library inside a function is fine)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _top_level_imports(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return trail + [m, t]
            if t not in state and (found := visit(t, trail + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m, [])):
            raise AssertionError("import circle: " + " -> ".join(circle))
