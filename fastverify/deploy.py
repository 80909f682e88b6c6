"""The deployment record: what ``tune`` decided, in the form ``launch`` and every TP rank read.

One versioned, typed JSON file beside the env file (``X.env`` → ``X.deploy.json``,
:func:`record_path_for`) with the facts a later stage must not guess again: the backend by its
registry name, the shapes to prepare (:class:`VerifyShapes`: largest captured batch × draft
tokens, hidden, dtype), the P2P facts and their source (:class:`P2PFacts`), the box fingerprint
(:class:`BoxFingerprint`), the NCCL settings and the gain with its basis (measured or predicted).
The env file holds NCCL settings only, so sourcing it without ``launch`` (docker, systemd) never
starts an IPC path nobody checked P2P for; :func:`write_deployment` writes both files or none.
``launch`` checks the record against the box and the installed SGLang; the patch reads it in
every rank through ``FASTVERIFY_DEPLOYMENT``. Nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_WORLD_SIZE
from fastverify.envfile import check_setting, check_together, render_env
from fastverify.errors import UserError, path_text, schema_error
from fastverify.inputs import decode_json, read_bytes, read_text
from fastverify.nccl.version import NcclVersion
from fastverify.outputs import atomic_write_texts, backup_path
from fastverify.proof.answers import AnswerBaseline
from fastverify.registry import BackendName, Reach, backend_info
from fastverify.topo.nvml import sysfs_bdf

SCHEMA = "fastverify.deployment"
VERSION = 1
ENV_DEPLOYMENT = "FASTVERIFY_DEPLOYMENT"
"""Env var naming the record's absolute path in every TP rank (set by ``launch``)."""

INT64_MAX = 2**63 - 1

P2PSource = Literal["p2p_check", "nvml", "nccl_log", "caller", "not_checked"]
Basis = Literal["measured", "predicted"]


def _uuid_key(uuid: str | None) -> str | None:
    """``"GPU-8ba4..."`` (NVML) and ``"8ba4..."`` (``torch.cuda.get_device_properties(i).uuid``)
    name one GPU: lower case, without the ``GPU-`` prefix; None for an empty value."""
    if not uuid:
        return None
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _pci_key(bus_id: str | None) -> str | None:
    """NVML's ``"00000000:18:00.0"`` and sysfs' ``"0000:18:00.0"`` name one PCI function:
    :func:`fastverify.topo.nvml.sysfs_bdf` of either; None when it is not a PCI address."""
    if not bus_id:
        return None

    return sysfs_bdf(str(bus_id))


