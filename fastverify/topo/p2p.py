"""A real GPU peer-to-peer (P2P) check, run in child processes and cached per box.

The driver's P2P report (``cudaDeviceCanAccessPeer``, NVML's P2P status) can say yes where P2P
reads or writes fail, hang or corrupt data (IOMMU/ACS settings, some BIOSes and consumer boards);
vLLM tests P2P for real before enabling its custom all-reduce for that reason
(``custom_all_reduce_utils.py::gpu_p2p_access_check``). fastverify does the same with torch:

For each unordered GPU pair ``{i, j}`` one child (``python -m fastverify.topo.p2p pair i j OUT``)
starts two *side* processes, one per GPU. Each side allocates a 4 MiB buffer on its GPU, fills it
with its own byte pattern and publishes the buffer's CUDA IPC handle
(``UntypedStorage._share_cuda_``, the call behind ``torch.multiprocessing``'s CUDA sharing). It
then opens the other side's handle **under its own device** (``UntypedStorage._new_shared_cuda``
with its own device index), so the peer's memory is mapped into its own CUDA context and every
torch op on it runs on its own GPU and crosses the PCIe/NVLink fabric: it reads the peer pattern
back (P2P read), writes a second pattern with a copy-engine copy (first half) and an SM kernel
(second half) (P2P write), and each side finally checks that its own buffer holds what the peer
wrote. Direction ``(i, j)`` = memory on GPU ``i``, accessed from GPU ``j``.

Everything that can hang runs in a child with a timeout; a hang yields ``P2PResult(False,
"timeout ...")``. Data passes through files, never stdout (children may print logs). Results are
cached as JSON in ``<cache>/p2p-<fingerprint>.json``; the fingerprint covers GPU names, PCI bus
ids, driver version, ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (both change what CUDA
ordinal ``i`` means), and the key is repeated inside the file.

This checks legacy CUDA IPC (``cudaIpcOpenMemHandle``), the mechanism of the PCIe IPC all-reduces
(SGLang/vLLM custom all-reduce, FlashInfer); NCCL may use cuMem handles instead
(``NCCL_CUMEM_ENABLE``), which share the same fabric path.

The check file (``fastverify p2p --output p2p.json``, schema
``fastverify.p2p_check`` version 2, :func:`check_document`) names the GPUs it tested, so a proof
is bound to a box, not to a count of passing directions::

    {"schema": "fastverify.p2p_check", "version": 2,
     "cuda_visible_devices": null, "cuda_device_order": null,
     "gpus": [{"cuda": 0, "index": 0, "pci_bus_id": "00000000:18:00.0", "uuid": "GPU-...", "name": "..."}, ...],
     "results": [{"src": 0, "dst": 1, "ok": true, "reason": "..."}, ...]}

``src``/``dst`` are CUDA ordinals of the checking process; ``gpus[k]`` is ordinal ``k`` as NVML
names it (index, PCI bus id, UUID; :func:`gpu_identities` matches torch's device properties to
NVML's GPUs), under the ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` recorded beside them.
:func:`read_check_file` also reads the older forms (the bare result list, the cache file) but
they name no GPU, so :func:`proof_for` refuses them for proof ("rerun the check"). ``launch``
accepts a proof only when every GPU of its TP group is one the check tested (by UUID, else PCI
address: never by index, which every box has) and every ordered pair ``(i, j)``, ``i != j``,
of the group passed (``world x (world - 1)`` directions; a count alone proves nothing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fastverify.errors import EXIT_USER_ERROR, UserError
from fastverify.procs import RankGroup, child_env, exit_reason, rank_workdir, stderr_path

SCHEMA_VERSION = 1  # of the cache file (its own "schema_version")
CHECK_SCHEMA = "fastverify.p2p_check"
CHECK_VERSION = 2  # version 1: the bare result list, naming no GPU
DEFAULT_TIMEOUT_S = 120.0
BUFFER_BYTES = 4 << 20
NO_CUDA = "no CUDA GPUs: the real P2P check needs a GPU box"
_POLL_S = 0.02

# argv of the child that tests the unordered pair {i, j} and writes its JSON result to out_path.
ChildArgv = Callable[[int, int, Path], Sequence[str]]


@dataclass(frozen=True)
class P2PResult:
    """Outcome for one direction: ``ok`` when GPU j read and wrote GPU i's memory correctly;
    ``reason`` says what was done or what failed, in one line."""

    ok: bool
    reason: str


# --- fingerprint and cache --------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$FASTVERIFY_CACHE_DIR``, else ``~/.cache/fastverify``."""
    env = os.environ.get("FASTVERIFY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fastverify"


def box_key(nvml: Any | None = None) -> dict:
    """What identifies this box for the P2P cache: GPU names and PCI bus ids (NVML order), the
    driver version, ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. Without NVML the GPU list
    comes from torch and the driver is ``None``."""
    key: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
    }
    try:
        from fastverify.topo.nvml import read_nvml_topology  # noqa: PLC0415

        topo = read_nvml_topology(nvml)
        key["gpus"] = [[g.name, g.pci_bus_id] for g in topo.gpus]
        key["driver"] = topo.source
    except UserError:
        import torch  # noqa: PLC0415

        key["gpus"] = [[torch.cuda.get_device_name(k), None] for k in range(torch.cuda.device_count())]
        key["driver"] = None
    return key


