"""The facts about this box that decide which all-reduce backend can run in SGLang here.

* :func:`read_box`: the :class:`~fastverify.deploy.BoxFingerprint` (GPU name, compute capability,
  GPU count, driver, NCCL version) from NVML (``pynvml``: ``nvmlDeviceGetName``,
  ``nvmlDeviceGetCudaComputeCapability``, ``nvmlSystemGetDriverVersion``), falling back to
  ``torch.cuda`` where NVML cannot start. NVML creates no CUDA context, so ``launch`` can ask
  before SGLang starts; torch is imported only for the fallback.
* :func:`box_from_description`: a *described* box (JSON object or a file holding one) for tests
  and for checking a record on a machine other than the target (``launch`` reads it from the
  ``FASTVERIFY_DESCRIBE_BOX`` variable or its hidden ``--describe-box`` flag).
* :func:`read_p2p_file`: :class:`~fastverify.deploy.P2PFacts` from the output of the real check
  (``fastverify p2p --output p2p.json``, or its cache file
  ``~/.cache/fastverify/p2p-<fingerprint>.json``): the only source that *proves* P2P.
* :func:`p2p_from_topology` / :func:`p2p_from_results`: facts from NVML's P2P status (not proof)
  or from :func:`fastverify.topo.p2p.check_p2p` results (proof).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from fastverify.bounds import (
    MAX_GPU_MEMORY_BYTES,
    MAX_WORLD_SIZE,
    duplicate_json_key,
    implausible_count,
    implausible_name,
)
from fastverify.deploy import BOX_EXAMPLES, BoxFingerprint, P2PFacts
from fastverify.errors import UserError, one_line, schema_error
from fastverify.inputs import read_text
from fastverify.nccl.version import read_nccl_version
from fastverify.topo.gpu_identity import nvml_gpus, visible_gpus
from fastverify.topo.nvml import nvml_text
from fastverify.topo.boxfacts import SM_RANGE
from fastverify.topo.p2p_proof import read_check_file

ENV_DESCRIBE_BOX = "FASTVERIFY_DESCRIBE_BOX"
"""Env var holding a described box (JSON object text, or the path of a file with one)."""


def _nccl_text() -> str | None:
    try:
        v = read_nccl_version()
    except (UserError, OSError):
        return None
    return str(v) if v is not None else None


def _summarise(names: list[str], sms: list[tuple[int, int]]) -> tuple[str | None, tuple[int, int] | None]:
    """One name and one SM for the box. Mixed boxes report the lowest SM (the gate every rank
    must pass) and the name of a GPU with that SM."""
    if not sms:
        return (names[0] if names else None), None
    low = min(sms)
    return names[sms.index(low)] if names else None, low


def _nvlink_full(nvml: Any, handles: list[Any], error_type: type) -> bool | None:
    """SGLang 0.5.23's own test (``custom_all_reduce_utils.py::is_full_nvlink``): every pair's
    ``nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)`` is ``NVML_P2P_STATUS_OK``.
    None when NVML lacks the query or it fails (unknown, not "no")."""
    index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", None)
    if index is None or ok is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
        return None
    try:
        return all(nvml.nvmlDeviceGetP2PStatus(a, b, index) == ok
                   for i, a in enumerate(handles) for b in handles[i + 1:])
    except error_type:
        return None


def read_box(tp: int = 0, *, nvml: Any | None = None, torch_fallback: bool = True,
             nccl_version: str | None = None, environ: Mapping[str, str] | None = None) -> BoxFingerprint:
    """This box's fingerprint.

    Parameters
    ----------
    tp : int
        Tensor-parallel size the fingerprint is for (0: not known yet).
    nvml : module or None
        The NVML binding (tests pass a stand-in); ``None`` imports ``pynvml``.
    torch_fallback : bool
        Ask ``torch.cuda`` when NVML cannot start (it imports torch, ~1 s).
    nccl_version : str or None
        Known NCCL version; default read from the library the box would load.
    environ : mapping or None
        The environment whose ``CUDA_VISIBLE_DEVICES`` picks and orders the GPUs (default
        ``os.environ``): the fingerprint is of the GPUs CUDA shows a process started with it
        (:func:`fastverify.topo.gpu_identity.visible_gpus`; NVML order where that cannot be told).

    Returns
    -------
    BoxFingerprint
        ``gpu_count == 0`` and ``sm is None`` when neither NVML nor torch sees a GPU (never raises
        for that: a box without GPUs is a fact, and the callers refuse what it cannot run).
        ``nvlink_full`` from NVML over the first ``tp`` GPUs CUDA shows (all when ``tp`` is 0);
        None without NVML.
    """
    names: list[str] = []
    nvlink: bool | None = None
    sms: list[tuple[int, int]] = []
    driver: str | None = None
    got = False
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            nvml = None
    if nvml is not None:
        names, sms, nvlink, driver, got = _nvml_facts(nvml, tp, environ if environ is not None else os.environ)
    if not got and torch_fallback:
        try:
            import torch  # noqa: PLC0415

            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                names = [torch.cuda.get_device_name(i) for i in range(n)]
                sms = [tuple(torch.cuda.get_device_capability(i)) for i in range(n)]  # type: ignore[misc]
                got = n > 0
        except Exception:  # a broken CUDA install reads as "no GPU", never a traceback
            names, sms, got = [], [], False
    name, sm = _summarise(names, sms) if got else (None, None)
    return BoxFingerprint(gpu_name=name, sm=sm, gpu_count=len(names) if got else 0, tp=int(tp), driver=driver,
                          nccl_version=nccl_version if nccl_version is not None else (_nccl_text() if got else None),
                          nvlink_full=nvlink if got else None)


def _nvml_facts(nvml: Any, tp: int,
                environ: Mapping[str, str]) -> tuple[list[str], list, bool | None, str | None, bool]:
    """(names, SMs, nvlink_full, driver, any GPU) from NVML, for the GPUs CUDA shows under
    ``environ`` in CUDA's order (:func:`_cuda_order`)."""
    names: list[str] = []
    nvlink: bool | None = None
    sms: list[tuple[int, int]] = []
    driver: str | None = None
    got = False
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error_type, OSError):
        pass
    else:
        try:
            count = nvml.nvmlDeviceGetCount()
            order = _cuda_order(nvml, environ)
            handles = []
            for i in (order if order is not None else range(count)):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                handles.append(h)
                names.append(nvml_text(nvml.nvmlDeviceGetName(h)))
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                sms.append((int(major), int(minor)))
            nvlink = _nvlink_full(nvml, handles[: tp or None], error_type) if len(handles) > 1 else None
            try:
                driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
            except error_type:
                driver = None
            got = len(handles) > 0
        except error_type:
            names, sms, got, nvlink = [], [], False, None
        finally:
            try:
                nvml.nvmlShutdown()
            except error_type:
                pass
    return names, sms, nvlink, driver, got


