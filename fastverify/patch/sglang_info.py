"""What the launcher's Python can see of an SGLang, found without importing it, and the
``fastverify patch --check`` command built on it.

SGLang is located with ``importlib.util.find_spec`` (or given as a source tree) and its files are
looked at on disk: whether it has general plugins (``sglang/srt/plugins/__init__.py``, group
``sglang.srt.plugins``), which of the registry's switch modules exist (SGLang 0.5.23
``srt/distributed/device_communicators/pcie_ipc_ar.py``), its version, and whether fastverify's plugin
entry point is installed (:func:`detect_sglang`). :func:`check` reads the same files with ``ast``:
which patch targets resolve and which route would load the patch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fastverify.errors import UserError
from fastverify.patch.handoff import PLUGIN_GROUP, PLUGIN_NAME, ROUTE_HOOK, ROUTE_PLUGIN
from fastverify.patch.targets import TARGETS, Target
from fastverify.registry import BACKENDS as REGISTRY, BackendInfo

_SWITCH_MODULES = tuple(b.sglang_switch_module for b in REGISTRY if b.sglang_switch_module)


@dataclass(frozen=True)
class SGLangInfo:
    """What the launcher's interpreter can see of SGLang, without importing it.

    ``switch_modules``: the registry's ``sglang_switch_module`` names whose file exists in this
    SGLang (0.5.23 has ``...device_communicators.pcie_ipc_ar``, the ``pcie_ipc`` switch).
    """

    found: bool
    location: str | None = None
    version: str | None = None
    has_plugins: bool = False  # sglang/srt/plugins/__init__.py with the general-plugin group
    entry_point_installed: bool = False  # fastverify registered in group sglang.srt.plugins
    switch_modules: frozenset[str] = frozenset()

    def has_switch(self, info: BackendInfo) -> bool:
        """Whether this SGLang has ``info``'s own switchable implementation."""
        return info.sglang_switch_module is not None and info.sglang_switch_module in self.switch_modules


def detect_sglang(sglang_dir: str | Path | None = None) -> SGLangInfo:
    """Locate SGLang (``sglang_dir``: the ``sglang`` package folder; default: ``find_spec``) and
    report which mechanisms its files have. Never imports SGLang."""
    if sglang_dir is None:
        try:
            spec = importlib.util.find_spec("sglang")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return SGLangInfo(found=False, entry_point_installed=_entry_point_installed())
        root = Path(list(spec.submodule_search_locations)[0])
    else:
        root = Path(sglang_dir)
        if not (root / "srt").is_dir():
            return SGLangInfo(found=False, location=str(root), entry_point_installed=_entry_point_installed())
    plugins = root / "srt" / "plugins" / "__init__.py"
    try:
        has_plugins = plugins.is_file() and PLUGIN_GROUP in plugins.read_text(encoding="utf-8", errors="replace")
    except OSError:
        has_plugins = False
    version = None
    try:
        version = importlib.metadata.version("sglang") if sglang_dir is None else None
    except importlib.metadata.PackageNotFoundError:
        version = None
    for vname in ("version.py", "_version.py"):  # 0.5.23 keeps the number in setuptools-scm's _version.py
        if version is not None:
            break
        try:
            for line in (root / vname).read_text(encoding="utf-8").splitlines():
                value = line.rsplit("=", 1)[1].strip() if line.startswith("__version__") and "=" in line else ""
                if value[:1] in ("'", '"'):  # `__version__ = version = '0.5.23'`; not `= _compute()`
                    version = value.strip("\"'") or None
                    break
        except (OSError, IndexError):
            pass
    return SGLangInfo(
        found=True,
        location=str(root),
        version=version,
        has_plugins=has_plugins,
        entry_point_installed=_entry_point_installed(),
        switch_modules=frozenset(
            m for m in _SWITCH_MODULES if root.joinpath(*m.split(".")[1:]).with_suffix(".py").is_file()
        ),
    )


def _entry_point_installed() -> bool:
    try:
        return any(ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP))
    except Exception:
        return False


