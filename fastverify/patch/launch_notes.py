"""``fastverify launch``'s notes: where the command, the env file and the installed SGLang differ
from what the deployment record was made for, and what covers the server's verify steps. Each
note is one line the plan prints (``note: ...``); only :func:`workspace_check` refuses anything
(an IPC workspace that would not fit beside SGLang's static pool)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastverify.deploy import BoxFingerprint, DeploymentRecord
from fastverify.errors import UserError
from fastverify.patch.server_cmd import ServerShapes
from fastverify.registry import BackendInfo

if TYPE_CHECKING:
    from fastverify.patch.sglang_info import SGLangInfo


def settings_notes(record: DeploymentRecord, settings: Mapping[str, str], env_file: str, notes: list[str]) -> None:
    """A note (not a refusal) where the env file's NCCL settings differ from the record's.

    The env file is what is exported, and it is validated line by line like the record's
    settings; a hand edit of it (a plain docker/systemd file) is a normal thing to do, and the
    record's other facts (box, TP, backend, shapes, P2P) are checked on their own. What differs
    is only the record's gain, which was obtained with the record's settings: the note says so.
    """
    env_nccl = {k: v for k, v in settings.items() if k.startswith("NCCL_")}
    if env_nccl == dict(record.nccl_settings):
        return
    keys = sorted(set(env_nccl) | set(record.nccl_settings))
    diff = ", ".join(
        f"{k}: env {env_nccl.get(k, '(unset)')} / record {record.nccl_settings.get(k, '(unset)')}"
        for k in keys
        if env_nccl.get(k) != record.nccl_settings.get(k)
    )
    notes.append(
        f"{env_file}: NCCL settings differ from the deployment record's ({diff}); the env file's are "
        "set, and the record's gain was obtained with the record's"
    )


def served_dtype(record: DeploymentRecord | None, server: ServerShapes | None) -> str | None:
    """The dtype the server's all-reduces run in: the command's ``--dtype`` where it names one
    (``bfloat16``, ``float16``/``half``, ``float32``/``float``), else the record's; None unknown."""
    given = {
        "bfloat16": "bfloat16",
        "float16": "float16",
        "half": "float16",
        "float32": "float32",
        "float": "float32",
    }.get((server.dtype or "") if server is not None else "")
    return given or (record.shapes.dtype if record is not None else None)


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

IPC_WORKSPACE_MAX_GPU_PERCENT = 10
"""The most of one GPU's memory, in percent, an IPC all-reduce workspace may take (new bound, defined here,
not in :mod:`fastverify.bounds`). SGLang 0.5.23 allocates the workspace after its static pool
(weights + KV cache, ``--mem-fraction-static``), from the few GB it reserves for activations and
CUDA graphs (``arg_groups/memory_hook.py``: 512 MB + 1.5 MB per activation token + 1 GB per 8 TP
ranks, at least 10 GB above 60 GB); a decode-sized workspace takes well under 1 % (48 x 6 rows x
7168 x 2 B x 34 ≈ 140 MB at TP 8), so a tenth of the GPU is far above any real one and far below
what would take the server's own memory."""