def _cuda_order(nvml: Any, environ: Mapping[str, str]) -> list[int] | None:
    """NVML indices of the GPUs CUDA shows under ``environ``, in CUDA's order; None where that
    cannot be told (then NVML's order, all GPUs)."""
    rows, _ = visible_gpus(nvml_gpus(nvml), environ)
    return None if rows is None else [int(r["index"]) for r in rows]


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of something that exists (a name too long or holding a NUL
    names nothing)."""
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):
        return False


def box_from_description(text: str, *, where: str = ENV_DESCRIBE_BOX, tp: int = 0) -> BoxFingerprint:
    """A described box: a JSON object with :class:`BoxFingerprint`'s fields (``sm`` as
    ``[major, minor]``; ``tp`` defaults to ``tp``), or the path of a file holding one.

    Raises
    ------
    UserError
        One line naming ``where``: unreadable file, bad JSON, unknown field or bad value.
    """
    raw = text.strip()
    # JSON text when it looks like JSON or names no file; a path otherwise (so "[]" is a JSON
    # array, not a missing file called "[]").
    is_json = raw[:1] in ("{", "[", '"')
    if not is_json and not _names_a_file(raw):
        try:
            json.loads(raw)
            is_json = True
        except (ValueError, RecursionError):  # not JSON; or an integer over Python's 4300 digits
            pass
    if not is_json:
        raw = read_text(Path(raw).expanduser(), kind="text", flag=where, what="the box description")
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: box description is not JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise UserError(f"{where}: box description nested too deeply") from None
    except ValueError as err:  # an integer of over 4300 digits
        raise UserError(f"{where}: box description is not JSON ({one_line(str(err), 100)})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{where}: box description must be a JSON object, got {type(doc).__name__} {raw.strip()[:40]!r}")
    if (key := duplicate_json_key(raw)) is not None:
        raise UserError(f"{where}: invalid box description: the key {one_line(repr(key), 80)} is given twice")
    doc.setdefault("tp", tp)
    doc.setdefault("gpu_name", None)
    doc.setdefault("sm", None)
    doc.setdefault("gpu_count", 0)
    try:
        box = msgspec.convert(doc, BoxFingerprint)
    except msgspec.ValidationError as err:
        raise schema_error(f"{where}: invalid box description", err, BOX_EXAMPLES) from None
    except ValueError as err:
        raise UserError(f"{where}: invalid box description: {err}") from None
    if (why := implausible_box(box)) is not None:
        raise UserError(f"{where}: invalid box description: {why}")
    return box


def implausible_box(box: BoxFingerprint) -> str | None:
    """Why a described box cannot be a real one (:mod:`fastverify.bounds`), or None when it can:
    ``gpu_count``, ``tp``, ``gpus`` and their indices within ``MAX_WORLD_SIZE``; ``sm`` a
    compute capability the cost model takes (``SM_RANGE``, minor 0-9); ``gpu_memory_bytes`` up to
    ``MAX_GPU_MEMORY_BYTES``; each text at most ``MAX_NAME_CHARS`` characters."""
    for name in ("gpu_count", "tp"):
        if why := implausible_count(getattr(box, name), upper=MAX_WORLD_SIZE, what=name):
            return f'field "{name}": {why} (fastverify/bounds.py MAX_WORLD_SIZE)'
    if box.sm is not None:
        major, minor = box.sm
        if not (SM_RANGE[0] <= 10 * major + minor <= SM_RANGE[1] and 0 <= minor <= 9):
            return (f'field "sm": {one_line(repr(list(box.sm)), 60)} is no compute capability from '
                    f"[{SM_RANGE[0] // 10}, 0] to [{SM_RANGE[1] // 10}, 0] (e.g. [12, 0])")
    mem = box.gpu_memory_bytes
    if mem is not None and mem > MAX_GPU_MEMORY_BYTES:
        return f'field "gpu_memory_bytes": {mem:.3g} bytes is over {MAX_GPU_MEMORY_BYTES:,} (1 TiB)'
    texts = [(n, getattr(box, n)) for n in ("gpu_name", "driver", "nccl_version")]
    if box.gpus is not None:
        if len(box.gpus) > MAX_WORLD_SIZE:
            return f'field "gpus": {len(box.gpus):,} GPUs is over {MAX_WORLD_SIZE} (fastverify/bounds.py)'
        for i, g in enumerate(box.gpus):
            if g.index is not None and g.index > MAX_WORLD_SIZE:
                return f'field "gpus[{i}].index": {g.index:.3g} is over {MAX_WORLD_SIZE}'
            texts += [(f"gpus[{i}].{n}", getattr(g, n)) for n in ("pci_bus_id", "uuid", "name")]
    for name, text in texts:
        if text is not None and (why := implausible_name(text, what=name)):
            return f'field "{name}": {why}'
    return None


def described_box(environ: Mapping[str, str] | None = None, *, tp: int = 0) -> BoxFingerprint | None:
    """The box described in ``FASTVERIFY_DESCRIBE_BOX``, None when unset."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_DESCRIBE_BOX)
    return box_from_description(text, tp=tp) if text else None


