#!/usr/bin/env python3
"""Build a ~50 MB (uncompressed JSON) PyTorch-profiler trace for the trace benchmark.

The trace is *derived* from a real one (by default the vLLM B200 TP8 rank-0 trace copied from
TraceLens, ``../shared/traces/TraceLens/eager_trace.json.gz``): its events are tiled N times along
the time axis. Copy ``k`` is shifted by ``k * period`` in ``ts`` (period = the source's time span
plus a gap) and by ``k * id_stride`` in every linking id (``correlation``, ``External id``,
``Ev Idx``, ``Python id``, ``Python parent id`` and the flow-event ``id``), so kernels, launches,
flows and Python-stack parents stay linked within their copy and never collide across copies.
Everything else is kept: the top-level metadata (``deviceProperties``, ``distributedInfo``, ...),
``python_function`` events (part of a real trace's size), the args and the source's JSON layout
(4-space indentation). ``traceName`` says plainly that the file is derived and from what.

``--rank R`` makes the copy claim to be rank ``R`` of the run: ``distributedInfo.rank`` is set to
``R`` (``distributedInfo`` is added, first in the document, when the source has none) and a
``world_size`` present there is raised to ``R + 1`` when it is smaller; ``traceName`` says so. Two
such files (``--rank 0``, ``--rank 1``) are a derived 2-rank run for the benchmark's parallel-decode
case: same events, different ranks. HTA reads a file's rank with the regex ``"rank":\\s+(\\d+)`` on
the file text (its first match), which finds ``distributedInfo.rank`` as long as it comes before the
events, as in Kineto's own layout.

Usage::

    python benchmarks/make_big_trace.py                       # ~50 MB -> bench_out/
    python benchmarks/make_big_trace.py --copies 2 --out /tmp/x2.json.gz
    python benchmarks/make_big_trace.py --rank 1 --out bench_out/eager_trace_x4_rank1.json.gz

Only the standard library is used, so any Python 3.11 runs it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO.parent / "shared" / "traces" / "TraceLens" / "eager_trace.json.gz"
DEFAULT_OUT_DIR = REPO / "bench_out"
DEFAULT_TARGET_MB = 50.0
DEFAULT_GAP_US = 1000.0

# Linking ids inside `args`: shifted per copy so that links stay within one copy.
ARG_ID_KEYS = ("correlation", "External id", "Ev Idx", "Python id", "Python parent id")
# Flow events (`ph` s/t/f) carry their id at top level; for `ac2g` it equals the correlation.
FLOW_PHASES = frozenset({"s", "t", "f"})


def load_trace(path: Path) -> tuple[dict[str, Any], int]:
    """Return (document, uncompressed size in bytes)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    return json.loads(raw), len(raw)


def time_span(events: list[dict[str, Any]]) -> tuple[float, float]:
    lo = math.inf
    hi = -math.inf
    for ev in events:
        ts = ev.get("ts")
        if ts is None:
            continue
        ts = float(ts)
        lo = min(lo, ts)
        hi = max(hi, ts + float(ev.get("dur", 0) or 0))
    if lo == math.inf:
        raise ValueError("source trace has no timestamped events")
    return lo, hi


def id_stride(events: list[dict[str, Any]]) -> int:
    """One stride for all linking ids (keeps flow id == correlation after the shift)."""
    top = 0
    for ev in events:
        if ev.get("ph") in FLOW_PHASES and isinstance(ev.get("id"), int):
            top = max(top, ev["id"])
        args = ev.get("args")
        if args:
            for key in ARG_ID_KEYS:
                val = args.get(key)
                if isinstance(val, int) and not isinstance(val, bool):
                    top = max(top, val)
    return top + 1


