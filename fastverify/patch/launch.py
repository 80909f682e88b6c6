"""``fastverify launch``: put tuned settings and the patch in front of the user's SGLang command.

SGLang facts this relies on (read in the 0.5.23 wheel):

* ``entrypoints/engine.py::_set_envs_and_config`` always writes ``CUDA_DEVICE_MAX_CONNECTIONS=8``
  in the launcher before spawning the ranks, so a value set here would be lost. launch passes it
  as ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS`` and the patch re-applies it in each rank before
  CUDA starts there.
* The same function sets ``NCCL_CUMEM_ENABLE`` / ``NCCL_NVLS_ENABLE`` to ``0`` only when unset
  (and forces them on with ``--enable-symm-mem`` / ``--enable-nccl-nvls``), so values from the env
  file are simply exported here and survive.
* General plugins (``sglang/srt/plugins/__init__.py``, group ``sglang.srt.plugins``) run at the
  top of ``run_scheduler_process`` in every rank; ``SGLANG_PLUGINS``, when set, lists the only
  plugins that load, so launch appends ``fastverify`` to it.
* ``distributed/device_communicators/pcie_ipc_ar.py`` is switched by
  ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``: with ``--backend pcie-ipc`` on such an SGLang, launch only
  sets the switch and the patch leaves the all-reduce dispatch alone.

SGLang is never imported here: it is located with ``importlib.util.find_spec`` and its files are
looked at on disk.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.errors import UserError
from fastverify.patch import (
    ENV_BACKEND,
    ENV_CUDA_MAX_CONNECTIONS,
    ENV_FLAG,
    ENV_PROFILE_VERIFY,
    ENV_PROFILE_VERIFY_STEPS,
    PLUGIN_GROUP,
    PLUGIN_NAME,
)

BACKENDS = ("auto", "nccl", "pcie-ipc", "fused", "off")
ROUTE_PLUGIN = "plugin entry point"
ROUTE_HOOK = "import hook"
HOOK_DIR = Path(__file__).resolve().parent / "sitecustomize"
PCIE_SWITCH = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
# Set by SGLang in the launcher only when unset: exporting them here is enough.
SET_WHEN_UNSET = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")
# Always overwritten by SGLang in the launcher: re-applied in each rank by the patch.
OVERWRITTEN = ("CUDA_DEVICE_MAX_CONNECTIONS",)


@dataclass(frozen=True)
class SGLangInfo:
    """What the launcher's interpreter can see of SGLang, without importing it."""

    found: bool
    location: str | None = None
    version: str | None = None
    has_plugins: bool = False  # sglang/srt/plugins/__init__.py with the general-plugin group
    has_pcie_ipc: bool = False  # sglang/srt/distributed/device_communicators/pcie_ipc_ar.py
    entry_point_installed: bool = False  # fastverify registered in group sglang.srt.plugins


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
    )


def _entry_point_installed() -> bool:
    try:
        return any(ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP))
    except Exception:
        return False