def p2p_from_results(results: Mapping[tuple[int, int], Any], *, source: str = "p2p_check") -> P2PFacts:
    """Facts from real-check results (``{(i, j): P2PResult}``): ok when every direction passed;
    not known (``ok`` None) when some timed out and none failed (a timeout is no answer)."""
    if not results:
        return P2PFacts(ok=None, source="not_checked", note="no GPU pair checked")
    bad = [(p, r) for p, r in sorted(results.items()) if not r.ok and not getattr(r, "timed_out", False)]
    late = [(p, r) for p, r in sorted(results.items()) if getattr(r, "timed_out", False)]
    if late and not bad:
        (i, j), r = late[0]
        note = (f"{len(late)} of {len(results)} directions timed out (not a failure; rerun the check); first: "
                f"GPU {j} -> memory of GPU {i}: {r.reason}")
        return P2PFacts(ok=None, source=source, note=note[:300], pairs=len(results))  # type: ignore[arg-type]
    if bad:
        (i, j), r = bad[0]
        note = f"{len(bad)} of {len(results)} directions failed; first: GPU {j} -> memory of GPU {i}: {r.reason}"
        return P2PFacts(ok=False, source=source, note=note[:300], pairs=len(results))  # type: ignore[arg-type]
    return P2PFacts(ok=True, source=source, note=f"all {len(results)} directions passed",  # type: ignore[arg-type]
                    pairs=len(results))


