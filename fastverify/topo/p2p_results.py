"""One direction's outcome of the real P2P check, and the JSON files that carry results.

A result row is ``{"src", "dst", "ok", "reason"}``: memory on GPU ``src`` accessed from GPU
``dst`` (CUDA ordinals). The check's processes hand each other files, never stdout (children may
print logs); each file is written atomically so a process polling for it never reads half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLL_S = 0.02  # how often the check's processes look for each other's files, seconds


@dataclass(frozen=True)
class P2PResult:
    """Outcome for one direction: ``ok`` when GPU j read and wrote GPU i's memory correctly;
    ``reason`` says what was done or what failed, in one line."""

    ok: bool
    reason: str


def results_to_json(results: dict[tuple[int, int], P2PResult]) -> list[dict]:
    """``{(src, dst): P2PResult}`` as result rows, sorted by ``(src, dst)``."""
    return [{"src": i, "dst": j, "ok": r.ok, "reason": r.reason} for (i, j), r in sorted(results.items())]


def results_from_json(rows: Any) -> dict[tuple[int, int], P2PResult]:
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
