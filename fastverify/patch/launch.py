"""``fastverify launch``: check the tuned deployment against this box, then put its settings and the
patch in front of the user's SGLang command.

:func:`plan_launch` reads the env file, the deployment record beside it, this box, the installed
SGLang (:mod:`fastverify.patch.sglang_info`, never imported) and the command, and refuses (exit 2,
one line) a backend the box, SGLang or P2P cannot reach; ``--dry-run`` collects every refusal as a
blocker (:mod:`fastverify.patch.launch_plan`). :func:`describe` prints the plan, :func:`exec_plan`
runs it. Why a partial P2P proof is refused: FlashInfer 0.7.4 ``flashinfer/comm/cuda_ipc.py`` opens
every peer's IPC handle then ``dist.barrier()``s, and SGLang 0.5.23
``srt/distributed/device_communicators/pcie_ipc_ar.py`` falls back per rank, so ranks wait forever.

The environment ``fastverify launch`` sets for the SGLang command: the env file's settings,
SGLang's switch for the chosen backend, and how the patch loads in every rank (plugin entry point or
import hook). :func:`plan_launch` calls these in order on one :class:`Draft`.
SGLang facts are from the 0.5.23 wheel (``entrypoints/engine.py``, ``srt/plugins/__init__.py``).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastverify.deploy import (
    ENV_DEPLOYMENT,
    BoxFingerprint,
    DeploymentRecord,
    P2PFacts,
    named_record,
    read_record,
    record_path_for,
    sglang_settings,
)
from fastverify.envfile import check_setting, read_env_file
from fastverify.errors import UserError, shown
from fastverify.outputs import check_folder
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
from fastverify.patch.launch_plan import (
    Blocker,
    Checks,
    blocked_text,
    box_text,
    check_box,
    flag_int,
    settings_notes,
    shape_notes,
    workspace_note,
)
from fastverify.patch.server_cmd import ServerShapes, read_command
from fastverify.patch.sglang_info import SGLangInfo, detect_sglang
from fastverify.proof.answers import AnswerBaseline
from fastverify.proof.run import check_url, proof_blockers
from fastverify.registry import BACKENDS as REGISTRY, BackendInfo, BackendName, Reach, Role, backend_info, names
from fastverify.topo.box import ENV_DESCRIBE_BOX, box_from_description, described_box, p2p_file_facts, read_box
from fastverify.topo.gpu_identity import gpu_id, nvml_gpus, visible_gpus
from fastverify.topo.p2p_proof import complete_gpus, read_check_file

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


AUTO = "auto"
BACKENDS = (AUTO, OFF, *(n.value for n in names(deployable=True)))
"""``--backend`` choices: ``auto`` (the record's backend, else SGLang's own dispatch with the env
file's settings), ``off`` (no all-reduce change) and every deployable registry name."""
# SGLang 0.5.23 server flags launch reads (srt/arg_groups/fields/parallel.py: tp_size with alias
# --tensor-parallel-size; argparse also takes the unambiguous prefix --tp).
_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
#: TP sizes a command may ask for: the range the SGLang command's ``--tp-size`` is checked against
#: (:mod:`fastverify.patch.server_cmd`); a larger one is refused before anything is sized by it.
TP_RANGE = (1, 4096)


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
    backend : str
        The registry name the ranks get (``FASTVERIFY_BACKEND``), ``auto`` (SGLang's own dispatch)
        or ``off``.
    deployment : str or None
        Absolute path of the deployment record the ranks read (``FASTVERIFY_DEPLOYMENT``).
    box : BoxFingerprint or None
        The box the plan was checked against (None when nothing needed checking).
    p2p : P2PFacts or None
        The P2P facts used for the check.
    server : ServerShapes or None
        The SGLang command's verify shapes (None: not an SGLang server command).
    replaced : dict[str, tuple[str, str]]
        Variables whose value in the current environment the plan replaces: name → (old, new).
    in_rank : dict[str, str]
        Variables SGLang overwrites in its launcher, restored at interpreter start in each rank.
    notes : tuple[str, ...]
        What the user should know (SGLang not found, flags that override the env file, ...).
    box_source : str or None
        Where the box was described (``--describe-box``, ``FASTVERIFY_DESCRIBE_BOX``); None: read
        from this machine (or given by a caller).
    answer_baseline : AnswerBaseline or None
        The deployment record's baseline answers (``tune --write-env --baseline``): launch asks them
        of the server before it serves.
    blockers : tuple[Blocker, ...]
        Every check that would refuse the real launch (``plan_launch(collect_blockers=True)``;
        always empty otherwise: the first one raised). :func:`exec_plan` refuses a plan with any.
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
    deployment: str | None = None
    box: BoxFingerprint | None = None
    p2p: P2PFacts | None = None
    server: ServerShapes | None = None
    box_source: str | None = None
    answer_baseline: AnswerBaseline | None = None
    blockers: tuple[Blocker, ...] = ()

    def child_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The complete environment the command gets: ``environ`` updated with :attr:`env`."""
        out = dict(environ)
        out.update(self.env)
        return out


def _check_backend_name(backend: str) -> None:
    if backend in BACKENDS:
        return
    hint = ""
    norm = backend.replace("-", "_").lower()
    if norm in BACKENDS:
        hint = f" (the one spelling is {norm})"
    raise UserError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}{hint}")


def _with_nvml_gpus(box: BoxFingerprint, environ: Mapping[str, str], notes: list[str]) -> BoxFingerprint:
    """``box`` (read from this box) with its GPUs' identities and memory from NVML
    (:func:`fastverify.topo.gpu_identity.nvml_gpus`), as the command's environment maps them to CUDA
    ordinals (:func:`fastverify.topo.gpu_identity.visible_gpus`, whose line goes to ``notes``);
    unchanged where NVML cannot tell."""
    import msgspec  # noqa: PLC0415

    listed = nvml_gpus()
    rows, why = visible_gpus(listed, environ)
    if why and listed:  # no NVML (no GPU box): nothing to say
        notes.append(why)
    if not rows:
        return box
    try:
        ids = tuple(gpu_id(r) for r in rows)
    except (ValueError, TypeError):
        return box
    mems = [r.get("memory_bytes") for r in rows]  # the smallest GPU the command sees: the tightest fit
    mem = min(mems) if mems and all(isinstance(m, int) and m > 0 for m in mems) else None
    return msgspec.structs.replace(
        box, gpus=ids, gpu_memory_bytes=mem if box.gpu_memory_bytes is None else box.gpu_memory_bytes
    )


def _read_inputs(
    env_file: str | None,
    deployment: str | Path | None,
) -> tuple[dict[str, str], Path | None, DeploymentRecord | None]:
    """The env file's settings, the record's path and the record. Anything at ``X.deploy.json``
    is the record: a folder or an unreadable file is an error (:func:`read_record` names it),
    never silently "no record". Raises :class:`UserError` for a bad env file or record."""
    settings = read_env_file(env_file) if env_file is not None else {}
    record_path: Path | None = None
    if deployment is not None:
        record_path = Path(deployment).expanduser()
    elif env_file is not None and (record_path_for(env_file).exists() or record_path_for(env_file).is_symlink()):
        record_path = record_path_for(env_file)
    elif env_file is not None and (name := named_record(env_file)) is not None:
        raise UserError(
            f"{env_file}: its header names the deployment record {name}, which is not beside it "
            f"({record_path_for(env_file)}): copy it there, or pass --deployment FILE"
        )
    record = read_record(record_path) if record_path is not None else None
    return settings, record_path, record


def _choose_backend(
    backend: str, record: DeploymentRecord | None, environ: Mapping[str, str], checks: Checks, notes: list[str]
) -> tuple[BackendName | None, list[BackendInfo], list[BackendInfo]]:
    """The backend the ranks get, the SGLang switches already on in ``environ``, and the backends
    to check against the box (the chosen one first).

    A switch in the command's environment (the user's shell, a unit file) turns SGLang's path on
    as surely as launch does, so it is checked like the chosen backend (the env file cannot hold
    one: :mod:`fastverify.envfile` refuses ``SGLANG_*`` keys); a switch set to 0 that contradicts
    ``backend`` is refused through ``checks``.
    """
    chosen: BackendName | None
    if backend == OFF:
        chosen = None
    elif backend == AUTO:
        chosen = record.backend if record is not None else None
    else:
        chosen = BackendName(backend)
        if record is not None and record.backend is not chosen:
            notes.append(
                f"--backend {chosen.value} overrides the record's {record.backend.value} "
                "(the record's shapes and P2P facts still apply)"
            )
    switched = [b for b in REGISTRY if b.sglang_switch and environ.get(b.sglang_switch) == "1"]
    for b in REGISTRY:
        if chosen is b.name and b.sglang_switch and environ.get(b.sglang_switch) == "0":
            checks.refuse(
                "environment",
                f"the environment's {b.sglang_switch}=0 contradicts --backend "
                f"{b.name.value} (unset it or drop one of them)",
            )
    to_check = [] if backend == OFF else [b for b in switched if b.name is not chosen]
    if chosen is not None and chosen is not BackendName.nccl:
        to_check.insert(0, backend_info(chosen))
    return chosen, switched, to_check


def _check_the_box(
    checks: Checks,
    record: DeploymentRecord | None,
    record_path: Path | None,
    tp: int | None,
    argv: tuple[str, ...],
    to_check: list[BackendInfo],
    p2p_file: str | Path | None,
    info: SGLangInfo,
    server: ServerShapes | None,
    box: BoxFingerprint | None,
    box_source: str | None,
    environ: Mapping[str, str],
    notes: list[str],
) -> tuple[BoxFingerprint | None, P2PFacts | None, int | None, str | None]:
    """Read ``--p2p-check`` (whenever given), find the box (``box``, else
    ``FASTVERIFY_DESCRIBE_BOX``, else this machine with NVML's GPUs) when a backend or the record
    needs checking, and run :func:`~fastverify.patch.launch_plan.check_box`.

    Only a real P2P check proves P2P, and only for the GPUs it tested: every GPU of the TP group
    (CUDA ordinals ``base_gpu_id + r x gpu_id_step``, SGLang's rule, mapped to NVML's GPUs through
    the command's ``CUDA_VISIBLE_DEVICES``) must be one it tested, every ordered pair passed
    (:func:`fastverify.topo.p2p_proof.proof_for`).

    Returns
    -------
    (box, p2p, world, box_source)
        The box checked (None: nothing needed it), the P2P facts used, the TP size checked, and
        where the box was described.

    Raises
    ------
    UserError
        A bad P2P check file or box description; the first failed check unless ``checks`` collects.
    """
    checked_box: BoxFingerprint | None = None
    p2p: P2PFacts | None = None
    check_file = None
    if p2p_file is not None:
        check_file = read_check_file(p2p_file)
    world = None
    if to_check or record is not None:
        if box is None:
            box = described_box(environ, tp=tp or 0)
            if box is None:
                box = _with_nvml_gpus(read_box(tp or 0), environ, notes)
            else:
                box_source = ENV_DESCRIBE_BOX
        checked_box = box
        world, p2p = check_box(checks, box, record, record_path, tp, argv, to_check, check_file, p2p_file, info, server)
    if check_file is not None and not any(b.needs_p2p for b in to_check):  # read, said, not needed
        import msgspec  # noqa: PLC0415

        p2p = msgspec.structs.replace(p2p_file_facts(p2p_file, check_file.results), gpus=complete_gpus(check_file))
        notes.append(f"--p2p-check {p2p_file}: read; nothing in this plan needs P2P")
    return checked_box, p2p, world, box_source


def plan_launch(
    env_file: str | None,
    backend: str,
    profile_verify: str | None,
    command: Sequence[str],
    *,
    environ: Mapping[str, str],
    sglang_dir: str | Path | None = None,
    sglang: SGLangInfo | None = None,
    trace_steps: int = 0,
    deployment: str | Path | None = None,
    p2p_file: str | Path | None = None,
    box: BoxFingerprint | None = None,
    server: ServerShapes | None = None,
    box_source: str | None = None,
    collect_blockers: bool = False,
) -> LaunchPlan:
    """Validate the inputs against this box and decide what to set.

    Parameters
    ----------
    env_file
        A file of ``fastverify tune --write-env`` (read with :func:`fastverify.envfile.read_env_file`)
        or None; the deployment record beside it (``X.deploy.json``) is read when present.
    backend
        ``auto``, ``off`` or a deployable registry name (:data:`BACKENDS`).
    profile_verify
        Folder for per-rank verify timings (JSON lines), or None.
    command
        The SGLang command line (after ``--``), read with the installed SGLang's own parser where
        it imports, else :func:`fastverify.patch.server_cmd.read_command` (SGLang 0.5.23's flags).
    environ
        The current environment (read only); ``FASTVERIFY_DESCRIBE_BOX`` describes a box.
    sglang_dir, sglang
        Override SGLang detection (tests, ``--sglang-source``).
    deployment
        A deployment record to use instead of the one beside the env file.
    p2p_file
        The JSON of ``fastverify p2p`` (replaces the record's P2P facts).
    box
        The box to check against (tests: a described box); default ``FASTVERIFY_DESCRIBE_BOX``,
        else :func:`fastverify.topo.box.read_box`.
    server
        The command's shapes, already read (tests); default: read from ``command``.
    box_source
        Where ``box`` was described (``"--describe-box"``), said by :func:`describe`; None: this
        machine or a caller's box (one from ``FASTVERIFY_DESCRIBE_BOX`` is named so).
    collect_blockers
        False (the real launch): the first failed check raises. True (``--dry-run``): every check
        that would refuse the launch (the record's box or TP, a backend the box, SGLang or P2P
        cannot reach, a switch or size in the environment, the IPC workspace against the GPU's
        memory, a command SGLang refuses or that contradicts the backend) goes into
        :attr:`LaunchPlan.blockers`; bad inputs still raise.

    Raises
    ------
    UserError
        One line: empty command, unknown backend, a bad env file, record, box description or
        P2P check file (naming it), a profile folder that is a file, bad --trace-verify-steps;
        and, unless ``collect_blockers``, the first blocker (see above).
    """
    argv = tuple(str(a) for a in command)
    if not argv or argv[0] == "":
        raise UserError("nothing to launch: give the sglang command after --")
    _check_backend_name(backend)
    settings, record_path, record = _read_inputs(env_file, deployment)
    info = sglang if sglang is not None else detect_sglang(sglang_dir)
    checks = Checks(collect_blockers)
    draft = Draft()
    server, tp = _command_shapes(argv, server, checks, sglang is None and sglang_dir is None and info.found)
    chosen, switched, to_check = _choose_backend(backend, record, environ, checks, draft.notes)
    checked_box, p2p, world, box_source = _check_the_box(
        checks, record, record_path, tp, argv, to_check, p2p_file, info, server, box, box_source, environ, draft.notes
    )
    settings_env(draft, settings, switched, backend)
    patch_in_rank = backend_env(
        draft, checks, chosen, switched, backend, argv, environ, info, record, server, checked_box, world
    )
    if record is not None:
        shape_notes(record, server, info, draft.notes)
        if env_file is not None:
            settings_notes(record, settings, env_file, draft.notes)
    prof = profile_folder(profile_verify, trace_steps)
    patch, route = _patch_route(
        draft, chosen, record_path, bool(patch_in_rank or prof), backend, prof, trace_steps, info, environ
    )
    flag_notes(draft.notes, settings, argv, environ)
    replaced = {k: (environ[k], v) for k, v in draft.env.items() if k in environ and environ[k] != v}
    return LaunchPlan(
        env=draft.env,
        route=route,
        patch=patch,
        argv=argv,
        server=server,
        backend=chosen.value if chosen is not None else backend,
        env_file=env_file,
        profile_verify=prof,
        sglang=info,
        replaced=replaced,
        in_rank=draft.in_rank,
        notes=tuple(draft.notes),
        deployment=str(record_path.resolve()) if record_path is not None else None,
        box=checked_box,
        p2p=p2p,
        box_source=box_source,
        blockers=checks.blockers,
        answer_baseline=record.baseline if record is not None else None,
    )


def proof_asked(args, plan: LaunchPlan) -> bool:
    """Whether launch stays the server's parent for the proof of a swap: ``--load``, ``--baseline``
    or a deployment record with baseline answers."""
    return args.load is not None or args.baseline is not None or plan.answer_baseline is not None


def plan_of_args(args, environ: Mapping[str, str]) -> LaunchPlan:
    """The plan of ``launch``'s parsed arguments (``--describe-box`` read first). For ``--dry-run``
    its :attr:`LaunchPlan.blockers` hold every check the real launch would refuse with: the
    plan's own, then those of the proof inputs (:func:`fastverify.proof.run.proof_blockers`: the
    checks the real launch runs before it starts the server, the same code).

    Raises
    ------
    UserError
        As :func:`plan_launch` (the real launch: its first blocker), or a bad ``--describe-box``.
    """
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    box = source = None
    if args.describe_box is not None:  # a described box: checking a record away from its box
        box = box_from_description(args.describe_box, where="--describe-box")
        source = "--describe-box"
    plan = plan_launch(
        str(args.env) if args.env else None,
        args.backend,
        str(args.profile_verify) if args.profile_verify else None,
        cmd,
        environ=environ,
        trace_steps=args.trace_verify_steps,
        deployment=args.deployment,
        p2p_file=args.p2p_check,
        box=box,
        box_source=source,
        collect_blockers=args.dry_run,
    )
    if args.dry_run and proof_asked(args, plan):
        plan = replace(plan, blockers=plan.blockers + proof_blockers(plan, args))
    elif getattr(args, "url", None) is not None and not proof_asked(args, plan):
        checks = Checks(collect=args.dry_run)  # checked as the proof run checks it, and collect --server
        with checks.guard("URL"):
            check_url(args.url)
        plan = replace(plan, blockers=plan.blockers + checks.blockers)
    return plan


def _command_shapes(
    argv: tuple[str, ...], server: ServerShapes | None, checks: Checks, sglang_found: bool
) -> tuple[ServerShapes | None, int | None]:
    """The command's verify shapes (``server``, else read from ``argv``; SGLang's own parser
    refusing the command is a blocker: so would the server) and its TP size: None when unknown
    or outside :data:`TP_RANGE` (refused: a blocker, unless the SGLang check already is one)."""
    n_blockers = len(checks.blockers)
    if server is None:
        with checks.guard("command"):
            server = read_command(argv, sglang_found=sglang_found)
    if server is not None and server.tp:
        return server, server.tp
    tp = flag_int(argv, _TP_FLAGS)
    if tp is not None and not TP_RANGE[0] <= tp <= TP_RANGE[1]:
        if len(checks.blockers) == n_blockers:  # not yet refused by the SGLang command's own check
            flag = next(a.partition("=")[0] for a in reversed(argv) if a.partition("=")[0] in _TP_FLAGS)
            checks.refuse("command", f"the command's {flag} {tp}: expected {TP_RANGE[0]}..{TP_RANGE[1]}")
        return server, None
    return server, tp


def _patch_route(
    draft: Draft,
    chosen: BackendName | None,
    record_path: Path | None,
    needed: bool,
    backend: str,
    prof: str | None,
    trace_steps: int,
    info: SGLangInfo,
    environ: Mapping[str, str],
) -> tuple[bool, str]:
    """The ranks' backend and record (``FASTVERIFY_BACKEND``, ``FASTVERIFY_DEPLOYMENT``), whether the
    patch loads in them (``needed`` by the backend or the profile folder, or a backend is chosen:
    its paths are counted) and the route that loads it (:func:`route_patch`)."""
    if chosen is not None:
        draft.env[ENV_BACKEND] = chosen.value
    if record_path is not None:
        draft.env[ENV_DEPLOYMENT] = str(record_path.resolve())
    patch = needed or chosen is not None
    route = route_patch(draft, patch, backend, prof, trace_steps, info, environ)
    if not info.found:
        draft.notes.append(
            "SGLang is not importable by this Python: the route assumes the command's Python sees "
            "the same packages (install fastverify next to SGLang)"
        )
    return patch, route


def describe(plan: LaunchPlan) -> str:
    """The ``--dry-run`` text: where the box's facts come from (first, when it was described),
    exactly what would be set, how the patch loads, the command, and what blocks the launch
    (:attr:`LaunchPlan.blockers`: ``blocked by:`` and one line per check with its fix, or
    ``blocked by: nothing``)."""
    lines = []
    if plan.box_source is not None:
        lines.append(f"box: described by {plan.box_source} (not read from this machine)")
    s = plan.sglang
    if s.found:
        mods = sorted(m.rsplit(".", 1)[-1] for m in s.switch_modules)
        mech = ", ".join((["plugins"] if s.has_plugins else []) + mods) or "none"
        lines.append(f"sglang: {s.version or 'version unknown'} at {s.location} (has: {mech})")
    else:
        lines.append("sglang: not found by this Python")
    lines.append(f"env file: {plan.env_file or '(none)'}")
    lines.append(f"deployment record: {plan.deployment or '(none)'}")
    lines.append(f"backend: {plan.backend}")
    if plan.server is not None:
        lines.append(f"server: {plan.server.covers()} (read by {plan.server.source})")
    if plan.box is not None:
        b = plan.box
        lines.append(f"box: {box_text(b)}, driver {b.driver or 'unknown'}")
    if plan.p2p is not None:
        lines.append(
            f"P2P: {'proven' if plan.p2p.proven else 'not proven'} ({plan.p2p.source}"
            + (f": {plan.p2p.note}" if plan.p2p.note else "")
            + ")"
        )
    lines.append("environment set for the command and its children:")
    if plan.env:
        for k in sorted(plan.env):
            extra = f"   (was {plan.replaced[k][0]})" if k in plan.replaced else ""
            lines.append(f"  {k}={plan.env[k]}{extra}")
    else:
        lines.append("  (nothing)")
    for k, v in sorted(plan.in_rank.items()):
        lines.append(
            f"re-applied in each rank: {k}={v} at interpreter start, before CUDA initialises "
            f"(SGLang overwrites it in its launcher; {HOOK_DIR} on PYTHONPATH)"
        )
    if plan.patch:
        lines.append(
            f"patch: loads in every rank through the {plan.route}"
            + (
                f" ({HOOK_DIR} on PYTHONPATH)"
                if plan.route == ROUTE_HOOK
                else f" (group {PLUGIN_GROUP}, name {PLUGIN_NAME})"
            )
        )
    else:
        lines.append("patch: not needed (settings only)")
    if plan.profile_verify:
        lines.append(f"verify timings: {plan.profile_verify}/verify-rank<R>.jsonl")
        if plan.env.get(ENV_PROFILE_VERIFY_STEPS):
            lines.append(
                f"verify trace: {plan.env[ENV_PROFILE_VERIFY_STEPS]} steps to {plan.profile_verify}/"
                "verify-TP-<R>.trace.json.gz (read it with `fastverify profile --trace`)"
            )
    for n in plan.notes:
        lines.append(f"note: {n}")
    lines.append("command: " + shlex.join(plan.argv))
    lines.extend(blocked_text(plan.blockers))
    # each line may quote an input (a record's P2P note, a described box, an env value): one escaped line
    return "".join(shown(line, limit=None) + "\n" for line in lines)


def exec_plan(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> None:
    """Replace this process with the command (``os.execvpe``), environment updated by the plan.
    Creates the ``--profile-verify`` folder first. Returns only by raising.

    Raises
    ------
    UserError
        The plan has blockers (the first one's line; nothing is run), the profile folder cannot
        be created, or the command cannot be run.
    """
    if plan.blockers:
        raise UserError(plan.blockers[0].message)
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
