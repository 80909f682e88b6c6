"""``fastverify patch --check``: which patch targets resolve in an SGLang (installed, or a source
tree given with ``--sglang-source``) and which route would load the patch, read from the source
files with ``ast``, never importing SGLang."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from fastverify.errors import UserError
from fastverify.patch.install import TARGETS, Target
from fastverify.patch import PLUGIN_GROUP, PLUGIN_NAME
from fastverify.patch.launch_env import ROUTE_HOOK, ROUTE_PLUGIN
from fastverify.patch.sglang_info import SGLangInfo, detect_sglang


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
    # a module-level target: a top-level def (what install.resolve finds in the module's namespace)
    fn = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == t.attr), None)
    if fn is None:
        return TargetStatus(t.key, where, "missing", f"{owner} has no {t.attr}")
    pos = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    names = pos + [a.arg for a in fn.args.kwonlyargs]
    # the same rule as install._check_signature, on the source instead of the live object
    if tuple(pos[: len(t.params)]) != t.params:
        return TargetStatus(t.key, where, "different",
                            f"parameters ({', '.join(pos)}) do not start with ({', '.join(t.params)})")
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
            raise UserError("no SGLang importable by this Python: give --sglang-source DIR (an unpacked wheel "
                            "or a checkout)")
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
    lines = [f"SGLang {info.version or 'version unknown'} at {info.location}",
             f"route: {route}",
             f"PCIe IPC all-reduce switch (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE): "
             f"{'present' if info.has_pcie_ipc else 'absent'}"]
    for s in statuses:
        lines.append(f"  {s.status:9} {s.key:13} {s.where}: {s.reason}")
    n = sum(s.status == "found" for s in statuses)
    lines.append(f"{n} of {len(statuses)} targets resolve; the patch skips the others with one log line each")
    return "\n".join(lines) + "\n"