def _ipc_slab_factor(world: int) -> int:
    """Bytes per payload byte FlashInfer 0.7.4 allocates per rank for its PCIe IPC workspace
    (``include/flashinfer/comm/pcie_ipc_all_reduce.cuh::compute_workspace_layout``): two scratch
    regions of ``2 x world x payload`` each plus the copy-engine ring, ``2 x (world - 1)``
    shards of ``payload / world`` (< 2 x payload); signals and flags are a few KiB. So at least
    ``4 x world + 2`` times the payload: a lower bound, which is what a refusal needs."""
    return 4 * world + 2


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def workspace_check(
    b: BackendInfo,
    environ: Mapping[str, str],
    record: DeploymentRecord | None,
    server: ServerShapes | None,
    box: BoxFingerprint | None,
    world: int | None,
) -> str:
    """What covers the verify steps of a backend SGLang switches and sizes itself, and whether its
    IPC workspace fits the GPU (one line); refuses one that does not.

    The size: ``b.size_env`` from the environment where set (SGLang 0.5.23 uses it verbatim and
    sends every wider step to NCCL; the caller validated it against the bounds first,
    :func:`fastverify.envfile.check_setting`), else SGLang's own decode width
    (``pcie_ipc_ar.py::_decode_width``: largest captured batch x draft tokens, the command's
    rows here, else the record's) times the record's hidden size. Elements x dtype bytes (the
    record's dtype; SGLang builds the workspace in bfloat16) x FlashInfer's per-rank layout
    (:func:`_ipc_slab_factor`) is compared with the GPU's memory where NVML (or the described
    box) gives it (:attr:`BoxFingerprint.gpu_memory_bytes`), and said where it does not.

    Raises
    ------
    UserError
        The workspace would take more than :data:`IPC_WORKSPACE_MAX_GPU_PERCENT` % of the GPU.
    """
    covers = server.covers() if server is not None else "every captured verify step"
    hidden = record.shapes.hidden if record is not None else None
    rows = (
        server.max_rows
        if server is not None and server.max_rows
        else (record.shapes.max_rows if record is not None else None)
    )
    given = environ.get(b.size_env) if b.size_env else None
    if given is not None:
        elements = int(given)
        if hidden and rows and elements < rows * hidden:
            head = (
                f"{b.name.value}: the environment's {b.size_env}={elements} caps the workspace at "
                f"{elements // hidden} rows x hidden {hidden}; the command runs {covers}: verify steps above "
                f"{elements // hidden} rows go to NCCL (unset it to let SGLang size it)"
            )
        else:
            head = (
                f"{b.name.value}: the environment's {b.size_env}={elements} sizes the workspace (SGLang uses it "
                f"verbatim; the command runs {covers})"
            )
    else:
        elements = rows * hidden if rows and hidden else None
        head = (
            f"{b.name.value}: {b.size_env or 'the workspace'} not set: SGLang sizes the workspace from its "
            f"decode CUDA-graph width, covering {covers}"
        )
    if elements is None:
        return (
            head + "; workspace size unknown (no deployment record gives the hidden size): not checked against "
            "the GPU's memory"
        )
    elem = _DTYPE_BYTES.get(record.shapes.dtype if record is not None else "bfloat16", 2)
    w = world or 8
    slab = elements * elem * _ipc_slab_factor(w)
    what = f"{elements:,} elements x {elem} B x {_ipc_slab_factor(w)} (FlashInfer's layout at TP {w})"
    mem = box.gpu_memory_bytes if box is not None else None
    if mem is None:
        return (
            head + f"; workspace about {_mib(slab)} per GPU ({what}); GPU memory unknown (NVML gave none): not "
            "checked against it"
        )
    if slab * 100 > mem * IPC_WORKSPACE_MAX_GPU_PERCENT:  # integers: exact at the bound
        raise UserError(
            f"{b.name.value}: its IPC workspace would take {_mib(slab)} per GPU ({what}), "
            f"{100.0 * slab / mem:.1f} % of the GPU's {_mib(mem)}, more than the "
            f"{IPC_WORKSPACE_MAX_GPU_PERCENT} % SGLang leaves beside its static pool: lower the "
            f"size, the decode batch or the draft tokens, or use nccl"
        )
    return head + f"; workspace about {_mib(slab)} per GPU ({what}), {100.0 * slab / mem:.1f} % of its {_mib(mem)}"


def shape_notes(record: DeploymentRecord, server: ServerShapes | None, info: SGLangInfo, notes: list[str]) -> None:
    """Notes where the command or the installed SGLang differ from what the record was made for."""
    s = record.shapes
    if server is not None:
        notes.append(
            f"the command (read by {server.source}{'; ' + server.note if server.note else ''}) runs {server.covers()}"
        )
        rows = server.max_rows
        if rows is not None and rows > s.max_rows:
            notes.append(
                f"the record was measured for verify steps up to {s.max_rows} rows ({s.max_batch} requests x "
                f"{s.draft_tokens} tokens); the command runs up to {rows}: its gain was not measured there "
                f"(re-run tune with --max-batch {server.max_batch} --draft-tokens {server.tokens_per_request})"
            )
        if server.draft_tokens is not None and server.algorithm and server.draft_tokens != s.draft_tokens:
            notes.append(
                f"the command verifies {server.draft_tokens} tokens per request; the record was made for "
                f"{s.draft_tokens}"
            )
    if record.sglang_version and info.version and record.sglang_version != info.version:
        notes.append(f"the record was made with SGLang {record.sglang_version}; this SGLang is {info.version}")