def shifted_copy(ev: dict[str, Any], dt: float, did: int, int_ts: bool) -> dict[str, Any]:
    """Shallow copy of one event, shifted by dt (µs) in time and did in its linking ids."""
    if dt == 0 and did == 0:
        return ev
    out = dict(ev)
    ts = ev.get("ts")
    if ts is not None:
        if int_ts and isinstance(ts, int):
            out["ts"] = ts + int(dt)
        else:
            # Kineto writes ns-fractional µs; keep 3 decimals so no float noise is introduced.
            out["ts"] = round(float(ts) + dt, 3)
    if ev.get("ph") in FLOW_PHASES and isinstance(ev.get("id"), int):
        out["id"] = ev["id"] + did
    args = ev.get("args")
    if args:
        new_args = None
        for key in ARG_ID_KEYS:
            val = args.get(key)
            if isinstance(val, int) and not isinstance(val, bool):
                if new_args is None:
                    new_args = dict(args)
                new_args[key] = val + did
        if new_args is not None:
            out["args"] = new_args
    return out


def tiled_events(events: list[dict[str, Any]], copies: int, gap_us: float) -> Iterator[dict[str, Any]]:
    lo, hi = time_span(events)
    int_ts = all(isinstance(ev.get("ts"), int) for ev in events if "ts" in ev)
    period = float(math.ceil(hi - lo + gap_us))
    stride = id_stride(events)
    for k in range(copies):
        dt, did = k * period, k * stride
        for ev in events:
            yield shifted_copy(ev, dt, did, int_ts)


def _indent_tail(text: str, pad: str) -> str:
    """Indent every line but the first (the first follows a key or list bracket)."""
    return text.replace("\n", "\n" + pad)


