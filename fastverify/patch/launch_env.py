"""The environment ``fastverify launch`` sets for the SGLang command: the env file's settings,
SGLang's switch for the chosen backend, and how the patch loads in every rank (plugin entry point or
import hook). :func:`fastverify.patch.launch.plan_launch` calls these in order on one :class:`Draft`.
SGLang facts are from the 0.5.23 wheel (``entrypoints/engine.py``, ``srt/plugins/__init__.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.deploy import BoxFingerprint, DeploymentRecord, sglang_settings
from fastverify.envfile import check_setting
from fastverify.errors import UserError
from fastverify.output_paths import check_folder
from fastverify.patch.handoff import (
    ENV_BACKEND,
    ENV_CUDA_MAX_CONNECTIONS,
    ENV_FLAG,
    ENV_PATCH_ROUTE,
    ENV_PROFILE_VERIFY,
    ENV_PROFILE_VERIFY_STEPS,
    PLUGIN_GROUP,
    PLUGIN_NAME,
    ROUTE_HOOK,
    ROUTE_PLUGIN,
)
from fastverify.patch.launch_plan import Checks, workspace_note
from fastverify.patch.server_cmd import ServerShapes
from fastverify.patch.sglang_info import SGLangInfo
from fastverify.registry import BACKENDS as REGISTRY, BackendInfo, BackendName, Reach, Role, backend_info

OFF = "off"
"""The ``--backend`` value that changes no all-reduce."""
HOOK_DIR = Path(__file__).resolve().parent / "sitecustomize"
# SGLang 0.5.23 ``entrypoints/engine.py::_set_envs_and_config`` sets these in the launcher only when
# unset (and forces them on with --enable-symm-mem / --enable-nccl-nvls): exporting them is enough.
SET_WHEN_UNSET = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")
# Always overwritten by that function in the launcher: restored at interpreter start in each rank
# (:func:`_settings_env`).
OVERWRITTEN = ("CUDA_DEVICE_MAX_CONNECTIONS",)
_PATCH_REACH = (Reach.patch_fused_norm, Reach.patch_add_norm, Reach.patch_dispatch)


@dataclass
class Draft:
    """What :func:`plan_launch` builds up, step by step: the variables set for the command, those
    restored in each rank, and the notes for the user."""

    env: dict[str, str] = field(default_factory=dict)
    in_rank: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def settings_env(draft: Draft, settings: Mapping[str, str], switched: list[BackendInfo], backend: str) -> None:
    """Export the env file's settings, and turn the environment's SGLang switches off for
    ``--backend off``.

    SGLang 0.5.23 ``entrypoints/engine.py::_set_envs_and_config`` always writes
    ``CUDA_DEVICE_MAX_CONNECTIONS=8`` in the launcher before spawning the ranks, and a spawned rank
    reaches ``cuInit`` (``torch.cuda.is_available()`` at import of ~100 modules) before the general
    plugins load. CUDA documents the variable per context (NVIDIA MPS guide) without saying when the
    driver reads it, and NVIDIA's projects treat setting it from Python at run time as ineffective
    (NVIDIA NeMo PR #12894, Megatron-Bridge PR #925). So its value travels as
    ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS`` and the import-hook folder's ``sitecustomize`` copies
    it back when Python starts in each rank, before any import (:attr:`LaunchPlan.in_rank`); it is
    also exported for the launcher and non-SGLang children.
    """
    for key, value in settings.items():
        if key in OVERWRITTEN:
            draft.in_rank[key] = value
            draft.env[ENV_CUDA_MAX_CONNECTIONS] = value
        draft.env[key] = value
    for b in switched:
        if backend == OFF:  # the environment's switch would start the path anyway: turned off for the command
            draft.env[b.sglang_switch] = "0"
            draft.notes.append(f"--backend off: the environment's {b.sglang_switch}=1 is set to 0 for the command")


def bad_sizes(
    checks: Checks, chosen: BackendName | None, switched: list[BackendInfo], backend: str, environ: Mapping[str, str]
) -> set[BackendName]:
    """The backends whose workspace size inherited from ``environ`` is refused (a blocker: their
    workspace cannot be sized). SGLang reads the size verbatim, so it is validated before it is
    inherited (a value of 10**18 would be handed to FlashInfer as the workspace size)."""
    bad_size = set()
    for b in [
        x
        for x in REGISTRY
        if x.size_env and x.size_env in environ and backend != OFF and (x.name is chosen or x in switched)
    ]:
        valid = False
        with checks.guard("environment", f"unset {b.size_env} (SGLang sizes the workspace itself)"):
            check_setting(b.size_env, environ[b.size_env], "the environment")
            valid = True
        if not valid:
            bad_size.add(b.name)
    return bad_size


def backend_env(
    draft: Draft,
    checks: Checks,
    chosen: BackendName | None,
    switched: list[BackendInfo],
    backend: str,
    argv: tuple[str, ...],
    environ: Mapping[str, str],
    info: SGLangInfo,
    record: DeploymentRecord | None,
    server: ServerShapes | None,
    box: BoxFingerprint | None,
    world: int | None,
) -> bool:
    """Set SGLang's switch for the chosen backend (after the P2P proof; no size: SGLang 0.5.23 sizes
    the workspace from the server's decode width, ``pcie_ipc_ar.py::_decode_width``), check each
    switched path's IPC workspace against the GPU's memory, and note what the user should know.
    Returns whether the patch must route all-reduces in every rank."""
    patch_in_rank = False
    bad_size = bad_sizes(checks, chosen, switched, backend, environ)
    if chosen is not None:
        b = backend_info(chosen)
        if b.reach is Reach.sglang_switch:
            if info.has_switch(b):
                draft.env.update(sglang_settings(b.name))
                if b.name not in bad_size:
                    workspace_note(checks, draft.notes, b, environ, record, server, box, world)
            else:
                patch_in_rank = True
                draft.notes.append(
                    f"this SGLang has no {b.sglang_switch_module}: the patch must route all-reduces "
                    f"itself (fastverify's in-rank {b.name.value} dispatch)"
                )
        elif b.reach in _PATCH_REACH:
            patch_in_rank = True
        elif chosen is BackendName.custom_ar and "--disable-custom-all-reduce" in argv:
            checks.refuse(
                "command", "--backend custom_ar contradicts the command's --disable-custom-all-reduce (drop one)"
            )
    for b in switched:
        if info.found and not info.has_switch(b) and backend != OFF:
            draft.notes.append(
                f"{b.sglang_switch} is in the environment but this SGLang has no "
                f"{b.sglang_switch_module}: it has no effect"
            )
        elif b.name is not chosen and backend != OFF and info.has_switch(b) and b.name not in bad_size:
            workspace_note(checks, draft.notes, b, environ, record, server, box, world)
    if chosen is not None and backend_info(chosen).role is Role.fused_norm and switched:
        draft.notes.append(
            f"{', '.join(b.sglang_switch for b in switched)}=1 with --backend {chosen.value}: plain "
            "all-reduces use SGLang's switched path, the residual + RMSNorm ones fastverify's fused path"
        )
    return patch_in_rank


def profile_folder(profile_verify: str | None, trace_steps: int) -> str | None:
    """The absolute ``--profile-verify`` folder, or None. Raises :class:`UserError` for
    ``--trace-verify-steps`` without a folder or outside 0..1000 steps, or a folder that is a file
    or cannot be created."""
    if trace_steps and profile_verify is None:
        raise UserError("--trace-verify-steps writes its trace into the --profile-verify folder: give both")
    if not 0 <= trace_steps <= 1000:
        raise UserError(f"--trace-verify-steps {trace_steps}: expected 0..1000 verify steps")
    if profile_verify is None:
        return None
    p = Path(profile_verify).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"--profile-verify {profile_verify}: exists and is not a folder")
    check_folder(p, "--profile-verify", is_folder=True)  # "afile/dir": afile is a file, not a folder
    return str(p.resolve())


def route_patch(
    draft: Draft,
    patch: bool,
    backend: str,
    prof: str | None,
    trace_steps: int,
    info: SGLangInfo,
    environ: Mapping[str, str],
) -> str:
    """How the patch loads in every rank, and the variables for it; returns the route (``""``:
    no patch). General plugins (SGLang 0.5.23 ``srt/plugins/__init__.py``) run at the top of
    ``run_scheduler_process`` in every rank; ``SGLANG_PLUGINS``, when set, lists the only plugins
    that load, so ``fastverify`` is appended to it. Without the plugin mechanism, the import hook
    folder goes on ``PYTHONPATH`` (also whenever a variable is restored in each rank)."""
    route = ""
    use_hook_dir = bool(draft.in_rank)
    if patch:
        draft.env[ENV_FLAG] = "1"
        draft.env.setdefault(ENV_BACKEND, backend)  # auto / off: the patch only times (no backend chosen)
        if prof:
            draft.env[ENV_PROFILE_VERIFY] = prof
            if trace_steps:
                draft.env[ENV_PROFILE_VERIFY_STEPS] = str(trace_steps)
        if info.has_plugins and info.entry_point_installed:
            route = ROUTE_PLUGIN
            listed = [x.strip() for x in environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
            if listed and PLUGIN_NAME not in listed:
                draft.env["SGLANG_PLUGINS"] = ",".join([*listed, PLUGIN_NAME])
        else:
            route = ROUTE_HOOK
            use_hook_dir = True
            if info.has_plugins and not info.entry_point_installed:
                draft.notes.append(
                    "this SGLang has plugins but fastverify's entry point is not installed "
                    f"(group {PLUGIN_GROUP}, name {PLUGIN_NAME}; reinstall fastverify): using the "
                    "import hook"
                )
    if route == ROUTE_PLUGIN and use_hook_dir:
        draft.env[ENV_PATCH_ROUTE] = "plugin"  # the entry point runs the patch; the hook only restores the variable
    if use_hook_dir:
        parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(HOOK_DIR)]
        draft.env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), *parts])
    return route


def flag_notes(
    notes: list[str], settings: Mapping[str, str], argv: tuple[str, ...], environ: Mapping[str, str]
) -> None:
    """Notes on :data:`SET_WHEN_UNSET`: flags that make SGLang force one over the env file, and
    those SGLang will set to 0."""
    flags = set(argv)
    for key in SET_WHEN_UNSET:
        if key in settings and (
            "--enable-symm-mem" in flags or (key == "NCCL_NVLS_ENABLE" and "--enable-nccl-nvls" in flags)
        ):
            notes.append(f"the command's flags make SGLang force {key}=1 over the env file's {key}={settings[key]}")
    for key in SET_WHEN_UNSET:
        if key not in settings and key not in environ:
            notes.append(f"{key} unset: SGLang will set it to 0")
