"""Load PyTorch profiler (Kineto) Chrome traces into :class:`~fastverify.events.RankEvents`.

Formats read (facts from Kineto ``libkineto/src/output_json.cpp``, SGLang
``managers/scheduler_components/profiler_manager.py`` and ``utils/profile_merger.py``):

- one file per TP rank, ``.json`` or ``.json.gz``: SGLang's
  ``<id>-TP-<r>[-DP-..][-EP-..][-<stage>].trace.json.gz``, vLLM's, plain ``torch.profiler`` ones;
- SGLang's merged file, whose ``pid`` values are strings ``"[TP00-DP01] 123"``: split by TP rank.

Times: ``ts``/``dur`` are µs, either ns-fractional floats relative to ``baseTimeNanoseconds`` or
integer epoch µs (old Kineto). Both become int64 ns without rounding to µs: the start is taken
relative to an integer base first, so a float never has to hold an epoch in ns (HTA rounds to
whole µs, losing ~1 µs per kernel). Integers wider than 64 bits (``Comms Id``) make orjson fail, so
such files fall back to the standard ``json`` module.

This module must not import torch: the trace path starts in well under a second.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import re
import zlib
from pathlib import Path

import msgspec
import numpy as np
import orjson

from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step, assign_steps
from fastverify.trace.classify import classify_name, resolve_from_op

GPU_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "gpu_memset", "Memcpy", "Memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})
GRAPH_LAUNCH = re.compile(r"^(cuda|hip)GraphLaunch")

# Host-side regions that make one step, tried in this order; the first that matches any event wins.
# (name regex, source)
STEP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"^ProfilerStep#\d+", "torch.profiler schedule / prof.step()"),
    (r"^step\[", "SGLang utils/profile_utils.py::build_step_span_name, e.g. step[TARGET_VERIFY bs=8]"),
    (r"^execute_", "vLLM model runner annotation execute_context_..._generation_..."),
)

_DTYPE_BYTES = {
    "float": 4, "float32": 4, "c10::float": 4, "double": 8, "float64": 8,
    "half": 2, "float16": 2, "c10::half": 2, "bfloat16": 2, "c10::bfloat16": 2,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "int8": 1, "signed char": 1, "unsigned char": 1,
    "uint8": 1, "byte": 1, "char": 1, "c10::float8_e4m3fn": 1, "float8_e4m3fn": 1,
    "c10::float8_e5m2": 1, "float8_e5m2": 1,
}

_RANK_FROM_NAME = (
    re.compile(r"-TP-(\d+)"),
    re.compile(r"(?i)(?:^|[^a-z])rank[-_]?(\d+)"),
    re.compile(r"(?i)(?:^|[^a-z])tp[-_]?(\d+)"),
)
_RANK_FROM_PID = re.compile(r"^\[TP(\d+)")
_NULL = msgspec.Raw(b"null")

try:  # python-isal inflates about 1.5x faster than zlib; same format
    from isal.igzip import decompress as _gunzip
    from isal.igzip_lib import IsalError as _InflateError
except ImportError:  # pragma: no cover - isal is a declared dependency
    from gzip import decompress as _gunzip
    from zlib import error as _InflateError


class _Event(msgspec.Struct, gc=False):
    """The keys of a trace event the analyzer reads; every other key is skipped unparsed, and
    ``name``/``args``/``pid`` stay raw bytes until an event turns out to matter (most events are
    ``python_function`` or flow events, which never do)."""

    ph: str = ""
    cat: str = ""
    name: msgspec.Raw = _NULL
    ts: int | float | None = None
    dur: int | float | None = None
    pid: msgspec.Raw = _NULL
    args: msgspec.Raw = _NULL


class _Trace(msgspec.Struct, gc=False):
    traceEvents: list[_Event]
    distributedInfo: msgspec.Raw = _NULL
    deviceProperties: msgspec.Raw = _NULL


_TRACE_DECODER = msgspec.json.Decoder(_Trace)
_RAW_DECODER = msgspec.json.Decoder()


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = _gunzip(raw)
        except (EOFError, OSError, zlib.error, _InflateError) as e:
            raise UserError(f"{path}: truncated or corrupt gzip ({e})") from None
    return raw


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """Read one trace file (``.json`` or gzip, detected by magic bytes).

    Returns the top-level ``distributedInfo``/``deviceProperties`` and the events the analyzer
    uses (GPU, runtime, host-op and metadata events, as dicts), without ``python_function`` and
    flow events. Well-formed traces take a typed msgspec decode that skips unused keys; anything
    it rejects goes through :func:`read_trace_json`, which either parses it or names the problem.

    Raises
    ------
    UserError
        As :func:`read_trace_json`.
    """
    raw = _read_bytes(path)
    try:
        doc = _TRACE_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        full = read_trace_json(path, raw)
        top = {k: full.get(k) for k in ("distributedInfo", "deviceProperties")}
        return top, [ev for ev in full["traceEvents"] if isinstance(ev, dict) and _wanted(ev.get("cat"), ev.get("ph"))]
    if not doc.traceEvents:
        raise UserError(f"{path}: the trace has no events")
    top = {"distributedInfo": _raw(doc.distributedInfo), "deviceProperties": _raw(doc.deviceProperties)}
    events = []
    for ev in doc.traceEvents:
        cat = ev.cat
        if cat in GPU_CATS or cat in RUNTIME_CATS:
            events.append({"ph": ev.ph or "X", "cat": cat, "name": _raw(ev.name), "ts": ev.ts, "dur": ev.dur,
                           "pid": _raw(ev.pid), "args": _raw(ev.args)})
        elif cat in HOST_CATS and _HOST_KEEP_RAW.search(ev.name):
            # Only comm ops (External id, shapes) and step spans are read: a byte-level look at the
            # still-encoded name drops the other ~95 % of host ops without decoding them.
            name = _raw(ev.name)
            d = {"ph": ev.ph, "cat": cat, "name": name, "ts": ev.ts, "dur": ev.dur}
            if isinstance(name, str) and _looks_comm_op(name):
                d["args"] = _raw(ev.args)
            events.append(d)
    return top, events


def _wanted(cat, ph) -> bool:
    return type(cat) is str and (cat in GPU_CATS or cat in RUNTIME_CATS or cat in HOST_CATS)


def _raw(value: msgspec.Raw):
    """Decode a raw JSON value; None if it cannot be decoded (e.g. a float out of range)."""
    try:
        return _RAW_DECODER.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def read_trace_json(path: Path, raw: bytes | None = None) -> dict:
    """Parse one whole trace file into plain Python objects (slow path, any valid JSON).

    Raises
    ------
    UserError
        Unreadable file, truncated/corrupt gzip, not JSON, or JSON that is not a trace object.
    """
    if raw is None:
        raw = _read_bytes(path)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the parse allocates millions of objects; GC passes over them only cost time
    try:
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            # orjson rejects integers wider than 64 bits (e.g. NCCL `Comms Id`) and NaN; json does not.
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise UserError(f"{path}: not valid JSON ({_first_line(e)})") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    if isinstance(doc, list):  # the Chrome trace format also allows a bare event array
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise UserError(f"{path}: no 'traceEvents' key; not a PyTorch profiler (Chrome) trace")
    if not isinstance(doc["traceEvents"], list):
        raise UserError(f"{path}: 'traceEvents' is not a list")
    if not doc["traceEvents"]:
        raise UserError(f"{path}: the trace has no events")
    return doc


def _is_time(v) -> bool:
    """A usable µs value: a finite int or float (not bool), within ±2**62 ns once scaled."""
    return type(v) in (int, float) and math.isfinite(v) and abs(v) < 4.6e15


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def rank_from_filename(path: Path) -> int | None:
    """TP rank from a file name: SGLang ``...-TP-3...``, ``rank-3``, ``rank_3``, ``tp3``; else None."""
    for pattern in _RANK_FROM_NAME:
        m = pattern.search(path.name)
        if m:
            return int(m.group(1))
    return None


def _msg_bytes(args: dict) -> int:
    """Payload of a collective in bytes from c10d args (``In msg nelems`` × dtype), else from
    ``Input Dims``/``Input type`` of the launching op (first input); -1 when unknown."""
    nelems = args.get("In msg nelems")
    dtype = args.get("dtype")
    if isinstance(nelems, int) and isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        return nelems * _DTYPE_BYTES[dtype.lower()]
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if isinstance(dims, list) and isinstance(types, list) and dims and types:
        first, t = dims[0], types[0]
        if isinstance(first, list) and first and isinstance(t, str) and t.lower() in _DTYPE_BYTES:
            try:
                return math.prod(int(x) for x in first) * _DTYPE_BYTES[t.lower()]
            except (TypeError, ValueError):
                return -1
    return -1


def _to_ns(values: list) -> np.ndarray:
    """µs timestamps (ints or floats) → int64 ns, exact for integer µs and ns-exact for floats.

    The integer part of the smallest value is subtracted before scaling, so the float product
    stays small (a float epoch in ns would lose up to ~256 ns).
    """
    if not values:
        return np.zeros(0, dtype=np.int64)
    if all(type(v) is int for v in values):
        return np.array(values, dtype=np.int64) * 1000
    base = math.floor(min(values))
    rel = np.array([v - base for v in values], dtype=np.float64)
    return np.rint(rel * 1000.0).astype(np.int64) + np.int64(base) * 1000


def load_trace(path: str | Path) -> list[RankEvents]:
    """Load one trace file into one :class:`RankEvents` per rank it holds (one, or several for a
    SGLang merged file).

    The rank comes from ``distributedInfo.rank``, else the file name, else the ``pid`` label of a
    merged file; a single unnamed rank defaults to 0 and says so in ``meta["rank_source"]``.
    ``python_function`` events are skipped. GPU events are kernels, memcpys and memsets;
    ``gpu_user_annotation`` spans are not GPU work.

    Raises
    ------
    UserError
        Any problem from :func:`read_trace_json`, or a trace without GPU events.
    """
    path = Path(path)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # hundreds of thousands of short-lived objects and no cycles: GC passes only cost time
    try:
        return _load_trace(path)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load_trace(path: Path) -> list[RankEvents]:
    doc, events = read_trace(path)

    # One pass over the events. Everything is collected into plain lists; numpy comes after.
    gpu: list[dict] = []
    runtime_ts: dict[int, float] = {}  # correlation -> host launch time (µs)
    graph_launches: list[dict] = []
    ops_by_ext: dict[int, dict] = {}  # External id -> innermost comm-ish cpu_op (name, args)
    step_candidates: list[dict] = []
    step_res = [re.compile(p) for p, _ in STEP_PATTERNS]
    skipped = 0  # GPU events without a usable ts/dur
    for ev in events:
        if not isinstance(ev, dict):
            continue
        cat = ev.get("cat")
        if cat == "python_function":
            continue
        if type(cat) is not str:
            cat = ""
        if cat in GPU_CATS:
            if ev.get("ph", "X") == "X" and _is_time(ev.get("ts")) and _is_time(ev.get("dur")):
                gpu.append(ev)
            else:
                skipped += 1
        elif cat in RUNTIME_CATS:
            args = ev.get("args") or {}
            if not isinstance(args, dict) or not _is_time(ev.get("ts")):
                continue
            corr = args.get("correlation")
            if isinstance(corr, int):
                runtime_ts[corr] = ev["ts"]
            name = ev.get("name")
            if isinstance(name, str) and GRAPH_LAUNCH.match(name):
                graph_launches.append(ev)
        elif cat in HOST_CATS:
            name = ev.get("name")
            args = ev.get("args") or {}
            if not isinstance(name, str) or not isinstance(args, dict):
                continue
            ext = args.get("External id")
            if isinstance(ext, int) and _looks_comm_op(name):
                ops_by_ext[ext] = {"name": name, "args": args}
            if _is_time(ev.get("ts")) and _is_time(ev.get("dur")) and any(r.match(name) for r in step_res):
                step_candidates.append(ev)

    if not gpu:
        raise UserError(f"{path}: no GPU events (kernels, memcpy, memset) in the trace; "
                        "was it recorded with ProfilerActivity.CUDA?")

    dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    meta = {
        "file": str(path),
        "world_size": dist.get("world_size"),
        "nccl_version": dist.get("nccl_version"),
        "dist_backend": dist.get("backend"),
        "gpu_name": _gpu_name(doc),
        "timing": "trace",
    }
    if skipped:
        meta["skipped_gpu_events"] = skipped

    # Merged SGLang file: several ranks in one file, told apart by the pid label.
    by_rank: dict[int, list[dict]] = {}
    for ev in gpu:
        pid = ev.get("pid")
        m = _RANK_FROM_PID.match(pid) if isinstance(pid, str) else None
        by_rank.setdefault(int(m.group(1)) if m else -1, []).append(ev)
    if len(by_rank) > 1 or -1 not in by_rank:
        ranks = {r: evs for r, evs in by_rank.items() if r >= 0}
        meta["rank_source"] = "pid label (merged file)"
    else:
        rank = dist.get("rank") if isinstance(dist.get("rank"), int) else None
        meta["rank_source"] = "distributedInfo.rank"
        if rank is None:
            rank = rank_from_filename(path)
            meta["rank_source"] = "file name"
        if rank is None:
            rank = 0
            meta["rank_source"] = "default (no rank in the trace or its name)"
        ranks = {rank: gpu}

    steps = _find_steps(step_candidates, graph_launches)
    out = []
    for rank, evs in sorted(ranks.items()):
        out.append(_build(rank, path, evs, runtime_ts, ops_by_ext, steps, dict(meta)))
    return out


_COMM_OP = re.compile(r"(?i)all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|^nccl:|"
                      r"record_param_comms|c10d::|symm_mem::|custom_ar|_C_custom_ar|sgl_kernel::.*reduce")


# The same patterns (comm ops, step spans) over a JSON-encoded name, quotes included: a superset
# filter, the exact check runs on the decoded string.
_HOST_KEEP_RAW = re.compile(
    rb"(?i)all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|nccl:|record_param_comms|c10d::"
    rb"|symm_mem::|custom_ar|sgl_kernel::|^\"ProfilerStep#|^\"step\[|^\"execute_"
)


def _looks_comm_op(name: str) -> bool:
    return bool(_COMM_OP.search(name))


def _gpu_name(doc: dict) -> str | None:
    props = doc.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return props[0].get("name")
    return None


def _find_steps(candidates: list[dict], graph_launches: list[dict]) -> list[tuple[str, float, float, str]]:
    """Host-side step windows ``(name, ts_us, end_us, kind)``, sorted, non-overlapping.

    The first pattern of :data:`STEP_PATTERNS` with a match wins; otherwise each CUDA/HIP graph
    launch is one step (decode/verify replays); otherwise there are none (the whole trace).
    """
    for regex, _source in STEP_PATTERNS:
        r = re.compile(regex)
        found = [e for e in candidates if r.match(e.get("name", ""))]
        if found:
            return _non_overlapping([(e["name"], e["ts"], e["ts"] + e["dur"], "annotation") for e in found])
    if graph_launches:
        return _non_overlapping([(f"graph_launch#{i}", e["ts"], e["ts"] + (e["dur"] if _is_time(e.get("dur")) else 0),
                                  "graph_launch")
                                 for i, e in enumerate(sorted(graph_launches, key=lambda e: e["ts"]))])
    return []


def _non_overlapping(windows: list[tuple[str, float, float, str]]) -> list[tuple[str, float, float, str]]:
    out: list[tuple[str, float, float, str]] = []
    for w in sorted(windows, key=lambda w: w[1]):
        if not out or w[1] >= out[-1][2]:
            out.append(w)
    return out


def _build(rank: int, path: Path, evs: list[dict], runtime_ts: dict, ops_by_ext: dict,
           steps: list[tuple[str, float, float, str]], meta: dict) -> RankEvents:
    n = len(evs)
    names: list[str] = []
    name_index: dict[str, int] = {}
    name_id = np.empty(n, dtype=np.int32)
    cls = np.empty(n, dtype=np.int8)
    msg = np.full(n, -1, dtype=np.int64)
    stream = np.empty(n, dtype=np.int64)
    launch_us: list = []
    unresolved: dict[str, int] = {}
    comm_codes = {EventClass.ALLREDUCE.code, EventClass.FUSED_ALLREDUCE.code, EventClass.OTHER_COMM.code,
                  EventClass.UNKNOWN_COMM.code}
    for i, ev in enumerate(evs):
        name = ev.get("name")
        if not isinstance(name, str):
            name = str(name)
        j = name_index.get(name)
        if j is None:
            j = name_index[name] = len(names)
            names.append(name)
        name_id[i] = j
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        c = classify_name(name).cls
        ext = args.get("External id")
        op = ops_by_ext.get(ext) if isinstance(ext, int) else None
        if c is None:
            collective = args.get("Collective name") or (op["args"].get("Collective name") or op["name"] if op else None)
            c = resolve_from_op(collective)
            if c is EventClass.UNKNOWN_COMM:
                unresolved[name] = unresolved.get(name, 0) + 1
        elif ev.get("cat") in ("gpu_memcpy", "gpu_memset", "Memcpy", "Memset"):
            c = EventClass.MEMORY
        cls[i] = c.code
        if c.code in comm_codes:
            b = _msg_bytes(args)
            if b < 0 and op is not None:
                b = _msg_bytes(op["args"])
            msg[i] = b if 0 <= b < 2**62 else -1
        s = args.get("stream", ev.get("tid", 0))
        stream[i] = s if type(s) is int and abs(s) < 2**62 else -1
        corr = args.get("correlation")
        launch_us.append(runtime_ts.get(corr, ev["ts"]) if isinstance(corr, int) else ev["ts"])

    start_ns = _to_ns([ev["ts"] for ev in evs])
    dur_ns = _to_ns([ev["dur"] for ev in evs])
    order = np.argsort(start_ns, kind="stable")
    launch_ns = _to_ns(launch_us)
    step_objs = [Step(name, int(a), int(b)) for name, a, b in
                 zip([s[0] for s in steps], _to_ns([s[1] for s in steps]), _to_ns([s[2] for s in steps]))]
    step_idx = assign_steps(launch_ns, step_objs)
    meta["step_source"] = steps[0][3] if steps else "none (whole trace is one window)"
    if unresolved:
        meta["unresolved_comm_kernels"] = unresolved
    return RankEvents(
        rank=rank,
        origin=str(path),
        start_ns=start_ns[order],
        dur_ns=np.maximum(dur_ns[order], 0),
        cls=cls[order],
        name_id=name_id[order],
        msg_bytes=msg[order],
        step=step_idx[order],
        stream=stream[order],
        names=names,
        steps=step_objs,
        meta=meta,
    )


def load_traces(paths: list[str | Path]) -> list[RankEvents]:
    """Load every trace under ``paths`` (files, or folders searched for ``*.json``/``*.json.gz``).

    Returns one :class:`RankEvents` per rank, sorted by rank.

    Raises
    ------
    UserError
        A path that does not exist, a folder without traces, a bad file (see :func:`load_trace`),
        or two files claiming the same rank.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and (f.name.endswith(".json") or f.name.endswith(".json.gz")))
            if not found:
                raise UserError(f"{p}: folder holds no .json or .json.gz trace files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or folder")
    result: dict[int, RankEvents] = {}
    for f in files:
        for r in load_trace(f):
            if r.rank in result:
                if r.meta.get("rank_source", "").startswith("default") or \
                        result[r.rank].meta.get("rank_source", "").startswith("default"):
                    raise UserError(f"{f}: no rank in the trace (distributedInfo) or its file name, and "
                                    f"{result[r.rank].origin} is rank {r.rank} too; name files with -TP-<rank>")
                raise UserError(f"{f}: rank {r.rank} also claimed by {result[r.rank].origin}")
            result[r.rank] = r
    return [result[k] for k in sorted(result)]