class GpuId(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One GPU as NVML names it: what ties a P2P check, and a record's P2P proof, to the box's
    own GPUs (a check that only counts passing directions proves nothing about *which* GPUs
    passed).

    Attributes
    ----------
    index : int or None
        NVML index (``nvidia-smi`` order; NVML ignores ``CUDA_VISIBLE_DEVICES``).
    pci_bus_id : str or None
        NVML's PCI bus id, ``"00000000:18:00.0"``.
    uuid : str or None
        NVML's UUID, ``"GPU-8ba4b3d5-..."``.
    name : str or None
        Device name (said in messages, never compared).
    """

    index: int | None = None
    pci_bus_id: str | None = None
    uuid: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.index is not None and (isinstance(self.index, bool) or self.index < 0):
            raise ValueError(f"index must be an int >= 0, got {self.index!r}")
        if _uuid_key(self.uuid) is None and _pci_key(self.pci_bus_id) is None:
            raise ValueError("a GPU needs a uuid or a PCI bus id (as NVML reports them)")

    def same_gpu(self, other: "GpuId") -> bool:
        """Whether both name one physical GPU: the UUIDs where both have one, else the PCI
        addresses where both have one; never the index or the name (another box has a GPU 0
        of the same name too)."""
        a, b = _uuid_key(self.uuid), _uuid_key(other.uuid)
        if a is not None and b is not None:
            return a == b
        a, b = _pci_key(self.pci_bus_id), _pci_key(other.pci_bus_id)
        return a is not None and a == b

    def label(self) -> str:
        """``GPU 3 (0000:18:00.0)`` for messages."""
        where = _pci_key(self.pci_bus_id) or self.uuid or "?"
        return f"GPU {self.index if self.index is not None else '?'} ({where})"


class VerifyShapes(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The verify step's all-reduce shapes, ``(rows, hidden)`` with ``rows <= max_rows``.

    Attributes
    ----------
    max_batch : int
        Largest batch (requests) SGLang captures or serves in one verify step, 1..4096.
    draft_tokens : int
        Tokens per request in a verify step (draft tokens; SGLang's ``num_draft_tokens``), 1..64.
    hidden : int
        Hidden size (elements per row), 1..65536.
    dtype : str
        torch dtype name of the all-reduced tensors (``"bfloat16"``).

    Why the bounds: they are ``tune``'s own (``--max-batch``/``--batch`` ≤ 4096,
    ``--draft-tokens`` ≤ 64, ``--hidden`` ≤ 65536; the widest released models have hidden
    16384), so a record ``tune`` could not have written is refused before ``launch`` exports
    ``max_numel`` as SGLang's workspace size. They keep :attr:`max_numel` ≤ 2**34, which SGLang
    0.5.23 reads with ``int()`` (``srt/environ.py`` ``EnvInt``) and hands to FlashInfer's
    ``PcieIpcAllReduceWorkspace(max_numel=...)`` (a 64-bit integer in its binding), and which the
    env-file validator's 18-digit size rule accepts.
    """

    max_batch: int
    draft_tokens: int
    hidden: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name, hi in (("max_batch", MAX_BATCH), ("draft_tokens", MAX_DRAFT_TOKENS), ("hidden", MAX_HIDDEN)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an int in 1..{hi}, got {value!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.max_numel > INT64_MAX:  # unreachable within the bounds above; the contract stated as code
            raise ValueError(f"max_numel {self.max_numel} does not fit a 64-bit integer")

    @property
    def max_rows(self) -> int:
        """Rows of the largest verify all-reduce: ``max_batch × draft_tokens``."""
        return self.max_batch * self.draft_tokens

    @property
    def max_numel(self) -> int:
        """Elements of the largest verify all-reduce: ``max_rows × hidden``."""
        return self.max_rows * self.hidden


class P2PFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """P2P between the box's GPU pairs.

    Attributes
    ----------
    ok : bool or None
        True when every ordered pair passed, False when one failed, None when not checked.
    source : str
        ``"p2p_check"`` (fastverify's real read/write check in child processes), ``"nvml"``
        (the driver's P2P status), ``"nccl_log"`` (NCCL's chosen transports), ``"caller"``,
        ``"not_checked"``. Only ``p2p_check`` proves the kernels will not hang.
    note : str
        One line: which pair failed, or how many passed.
    pairs : int
        Ordered pairs checked.
    gpus : tuple[GpuId, ...]
        The GPUs the real check tested, every ordered pair among them present and passed (empty
        otherwise, and for every other source). ``launch`` accepts the record's proof only for a
        TP group whose GPUs are all among them (:func:`fastverify.topo.p2p_proof.proof_for`); a record
        without them (written before the check named its GPUs) proves nothing there.
    """

    ok: bool | None
    source: P2PSource = "not_checked"
    note: str = ""
    pairs: int = 0
    gpus: tuple[GpuId, ...] = ()

    @property
    def proven(self) -> bool:
        """Whether P2P was shown to work by a check that exercises it."""
        return self.ok is True and self.source in ("p2p_check", "caller")


class BoxFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The box a record was made on.

    Attributes
    ----------
    gpu_name : str or None
        NVML / torch device name (``"NVIDIA RTX PRO 6000 Blackwell Server Edition"``).
    sm : tuple[int, int] or None
        Compute capability (major, minor).
    gpu_count : int
        GPUs visible.
    tp : int
        Tensor-parallel size the record is for (0: not known yet, never in a record).
    driver : str or None
    nccl_version : str or None
    nvlink_full : bool or None
        Every pair of the first ``tp`` GPUs (all GPUs when ``tp`` is 0) on NVLink, the test SGLang
        0.5.23 makes before it runs its custom all-reduce on more than 2 GPUs
        (``custom_all_reduce_utils.py::is_full_nvlink``); None: unknown.
    gpus : tuple[GpuId, ...] or None
        The GPUs the server's CUDA ordinals 0, 1, ... are, in that order (NVML's identities,
        mapped through ``CUDA_VISIBLE_DEVICES``; :func:`fastverify.topo.gpu_identity.visible_gpus`);
        None: unknown. ``launch`` fills it from NVML; a described box may give it.
    gpu_memory_bytes : int or None
        Total memory of the smallest of those GPUs (NVML ``nvmlDeviceGetMemoryInfo().total``);
        None: unknown. ``launch`` checks an IPC workspace against it.

    Raises
    ------
    ValueError
        ``gpu_count`` or ``tp`` negative, an ``sm`` part negative, ``gpu_memory_bytes`` not
        positive.
    """

    gpu_name: str | None
    sm: tuple[int, int] | None
    gpu_count: int
    tp: int
    driver: str | None = None
    nccl_version: str | None = None
    nvlink_full: bool | None = None
    gpus: tuple[GpuId, ...] | None = None
    gpu_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_count", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.sm is not None and any(part < 0 for part in self.sm):
            raise ValueError(f"sm parts must be >= 0, got {list(self.sm)}")
        mem = self.gpu_memory_bytes
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0):
            raise ValueError(f"gpu_memory_bytes must be a positive int, got {mem!r}")

    def key(self) -> str:
        """A file-name-safe key: ``<gpu>-sm<XY>-tp<N>-nccl<V>``."""
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in (self.gpu_name or "unknown-gpu"))
        sm = f"sm{self.sm[0]}{self.sm[1]}" if self.sm else "smNA"
        return f"{name}-{sm}-tp{self.tp}-nccl{self.nccl_version or 'unknown'}"


class Gain(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The all-reduce time per verify step before and after, and how it was obtained.

    ``basis`` is ``"predicted"`` (cost model) or ``"measured"``; ``clock`` says which clock
    measured it (``cuda_events``); a CPU clock never appears here (tune refuses to write then).
    """

    baseline_us: float
    best_us: float
    basis: Basis
    clock: str | None = None


class DeploymentRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``tune --write-env`` decided (see the module docstring)."""

    backend: BackendName
    shapes: VerifyShapes
    p2p: P2PFacts
    box: BoxFingerprint
    nccl_settings: dict[str, str] = {}
    sglang_version: str | None = None
    gain: Gain | None = None
    baseline: AnswerBaseline | None = None
    source: str = ""
    schema: str = SCHEMA
    version: int = VERSION


def record_path_for(env_path: str | Path) -> Path:
    """``nccl_configs/X.env`` → ``nccl_configs/X.deploy.json`` (beside the env file)."""
    p = Path(env_path)
    stem = p.name[: -len(".env")] if p.name.endswith(".env") else p.name
    return p.with_name(stem + ".deploy.json")


RECORD_HEADER = "deployment record: "  # the env-file header line (after "# ") naming the record beside it


def named_record(env_path: str | Path) -> str | None:
    """The record name an env file's header gives (the line :func:`write_deployment` writes), else None.

    Raises
    ------
    UserError
        The env file cannot be read (named).
    """
    text = read_text(Path(env_path), kind="text", what="env file")
    line = next((ln for ln in text.split("\n") if ln.startswith("# " + RECORD_HEADER)), None)
    return None if line is None else line[len(RECORD_HEADER) + 2 :].split(" (", 1)[0].strip() or None


def encode_record(record: DeploymentRecord) -> bytes:
    """The record as indented JSON bytes (keys in field order), newline-terminated; a text that
    is not valid UTF-8 (the path of a non-UTF-8 input file) is written with its bytes escaped
    (:func:`fastverify.errors.path_text`)."""
    try:
        raw = msgspec.json.encode(record)
    except UnicodeEncodeError:
        raw = msgspec.json.encode(_utf8(msgspec.to_builtins(record)))
    return msgspec.json.format(raw, indent=2) + b"\n"


def _utf8(obj):
    if isinstance(obj, str):
        return path_text(obj)
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_utf8(v) for v in obj]
    return obj


GPU_EXAMPLES = {
    "index": "0",
    "pci_bus_id": '"00000000:18:00.0"',
    "uuid": '"GPU-8ba4b3d5-0000-0000-0000-000000000000"',
    "name": '"NVIDIA RTX PRO 6000 Blackwell Server Edition"',
}
"""An example value (JSON text) of every :class:`GpuId` field, said in a schema error."""
BOX_EXAMPLES = {
    "gpu_name": '"NVIDIA RTX PRO 6000 Blackwell Server Edition"',
    "sm": "[12, 0]",
    "gpu_count": "8",
    "tp": "4",
    "driver": '"580.65.06"',
    "nccl_version": '"2.27.3"',
    "nvlink_full": "false",
    "gpus": '[{"index": 0, "pci_bus_id": "00000000:18:00.0"}]',
    "gpu_memory_bytes": "102005473280",
    **{f"gpus.{k}": v for k, v in GPU_EXAMPLES.items()},
}
"""An example value (JSON text) of every :class:`BoxFingerprint` field, said in a schema error."""
RECORD_EXAMPLES = {
    "backend": '"pcie_ipc"',
    "shapes": '{"max_batch": 8, "draft_tokens": 4, "hidden": 7168, "dtype": "bfloat16"}',
    "shapes.max_batch": "8",
    "shapes.draft_tokens": "4",
    "shapes.hidden": "7168",
    "shapes.dtype": '"bfloat16"',
    "p2p": '{"ok": true, "source": "p2p_check", "pairs": 12}',
    "p2p.ok": "true",
    "p2p.source": '"p2p_check"',
    "p2p.note": '"all 12 directions passed"',
    "p2p.pairs": "12",
    "box": '{"gpu_name": null, "sm": [12, 0], "gpu_count": 4, "tp": 4}',
    "nccl_settings": '{"NCCL_P2P_LEVEL": "PHB"}',
    "sglang_version": '"0.5.23"',
    "gain": '{"baseline_us": 250.0, "best_us": 180.0, "basis": "measured", "clock": "cuda_events"}',
    "gain.baseline_us": "250.0",
    "gain.best_us": "180.0",
    "gain.basis": '"measured"',
    "gain.clock": '"cuda_events"',
    "baseline": '{"source": "before/", "prompts": [{"id": "p00", "text": "Hi"}], "max_new_tokens": 64, "answers": []}',
    "source": '"tune --write-env"',
    "schema": f'"{SCHEMA}"',
    "version": str(VERSION),
    **{f"box.{k}": v for k, v in BOX_EXAMPLES.items()},
    **{f"p2p.gpus.{k}": v for k, v in GPU_EXAMPLES.items()},
}
"""An example value (JSON text) of every :class:`DeploymentRecord` field and nested field."""


def decode_record(data: bytes, *, source: str = "deployment record") -> DeploymentRecord:
    """Parse and validate a record.

    Raises
    ------
    UserError
        One line naming ``source`` for bad JSON, a wrong schema or version, an unknown backend or
        field, or an invalid value.
    """
    head = decode_json(data, source, what="the deployment record")
    if not isinstance(head, dict):
        kind = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean", type(None): "JSON null"}.get(
            type(head), "a JSON number"
        )
        raise UserError(
            f"{source}: not a fastverify deployment record ({kind}; expected an object with schema {SCHEMA!r})"
        )
    if head.get("schema") != SCHEMA:
        raise UserError(
            f"{source}: not a fastverify deployment record (schema {head.get('schema')!r}, expected {SCHEMA!r})"
        )
    version = head.get("version")
    if version != VERSION or type(version) is not int:
        what = (
            f"{version!r} ({type(version).__name__}, expected the integer {VERSION})"
            if type(version) is not int
            else f"{version}; this fastverify reads version {VERSION}"
        )
        raise UserError(f"{source}: deployment record version {what} (re-run `fastverify tune --write-env`)")
    try:
        record = msgspec.json.decode(data, type=DeploymentRecord)
    except msgspec.ValidationError as err:
        raise schema_error(f"{source}: invalid deployment record", err, RECORD_EXAMPLES) from None
    except ValueError as err:
        raise UserError(f"{source}: invalid deployment record: {err}") from None
    _check_record(record, source)
    return record


def _check_record(record: DeploymentRecord, source: str) -> None:
    """What a record must hold beyond its types: a TP size in 1..``MAX_WORLD_SIZE`` and a GPU count
    up to it (:mod:`fastverify.bounds`), and NCCL settings that an env file
    could hold (allowed ``NCCL_*`` names, values the NCCL catalogue does not reject for the
    record's NCCL version: :func:`fastverify.envfile.check_setting`)."""
    if record.box.tp < 1:
        raise UserError(f"{source}: invalid deployment record: box.tp must be >= 1, got {record.box.tp}")
    for name in ("tp", "gpu_count"):  # a box's GPUs (fastverify/bounds.py), before launch sizes anything by them
        if (value := getattr(record.box, name)) > MAX_WORLD_SIZE:
            raise UserError(
                f"{source}: invalid deployment record: box.{name} {value:.3g} is over {MAX_WORLD_SIZE} "
                "(the most GPUs of one box, fastverify/bounds.py MAX_WORLD_SIZE)"
            )
    version = None
    if record.box.nccl_version is not None:
        try:
            version = NcclVersion.parse(record.box.nccl_version)
        except UserError as err:
            raise UserError(f"{source}: invalid deployment record: box.nccl_version: {err}") from None
    for key, value in record.nccl_settings.items():
        if not key.startswith("NCCL_"):
            raise UserError(f"{source}: invalid deployment record: nccl_settings holds {key}, not an NCCL_* name")
        check_setting(key, value, f"{source}: nccl_settings", version)
    check_together(dict(record.nccl_settings), f"{source}: nccl_settings", version)


def read_record(path: str | Path) -> DeploymentRecord:
    """Read and validate the record at ``path``; :class:`UserError` (one line naming the file)
    when it is missing, unreadable or invalid."""
    p = Path(path)

    data = read_bytes(p, kind="json", what="the deployment record")
    return decode_record(data, source=str(p))


def record_from_environ(environ: "os._Environ[str] | dict[str, str] | None" = None) -> DeploymentRecord | None:
    """The record named by ``FASTVERIFY_DEPLOYMENT`` in ``environ`` (default ``os.environ``), None
    when unset. Raises :class:`UserError` for a named file that is bad."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_DEPLOYMENT)
    return read_record(path) if path else None


def sglang_settings(backend: BackendName | str) -> dict[str, str]:
    """The variables that make SGLang itself run ``backend`` (registry facts, no names here):
    what ``fastverify launch`` exports, after the P2P proof. Never written to an env file
    (:mod:`fastverify.envfile`: an env file sourced without launch would start the path
    unchecked).

    For a backend SGLang switches (``Reach.sglang_switch``): its switch ``=1``, and no size.
    SGLang 0.5.23 then sizes the workspace from its own decode CUDA-graph width, the largest
    captured batch x draft tokens of the server it runs in (``device_communicators/pcie_ipc_ar.py``
    ``_decode_width``), so every captured verify step is covered; a size would be used verbatim
    and send every wider step to NCCL; the record's shapes never cap it (a cap is only a
    decision from a measured crossover). Backends the patch reaches, or SGLang's native ones,
    need no variable: the record carries them. ``{}`` then.
    """
    info = backend_info(backend)
    out: dict[str, str] = {}
    if info.reach is Reach.sglang_switch and info.sglang_switch:
        out[info.sglang_switch] = "1"
    return out


def installed_sglang_version() -> str | None:
    """The installed SGLang's version from its distribution metadata (SGLang is never imported:
    that takes ~20 s and initialises CUDA); None when it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def write_deployment(
    env_path: str | Path,
    settings: dict[str, str],
    record: DeploymentRecord,
    *,
    header_lines: "list[str] | tuple[str, ...]" = (),
    nccl_version: object = None,
    inputs: "tuple[str | Path | None, ...]" = (),
) -> tuple[Path, Path]:
    """Write the env file and the deployment record beside it (:func:`record_path_for`), both or
    neither.

    Both are validated before either is written (a bad setting, an ``SGLANG_*`` key among them,
    leaves no file changed); then both are staged and renamed together
    (:func:`fastverify.outputs.atomic_write_texts`): should the env file's rename fail, the
    record gets its old content back (or is removed, where there was none), so a failed write
    never leaves a new record beside an old env file.

    Parameters
    ----------
    settings
        The env file's lines: NCCL settings and ``CUDA_DEVICE_MAX_CONNECTIONS`` only; the backend
        is the record's.
    inputs
        Files the command read (profile, topology, P2P results): neither output, nor the ``.bak``
        each keeps of an existing file, may be one of them.

    Raises
    ------
    UserError
        An output path (or its backup) is one of ``inputs``, a setting is not allowed, or a file
        cannot be written.
    """
    env_p = Path(env_path)
    rec_p = record_path_for(env_p)
    taken = {os.path.realpath(str(i)) for i in inputs if i}
    for out in (env_p, rec_p, backup_path(env_p), backup_path(rec_p)):
        if os.path.realpath(str(out)) in taken:
            raise UserError(f"{out}: is one of this command's inputs; write the env file elsewhere")
    text = render_env(
        settings,
        header_lines=[
            *header_lines,
            f"{RECORD_HEADER}{rec_p.name} (read by `fastverify launch --env` and every TP rank)",
        ],
        nccl_version=nccl_version,
        where=str(env_p),
    )  # type: ignore[arg-type]
    data = encode_record(record).decode("utf-8")
    atomic_write_texts([(rec_p, data), (env_p, text)])
    return env_p, rec_p
