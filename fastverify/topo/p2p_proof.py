"""The real P2P check's results as data, the check file, and the rule that makes it a proof of P2P
for a TP group.

One direction's outcome of the real P2P check, and the JSON files that carry results.

A result row is ``{"src", "dst", "ok", "reason"}``, with ``"timed_out": true`` added when the
direction got no answer in time: memory on GPU ``src`` accessed from GPU ``dst`` (CUDA ordinals).
A timeout is its own status, neither a pass nor a failure: the check did not finish (a slow
``import torch``, a busy box, or a hang), so it is never cached and is retried on the next run.
Rows written before that key existed say a timeout only in their reason (``"timeout..."``, the
words every timeout of the check starts with) and are read as timeouts too.
The check's processes hand each other files, never stdout (children may print logs); each file is
written atomically so a process polling for it never reads half of one.

The file ``fastverify p2p --output p2p.json`` writes (schema ``fastverify.p2p_check`` version 2,
:func:`check_document`) names the GPUs it tested, so a proof is bound to a box, not to a count
of passing directions::

    {"schema": "fastverify.p2p_check", "version": 2,
     "cuda_visible_devices": null, "cuda_device_order": null,
     "gpus": [{"cuda": 0, "index": 0, "pci_bus_id": "00000000:18:00.0", "uuid": "GPU-...", "name": "..."}, ...],
     "results": [{"src": 0, "dst": 1, "ok": true, "reason": "..."}, ...]}

A result that timed out carries ``"timed_out": true`` (:class:`P2PResult`): it
neither proves nor refutes P2P, so :func:`proof_for` refuses it as unknown and says to rerun.

``src``/``dst`` are CUDA ordinals of the checking process; ``gpus[k]`` is ordinal ``k`` as NVML
names it (:func:`fastverify.topo.gpu_identity.gpu_identities`), under the environment recorded
beside them. Older forms (the bare result list, the cache file without GPUs) are read but prove
nothing (:func:`proof_for`: "rerun the check").
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fastverify.deploy import GpuId
from fastverify.errors import UserError
from fastverify.inputs import loads_json, read_text

POLL_S = 0.02  # how often the check's processes look for each other's files, seconds


TIMEOUT_WORD = "timeout"  # every timeout reason of the check starts with it


@dataclass(frozen=True)
class P2PResult:
    """Outcome for one direction: ``ok`` when GPU j read and wrote GPU i's memory correctly;
    ``reason`` says what was done or what failed, in one line; ``timed_out`` when the check gave
    no answer in time (then ``ok`` is False, and the direction is neither passed nor failed)."""

    ok: bool
    reason: str
    timed_out: bool = False

    @property
    def status(self) -> str:
        """``"passed"``, ``"failed"`` or ``"timeout"``."""
        return "passed" if self.ok else "timeout" if self.timed_out else "failed"


def timed_out_row(ok: bool, reason: str, flag: object = None) -> bool:
    """Whether a row with ``ok``, ``reason`` and ``"timed_out"`` value ``flag`` (None: absent, a
    row written before the key existed) is a timeout."""
    if flag is not None:
        return flag is True and not ok
    return not ok and reason.lstrip().lower().startswith(TIMEOUT_WORD)


def results_to_json(results: dict[tuple[int, int], P2PResult]) -> list[dict]:
    """``{(src, dst): P2PResult}`` as result rows, sorted by ``(src, dst)``."""
    return [
        {"src": i, "dst": j, "ok": r.ok, "reason": r.reason, **({"timed_out": True} if r.timed_out else {})}
        for (i, j), r in sorted(results.items())
    ]


def count_statuses(results) -> dict[str, int]:
    """``{"passed": n, "failed": n, "timeout": n}`` of ``results`` (an iterable of :class:`P2PResult`)."""
    counts = {"passed": 0, "failed": 0, "timeout": 0}
    for r in results:
        counts[r.status] += 1
    return counts


def results_from_json(rows: Any) -> dict[tuple[int, int], P2PResult]:
    """Parse ``[{"src", "dst", "ok", "reason"[, "timed_out"]}, ...]``; raises ``ValueError`` on any
    other shape."""
    if not isinstance(rows, list):
        raise ValueError("results is not a list")
    out: dict[tuple[int, int], P2PResult] = {}
    for row in rows:
        if not isinstance(row, dict):
            raise ValueError("a result is not an object")
        src, dst, ok, reason = row.get("src"), row.get("dst"), row.get("ok"), row.get("reason")
        flag = row.get("timed_out")
        if (
            type(src) is not int
            or type(dst) is not int
            or type(ok) is not bool
            or not isinstance(reason, str)
            or not (flag is None or type(flag) is bool)
        ):
            raise ValueError(f"bad result row {row!r:.80}")
        out[(src, dst)] = P2PResult(ok, " ".join(reason.split()), timed_out_row(ok, reason, flag))
    return out


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write ``doc`` as JSON to ``path``: a temporary file in the same folder, fsynced, then renamed."""
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


