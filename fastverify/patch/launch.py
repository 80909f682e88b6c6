"""``fastverify launch``: check the tuned deployment against this box, then put its settings and the
patch in front of the user's SGLang command.

What launch reads and checks, before anything starts:

* the env file (``--env``) and the deployment record beside it (``X.env`` → ``X.deploy.json``,
  :func:`fastverify.deploy.record_path_for`) or ``--deployment FILE``;
* this box (:func:`fastverify.topo.box.read_box`: NVML, else torch) — a record made on another
  box (GPU name, compute capability or GPU count differ) is refused;
* the installed SGLang (version, which switch modules exist), found without importing it;
* the backend (``--backend``: ``auto``, ``off`` or a deployable registry name, the one spelling of
  :class:`fastverify.registry.BackendName`) against :func:`fastverify.registry.unreachable_reason`:
  a backend SGLang cannot reach on this box is refused, exit 2, one line (``fused`` on SM89/SM120:
  SGLang 0.5.23 calls ``RMSNorm.forward_with_allreduce_fusion`` only on SM90/SM100).
* P2P for backends that need it (``pcie_ipc``, ``fused``, ``b12x``, ``custom_ar``): only a real
  check proves it, and only for the GPUs it tested. ``--p2p-check FILE`` (the JSON of ``fastverify p2p``, which names each GPU it tested by NVML index, PCI bus id and UUID)
  proves P2P when every GPU of the server's TP group is one the check tested and every ordered
  pair ``(i, j)``, ``i != j``, of the group passed (:func:`fastverify.topo.p2p.proof_for`); else
  it is refused, one line naming the file: an older file naming no GPU ("rerun the check"), a
  check of other GPUs or another box, a missing direction. The record's proof
  (:attr:`~fastverify.deploy.P2PFacts.gpus`) is bound the same way. The TP group is CUDA ordinals
  ``base_gpu_id + r x gpu_id_step`` of the command (SGLang's rule), mapped to NVML's GPUs through
  the command's ``CUDA_VISIBLE_DEVICES`` (:func:`fastverify.topo.p2p.visible_gpus`; a described
  box gives ``gpus`` itself). Why it is refused otherwise:
  FlashInfer 0.7.4 opens every peer's IPC handle and then ``dist.barrier()``s
  (``flashinfer/comm/cuda_ipc.py``); SGLang 0.5.23 catches the failure per rank
  (``device_communicators/pcie_ipc_ar.py``: "workspace ... failed ...; reductions stay on NCCL"),
  so with partial P2P (ACS/IOMMU) the failed ranks go back to NCCL while the others wait in the
  barrier: the server hangs at start-up.
* The env file holds NCCL settings only (:mod:`fastverify.tune.envfile` refuses an ``SGLANG_*``
  line): launch sets SGLang's switch itself, after the proof. A switch already in the command's
  environment (the shell, a unit file) is checked like the chosen backend, and ``--backend off``
  sets it to 0; an inherited workspace size is validated against the bounds first.
* The IPC workspace SGLang will build (its decode width x the record's hidden, or an inherited
  size, x 2 B x FlashInfer's per-rank layout) is checked against the GPU's memory from NVML
  (:func:`fastverify.patch.launch_notes.workspace_check`), and said where that is unknown.
* ``custom_ar`` beyond 2 GPUs needs full NVLink (the registry's ``world_sizes_without_nvlink``,
  from SGLang 0.5.23 ``custom_all_reduce_utils.py``); the box's ``nvlink_full`` comes from NVML
  with SGLang's own query (:func:`fastverify.topo.box.read_box`); unknown counts as none.
* A record whose NCCL settings differ from the env file's is noted, not refused
  (:func:`fastverify.patch.launch_notes.settings_notes` says why).

The real launch refuses at the first failed check. ``--dry-run`` (``plan_launch(...,
collect_blockers=True)``) runs the same checks, records each failure as a blocker
(:mod:`fastverify.patch.launch_plan`) and still builds the plan, so a user preparing away from
the box sees every blocker at once; an input that cannot be read (env file, record, box
description, P2P check file) is refused at once in both modes.

What launch sets for the ranks: the env file's settings; ``FASTVERIFY_BACKEND=<registry name>``
and ``FASTVERIFY_DEPLOYMENT=<record's absolute path>`` (the patch reads both in every rank);
for a backend SGLang switches itself (``Reach.sglang_switch``) the registry's switch (``=1``,
:func:`fastverify.deploy.sglang_settings`) and no size: SGLang 0.5.23 sizes the workspace from the
server's own decode width (largest captured batch × tokens per request,
``device_communicators/pcie_ipc_ar.py::_decode_width``), so every captured verify step is covered;
a size inherited from the environment is used verbatim by SGLang and the plan says which steps it
leaves to NCCL (:func:`fastverify.patch.launch_notes.workspace_check`). The command's shapes are
read with SGLang's own parser (:mod:`fastverify.patch.server_cmd`) and every plan says what they
cover (``server: verify steps up to 48 requests x 6 tokens (288 rows)``).

SGLang facts this relies on (read in the 0.5.23 wheel):

* ``entrypoints/engine.py::_set_envs_and_config`` always writes ``CUDA_DEVICE_MAX_CONNECTIONS=8``
  in the launcher, then ``mp.set_start_method("spawn")`` starts the ranks with that environment.
  Item 11 of issue 9, checked: a spawned rank unpickles ``run_scheduler_process``, which imports
  ``sglang.srt.managers.scheduler`` and with it ~100 modules that run ``_is_cuda = is_cuda()``
  (``torch.cuda.is_available()``, i.e. ``cudaGetDeviceCount`` → ``cuInit``, no context) at import
  time; the general plugins load only afterwards, at the top of ``run_scheduler_process``; the
  CUDA context comes later still (``set_device`` in the model worker). CUDA documents the variable
  per context ("each CUDA context would be allocated its own separate connection pool", NVIDIA MPS
  guide, CUDA_DEVICE_MAX_CONNECTIONS) but nowhere says whether the driver reads it at ``cuInit``
  or at context creation, and NVIDIA's own projects treat setting it from Python at run time as
  ineffective (NeMo PR #12894, Megatron-Bridge PR #925). So the in-rank plugin may be too late.
  launch therefore re-applies it at interpreter start: the value travels as
  ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS`` (SGLang does not touch it) and the import-hook
  folder's ``sitecustomize`` (on ``PYTHONPATH`` whenever the env file sets the variable) copies it
  back into ``CUDA_DEVICE_MAX_CONNECTIONS`` when Python starts in each spawned rank, before any
  import. With the plugin route ``FASTVERIFY_PATCH_ROUTE=plugin`` tells the hook not to run the
  patch a second time. The in-rank copy in the patch stays as a second line of defence.
  ``doctor`` measures on a GPU whether a late value still takes effect.
* The same function sets ``NCCL_CUMEM_ENABLE`` / ``NCCL_NVLS_ENABLE`` to ``0`` only when unset
  (and forces them on with ``--enable-symm-mem`` / ``--enable-nccl-nvls``), so values from the env
  file are simply exported here and survive.
* General plugins (``sglang/srt/plugins/__init__.py``, group ``sglang.srt.plugins``) run at the
  top of ``run_scheduler_process`` in every rank; ``SGLANG_PLUGINS``, when set, lists the only
  plugins that load, so launch appends ``fastverify`` to it.

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

from fastverify.deploy import (ENV_DEPLOYMENT, BoxFingerprint, P2PFacts, read_record, record_path_for,
                               sglang_settings)
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
from fastverify.patch.launch_notes import settings_notes, shape_notes
from fastverify.patch.launch_plan import Blocker, Checks, blocked_text, box_text, check_box, flag_int, workspace_note
from fastverify.patch.server_cmd import ServerShapes, read_command
from fastverify.registry import BACKENDS as REGISTRY
from fastverify.registry import (BackendInfo, BackendName, Reach, Role, backend_info, names)

AUTO, OFF = "auto", "off"
BACKENDS = (AUTO, OFF, *(n.value for n in names(deployable=True)))
"""``--backend`` choices: ``auto`` (the record's backend, else SGLang's own dispatch with the env
file's settings), ``off`` (no all-reduce change) and every deployable registry name."""
ROUTE_PLUGIN = "plugin entry point"
ROUTE_HOOK = "import hook"
HOOK_DIR = Path(__file__).resolve().parent / "sitecustomize"
ENV_PATCH_ROUTE = "FASTVERIFY_PATCH_ROUTE"
"""``plugin`` when the entry point runs the patch and the hook folder is on ``PYTHONPATH`` only to
restore ``CUDA_DEVICE_MAX_CONNECTIONS`` at start-up."""
# Set by SGLang in the launcher only when unset: exporting them here is enough.
SET_WHEN_UNSET = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")
# Always overwritten by SGLang in the launcher: restored at interpreter start in each rank.
OVERWRITTEN = ("CUDA_DEVICE_MAX_CONNECTIONS",)
_PATCH_REACH = (Reach.patch_fused_norm, Reach.patch_add_norm, Reach.patch_dispatch)
# SGLang 0.5.23 server flags launch reads (srt/arg_groups/fields/parallel.py: tp_size with alias
# --tensor-parallel-size; argparse also takes the unambiguous prefix --tp).
_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
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
    blockers: tuple[Blocker, ...] = ()

    def child_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The complete environment the command gets: ``environ`` updated with :attr:`env`."""
        out = dict(environ)
        out.update(self.env)
        return out


def _read_env_file(path: str) -> dict[str, str]:
    from fastverify.tune.envfile import read_env_file

    return read_env_file(path)


def _check_backend_name(backend: str) -> None:
    if backend in BACKENDS:
        return
    hint = ""
    norm = backend.replace("-", "_").lower()
    if norm in BACKENDS:
        hint = f" (the one spelling is {norm})"
    raise UserError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}{hint}")


def _with_nvml_gpus(box: BoxFingerprint, environ: Mapping[str, str]) -> BoxFingerprint:
    """``box`` (read from this box) with its GPUs' identities and memory from NVML
    (:func:`fastverify.topo.p2p.nvml_gpus`), as the command's environment maps them to CUDA
    ordinals (:func:`fastverify.topo.p2p.visible_gpus`); unchanged where NVML cannot tell."""
    import msgspec  # noqa: PLC0415

    from fastverify.topo.p2p import gpu_id, nvml_gpus, visible_gpus  # noqa: PLC0415

    rows, _ = visible_gpus(nvml_gpus(), environ)
    if not rows:
        return box
    try:
        ids = tuple(gpu_id(r) for r in rows)
    except (ValueError, TypeError):
        return box
    mems = [r.get("memory_bytes") for r in rows]  # the smallest GPU the command sees: the tightest fit
    mem = min(mems) if mems and all(isinstance(m, int) and m > 0 for m in mems) else None
    return msgspec.structs.replace(box, gpus=ids, gpu_memory_bytes=mem if box.gpu_memory_bytes is None
                                   else box.gpu_memory_bytes)


def plan_launch(env_file: str | None, backend: str, profile_verify: str | None, command: Sequence[str], *,
                environ: Mapping[str, str], sglang_dir: str | Path | None = None,
                sglang: SGLangInfo | None = None, trace_steps: int = 0, deployment: str | Path | None = None,
                p2p_file: str | Path | None = None, box: BoxFingerprint | None = None,
                server: ServerShapes | None = None, box_source: str | None = None,
                collect_blockers: bool = False) -> LaunchPlan:
    """Validate the inputs against this box and decide what to set.

    Parameters
    ----------
    env_file
        A file written by ``fastverify tune --write-env`` (allow-listed ``KEY=VALUE`` lines, read
        with :func:`fastverify.tune.envfile.read_env_file`), or None. The deployment record beside
        it (``X.deploy.json``) is read when present.
    backend
        ``auto``, ``off`` or a deployable registry name (:data:`BACKENDS`).
    profile_verify
        Folder for per-rank verify timings (JSON lines), or None.
    command
        The SGLang command line (after ``--``). An SGLang server command is read with the installed
        SGLang's own parser where it imports, else with fastverify's reader of 0.5.23's flags
        (:func:`fastverify.patch.server_cmd.read_command`): TP size, speculative algorithm, draft
        tokens, topk/steps, decode CUDA-graph batch sizes, dtype.
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
        Where ``box`` was described (``"--describe-box"``), said by :func:`describe`; None: read
        from this machine, or a caller's box. A box from ``FASTVERIFY_DESCRIBE_BOX`` names it.
    collect_blockers
        False (the real launch): the first failed check raises. True (``--dry-run``): every
        check that would refuse the launch (the record's box or TP, a backend the box, SGLang or
        P2P cannot reach, a switch or size in the environment, the IPC workspace against the
        GPU's memory, a command SGLang's parser refuses or that contradicts the backend) is
        recorded in :attr:`LaunchPlan.blockers` and the plan is still built; bad inputs still
        raise.

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
    settings = _read_env_file(env_file) if env_file is not None else {}
    record_path: Path | None = None
    if deployment is not None:
        record_path = Path(deployment).expanduser()
    elif env_file is not None and (record_path_for(env_file).exists() or record_path_for(env_file).is_symlink()):
        # Anything at X.deploy.json is the record: a folder or an unreadable file is an error
        # (read_record names it), never silently "no record".
        record_path = record_path_for(env_file)
    record = read_record(record_path) if record_path is not None else None
    info = sglang if sglang is not None else detect_sglang(sglang_dir)
    checks = Checks(collect_blockers)
    notes: list[str] = []
    env: dict[str, str] = {}
    in_rank: dict[str, str] = {}
    if server is None:
        with checks.guard("command"):  # SGLang's own parser refuses it: so would the server
            server = read_command(argv, sglang_found=sglang is None and sglang_dir is None and info.found)
    tp = server.tp if server is not None and server.tp else flag_int(argv, _TP_FLAGS)

    chosen: BackendName | None
    if backend == OFF:
        chosen = None
    elif backend == AUTO:
        chosen = record.backend if record is not None else None
    else:
        chosen = BackendName(backend)
        if record is not None and record.backend is not chosen:
            notes.append(f"--backend {chosen.value} overrides the record's {record.backend.value} "
                         "(the record's shapes and P2P facts still apply)")
    # A switch in the command's environment (the user's shell, a unit file) turns SGLang's path on
    # as surely as launch does: it is checked like the chosen backend (the env file cannot hold
    # one: fastverify.tune.envfile refuses SGLANG_* keys).
    switched = [b for b in REGISTRY if b.sglang_switch and environ.get(b.sglang_switch) == "1"]
    for b in REGISTRY:
        if chosen is b.name and b.sglang_switch and environ.get(b.sglang_switch) == "0":
            checks.refuse("environment", f"the environment's {b.sglang_switch}=0 contradicts --backend "
                                         f"{b.name.value} (unset it or drop one of them)")
    to_check = [] if backend == OFF else [b for b in switched if b.name is not chosen]
    if chosen is not None and chosen is not BackendName.nccl:
        to_check.insert(0, backend_info(chosen))

    checked_box: BoxFingerprint | None = None
    p2p: P2PFacts | None = None
    check_file = None
    if p2p_file is not None:  # read and validated whenever given
        from fastverify.topo.p2p import read_check_file  # noqa: PLC0415

        check_file = read_check_file(p2p_file)
    world = None
    if to_check or record is not None:
        if box is None:
            from fastverify.topo.box import ENV_DESCRIBE_BOX, described_box, read_box  # noqa: PLC0415

            box = described_box(environ, tp=tp or 0)
            if box is None:
                box = _with_nvml_gpus(read_box(tp or 0), environ)
            else:
                box_source = ENV_DESCRIBE_BOX
        checked_box = box
        world, p2p = check_box(checks, box, record, record_path, tp, argv, to_check, check_file, p2p_file, info,
                                server)

    if check_file is not None and not any(b.needs_p2p for b in to_check):  # read, said, not needed
        import msgspec  # noqa: PLC0415

        from fastverify.topo.box import p2p_file_facts  # noqa: PLC0415
        from fastverify.topo.p2p import complete_gpus  # noqa: PLC0415

        p2p = msgspec.structs.replace(p2p_file_facts(p2p_file, check_file.results), gpus=complete_gpus(check_file))
        notes.append(f"--p2p-check {p2p_file}: read; nothing in this plan needs P2P")
    for key, value in settings.items():
        if key in OVERWRITTEN:
            in_rank[key] = value
            env[ENV_CUDA_MAX_CONNECTIONS] = value
            # Also exported: the launcher process and non-SGLang children honour it directly.
        env[key] = value
    for b in switched:
        if backend == OFF:  # the environment's switch would start the path anyway: turned off for the command
            env[b.sglang_switch] = "0"
            notes.append(f"--backend off: the environment's {b.sglang_switch}=1 is set to 0 for the command")

    patch_in_rank = False
    bad_size = set()  # backends whose inherited size is a blocker: their workspace cannot be sized
    for b in [x for x in REGISTRY if x.size_env and x.size_env in environ and backend != OFF
              and (x.name is chosen or x in switched)]:
        # SGLang reads the size from the environment verbatim: validated before it is inherited
        # (a value of 10**18 would be handed to FlashInfer as the workspace size).
        from fastverify.tune.envfile import check_setting  # noqa: PLC0415

        valid = False
        with checks.guard("environment", f"unset {b.size_env} (SGLang sizes the workspace itself)"):
            check_setting(b.size_env, environ[b.size_env], "the environment")
            valid = True
        if not valid:
            bad_size.add(b.name)
    if chosen is not None:
        b = backend_info(chosen)
        if b.reach is Reach.sglang_switch:
            if info.has_switch(b):
                env.update(sglang_settings(b.name))  # the switch, set here after the P2P proof; no size
                if b.name not in bad_size:
                    workspace_note(checks, notes, b, environ, record, server, checked_box, world)
            else:
                patch_in_rank = True
                notes.append(f"this SGLang has no {b.sglang_switch_module}: the patch must route all-reduces itself "
                             f"(fastverify's in-rank {b.name.value} dispatch)")
        elif b.reach in _PATCH_REACH:
            patch_in_rank = True
        elif chosen is BackendName.custom_ar and "--disable-custom-all-reduce" in argv:
            checks.refuse("command", "--backend custom_ar contradicts the command's --disable-custom-all-reduce "
                                     "(drop one)")
    for b in switched:
        if info.found and not info.has_switch(b) and backend != OFF:
            notes.append(f"{b.sglang_switch} is in the environment but this SGLang has no {b.sglang_switch_module}: "
                         "it has no effect")
        elif b.name is not chosen and backend != OFF and info.has_switch(b) and b.name not in bad_size:
            workspace_note(checks, notes, b, environ, record, server, checked_box, world)
    if chosen is not None and backend_info(chosen).role is Role.fused_norm and switched:
        notes.append(f"{', '.join(b.sglang_switch for b in switched)}=1 with --backend {chosen.value}: plain "
                     "all-reduces use SGLang's switched path, the residual + RMSNorm ones fastverify's fused path")
    if record is not None:
        shape_notes(record, server, info, notes)
        if env_file is not None:
            settings_notes(record, settings, env_file, notes)

    prof: str | None = None
    if trace_steps and profile_verify is None:
        raise UserError("--trace-verify-steps writes its trace into the --profile-verify folder: give both")
    if not 0 <= trace_steps <= 1000:
        raise UserError(f"--trace-verify-steps {trace_steps}: expected 0..1000 verify steps")
    if profile_verify is not None:
        p = Path(profile_verify).expanduser()
        if p.exists() and not p.is_dir():
            raise UserError(f"--profile-verify {profile_verify}: exists and is not a folder")
        from fastverify.tune.envfile import check_folder  # noqa: PLC0415

        check_folder(p, "--profile-verify", is_folder=True)  # "afile/dir": afile is a file, not a folder
        prof = str(p.resolve())

    if chosen is not None:
        env[ENV_BACKEND] = chosen.value
    if record_path is not None:
        env[ENV_DEPLOYMENT] = str(record_path.resolve())
    patch = bool(patch_in_rank or prof or chosen is not None)  # a chosen backend: its paths are counted
    route = ""
    use_hook_dir = bool(in_rank)  # CUDA_DEVICE_MAX_CONNECTIONS is restored by the hook at start-up
    if patch:
        env[ENV_FLAG] = "1"
        env.setdefault(ENV_BACKEND, backend)  # auto / off: the patch only times (no backend chosen)
        if prof:
            env[ENV_PROFILE_VERIFY] = prof
            if trace_steps:
                env[ENV_PROFILE_VERIFY_STEPS] = str(trace_steps)
        if info.has_plugins and info.entry_point_installed:
            route = ROUTE_PLUGIN
            allowed = environ.get("SGLANG_PLUGINS", "")
            listed = [x.strip() for x in allowed.split(",") if x.strip()]
            if listed and PLUGIN_NAME not in listed:
                env["SGLANG_PLUGINS"] = ",".join([*listed, PLUGIN_NAME])
        else:
            route = ROUTE_HOOK
            use_hook_dir = True
            if info.has_plugins and not info.entry_point_installed:
                notes.append("this SGLang has plugins but fastverify's entry point is not installed "
                             f"(group {PLUGIN_GROUP}, name {PLUGIN_NAME}; reinstall fastverify): using the import hook")
    if route == ROUTE_PLUGIN and use_hook_dir:
        env[ENV_PATCH_ROUTE] = "plugin"  # the entry point runs the patch; the hook only restores the variable
    if use_hook_dir:
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
    return LaunchPlan(env=env, route=route, patch=patch, argv=argv, server=server,
                      backend=chosen.value if chosen is not None else backend, env_file=env_file,
                      profile_verify=prof, sglang=info, replaced=replaced, in_rank=in_rank, notes=tuple(notes),
                      deployment=str(record_path.resolve()) if record_path is not None else None,
                      box=checked_box, p2p=p2p, box_source=box_source, blockers=checks.blockers)


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
        mech = ", ".join(n for n, ok in (("plugins", s.has_plugins), ("pcie_ipc_ar", s.has_pcie_ipc)) if ok) or "none"
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
        lines.append(f"P2P: {'proven' if plan.p2p.proven else 'not proven'} ({plan.p2p.source}"
                     + (f": {plan.p2p.note}" if plan.p2p.note else "") + ")")
    lines.append("environment set for the command and its children:")
    if plan.env:
        for k in sorted(plan.env):
            extra = f"   (was {plan.replaced[k][0]})" if k in plan.replaced else ""
            lines.append(f"  {k}={plan.env[k]}{extra}")
    else:
        lines.append("  (nothing)")
    for k, v in sorted(plan.in_rank.items()):
        lines.append(f"re-applied in each rank: {k}={v} at interpreter start, before CUDA initialises "
                     f"(SGLang overwrites it in its launcher; {HOOK_DIR} on PYTHONPATH)")
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
    lines.extend(blocked_text(plan.blockers))
    return "\n".join(lines) + "\n"


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
