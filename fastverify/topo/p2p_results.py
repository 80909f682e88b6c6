"""One direction's outcome of the real P2P check, and the JSON files that carry results.

A result row is ``{"src", "dst", "ok", "reason"}``, with ``"timed_out": true`` added when the
direction got no answer in time: memory on GPU ``src`` accessed from GPU ``dst`` (CUDA ordinals).
A timeout is its own status, neither a pass nor a failure: the check did not finish (a slow
``import torch``, a busy box, or a hang), so it is never cached and is retried on the next run.
Rows written before that key existed say a timeout only in their reason (``"timeout..."``, the
words every timeout of the check starts with) and are read as timeouts too.
The check's processes hand each other files, never stdout (children may print logs); each file is
written atomically so a process polling for it never reads half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    return [{"src": i, "dst": j, "ok": r.ok, "reason": r.reason, **({"timed_out": True} if r.timed_out else {})}
            for (i, j), r in sorted(results.items())]


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
        if (type(src) is not int or type(dst) is not int or type(ok) is not bool or not isinstance(reason, str)
                or not (flag is None or type(flag) is bool)):
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