def fingerprint_of(key: dict) -> str:
    """16 hex digits of the SHA-256 of ``key`` as canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"p2p-{fingerprint_of(key)}.json"


def _results_to_json(results: dict[tuple[int, int], P2PResult]) -> list[dict]:
    return [{"src": i, "dst": j, "ok": r.ok, "reason": r.reason} for (i, j), r in sorted(results.items())]


def _results_from_json(rows: Any) -> dict[tuple[int, int], P2PResult]:
    """Parse ``[{"src", "dst", "ok", "reason"}, ...]``; raises ``ValueError`` on any other shape."""
    if not isinstance(rows, list):
        raise ValueError("results is not a list")
    out: dict[tuple[int, int], P2PResult] = {}
    for row in rows:
        if not isinstance(row, dict):
            raise ValueError("a result is not an object")
        src, dst, ok, reason = row.get("src"), row.get("dst"), row.get("ok"), row.get("reason")
        if type(src) is not int or type(dst) is not int or type(ok) is not bool or not isinstance(reason, str):
            raise ValueError(f"bad result row {row!r:.80}")
        out[(src, dst)] = P2PResult(ok, " ".join(reason.split()))
    return out


def read_cache(path: Path, key: dict) -> dict[tuple[int, int], P2PResult]:
    """Cached results in ``path`` when the file is ours and was written for ``key``; else ``{}``."""
    try:
        doc = json.loads(path.read_text())
        if (not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION
                or doc.get("fingerprint") != fingerprint_of(key) or doc.get("box") != key):
            return {}
        return _results_from_json(doc.get("results"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def write_cache(path: Path, key: dict, results: dict[tuple[int, int], P2PResult],
                gpus: Sequence[dict] | None = None) -> None:
    """Write ``results`` atomically (temporary file in the same folder, then rename); with
    ``gpus`` (:func:`gpu_identities`) the file names the GPUs too, and proves like the check's
    own output (:func:`read_check_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema_version": SCHEMA_VERSION, "fingerprint": fingerprint_of(key), "box": key,
           "written_unix_s": round(time.time(), 3), "results": _results_to_json(results)}
    if gpus is not None:
        doc.update(cuda_visible_devices=key.get("cuda_visible_devices"),
                   cuda_device_order=key.get("cuda_device_order"), gpus=list(gpus))
    _write_json_atomic(path, doc)


def _write_json_atomic(path: Path, doc: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --- which GPUs: the identities that bind a check to a box ----------------------------------------


def _nvml_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def nvml_gpus(nvml: Any | None = None) -> list[dict]:
    """This box's GPUs as NVML names them, in NVML order: ``[{"index", "pci_bus_id", "uuid",
    "name", "memory_bytes"}, ...]`` (a query NVML refuses leaves that field None;
    ``memory_bytes`` is ``nvmlDeviceGetMemoryInfo().total``). No CUDA context, no torch. ``[]``
    when NVML cannot start (no driver, no ``pynvml``)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            return []
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error, OSError):
        return []
    queries = (("pci_bus_id", lambda h: _nvml_text(nvml.nvmlDeviceGetPciInfo(h).busId)),
               ("uuid", lambda h: _nvml_text(nvml.nvmlDeviceGetUUID(h))),
               ("name", lambda h: _nvml_text(nvml.nvmlDeviceGetName(h))),
               ("memory_bytes", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total)))
    gpus: list[dict] = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            row: dict[str, Any] = {"index": i, "pci_bus_id": None, "uuid": None, "name": None, "memory_bytes": None}
            for field, query in queries:  # a refused query loses its own field only
                try:
                    row[field] = query(handle)
                except (error, AttributeError, TypeError, ValueError):
                    pass
            gpus.append(row)
    except error:
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass
    return gpus


def gpu_id(row: dict):
    """:class:`~fastverify.deploy.GpuId` of one :func:`nvml_gpus` row (ValueError when it has
    neither UUID nor PCI bus id)."""
    from fastverify.deploy import GpuId  # noqa: PLC0415

    return GpuId(index=row.get("index"), pci_bus_id=row.get("pci_bus_id"), uuid=row.get("uuid"), name=row.get("name"))


def gpu_identities(nvml: Any | None = None, torch_mod: Any | None = None) -> list[dict]:
    """The checking process's CUDA devices as NVML names them, in CUDA ordinal order:
    ``[{"cuda": k, "index", "pci_bus_id", "uuid", "name"}, ...]``.

    Ordinal ``k`` is matched to NVML's GPU by UUID (``torch.cuda.get_device_properties(k).uuid``),
    else by PCI address (``pci_domain_id``/``pci_bus_id``/``pci_device_id``), the way ``doctor``
    matches them: CUDA's order and ``CUDA_VISIBLE_DEVICES`` are whatever this process runs under.
    A device NVML does not list keeps torch's own facts (``index`` None). Needs torch with CUDA."""
    if torch_mod is None:
        import torch as torch_mod  # noqa: PLC0415
    listed = nvml_gpus(nvml)
    from fastverify.deploy import _pci_key, _uuid_key  # noqa: PLC0415 - the one comparison rule

    out = []
    for k in range(torch_mod.cuda.device_count()):
        props = torch_mod.cuda.get_device_properties(k)
        uuid = getattr(props, "uuid", None)
        uuid = str(uuid) if uuid is not None and str(uuid) else None
        parts = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        bus = (f"{int(parts[0]):08x}:{int(parts[1]):02x}:{int(parts[2]):02x}.0" if None not in parts else None)
        match = next((g for g in listed if _uuid_key(uuid) is not None and _uuid_key(g["uuid"]) == _uuid_key(uuid)),
                     None) or next((g for g in listed if bus is not None and _pci_key(g["pci_bus_id"]) == _pci_key(bus)),
                                   None)
        if match is not None:
            out.append({"cuda": k, **{f: match[f] for f in ("index", "pci_bus_id", "uuid", "name")}})
        else:
            out.append({"cuda": k, "index": None, "pci_bus_id": bus,
                        "uuid": (uuid if uuid is None or uuid.upper().startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"),
                        "name": getattr(props, "name", None)})
    return out


def check_document(results: dict[tuple[int, int], P2PResult], gpus: Sequence[dict],
                   environ: dict[str, str] | None = None) -> dict:
    """The JSON ``fastverify p2p`` prints (module docstring)."""
    env = os.environ if environ is None else environ
    return {"schema": CHECK_SCHEMA, "version": CHECK_VERSION,
            "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_order": env.get("CUDA_DEVICE_ORDER"),
            "gpus": list(gpus), "results": _results_to_json(results)}


def visible_gpus(listed: Sequence[dict], environ: Any) -> tuple[list[dict] | None, str]:
    """The GPUs (:func:`nvml_gpus` rows) a process started with ``environ`` gets as CUDA ordinals
    0, 1, ...; ``(None, why)`` where that cannot be told.

    ``CUDA_VISIBLE_DEVICES`` entries are NVML indices or (prefixes of) UUIDs: torch's own NVML
    device count (``torch.cuda._device_count_nvml``) and SGLang 0.5.23's custom all-reduce
    (``custom_all_reduce_utils.py``: ``device_ids[device.index]`` handed to
    ``nvmlDeviceGetHandleByIndex``) read them so; unset, the ordinals are NVML's order. That is
    CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; under CUDA's default (fastest first) it
    is the same for GPUs of one model, and not known for a mixed box, which gives ``None``.
    """
    if not listed:
        return None, "NVML lists no GPU here"
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({g.get("name") for g in listed}) > 1:
        return None, ("GPUs of several models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA orders them fastest "
                      "first, not as NVML does")
    if text is None:
        return list(listed), ""
    chosen: list[dict] = []
    for entry in (e.strip() for e in text.split(",")):
        if entry.isdigit():
            hit = [g for g in listed if g["index"] == int(entry)]
        elif entry.upper().startswith("GPU-"):
            hit = [g for g in listed if (g.get("uuid") or "").lower().startswith(entry.lower())]
        else:
            hit = []
        if len(hit) != 1:
            break  # CUDA stops at the first entry it cannot use
        if hit[0] in chosen:
            return None, f"CUDA_VISIBLE_DEVICES={text} names a GPU twice"
        chosen.append(hit[0])
    return chosen, ""


@dataclass(frozen=True)
class CheckFile:
    """A P2P check file as read (:func:`read_check_file`).

    ``gpus``: CUDA ordinal → :class:`~fastverify.deploy.GpuId`, None for an older file that
    names no GPU (it proves nothing: :func:`proof_for`). ``results``: ``(src, dst)`` →
    :class:`P2PResult`, each direction once."""

    path: str
    results: dict
    gpus: dict | None
    cuda_visible_devices: str | None = None
    cuda_device_order: str | None = None


def read_check_file(path: str | os.PathLike) -> CheckFile:
    """Read the output of ``fastverify p2p`` (version 2, module docstring),
    its cache file, or the older bare result list (``gpus`` None then).

    Raises
    ------
    UserError
        One line naming the file: unreadable, not such JSON, a malformed result, a direction
        given twice (which of two answers would count?), a result for a GPU the file does not
        name, a GPU named twice or without UUID and PCI bus id.
    """
    from fastverify.deploy import GpuId  # noqa: PLC0415
    from fastverify.inputs import read_text  # noqa: PLC0415

    p = str(path)
    text = read_text(Path(path), kind="text", what="the P2P check results")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise UserError(f"{p}: JSON nested too deeply (over Python's recursion limit)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{p}: not the JSON of `fastverify p2p`") from None
    if isinstance(doc, dict) and "schema" in doc and (doc.get("schema") != CHECK_SCHEMA
                                                      or doc.get("version") != CHECK_VERSION):
        raise UserError(f"{p}: not a P2P check this fastverify reads (schema {doc.get('schema')!r} version "
                        f"{doc.get('version')!r}, expected {CHECK_SCHEMA!r} version {CHECK_VERSION})")
    rows = doc.get("results") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{p}: no P2P results (expected the JSON `fastverify p2p` prints)")
    results: dict[tuple[int, int], P2PResult] = {}
    for row in rows:
        ok = row.get("ok") if isinstance(row, dict) else None
        src, dst = (row.get("src"), row.get("dst")) if isinstance(row, dict) else (None, None)
        if type(ok) is not bool or type(src) is not int or type(dst) is not int or src < 0 or dst < 0 or src == dst:
            raise UserError(f"{p}: a P2P result is not {{src, dst, ok, reason}} of two GPUs: {str(row)[:80]}")
        if (src, dst) in results:
            raise UserError(f"{p}: direction ({src}, {dst}) is given twice; a check gives each direction once "
                            "(rerun `fastverify p2p`)")
        results[(src, dst)] = P2PResult(ok, " ".join(str(row.get("reason", "")).split()))
    gpus = None
    raw = doc.get("gpus") if isinstance(doc, dict) else None
    if raw is not None:
        if not isinstance(raw, list):
            raise UserError(f"{p}: 'gpus' is not a list of GPUs")
        gpus = {}
        for g in raw:
            k = g.get("cuda") if isinstance(g, dict) else None
            if type(k) is not int or k < 0 or k in gpus:
                raise UserError(f"{p}: a GPU entry needs its own CUDA ordinal 'cuda': {str(g)[:80]}")
            try:
                gpus[k] = GpuId(index=g.get("index"), pci_bus_id=g.get("pci_bus_id"), uuid=g.get("uuid"),
                                name=g.get("name"))
            except (ValueError, TypeError) as err:
                raise UserError(f"{p}: GPU {k}: {err}") from None
        for k, g in gpus.items():
            if any(o != k and g.same_gpu(h) for o, h in gpus.items()):
                raise UserError(f"{p}: {g.label()} is named for two CUDA ordinals")
        unnamed = sorted({i for pair in results for i in pair} - set(gpus))
        if unnamed:
            raise UserError(f"{p}: results for CUDA ordinal {unnamed[0]}, which the file's 'gpus' does not name")
    env = doc if isinstance(doc, dict) else {}
    return CheckFile(path=p, results=results, gpus=gpus, cuda_visible_devices=env.get("cuda_visible_devices"),
                     cuda_device_order=env.get("cuda_device_order"))


def complete_gpus(check: CheckFile) -> tuple:
    """The check's GPUs (CUDA ordinal order) when every ordered pair among all of them is in the
    file and passed; ``()`` otherwise or for a file that names no GPU. What a deployment record
    keeps as its P2P proof (:attr:`fastverify.deploy.P2PFacts.gpus`)."""
    if not check.gpus:
        return ()
    ks = sorted(check.gpus)
    if all(check.results.get((a, b), P2PResult(False, "")).ok for a in ks for b in ks if a != b):
        return tuple(check.gpus[k] for k in ks)
    return ()


OLD_CHECK = ("names no GPU (written before the check recorded which GPUs it tested), so it cannot show "
             "they are this box's: rerun `fastverify p2p --output FILE` on this box")


def proof_for(check: CheckFile, tp_gpus: Sequence | None, why_unknown: str = "") -> tuple[bool, str]:
    """Whether ``check`` proves P2P for the TP group whose GPUs are ``tp_gpus`` (rank order,
    :class:`~fastverify.deploy.GpuId`): ``(True, note)`` when every ordered pair ``(i, j)``,
    ``i != j``, of the group passed, ``(False, note)`` when one of them failed.

    Raises
    ------
    UserError
        One line naming the file: it names no GPU (an older file); this box's GPUs are not known
        (``why_unknown``); a GPU of the group is not one the check tested (another box, or other
        GPUs of this one); a direction of the group is missing.
    """
    p = check.path
    if check.gpus is None:
        raise UserError(f"{p}: this P2P check {OLD_CHECK}")
    if not tp_gpus:
        raise UserError(f"{p}: cannot tell whether the P2P check tested this box's GPUs ({why_unknown or 'unknown'}); "
                        "launch needs NVML's GPU identities to bind the proof to the box")
    ordinal = []
    for rank, g in enumerate(tp_gpus):
        hits = [k for k, h in check.gpus.items() if h.same_gpu(g)]
        if not hits:
            tested = ", ".join(h.label() for _, h in sorted(check.gpus.items()))
            raise UserError(f"{p}: the P2P check did not test {g.label()}, TP rank {rank}'s GPU on this box (it tested "
                            f"{tested}): rerun `fastverify p2p` on this box with the server's "
                            "CUDA_VISIBLE_DEVICES")
        ordinal.append(hits[0])
    world = len(tp_gpus)
    failed = []
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            r = check.results.get((ordinal[a], ordinal[b]))
            if r is None:
                raise UserError(f"{p}: the P2P check misses direction ({ordinal[a]}, {ordinal[b]}) (memory of "
                                f"{tp_gpus[a].label()} from {tp_gpus[b].label()}) of TP ranks {a} and {b}; TP {world} "
                                f"needs all {world * (world - 1)} ordered pairs: rerun `fastverify p2p`")
            if not r.ok:
                failed.append((a, b, r.reason))
    if failed:
        a, b, reason = failed[0]
        return False, (f"{len(failed)} of {world * (world - 1)} directions of the TP group failed ({p}); first: "
                       f"{tp_gpus[b].label()} -> memory of {tp_gpus[a].label()}: {reason}")[:300]
    return True, f"all {world * (world - 1)} directions of the TP group's GPUs passed ({p})"


# --- running the pair children ----------------------------------------------------------------


def default_child_argv(timeout_s: float = DEFAULT_TIMEOUT_S) -> ChildArgv:
    """The real pair child: ``python -m fastverify.topo.p2p pair I J OUT --timeout S`` (the inner
    timeout is a little shorter, so the child can report which step hung)."""
    inner = max(1.0, timeout_s * 0.9 - 2.0)

    def argv(i: int, j: int, out_path: Path) -> list[str]:
        return [sys.executable, "-m", "fastverify.topo.p2p", "pair", str(i), str(j), str(out_path),
                "--timeout", f"{inner:g}"]
    return argv


def _child_env() -> dict[str, str]:
    env = child_env()  # the parent's environment, this package importable
    # Expandable segments export cuMem handles instead of cudaIpc ones; test the legacy path that
    # the PCIe IPC all-reduces use.
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    return env


def _tail(text: bytes | str | None, limit: int = 200) -> str:
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _file_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            return _tail(f.read())
    except OSError:
        return ""


def run_pair_child(argv: Sequence[str], i: int, j: int, out_path: Path, timeout_s: float,
                   env: dict[str, str] | None = None) -> dict[tuple[int, int], P2PResult]:
    """Run one pair child with a timeout and read its result file; both directions ``(i, j)`` and
    ``(j, i)`` always get a result (a failure reason when the child did not give one).

    The child runs under :class:`fastverify.procs.RankGroup`, the one launcher: its own process
    group (so the side processes it starts go with it), stdout and stderr in a temporary folder
    that is removed afterwards, and one kill rule at the end (SIGTERM to the group, SIGKILL after
    the grace period)."""
    def both(ok: bool, reason: str) -> dict[tuple[int, int], P2PResult]:
        return {(i, j): P2PResult(ok, reason), (j, i): P2PResult(ok, reason)}

    with RankGroup(prefix="fastverify-p2p-child-", env=env, capture_stdout=True) as child:
        try:
            child.start([argv])
        except OSError as err:
            return both(False, f"could not start the check: {err}")
        deadline = time.monotonic() + timeout_s
        while not child.all_exited():
            if time.monotonic() >= deadline:
                return both(False, f"timeout: no answer within {timeout_s:g} s (P2P access hung or the child stalled)")
            time.sleep(_POLL_S)
        code = child.returncode(0)
        stderr, stdout = _file_tail(stderr_path(child.workdir, 0)), _file_tail(child.workdir / "rank0.stdout")
    if code != 0:
        return both(False, f"check process failed ({exit_reason(code)}): {stderr or stdout or 'no output'}")
    try:
        doc = json.loads(out_path.read_text())
        results = _results_from_json(doc.get("results") if isinstance(doc, dict) else None)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return both(False, f"check process wrote no readable result ({' '.join(str(err).split())[:120]})")
    out = {}
    for pair in ((i, j), (j, i)):
        out[pair] = results.get(pair, P2PResult(False, "check process gave no result for this direction"))
    return out


def _gpu_count_or_fail() -> int:
    try:
        import torch  # noqa: PLC0415
    except ImportError as err:
        raise UserError(f"{NO_CUDA} (torch is not installed: {' '.join(str(err).split())})") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise UserError(NO_CUDA)
    return torch.cuda.device_count()


def check_p2p(*, pairs: Iterable[tuple[int, int]] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              cache_dir: str | os.PathLike | None = None, refresh: bool = False, max_parallel: int = 4,
              n_gpus: int | None = None, key: dict | None = None,
              child_argv: ChildArgv | None = None, gpus: Sequence[dict] | None = None
              ) -> dict[tuple[int, int], P2PResult]:
    """Test P2P between GPUs for real, in child processes; cached per box.

    Parameters
    ----------
    pairs
        Unordered GPU pairs (CUDA ordinals) to test; default every pair of ``range(n_gpus)``.
    timeout_s
        Wall-clock limit per pair child, seconds; a child still running then is killed with its
        process group and both directions get ``P2PResult(False, "timeout: ...")``.
    cache_dir
        Folder of ``p2p-<fingerprint>.json``; default ``$FASTVERIFY_CACHE_DIR`` or
        ``~/.cache/fastverify``.
    refresh
        Ignore cached results (they are still rewritten).
    max_parallel
        Pair children running at once.
    n_gpus, key, child_argv
        For tests and callers that know better: the GPU count (default torch's), the box key
        (default :func:`box_key`), and the pair child's argv (default :func:`default_child_argv`).
        With the default child the CUDA check below applies.
    gpus
        The GPUs' identities (:func:`gpu_identities`), written into the cache file with the results.

    Returns
    -------
    dict[tuple[int, int], P2PResult]
        Both directions of every pair: ``(i, j)`` means memory on GPU i accessed from GPU j.

    Raises
    ------
    UserError
        ``no CUDA GPUs: the real P2P check needs a GPU box`` when the real check is asked for and
        torch sees no CUDA device.
    """
    if child_argv is None:
        count = _gpu_count_or_fail()
        n_gpus = count if n_gpus is None else n_gpus
        child_argv = default_child_argv(timeout_s)
    if n_gpus is None:
        raise ValueError("n_gpus is required with a custom child_argv")
    wanted = sorted({(min(p), max(p)) for p in (pairs if pairs is not None else
                     [(a, b) for a in range(n_gpus) for b in range(a + 1, n_gpus)])})
    for a, b in wanted:
        if a == b or not (0 <= a < n_gpus and 0 <= b < n_gpus):
            raise ValueError(f"GPU pair ({a}, {b}) is not two different GPUs of 0..{n_gpus - 1}")
    box = key if key is not None else box_key()
    path = cache_path(box, cache_dir)
    cached = {} if refresh else read_cache(path, box)
    todo = [(a, b) for a, b in wanted if (a, b) not in cached or (b, a) not in cached]
    results = dict(cached)
    if todo:
        env = _child_env()
        with rank_workdir("fastverify-p2p-") as tmp, \
                concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_parallel)) as pool:
            futures = [pool.submit(run_pair_child, child_argv(a, b, Path(tmp) / f"pair-{a}-{b}.json"), a, b,
                                   Path(tmp) / f"pair-{a}-{b}.json", timeout_s, env) for a, b in todo]
            for future in futures:
                results.update(future.result())
        write_cache(path, box, results, gpus)
    return {p: results[p] for a, b in wanted for p in ((a, b), (b, a))}


# --- the child processes (need CUDA) ----------------------------------------------------------


def _pattern(torch: Any, seed: int, n: int, device: str) -> Any:
    """``n`` bytes ``(k * (2*seed + 1) + seed) % 256`` on ``device``: different for each seed."""
    k = torch.arange(n, dtype=torch.int64, device=device)
    return ((k * (2 * seed + 1) + seed) % 256).to(torch.uint8)


def _encode_share(share: Sequence[Any]) -> list:
    return [{"hex": v.hex()} if isinstance(v, bytes) else v for v in share]


def _decode_share(items: list) -> tuple:
    return tuple(bytes.fromhex(v["hex"]) if isinstance(v, dict) else v for v in items)


def _wait_for(path: Path, deadline: float, what: str) -> Any:
    while not path.exists():
        if time.monotonic() > deadline:
            raise _CheckFailed(f"timeout waiting for {what}")
        time.sleep(_POLL_S)
    return json.loads(path.read_text())


class _CheckFailed(Exception):
    """A failure this module diagnosed itself (its message is the whole reason)."""


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    if isinstance(err, _CheckFailed):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def run_side(me: str, peer: str, my_gpu: int, peer_gpu: int, workdir: Path, timeout_s: float) -> None:
    """One side of a pair test (needs CUDA). Writes ``<workdir>/<me>.report.json`` with
    ``access`` (this side's read+write of the peer's buffer) and ``own`` (whether the peer's write
    into this side's buffer arrived). Files it publishes on the way: ``<me>.handle.json`` (its
    buffer's IPC handle, or the error that prevented sharing it) and ``<me>.written.json``."""
    import torch  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    seeds = {"a": (1, 3), "b": (2, 4)}  # per side: (pattern of its own buffer, pattern it writes to the peer)
    n = BUFFER_BYTES
    dev = f"cuda:{my_gpu}"
    try:
        torch.cuda.set_device(my_gpu)
        buf = _pattern(torch, seeds[me][0], n, dev)
        torch.cuda.synchronize(my_gpu)
        share = tuple(buf.untyped_storage()._share_cuda_())
        if len(share) != 8:
            raise _CheckFailed(f"torch's CUDA IPC handle has {len(share)} fields, expected 8 (torch {torch.__version__})")
    except Exception as err:  # noqa: BLE001 - reported to the peer and the pair child
        failed = {"ok": False, "reason": f"GPU {my_gpu} could not share a buffer: {_first_line(err)}"}
        _write_json_atomic(workdir / f"{me}.handle.json", {"error": failed["reason"]})
        _write_json_atomic(workdir / f"{me}.written.json", {"wrote": False})
        _write_json_atomic(workdir / f"{me}.report.json", {"access": failed, "own": failed})
        return
    _write_json_atomic(workdir / f"{me}.handle.json", {"share": _encode_share(share)})

    report: dict[str, Any] = {}
    storage = peer_view = None
    wrote = False
    try:
        doc = _wait_for(workdir / f"{peer}.handle.json", deadline, f"GPU {peer_gpu}'s buffer")
        if "error" in doc:
            raise _CheckFailed(str(doc["error"]))
        peer_share = _decode_share(doc["share"])
        if my_gpu != peer_gpu and not torch.cuda.can_device_access_peer(my_gpu, peer_gpu):
            raise _CheckFailed(f"driver reports no peer access (cudaDeviceCanAccessPeer({my_gpu}, {peer_gpu}) = 0)")
        # Open the peer's buffer under *this* device (first field replaced): the mapping lives in
        # this GPU's context, so the ops below run on this GPU and reach the peer's memory over
        # the fabric. Event sync is off: the peer synchronised before publishing the handle.
        storage = torch.UntypedStorage._new_shared_cuda(my_gpu, *peer_share[1:7], False)
        peer_view = torch.empty((0,), dtype=torch.uint8, device=dev).set_(storage, 0, (n,), (1,))
        seen = peer_view.clone()  # P2P read
        torch.cuda.synchronize(my_gpu)
        bad = int((seen != _pattern(torch, seeds[peer][0], n, dev)).sum().item())
        if bad:
            raise _CheckFailed(f"P2P read returned {bad} of {n} bytes wrong")
        new = _pattern(torch, seeds[me][1], n, dev)
        half = n // 2
        peer_view[:half].copy_(new[:half])  # copy engine (cudaMemcpyAsync device to device)
        torch.bitwise_or(new[half:], 0, out=peer_view[half:])  # SM stores from a kernel
        torch.cuda.synchronize(my_gpu)
        wrote = True
        report["access"] = {"ok": True, "reason": f"GPU {my_gpu} read and wrote {n >> 20} MiB on GPU {peer_gpu}"}
    except Exception as err:  # noqa: BLE001 - every CUDA failure becomes the reason of this direction
        report["access"] = {"ok": False, "reason": _first_line(err)}
    _write_json_atomic(workdir / f"{me}.written.json", {"wrote": wrote})

    try:
        peer_wrote = _wait_for(workdir / f"{peer}.written.json", deadline, f"GPU {peer_gpu} to write")["wrote"]
        if peer_wrote:
            torch.cuda.synchronize(my_gpu)
            bad = int((buf != _pattern(torch, seeds[peer][1], n, dev)).sum().item())
            report["own"] = ({"ok": True, "reason": "the peer's write arrived"} if not bad else
                             {"ok": False, "reason": f"P2P write from GPU {peer_gpu} left {bad} of {n} bytes wrong"})
        else:
            report["own"] = {"ok": False, "reason": f"GPU {peer_gpu} did not write"}
    except Exception as err:  # noqa: BLE001
        report["own"] = {"ok": False, "reason": _first_line(err)}
    try:
        del peer_view, storage  # drop the mapping of the peer's buffer before the peer frees it
        torch.cuda.synchronize(my_gpu)
    except Exception:  # noqa: BLE001 - a sticky CUDA error is already in the report
        pass
    _write_json_atomic(workdir / f"{me}.report.json", report)
    # Keep this buffer alive until the peer has dropped its mapping of it.
    try:
        _wait_for(workdir / f"{peer}.report.json", deadline, "the peer to finish")
    except _CheckFailed:
        pass


def run_pair(i: int, j: int, out_path: Path, timeout_s: float) -> None:
    """Test both directions between GPUs ``i`` and ``j`` with two side processes; write
    ``{"results": [{"src", "dst", "ok", "reason"}, ...]}`` to ``out_path``."""
    deadline = time.monotonic() + timeout_s + 5.0
    gpu_of = {"a": i, "b": j}
    # The two sides run under the one launcher (fastverify.procs.RankGroup): side "a" is rank 0,
    # "b" rank 1; their stderr and reports live in its temporary folder, removed on leaving.
    with RankGroup(prefix="fastverify-p2p-pair-") as group:
        workdir = group.workdir
        sides = {"a": 0, "b": 1}
        group.start([sys.executable, "-m", "fastverify.topo.p2p", "side", me, peer, str(gpu_of[me]),
                     str(gpu_of[peer]), str(workdir), "--timeout", f"{timeout_s:g}"]
                    for me, peer in (("a", "b"), ("b", "a")))
        while not group.all_exited() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        errors = {}
        for me, rank in sides.items():
            code = group.returncode(rank)
            if code is None:
                errors[me] = f"timeout: GPU {gpu_of[me]}'s side hung for {timeout_s:g} s"
            elif code != 0:
                err = _file_tail(stderr_path(workdir, rank))
                errors[me] = f"GPU {gpu_of[me]}'s side failed ({exit_reason(code)}): {err or 'no output'}"
        group.stop()  # the kill rule, before the reports are read: a hung side writes nothing more
        reports = {}
        for me in sides:
            try:
                reports[me] = json.loads((workdir / f"{me}.report.json").read_text())
            except (OSError, ValueError):
                reports[me] = None

    def direction(owner: str, user: str) -> dict:
        # Memory of `owner`, accessed from `user`: user's access report, then owner's check of the write.
        for side in (user, owner):
            if reports[side] is None:
                return {"ok": False, "reason": errors.get(side, f"GPU {gpu_of[side]}'s side wrote no report")}
        access, own = reports[user]["access"], reports[owner]["own"]
        return own if access["ok"] and not own["ok"] else access

    rows = [dict(src=i, dst=j, **direction("a", "b")), dict(src=j, dst=i, **direction("b", "a"))]
    _write_json_atomic(out_path, {"results": rows})


def run_check_command(*, output: Path | None, timeout_s: float, refresh: bool) -> int:
    """``fastverify p2p``: the check on every GPU pair, its JSON (:func:`check_document`) printed,
    or written to ``output`` by the one writer (:func:`fastverify.procs.write_files`) with a
    one-line summary. Returns 0 when every ordered pair passed, else 1.

    Raises
    ------
    UserError
        No GPU pair to check (fewer than 2 GPUs, no NVIDIA driver), or an unusable ``output``.
    """
    from fastverify.procs import check_outputs, check_writable, refuse_symlink, write_files

    if output is not None:
        refuse_symlink(output, "--output")
        check_outputs({"--output": output})
        check_writable(output)
    _gpu_count_or_fail()
    gpus = gpu_identities()
    results = check_p2p(timeout_s=timeout_s, refresh=refresh, gpus=gpus)
    text = json.dumps(check_document(results, gpus), indent=1) + "\n"
    ok = sum(r.ok for r in results.values())
    if output is None:
        sys.stdout.write(text)
    else:
        write_files([(output, lambda tmp: tmp.write_text(text))])
        print(f"P2P: {ok} of {len(results)} ordered GPU pairs passed; wrote {output}")
    return 0 if ok == len(results) else 1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastverify.topo.p2p",
                                     description="Real GPU P2P check (children of fastverify topo).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="test every GPU pair; print JSON results")
    check.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pair")
    check.add_argument("--cache-dir", default=None)
    check.add_argument("--refresh", action="store_true")
    pair = sub.add_parser("pair", help="(internal) test GPUs I and J both ways")
    pair.add_argument("i", type=int)
    pair.add_argument("j", type=int)
    pair.add_argument("out", type=Path)
    pair.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    side = sub.add_parser("side", help="(internal) one GPU's side of a pair test")
    side.add_argument("me", choices=["a", "b"])
    side.add_argument("peer", choices=["a", "b"])
    side.add_argument("my_gpu", type=int)
    side.add_argument("peer_gpu", type=int)
    side.add_argument("workdir", type=Path)
    side.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.cmd == "check":
        try:
            _gpu_count_or_fail()
            gpus = gpu_identities()
            results = check_p2p(timeout_s=args.timeout, cache_dir=args.cache_dir, refresh=args.refresh, gpus=gpus)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(json.dumps(check_document(results, gpus), indent=1))
        return 0 if all(r.ok for r in results.values()) else 1
    if args.cmd == "pair":
        # The launcher's kill rule starts with SIGTERM: leave through the ``with`` blocks, so the
        # sides are stopped and the pair's temporary folder is removed before SIGKILL would come.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        run_pair(args.i, args.j, args.out, args.timeout)
        return 0
    run_side(args.me, args.peer, args.my_gpu, args.peer_gpu, args.workdir, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
