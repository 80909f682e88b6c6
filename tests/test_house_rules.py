"""Comments and docstrings in ``fastverify/`` stand on their own: none cites a file outside the
package (``STYLE.md``, ``../shared/...``, ``shared/research/...``) or a numbered issue of this
project's tracker. Public sources are fine (``SGLang 0.5.23 srt/...``, ``NVIDIA/nccl#1027``).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastverify"
FORBIDDEN = re.compile(r"STYLE\.md|\.\./shared|shared/research|\bissue \d+", re.IGNORECASE)

# Files allowed to cite such documents: none.
_PENDING: frozenset[str] = frozenset()


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in ``source``."""
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
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


LAZY = re.compile(r"#\s*lazy:\s*([A-Za-z_][\w.]*)")
"""The comment a function-level import of the package's own module carries: the heavy library it
keeps off the CLI's start-up path (``# lazy: torch``)."""
HEAVY = frozenset({"torch", "flashinfer", "sglang", "matplotlib", "numpy", "rich"})
"""The libraries worth keeping off start-up: each takes from a tenth of a second (rich's console:
0.17 s measured here; numpy) to seconds (torch, sglang) to import."""
DEFERRED = {
    "fastverify.cli": "subcommand",
    "fastverify.patch": "plugin",
    "fastverify.patch.sitecustomize.sitecustomize": "plugin",
}
"""The modules whose function-level imports may name what they defer instead of a heavy library: the
CLI imports the one command it runs (``# lazy: subcommand``), and SGLang's plugin entry point and the
sitecustomize hook, loaded in every SGLang process, import the patch only where ``FASTVERIFY_PATCH=1``
asks for it (``# lazy: plugin``)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, me: str, is_pkg: bool, known: set[str]) -> tuple[set[str], set[str]]:
    """(the package modules, the outside top-level packages) one import statement names."""
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:
            pkg = me if is_pkg else me.rpartition(".")[0]
            anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    own = {n for n in names if n in known and n != me}
    outside = {n.split(".")[0] for n in names if not n.startswith("fastverify")}
    return own, outside


class _Module:
    """One module's imports: every import statement anywhere in it (``own``), those run when the
    module is imported (``top_own``, ``top_outside``), and its function-level imports of the
    package's own modules with their line text (``inner``)."""

    def __init__(self, path: Path, known: set[str]) -> None:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        me, is_pkg = _module_name(path), path.name == "__init__.py"
        self.own: set[str] = set()
        self.top_own: set[str] = set()
        self.top_outside: set[str] = set()
        self.inner: list[tuple[int, set[str], str]] = []
        inside = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if n is not f
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                own, outside = _targets(node, me, is_pkg, known)
                self.own |= own
                if id(node) in inside:
                    if own:
                        self.inner.append((node.lineno, own, " ".join(lines[node.lineno - 1 : node.end_lineno])))
                else:
                    self.top_own |= own
                    self.top_outside |= outside


def _modules() -> dict[str, _Module]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _Module(p, set(paths)) for m, p in paths.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
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
            return circle
    return None


def test_no_import_circle_function_level_imports_included():
    """No two modules of the package import each other, directly or round a longer circle, counting
    every import statement (a function-level one too: it hides the circle from the module graph, it
    does not remove the dependency)."""
    modules = _modules()
    circle = _circle({m: mod.own for m, mod in modules.items()})
    assert circle is None, "import circle: " + " -> ".join(circle)


def _loaded_outside(modules: dict[str, _Module], start: set[str]) -> set[str]:
    """The outside packages importing ``start`` loads (module-level imports, followed through the
    package's own modules)."""
    seen, todo, outside = set(), list(start), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules]
        outside |= modules[m].top_outside
        todo += modules[m].top_own
    return outside


def test_function_level_imports_of_own_modules_say_what_they_keep_off_start_up():
    """A function-level import of a fastverify module is there only to keep a heavy library off the
    CLI's start-up path, and says which (``# lazy: torch``): one of :data:`HEAVY` that importing the
    target really loads (followed through its module-level imports), not a guess."""
    modules = _modules()
    bad = []
    for m, mod in sorted(modules.items()):
        for line, own, text in mod.inner:
            found = LAZY.search(text)
            if found is None:
                bad.append(f"{m}:{line}: no '# lazy: <dependency>': {text.strip()}")
            elif DEFERRED.get(m) == found.group(1):
                continue
            elif found.group(1) not in HEAVY:
                bad.append(f"{m}:{line}: '# lazy: {found.group(1)}' names none of {sorted(HEAVY)}")
            elif found.group(1) not in _loaded_outside(modules, own):
                bad.append(f"{m}:{line}: '# lazy: {found.group(1)}', but importing {sorted(own)} does not load it")
    assert not bad, f"{len(bad)} function-level imports:\n" + "\n".join(bad)