CHECK_SCHEMA = "fastverify.p2p_check"
CHECK_VERSION = 2  # version 1: the bare result list, naming no GPU
OLD_CHECK = (
    "names no GPU (written before the check recorded which GPUs it tested), so it cannot show "
    "they are this box's: rerun `fastverify p2p --output FILE` on this box"
)


def check_document(
    results: dict[tuple[int, int], P2PResult], gpus: Sequence[dict], environ: dict[str, str] | None = None
) -> dict:
    """The JSON ``fastverify p2p`` prints (module docstring)."""
    env = os.environ if environ is None else environ
    return {
        "schema": CHECK_SCHEMA,
        "version": CHECK_VERSION,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": env.get("CUDA_DEVICE_ORDER"),
        "gpus": list(gpus),
        "results": results_to_json(results),
    }


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
    p = str(path)
    doc = _check_json(p, read_text(Path(path), kind="text", what="the P2P check results"))
    results = _check_results(p, doc.get("results") if isinstance(doc, dict) else doc)
    raw = doc.get("gpus") if isinstance(doc, dict) else None
    gpus = None if raw is None else _check_gpus(p, raw, results)
    env = doc if isinstance(doc, dict) else {}
    return CheckFile(
        path=p,
        results=results,
        gpus=gpus,
        cuda_visible_devices=env.get("cuda_visible_devices"),
        cuda_device_order=env.get("cuda_device_order"),
    )


def _check_json(p: str, text: str) -> Any:
    """The file's JSON, refused when it is not JSON or a schema other than this version's."""
    doc = loads_json(text, p, what="the output of `fastverify p2p`", exact_ints=True)
    if (
        isinstance(doc, dict)
        and "schema" in doc
        and (doc.get("schema") != CHECK_SCHEMA or doc.get("version") != CHECK_VERSION)
    ):
        raise UserError(
            f"{p}: not a P2P check this fastverify reads (schema {doc.get('schema')!r} version "
            f"{doc.get('version')!r}, expected {CHECK_SCHEMA!r} version {CHECK_VERSION})"
        )
    return doc


def _check_results(p: str, rows: Any) -> dict[tuple[int, int], P2PResult]:
    """The file's result rows, each direction of two GPUs once."""
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{p}: no P2P results (expected the JSON `fastverify p2p` prints)")
    results: dict[tuple[int, int], P2PResult] = {}
    for row in rows:
        ok = row.get("ok") if isinstance(row, dict) else None
        src, dst = (row.get("src"), row.get("dst")) if isinstance(row, dict) else (None, None)
        if type(ok) is not bool or type(src) is not int or type(dst) is not int or src < 0 or dst < 0 or src == dst:
            raise UserError(f"{p}: a P2P result is not {{src, dst, ok, reason}} of two GPUs: {str(row)[:80]}")
        if (src, dst) in results:
            raise UserError(
                f"{p}: direction ({src}, {dst}) is given twice; a check gives each direction once "
                "(rerun `fastverify p2p`)"
            )
        reason = " ".join(str(row.get("reason", "")).split())
        flag = row.get("timed_out")
        if not (flag is None or type(flag) is bool):
            raise UserError(f"{p}: a P2P result's 'timed_out' is not true or false: {str(row)[:80]}")
        results[(src, dst)] = P2PResult(ok, reason, timed_out_row(ok, reason, flag))
    return results


