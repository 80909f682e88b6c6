"""The GPU backends call FlashInfer (and SGLang) only through ``ExternalCall`` table entries; this
checks every entry against the real library:

* installed: ``inspect.signature`` of the imported object (FlashInfer imports on a CPU-only
  machine with CPU torch; nothing is JIT-built at import);
* not installed: the library's wheel, read with ``ast`` without importing it. The wheel path
  comes from ``FASTVERIFY_FLASHINFER_WHEEL`` (``FASTVERIFY_SGLANG_WHEEL`` for SGLang); e.g.
  ``pip download --no-deps -d /tmp/fi flashinfer-python==0.7.4``.

A second check reads the backend modules' own source: every call on a library object passes its
arguments only as ``**ENTRY.kwargs(...)``, so the table is the whole truth about what is passed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

from fastverify.backends import flashinfer_fused  # noqa: E402
from fastverify.backends.base import ExternalCall  # noqa: E402
from fastverify.registry import BACKENDS  # noqa: E402

# Every registered backend's module, from the registry: a new backend's table is checked without
# editing this file. Modules without library calls (torch_dist) have no EXTERNAL_CALLS.
BACKEND_MODULES = tuple(
    importlib.import_module(m)
    for m in dict.fromkeys(b.module for b in BACKENDS)
    if hasattr(importlib.import_module(m), "EXTERNAL_CALLS")
)
CALLS: list[ExternalCall] = [c for m in BACKEND_MODULES for c in m.EXTERNAL_CALLS]
# FlashInfer ships b12x as ``flashinfer/experimental/b12x/`` and aliases it as top-level ``b12x``
# (``b12x/__init__.py``): imported objects report ``b12x.*`` module names, and b12x's own imports
# are spelled ``from b12x...``; both name the same files.
ALIASES = {"b12x": "flashinfer.experimental.b12x"}


def _canonical(module: str) -> str:
    head, _, rest = module.partition(".")
    return ALIASES[head] + (f".{rest}" if rest else "") if head in ALIASES else module


WHEEL_ENV = {"flashinfer": "FASTVERIFY_FLASHINFER_WHEEL", "sglang": "FASTVERIFY_SGLANG_WHEEL"}


def _top(call: ExternalCall) -> str:
    return call.public.split(".")[0]


def _ids(call: ExternalCall) -> str:
    return f"{call.public}.{call.qualname}"


def _import_error(name: str) -> str | None:
    """None when ``name`` imports, else why not (the exception's first line)."""
    try:
        importlib.import_module(name)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _not_importable_reason(call: ExternalCall, why: str, environ=os.environ) -> str:
    """The skip line of the installed check: what is really missing, and where the wheel check
    stands (it runs when the wheel variable is set, so the line never asks for it then)."""
    env = WHEEL_ENV[_top(call)]
    head = f"{call.public} is not installed here ({why})"
    if environ.get(env):
        return f"{head}; test_signature_wheel_source checks it against the wheel in {env}"
    return f"{head}; set {env} to a {_top(call)} wheel for the source check"


def test_every_registered_backend_module_is_checked():
    with_tables = {m.__name__ for m in BACKEND_MODULES}
    expected = {
        "fastverify.backends.flashinfer_pcie_ipc",
        "fastverify.backends.flashinfer_fused",
        "fastverify.backends.flashinfer_b12x",
        "fastverify.backends.sglang_custom_ar",
    }
    assert with_tables == expected
    assert {m for b in BACKENDS for m in [b.module]} - with_tables == {"fastverify.backends.torch_dist"}


def test_table_is_well_formed():
    assert len({_ids(c) for c in CALLS}) == len(CALLS), "duplicate table entries"
    for c in CALLS:
        assert c.kind in ("function", "class", "method", "attribute"), c
        assert c.kind != "attribute" or not c.params, c
        assert (c.kind == "method") == (c.qualname.count(".") == 1 and c.kind != "attribute"), c
        assert c.defined_in.startswith(_top(c)), c


def test_kwargs_refuses_names_outside_the_table():
    call = flashinfer_fused.ALLREDUCE_FUSION
    assert call.kwargs(input=1, use_oneshot=True) == {"input": 1, "use_oneshot": True}
    with pytest.raises(AssertionError, match="launch_with_pdll"):
        call.kwargs(launch_with_pdll=False)


# --- against the installed library -----------------------------------------------------------------


def _accepts(sig: inspect.Signature, names: tuple[str, ...]) -> list[str]:
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    usable = {n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [n for n in names if n not in usable]


@pytest.mark.parametrize("call", CALLS, ids=_ids)
def test_signature_installed(call: ExternalCall):
    why = _import_error(call.public)
    if why is not None:
        pytest.skip(_not_importable_reason(call, why))
    obj = call.resolve()
    if call.kind == "attribute":
        assert not callable(obj) or isinstance(obj, int)
        return
    owner = (
        call.resolve()
        if call.kind != "method"
        else ExternalCall(call.public, call.qualname.split(".")[0], call.defined_in).resolve()
    )
    assert _canonical(inspect.getmodule(owner).__name__) == call.defined_in, "defined_in is what the source test reads"
    sig = inspect.signature(obj)
    missing = _accepts(sig, call.params)
    assert not missing, f"{_ids(call)}{sig} has no parameter(s) {missing}"


# --- against the wheel's source, without importing ---------------------------------------------------


class WheelSource:
    def __init__(self, path: str) -> None:
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            for candidate in (f"{base}.py", f"{base}/__init__.py"):
                if candidate in self.names:
                    self._trees[dotted] = ast.parse(self.zip.read(candidate).decode(), filename=candidate)
                    break
            else:
                raise AssertionError(f"{dotted} not found in the wheel")
        return self._trees[dotted]

    def is_package(self, dotted: str) -> bool:
        return f"{dotted.replace('.', '/')}/__init__.py" in self.names

    def locate(self, dotted: str, name: str, depth: int = 0) -> tuple[str, str]:
        """(module, name) where ``name`` as seen from module ``dotted`` is really defined: follows
        ``from X import A as name`` re-exports (including ``if TYPE_CHECKING:`` ones, which
        document lazy exports) to the defining module."""
        assert depth < 8, f"re-export chain too long at {dotted}.{name}"
        tree = self.module(dotted)
        if _find(tree.body, name) is not None:
            return dotted, name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for al in node.names:
                    if (al.asname or al.name) == name:
                        if node.level:
                            pkg = dotted if self.is_package(dotted) else dotted.rsplit(".", 1)[0]
                            for _ in range(node.level - 1):
                                pkg = pkg.rsplit(".", 1)[0]
                            target = f"{pkg}.{node.module}" if node.module else pkg
                        else:
                            target = _canonical(node.module or "")
                        return self.locate(target, al.name, depth + 1)
        raise AssertionError(f"{dotted} neither defines nor imports {name}")


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    found = None
    for node in body:  # the last definition wins, as at import time
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = node
    return found


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def _param_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    return {p.arg for p in a.args + a.kwonlyargs} - {"self", "cls"}, a.kwarg is not None


def _exported(tree: ast.Module, name: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((al.asname or al.name) == name for al in node.names):
            return True
    return _find(tree.body, name) is not None


@pytest.fixture(scope="module")
def wheels() -> dict[str, WheelSource]:
    return {top: WheelSource(os.environ[env]) for top, env in WHEEL_ENV.items() if os.environ.get(env)}


@pytest.mark.parametrize("call", CALLS, ids=_ids)
def test_signature_wheel_source(call: ExternalCall, wheels):
    top = _top(call)
    if top not in wheels:
        pytest.skip(f"set {WHEEL_ENV[top]} to a {top} wheel to check against its source")
    src = wheels[top]
    head, *rest = call.qualname.split(".")
    assert _exported(src.module(call.public), head), f"{call.public} does not export {head}"
    where, real_name = src.locate(call.public, head)
    assert where == call.defined_in, f"{call.public}.{head} is defined in {where}, the table says {call.defined_in}"
    node = _find(src.module(call.defined_in).body, real_name)
    assert node is not None, f"{head} not defined in {call.defined_in}"
    if rest:
        assert isinstance(node, ast.ClassDef), f"{head} is not a class"
        node = _find(node.body, rest[0])
        assert node is not None, f"{call.qualname} not defined in {call.defined_in}"
    if call.kind == "attribute":
        assert isinstance(node, (ast.Assign, ast.AnnAssign)), f"{call.qualname} is not a constant"
        return
    if call.kind == "class":
        assert isinstance(node, ast.ClassDef)
        init = _find(node.body, "__init__")
        if init is None and _is_dataclass(node):
            fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            missing = [n for n in call.params if n not in fields]
            assert not missing, f"dataclass {head} in {call.defined_in} has no field(s) {missing}"
            return
        node = init
        assert node is not None, f"{head} has no __init__ of its own"
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{call.qualname} is not a function"
    names, var_kw = _param_names(node)
    missing = [] if var_kw else [n for n in call.params if n not in names]
    assert not missing, f"{call.qualname} in {call.defined_in} has no parameter(s) {missing}; it has {sorted(names)}"


# --- the backends pass library arguments only through the table ------------------------------------


def _library_receivers(mod) -> set[str]:
    """Attributes of ``self`` holding library objects: assigned from ``X.resolve()`` or a call of it."""
    tree = ast.parse(Path(mod.__file__).read_text())
    receivers = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                if "resolve" in ast.unparse(node.value):
                    receivers.add(t.attr)
    return receivers


@pytest.mark.parametrize("mod", BACKEND_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_backends_call_libraries_only_through_the_table(mod):
    source = Path(mod.__file__).read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert not any(n.split(".")[0] == "flashinfer" for n in names), (
                f"direct flashinfer import: {ast.unparse(node)}"
            )
    receivers = _library_receivers(mod)
    table_methods = {c.qualname.split(".")[-1] for c in mod.EXTERNAL_CALLS if c.kind == "method"}
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        # self._ws.method(...) or self._fn(...) where _ws/_fn came from a table entry
        recv = func.value if isinstance(func, ast.Attribute) else None
        if (
            isinstance(func, ast.Attribute)
            and isinstance(recv, ast.Attribute)
            and isinstance(recv.value, ast.Name)
            and recv.value.id == "self"
            and recv.attr in receivers
        ):
            assert func.attr in table_methods, f"{ast.unparse(node)}: method not in the table"
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and func.attr in receivers
        ):
            pass
        elif isinstance(func, ast.Call) and isinstance(func.func, ast.Attribute) and func.func.attr == "resolve":
            pass  # ENTRY.resolve()(...)
        else:
            continue
        checked += 1
        assert not node.args, f"{ast.unparse(node)}: pass arguments by keyword through the table"
        for kw in node.keywords:
            assert (
                kw.arg is None and isinstance(kw.value, ast.Call) and ast.unparse(kw.value.func).endswith(".kwargs")
            ), f"{ast.unparse(node)}: use **ENTRY.kwargs(...)"
    assert checked >= 3, "the scan found no library calls; the receivers pattern no longer matches"
