"""What the launcher's Python can see of the installed SGLang, found without importing it.

SGLang is located with ``importlib.util.find_spec`` and its files are looked at on disk: whether it
has general plugins (``sglang/srt/plugins/__init__.py``, group ``sglang.srt.plugins``), which of the
registry's switch modules exist (SGLang 0.5.23 ``srt/distributed/device_communicators/pcie_ipc_ar.py``),
its version, and whether fastverify's plugin entry point is installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fastverify.patch import PLUGIN_GROUP, PLUGIN_NAME
from fastverify.registry import BACKENDS as REGISTRY
from fastverify.registry import BackendInfo, BackendName, backend_info

_SWITCH_MODULES = tuple(b.sglang_switch_module for b in REGISTRY if b.sglang_switch_module)


@dataclass(frozen=True)
class SGLangInfo:
    """What the launcher's interpreter can see of SGLang, without importing it.

    ``switch_modules``: the registry's ``sglang_switch_module`` names whose file exists in this
    SGLang; ``has_pcie_ipc`` (the 0.5.23 PCIe IPC module) is kept for the reports and implies it.
    """

    found: bool
    location: str | None = None
    version: str | None = None
    has_plugins: bool = False  # sglang/srt/plugins/__init__.py with the general-plugin group
    has_pcie_ipc: bool = False  # sglang/srt/distributed/device_communicators/pcie_ipc_ar.py
    entry_point_installed: bool = False  # fastverify registered in group sglang.srt.plugins
    switch_modules: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.has_pcie_ipc:
            module = backend_info(BackendName.pcie_ipc).sglang_switch_module
            object.__setattr__(self, "switch_modules", frozenset(self.switch_modules) | {module})

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
        has_pcie_ipc=(root / "srt" / "distributed" / "device_communicators" / "pcie_ipc_ar.py").is_file(),
        entry_point_installed=_entry_point_installed(),
        switch_modules=frozenset(m for m in _SWITCH_MODULES
                                 if root.joinpath(*m.split(".")[1:]).with_suffix(".py").is_file()),
    )


def _entry_point_installed() -> bool:
    try:
        return any(ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP))
    except Exception:
        return False