def _check_gpus(p: str, raw: Any, results: dict[tuple[int, int], P2PResult]) -> dict[int, GpuId]:
    """The file's ``gpus``: CUDA ordinal → GPU, each GPU once, naming every GPU of ``results``."""
    if not isinstance(raw, list):
        raise UserError(f"{p}: 'gpus' is not a list of GPUs")
    gpus: dict[int, GpuId] = {}
    for g in raw:
        k = g.get("cuda") if isinstance(g, dict) else None
        if type(k) is not int or k < 0 or k in gpus:
            raise UserError(f"{p}: a GPU entry needs its own CUDA ordinal 'cuda': {str(g)[:80]}")
        try:
            gpus[k] = GpuId(
                index=g.get("index"), pci_bus_id=g.get("pci_bus_id"), uuid=g.get("uuid"), name=g.get("name")
            )
        except (ValueError, TypeError) as err:
            raise UserError(f"{p}: GPU {k}: {err}") from None
    for k, g in gpus.items():
        if any(o != k and g.same_gpu(h) for o, h in gpus.items()):
            raise UserError(f"{p}: {g.label()} is named for two CUDA ordinals")
    unnamed = sorted({i for pair in results for i in pair} - set(gpus))
    if unnamed:
        raise UserError(f"{p}: results for CUDA ordinal {unnamed[0]}, which the file's 'gpus' does not name")
    return gpus


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


def proof_for(check: CheckFile, tp_gpus: Sequence | None, why_unknown: str = "") -> tuple[bool, str]:
    """Whether ``check`` proves P2P for the TP group whose GPUs are ``tp_gpus`` (rank order,
    :class:`~fastverify.deploy.GpuId`): ``(True, note)`` when every ordered pair ``(i, j)``,
    ``i != j``, of the group passed (``world x (world - 1)`` directions: a count alone proves
    nothing), ``(False, note)`` when one of them failed. GPUs match by UUID, else PCI address.

    Raises
    ------
    UserError
        One line naming the file: it names no GPU (an older file); this box's GPUs are not known
        (``why_unknown``); a GPU of the group is not one the check tested (another box, or other
        GPUs of this one); a direction of the group is missing, or timed out (no answer either
        way) while none failed.
    """
    p = check.path
    if check.gpus is None:
        raise UserError(f"{p}: this P2P check {OLD_CHECK}")
    if not tp_gpus:
        raise UserError(
            f"{p}: cannot tell whether the P2P check tested this box's GPUs ({why_unknown or 'unknown'}); "
            "launch needs NVML's GPU identities to bind the proof to the box"
        )
    ordinal = _tested_ordinals(check, tp_gpus)
    world = len(tp_gpus)
    failed, timed_out = [], []
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            r = check.results.get((ordinal[a], ordinal[b]))
            if r is None:
                raise UserError(
                    f"{p}: the P2P check misses direction ({ordinal[a]}, {ordinal[b]}) (memory of "
                    f"{tp_gpus[a].label()} from {tp_gpus[b].label()}) of TP ranks {a} and {b}; TP {world} "
                    f"needs all {world * (world - 1)} ordered pairs: rerun `fastverify p2p`"
                )
            if r.timed_out:
                timed_out.append((a, b, r.reason))
            elif not r.ok:
                failed.append((a, b, r.reason))
    if timed_out and not failed:
        a, b, reason = timed_out[0]
        raise UserError(
            f"{p}: {len(timed_out)} of {world * (world - 1)} directions of the TP group timed out (no "
            f"answer in time, not a failure), so P2P is not known; first: {tp_gpus[b].label()} -> memory "
            f"of {tp_gpus[a].label()}: {reason}: rerun `fastverify p2p` (timeouts are retried)"
        )
    if failed:
        a, b, reason = failed[0]
        return False, (
            f"{len(failed)} of {world * (world - 1)} directions of the TP group failed ({p}); first: "
            f"{tp_gpus[b].label()} -> memory of {tp_gpus[a].label()}: {reason}"
        )[:300]
    return True, f"all {world * (world - 1)} directions of the TP group's GPUs passed ({p})"


def _tested_ordinals(check: CheckFile, tp_gpus: Sequence) -> list[int]:
    """The check's CUDA ordinal of each TP rank's GPU; UserError for a GPU it did not test."""
    ordinal = []
    for rank, g in enumerate(tp_gpus):
        hits = [k for k, h in check.gpus.items() if h.same_gpu(g)]
        if not hits:
            tested = ", ".join(h.label() for _, h in sorted(check.gpus.items()))
            raise UserError(
                f"{check.path}: the P2P check did not test {g.label()}, TP rank {rank}'s GPU on this box "
                f"(it tested {tested}): rerun `fastverify p2p` on this box with the server's "
                "CUDA_VISIBLE_DEVICES"
            )
        ordinal.append(hits[0])
    return ordinal