def write_trace(doc: dict[str, Any], events: Iterator[dict[str, Any]], out: Path, level: int = 6) -> int:
    """Write doc (its traceEvents replaced by `events`) in the 4-space layout; return bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    written = 0
    opener = (
        (lambda p: gzip.open(p, "wb", compresslevel=level)) if out.name.endswith(".gz") else (lambda p: open(p, "wb"))
    )
    with opener(tmp) as fh:

        def put(s: str) -> None:
            nonlocal written
            b = s.encode("utf-8")
            fh.write(b)
            written += len(b)

        put("{")
        first_key = True
        for key, val in doc.items():
            put("\n" if first_key else ",\n")
            first_key = False
            put("    " + json.dumps(key) + ": ")
            if key == "traceEvents":
                put("[")
                first_ev = True
                chunk: list[str] = []
                for ev in events:
                    chunk.append(
                        ("\n" if first_ev else ",\n")
                        + "        "
                        + _indent_tail(json.dumps(ev, indent=4, ensure_ascii=False), "        ")
                    )
                    first_ev = False
                    if len(chunk) >= 2000:
                        put("".join(chunk))
                        chunk.clear()
                put("".join(chunk))
                put("\n    ]")
            else:
                put(_indent_tail(json.dumps(val, indent=4, ensure_ascii=False), "    "))
        put("\n}")
    os.replace(tmp, out)
    return written


def with_rank(doc: dict[str, Any], rank: int) -> dict[str, Any]:
    """The document with ``distributedInfo.rank = rank`` (a shallow copy; ``doc`` is not changed).

    A ``world_size`` (int) present in ``distributedInfo`` is raised to ``rank + 1`` if smaller; none is
    added. Without ``distributedInfo`` one ``{"rank": rank}`` is put first in the document, so that
    HTA's rank regex (first ``"rank":\\s+N`` in the file) meets it before any event.
    Raises ValueError for a negative rank or a ``distributedInfo`` that is not an object.
    """
    if rank < 0:
        raise ValueError(f"--rank must be >= 0, got {rank}")
    info = doc.get("distributedInfo")
    if info is None:
        return {"distributedInfo": {"rank": rank}, **{k: v for k, v in doc.items() if k != "distributedInfo"}}
    if not isinstance(info, dict):
        raise ValueError(f"distributedInfo is a {type(info).__name__}, not an object")
    new_info = dict(info)
    new_info["rank"] = rank
    ws = info.get("world_size")
    if isinstance(ws, int) and not isinstance(ws, bool) and ws < rank + 1:
        new_info["world_size"] = rank + 1
    new_doc = dict(doc)
    new_doc["distributedInfo"] = new_info
    return new_doc


def make_big_trace(
    source: Path,
    out: Path | None = None,
    copies: int | None = None,
    target_mb: float = DEFAULT_TARGET_MB,
    gap_us: float = DEFAULT_GAP_US,
    rank: int | None = None,
) -> dict[str, Any]:
    """Build the tiled trace; return a summary dict (path, copies, events, json_bytes, gz_bytes, rank).

    ``rank``: None keeps the source's ``distributedInfo``; an int sets ``distributedInfo.rank`` (see
    ``with_rank``). Raises ValueError for a source without events, copies < 1 or a bad rank; OSError
    from reading or writing. The output appears whole or not at all (written to ``.part``, renamed).
    """
    doc, src_bytes = load_trace(source)
    if not isinstance(doc, dict) or not isinstance(events := doc.get("traceEvents"), list) or not events:
        raise ValueError(f"{source}: no traceEvents to tile")
    if rank is not None:
        doc = with_rank(doc, rank)
    if copies is None:
        copies = max(1, round(target_mb * 1e6 / src_bytes))
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if out is None:
        stem = source.name.split(".")[0]
        tail = "" if rank is None else f"_rank{rank}"
        out = DEFAULT_OUT_DIR / f"{stem}_x{copies}{tail}.json.gz"
    orig_name = doc.get("traceName", "")
    label = (
        f"DERIVED TRACE (not a recording): the real trace {source.name}"
        f" (original traceName {orig_name!r}) tiled {copies}x in time by"
        f" fastverify benchmarks/make_big_trace.py; ts, correlation, External id, Ev Idx,"
        f" Python id/parent id and flow ids shifted per copy"
    )
    if rank is not None:
        label += f"; distributedInfo.rank set to {rank} (not the recorded rank; events are the source's)"
    # Keep the key order of the source; traceName stays where it was (added last if absent).
    new_doc = dict(doc)
    new_doc["traceName"] = label
    nbytes = write_trace(new_doc, tiled_events(events, copies, gap_us), out)
    return {
        "path": str(out),
        "source": str(source),
        "copies": copies,
        "events": len(events) * copies,
        "json_bytes": nbytes,
        "gz_bytes": out.stat().st_size,
        "rank": rank,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="real trace to tile")
    ap.add_argument("--out", type=Path, default=None, help="output .json.gz (default bench_out/)")
    ap.add_argument("--copies", type=int, default=None, help="number of copies (overrides --target-mb)")
    ap.add_argument(
        "--target-mb",
        type=float,
        default=DEFAULT_TARGET_MB,
        help="aim for about this many MB of uncompressed JSON (default 50)",
    )
    ap.add_argument("--gap-us", type=float, default=DEFAULT_GAP_US, help="idle gap between copies in µs (default 1000)")
    ap.add_argument(
        "--rank",
        type=int,
        default=None,
        help="set distributedInfo.rank to this (world_size raised to rank+1 if smaller)",
    )
    args = ap.parse_args(argv)
    if args.rank is not None and args.rank < 0:
        print(f"make_big_trace: --rank must be >= 0, got {args.rank}", file=sys.stderr)
        return 2
    if not args.source.exists():
        print(f"make_big_trace: source trace not found: {args.source}", file=sys.stderr)
        return 2
    try:
        info = make_big_trace(args.source, args.out, args.copies, args.target_mb, args.gap_us, rank=args.rank)
    except (OSError, ValueError) as exc:
        print(f"make_big_trace: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {info['path']}: {info['copies']} copies, {info['events']:,} events,"
        f" {info['json_bytes'] / 1e6:.1f} MB JSON ({info['gz_bytes'] / 1e6:.1f} MB gz)"
        + ("" if info["rank"] is None else f", distributedInfo.rank {info['rank']}")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
