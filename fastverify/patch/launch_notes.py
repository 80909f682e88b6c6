"""``fastverify launch``'s notes: where the command, the env file and the installed SGLang differ
from what the deployment record was made for, and what covers the server's verify steps. Each
note is one line the plan prints (``note: ...``); none of them refuses anything."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastverify.deploy import DeploymentRecord
from fastverify.patch.server_cmd import ServerShapes
from fastverify.registry import BackendInfo

if TYPE_CHECKING:
    from fastverify.patch.launch import SGLangInfo


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
    diff = ", ".join(f"{k}: env {env_nccl.get(k, '(unset)')} / record {record.nccl_settings.get(k, '(unset)')}"
                     for k in keys if env_nccl.get(k) != record.nccl_settings.get(k))
    notes.append(f"{env_file}: NCCL settings differ from the deployment record's ({diff}); the env file's are "
                 "set, and the record's gain was obtained with the record's")


def served_dtype(record: DeploymentRecord | None, server: ServerShapes | None) -> str | None:
    """The dtype the server's all-reduces run in: the command's ``--dtype`` where it names one
    (``bfloat16``, ``float16``/``half``, ``float32``/``float``), else the record's; None unknown."""
    given = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
             "float": "float32"}.get((server.dtype or "") if server is not None else "")
    return given or (record.shapes.dtype if record is not None else None)


def workspace_note(b: BackendInfo, settings: Mapping[str, str], record: DeploymentRecord | None,
                    server: ServerShapes | None) -> str:
    """What covers the verify steps of a backend SGLang switches and sizes itself (one line).

    Without ``b.size_env`` in the env file SGLang 0.5.23 sizes the workspace from its own decode
    width (largest captured batch x draft tokens, ``pcie_ipc_ar.py::_decode_width``): every
    captured step is covered. With it, SGLang uses the value verbatim and sends every wider step to
    NCCL: the line says which steps, where the command's shapes and the hidden size are known.
    """
    covers = server.covers() if server is not None else "every captured verify step"
    if not b.size_env or b.size_env not in settings:
        return (f"{b.name.value}: {b.size_env or 'the workspace'} not set: SGLang sizes the workspace from its "
                f"decode CUDA-graph width, covering {covers}")
    value = int(settings[b.size_env])
    hidden = record.shapes.hidden if record is not None else None
    rows = server.max_rows if server is not None else None
    if hidden and rows and value < rows * hidden:
        return (f"{b.name.value}: {b.size_env}={value} from the env file caps the workspace at {value // hidden} rows "
                f"x hidden {hidden}; the command runs {covers}: verify steps above {value // hidden} rows go to "
                f"NCCL (drop the line to let SGLang size it)")
    return (f"{b.name.value}: {b.size_env}={value} from the env file sizes the workspace (SGLang uses it verbatim; "
            f"the command runs {covers})")


def shape_notes(record: DeploymentRecord, server: ServerShapes | None, info: SGLangInfo, notes: list[str]) -> None:
    """Notes where the command or the installed SGLang differ from what the record was made for."""
    s = record.shapes
    if server is not None:
        notes.append(f"the command (read by {server.source}{'; ' + server.note if server.note else ''}) runs "
                     f"{server.covers()}")
        rows = server.max_rows
        if rows is not None and rows > s.max_rows:
            notes.append(f"the record was measured for verify steps up to {s.max_rows} rows ({s.max_batch} requests x "
                         f"{s.draft_tokens} tokens); the command runs up to {rows}: its gain was not measured there "
                         f"(re-run tune with --max-batch {server.max_batch} --draft-tokens {server.tokens_per_request})")
        if server.draft_tokens is not None and server.algorithm and server.draft_tokens != s.draft_tokens:
            notes.append(f"the command verifies {server.draft_tokens} tokens per request; the record was made for "
                         f"{s.draft_tokens}")
    if record.sglang_version and info.version and record.sglang_version != info.version:
        notes.append(f"the record was made with SGLang {record.sglang_version}; this SGLang is {info.version}")