@dataclass(frozen=True)
class TargetStatus:
    """``status``: found (the patch would wrap it), different (it would skip it, ``reason`` says
    why) or missing."""

    key: str
    where: str  # module.Class.attr
    status: str
    reason: str


def _package_dir(source: str | Path) -> Path:
    """The ``sglang`` package folder from a source tree: the folder itself, its parent (an unpacked
    wheel, site-packages) or a checkout's ``python/`` layout."""
    root = Path(source)
    for cand in (root, root / "sglang", root / "python" / "sglang"):
        if (cand / "srt").is_dir():
            return cand
    raise UserError(f"{source}: no SGLang source here (expected sglang/srt/ under it)")


def _target_status(pkg: Path, t: Target) -> TargetStatus:
    where = t.where
    path = pkg.joinpath(*t.module.split(".")[1:]).with_suffix(".py")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError) as e:
        return TargetStatus(t.key, where, "missing", f"{path}: {type(e).__name__}")
    body, owner = tree.body, path.name
    if t.cls is not None:
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == t.cls), None)
        if cls is None:
            return TargetStatus(t.key, where, "missing", f"no class {t.cls} in {path.name}")
        body, owner = cls.body, t.cls
    # a module-level target: a top-level def (what targets.resolve finds in the module's namespace)
    fn = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == t.attr), None)
    if fn is None:
        return TargetStatus(t.key, where, "missing", f"{owner} has no {t.attr}")
    pos = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    names = pos + [a.arg for a in fn.args.kwonlyargs]
    # the same rule as targets.check_signature, on the source instead of the live object
    if tuple(pos[: len(t.params)]) != t.params:
        return TargetStatus(
            t.key, where, "different", f"parameters ({', '.join(pos)}) do not start with ({', '.join(t.params)})"
        )
    missing = [n for n in t.needs if n not in names]
    if missing:
        return TargetStatus(t.key, where, "different", f"has no parameter {missing[0]!r}")
    return TargetStatus(t.key, where, "found", f"{path.name}:{fn.lineno}")


def check(sglang_source: str | Path | None = None) -> tuple[SGLangInfo, list[TargetStatus], str]:
    """Targets and route for the installed SGLang (``None``) or a source tree.

    Raises
    ------
    UserError
        No SGLang installed (and no ``sglang_source``), or no SGLang under ``sglang_source``.
    """
    if sglang_source is None:
        info = detect_sglang()
        if not info.found:
            raise UserError(
                "no SGLang importable by this Python: give --sglang-source DIR (an unpacked wheel or a checkout)"
            )
        pkg = Path(info.location)
    else:
        pkg = _package_dir(sglang_source)
        info = detect_sglang(pkg)
    statuses = [_target_status(pkg, t) for t in TARGETS]
    if info.has_plugins and info.entry_point_installed:
        route = f"{ROUTE_PLUGIN} (group {PLUGIN_GROUP}, name {PLUGIN_NAME})"
    elif info.has_plugins:
        route = f"{ROUTE_HOOK}: this SGLang has plugins but fastverify's entry point is not installed here"
    else:
        route = f"{ROUTE_HOOK}: this SGLang has no plugin mechanism ({PLUGIN_GROUP})"
    return info, statuses, route


def format_report(info: SGLangInfo, statuses: list[TargetStatus], route: str) -> str:
    lines = [
        f"SGLang {info.version or 'version unknown'} at {info.location}",
        f"route: {route}",
        *(
            f"{b.sglang_switch_label} switch ({b.sglang_switch}): {'present' if info.has_switch(b) else 'absent'}"
            for b in REGISTRY
            if b.sglang_switch_module
        ),
    ]
    for s in statuses:
        lines.append(f"  {s.status:9} {s.key:13} {s.where}: {s.reason}")
    n = sum(s.status == "found" for s in statuses)
    lines.append(f"{n} of {len(statuses)} targets resolve; the patch skips the others with one log line each")
    return "\n".join(lines) + "\n"