QUIET_TRACE_RUN = """
import sys
from fastverify import cli
try:
    cli.main(["profile", "--trace", sys.argv[1], "--no-png", "--quiet", "--output", sys.argv[2]])
except SystemExit as e:
    assert not e.code, e.code
print("loaded:", *sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[3:])))
"""


def test_a_quiet_trace_profile_loads_no_printer_plotter_or_torch(tmp_path):
    """``profile --trace F --no-png --quiet`` (the path the trace benchmark times) prints no table
    and draws nothing: rich, matplotlib and torch stay unloaded (a module merge that moved the
    table's rich imports to the command's top once put rich on it)."""
    trace = PACKAGE.parent / "tests" / "data" / "ns_timestamps" / "ns_fractions.trace.json.gz"
    heavy = ["rich", "matplotlib", "torch"]
    cp = subprocess.run(
        [sys.executable, "-c", QUIET_TRACE_RUN, str(trace), str(tmp_path / "p.json"), *heavy],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert (tmp_path / "p.json").is_file()
    assert cp.stdout.splitlines()[-1] == "loaded:", f"on the quiet trace path: {cp.stdout.strip()}"


def _layout_paths() -> list[str]:
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return [p for p in re.findall(r"`([\w./-]+)`", section) if p.endswith((".py", "/"))]


def test_the_readme_layout_names_only_paths_that_exist():
    """Every file or folder the README's Layout names (under ``fastverify/``, or beside it) exists,
    and every package folder of ``fastverify/`` is named there."""
    paths = _layout_paths()
    root = PACKAGE.parent
    missing = [p for p in paths if not (PACKAGE / p).exists() and not (root / p).exists()]
    assert len(paths) > 30 and not missing, f"README Layout names missing paths: {missing}"
    folders = {f"{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists() and d.name != "data"}
    assert not folders - set(paths), f"README Layout leaves out {sorted(folders - set(paths))}"


TESTS = Path(__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of each use of a package private name in a test: ``from fastverify.x import
    _y``, ``mod._y`` on a name bound to a package module or object, and ``setattr(mod, "_y", ...)``
    (``monkeypatch.setattr`` included). Names of SGLang, FlashInfer or any other library are not
    the package's and do not count."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names bound to something imported from the package
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fastverify":
                    bound.add(a.asname or "fastverify")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fastverify":
            for a in node.names:
                if _private(a.name):
                    out.append((node.lineno, f"from {node.module} import {a.name}"))
                bound.add(a.asname or a.name)

    def root(node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) and node.id in bound else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and root(node.value):
            out.append((node.lineno, f"{ast.unparse(node)}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ("setattr", "delattr")
            and len(node.args) >= 2
        ):
            target, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                if root(target):
                    out.append((node.lineno, f"setattr({ast.unparse(target)}, {name.value!r})"))
            elif isinstance(target, ast.Constant) and isinstance(target.value, str):
                dotted = target.value  # monkeypatch.setattr("fastverify.x._y", value)
                if dotted.split(".")[0] == "fastverify" and _private(dotted.rsplit(".", 1)[-1]):
                    out.append((node.lineno, f"setattr({dotted!r})"))
    return sorted(out)


def test_tests_use_the_packages_public_names_only():
    """A test reaches the package through its public names: a private name it needs is either a
    real part of its module's job (then it is public) or reached through the public function that
    uses it."""
    bad = [
        f"{path.relative_to(TESTS.parent).as_posix()}:{line}: {what}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, what in _private_uses(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "tests use private names of fastverify:\n" + "\n".join(bad)


def test_the_private_name_rule_sees_each_form():
    src = (
        "import fastverify.inputs as I\n"
        "from fastverify import doctor\n"
        "from fastverify.tune.sweep import _collect, run_sweep\n"
        "import torch\n"
        "I._warned\n"
        "doctor.gpu._verdict\n"
        "run_sweep.__name__\n"
        "torch._C\n"
        "monkeypatch.setattr(doctor, '_out', None)\n"
        "monkeypatch.setattr(torch, '_x', None)\n"
        "monkeypatch.setattr('fastverify.procs._ticks', None)\n"
    )
    assert [w for _, w in _private_uses(src)] == [
        "from fastverify.tune.sweep import _collect",
        "I._warned",
        "doctor.gpu._verdict",
        "setattr(doctor, '_out')",
        "setattr('fastverify.procs._ticks')",
    ]