def read_p2p_results(path: str | Path) -> dict:
    """The per-direction results of the real check's JSON: the document ``fastverify p2p``
    prints (either version), or its cache file; read by
    :func:`fastverify.topo.p2p_proof.read_check_file`, the one reader of that file.

    Returns
    -------
    dict[(int, int), P2PResult]
        ``(src, dst)`` → result: GPU ``dst`` read and wrote the memory of GPU ``src``.

    Raises
    ------
    UserError
        One line naming the file when it cannot be read or is not such a JSON document.
    """
    return dict(read_check_file(path).results)


def p2p_file_facts(path: str | Path, results: Mapping[tuple[int, int], Any]) -> P2PFacts:
    """:class:`P2PFacts` of results read from ``path`` (:func:`read_p2p_results`)."""
    facts = p2p_from_results(results)
    return P2PFacts(ok=facts.ok, source="p2p_check", note=f"{facts.note} ({path})"[:300], pairs=facts.pairs)


def read_p2p_file(path: str | Path) -> P2PFacts:
    """P2P facts from the real check's JSON (:func:`read_p2p_results`); the only proof of P2P.

    Raises
    ------
    UserError
        One line naming the file when it cannot be read or is not such a JSON document.
    """
    return p2p_file_facts(path, read_p2p_results(path))


def p2p_from_topology(topo: Any | None) -> P2PFacts:
    """NVML's P2P status (``Topology.p2p_read`` / ``p2p_write``): what the driver reports, which
    can say yes where P2P fails or hangs (see :mod:`fastverify.topo.p2p_side`), so it never proves."""
    if topo is None or not getattr(topo, "p2p_read", None):
        return P2PFacts(ok=None, source="not_checked", note="no P2P status (topology text has none)")
    values = list(topo.p2p_read.values()) + list(topo.p2p_write.values())
    if all(v is None for v in values):
        return P2PFacts(ok=None, source="not_checked", note=f"no P2P status in {topo.source}"[:300])
    if any(v is False for v in values):
        return P2PFacts(ok=False, source="nvml", note="NVML reports P2P not supported for a pair",
                        pairs=len(values))
    if all(v is True for v in values):
        return P2PFacts(ok=True, source="nvml", note="NVML reports P2P read/write OK for every pair (not exercised)",
                        pairs=len(values))
    return P2PFacts(ok=None, source="nvml", note="NVML could not tell P2P for some pairs", pairs=len(values))