@dataclass(frozen=True)
class LaunchPlan:
    """Everything ``launch`` will do; :func:`describe` prints it, :func:`exec_plan` does it.

    Attributes
    ----------
    env : dict[str, str]
        Variables set (added or replaced) in the command's environment.
    route : str
        ``"plugin entry point"`` or ``"import hook"`` (``""`` when no patch is needed).
    patch : bool
        Whether ``FASTVERIFY_PATCH=1`` is set (the patch loads in every rank).
    argv : tuple[str, ...]
        The command, unchanged.
    replaced : dict[str, tuple[str, str]]
        Variables whose value in the current environment the plan replaces: name → (old, new).
    in_rank : dict[str, str]
        Variables SGLang overwrites in its launcher that the patch re-applies in each rank.
    notes : tuple[str, ...]
        What the user should know (SGLang not found, flags that override the env file, ...).
    """

    env: dict[str, str]
    route: str
    patch: bool
    argv: tuple[str, ...]
    backend: str
    env_file: str | None = None
    profile_verify: str | None = None
    sglang: SGLangInfo = field(default_factory=lambda: SGLangInfo(found=False))
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    in_rank: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def child_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The complete environment the command gets: ``environ`` updated with :attr:`env`."""
        out = dict(environ)
        out.update(self.env)
        return out


def _read_env_file(path: str) -> dict[str, str]:
    from fastverify.tune.envfile import read_env_file

    return read_env_file(path)


def plan_launch(env_file: str | None, backend: str, profile_verify: str | None, command: Sequence[str], *,
                environ: Mapping[str, str], sglang_dir: str | Path | None = None,
                sglang: SGLangInfo | None = None, trace_steps: int = 0) -> LaunchPlan:
    """Validate the inputs and decide what to set.

    Parameters
    ----------
    env_file
        A file written by ``fastverify tune --write-env`` (allow-listed ``KEY=VALUE`` lines, read
        with :func:`fastverify.tune.envfile.read_env_file`), or None.
    backend
        ``auto`` (SGLang's own dispatch with the env file's settings), ``nccl``, ``pcie-ipc``,
        ``fused`` (fastverify's safe fused all-reduce + residual + RMSNorm) or ``off`` (no all-reduce
        change at all).
    profile_verify
        Folder for per-rank verify timings (JSON lines), or None.
    command
        The SGLang command line (after ``--``).
    environ
        The current environment (read only).
    sglang_dir, sglang
        Override SGLang detection (tests, ``--sglang-source``).

    Raises
    ------
    UserError
        Empty command, unknown backend, a bad env file (one line naming file and line), a profile
        folder that is a file, or a backend that contradicts the env file.
    """
    argv = tuple(str(a) for a in command)
    if not argv or argv[0] == "":
        raise UserError("nothing to launch: give the sglang command after --")
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    settings = _read_env_file(env_file) if env_file is not None else {}
    info = sglang if sglang is not None else detect_sglang(sglang_dir)
    notes: list[str] = []
    env: dict[str, str] = {}
    in_rank: dict[str, str] = {}

    for key, value in settings.items():
        if key in OVERWRITTEN:
            in_rank[key] = value
            env[ENV_CUDA_MAX_CONNECTIONS] = value
            # Also exported: the launcher process and non-SGLang children honour it directly.
        env[key] = value

    if backend == "pcie-ipc":
        if settings.get(PCIE_SWITCH) == "0":
            raise UserError(f"{env_file}: {PCIE_SWITCH}=0 contradicts --backend pcie-ipc (drop one of them)")
        if info.has_pcie_ipc:
            env[PCIE_SWITCH] = "1"
        else:
            notes.append("this SGLang has no pcie_ipc_ar.py: the patch must route all-reduces itself "
                         "(fastverify's in-rank pcie-ipc dispatch)")
    elif PCIE_SWITCH in settings and info.found and not info.has_pcie_ipc:
        notes.append(f"{PCIE_SWITCH} is in the env file but this SGLang has no pcie_ipc_ar.py: it has no effect")
    if backend == "fused" and settings.get(PCIE_SWITCH) == "1":
        notes.append(f"{PCIE_SWITCH}=1 with --backend fused: plain all-reduces use SGLang's PCIe IPC path, "
                     "the residual + RMSNorm all-reduces use fastverify's fused path")

    prof: str | None = None
    if trace_steps and profile_verify is None:
        raise UserError("--trace-verify-steps writes its trace into the --profile-verify folder: give both")
    if not 0 <= trace_steps <= 1000:
        raise UserError(f"--trace-verify-steps {trace_steps}: expected 0..1000 verify steps")
    if profile_verify is not None:
        p = Path(profile_verify).expanduser()
        if p.exists() and not p.is_dir():
            raise UserError(f"--profile-verify {profile_verify}: exists and is not a folder")
        prof = str(p.resolve())

    patch_in_rank = backend in ("pcie-ipc", "fused") and not (backend == "pcie-ipc" and info.has_pcie_ipc)
    patch = bool(patch_in_rank or prof or in_rank)
    route = ""
    if patch:
        env[ENV_FLAG] = "1"
        env[ENV_BACKEND] = backend
        if prof:
            env[ENV_PROFILE_VERIFY] = prof
            if trace_steps:
                env[ENV_PROFILE_VERIFY_STEPS] = str(trace_steps)
        if info.has_plugins and info.entry_point_installed:
            route = ROUTE_PLUGIN
            allowed = environ.get("SGLANG_PLUGINS", "")
            names = [x.strip() for x in allowed.split(",") if x.strip()]
            if names and PLUGIN_NAME not in names:
                env["SGLANG_PLUGINS"] = ",".join([*names, PLUGIN_NAME])
        else:
            route = ROUTE_HOOK
            if info.has_plugins and not info.entry_point_installed:
                notes.append("this SGLang has plugins but fastverify's entry point is not installed "
                             f"(group {PLUGIN_GROUP}, name {PLUGIN_NAME}; reinstall fastverify): using the import hook")
            old = environ.get("PYTHONPATH", "")
            parts = [p for p in old.split(os.pathsep) if p and p != str(HOOK_DIR)]
            env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), *parts])
    if not info.found:
        notes.append("SGLang is not importable by this Python: the route assumes the command's Python sees "
                     "the same packages (install fastverify next to SGLang)")

    flags = set(argv)
    for key in SET_WHEN_UNSET:
        if key in settings and ("--enable-symm-mem" in flags or (key == "NCCL_NVLS_ENABLE" and "--enable-nccl-nvls" in flags)):
            notes.append(f"the command's flags make SGLang force {key}=1 over the env file's {key}={settings[key]}")
    for key in SET_WHEN_UNSET:
        if key not in settings and key not in environ:
            notes.append(f"{key} unset: SGLang will set it to 0")

    replaced = {k: (environ[k], v) for k, v in env.items() if k in environ and environ[k] != v}
    return LaunchPlan(env=env, route=route, patch=patch, argv=argv, backend=backend, env_file=env_file,
                      profile_verify=prof, sglang=info, replaced=replaced, in_rank=in_rank, notes=tuple(notes))


def describe(plan: LaunchPlan) -> str:
    """The ``--dry-run`` text: exactly what would be set, how the patch loads, the command."""
    lines = []
    s = plan.sglang
    if s.found:
        mech = ", ".join(n for n, ok in (("plugins", s.has_plugins), ("pcie_ipc_ar", s.has_pcie_ipc)) if ok) or "none"
        lines.append(f"sglang: {s.version or 'version unknown'} at {s.location} (has: {mech})")
    else:
        lines.append("sglang: not found by this Python")
    lines.append(f"env file: {plan.env_file or '(none)'}")
    lines.append(f"backend: {plan.backend}")
    lines.append("environment set for the command and its children:")
    if plan.env:
        for k in sorted(plan.env):
            extra = f"   (was {plan.replaced[k][0]})" if k in plan.replaced else ""
            lines.append(f"  {k}={plan.env[k]}{extra}")
    else:
        lines.append("  (nothing)")
    for k, v in sorted(plan.in_rank.items()):
        lines.append(f"re-applied in each rank: {k}={v} (SGLang overwrites it in its launcher)")
    if plan.patch:
        lines.append(f"patch: loads in every rank through the {plan.route}"
                     + (f" ({HOOK_DIR} on PYTHONPATH)" if plan.route == ROUTE_HOOK else
                        f" (group {PLUGIN_GROUP}, name {PLUGIN_NAME})"))
    else:
        lines.append("patch: not needed (settings only)")
    if plan.profile_verify:
        lines.append(f"verify timings: {plan.profile_verify}/verify-rank<R>.jsonl")
        if plan.env.get(ENV_PROFILE_VERIFY_STEPS):
            lines.append(f"verify trace: {plan.env[ENV_PROFILE_VERIFY_STEPS]} steps to {plan.profile_verify}/"
                         "verify-TP-<R>.trace.json.gz (read it with `fastverify profile --trace`)")
    for n in plan.notes:
        lines.append(f"note: {n}")
    lines.append("command: " + shlex.join(plan.argv))
    return "\n".join(lines) + "\n"


def exec_plan(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> None:
    """Replace this process with the command (``os.execvpe``), environment updated by the plan.
    Creates the ``--profile-verify`` folder first. Returns only by raising."""
    env = plan.child_env(os.environ if environ is None else environ)
    if plan.profile_verify:
        try:
            Path(plan.profile_verify).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"--profile-verify {plan.profile_verify}: cannot create: {err.strerror or err}") from None
    try:
        os.execvpe(plan.argv[0], list(plan.argv), env)
    except OSError as err:
        raise UserError(f"cannot run {plan.argv[0]!r}: {err.strerror or err}") from None
