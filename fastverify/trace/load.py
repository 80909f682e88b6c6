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
import math
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path

import msgspec
import numpy as np

from fastverify.bounds import MAX_EVENT_NS, MAX_MSG_BYTES
from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step, assign_steps
from fastverify.inputs import inflate_trace, loads_json, read_bytes
from fastverify.trace.classify import classify_name, refine_from_op, resolve_from_op

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



class _TooDeep(UserError):
    """A value nested deeper than msgspec allows; re-raised naming the file by the reader."""

    def __init__(self, path: object = None):
        super().__init__(f"{path or 'a trace'}: JSON nested too deeply inside one event "
                         "(over the parser's recursion limit)")


class _Event(msgspec.Struct, gc=False):
    """The keys of a trace event the analyzer reads; every other key is skipped unparsed, and the
    rest stay raw JSON text until an event turns out to matter (most events are
    ``python_function`` or flow events, which never do). ``ts``/``dur`` stay text so that they
    convert to integer ns exactly (see :func:`_ns_from_text`)."""

    ph: str = ""
    cat: str = ""
    name: msgspec.Raw = _NULL
    ts: msgspec.Raw = _NULL
    dur: msgspec.Raw = _NULL
    pid: msgspec.Raw = _NULL
    args: msgspec.Raw = _NULL


class _Trace(msgspec.Struct, gc=False):
    traceEvents: list[_Event]
    distributedInfo: msgspec.Raw = _NULL
    deviceProperties: msgspec.Raw = _NULL


_TRACE_DECODER = msgspec.json.Decoder(_Trace)
_RAW_DECODER = msgspec.json.Decoder()
_MAX_NS = 2**62
_IMPLAUSIBLE_NS = 10 * 10**9  # a GPU kernel or copy of over 10 s in a serving trace is a broken event


def _ns_from_text(text: bytes) -> int | None:
    """A JSON number of µs, as text, to integer ns without going through a float.

    ``b"1365627866520.196"`` → ``1365627866520196``. A float64 cannot hold a µs timestamp past
    ~2**43 µs (102 days of uptime, which Kineto's relative ``ts`` reaches) to the ns; the text
    can. More than 3 decimals round half to even. None for anything that is not a finite number
    within ±2**62 ns.
    """
    ip, dot, fp = text.partition(b".")
    try:
        if len(fp) <= 3 and b"e" not in text and b"E" not in text and not text.startswith(b"-"):
            ns = int(ip) * 1000 + (int(fp.ljust(3, b"0")) if dot else 0)
        else:
            d = Decimal(text.decode("ascii"))
            if not d.is_finite():
                return None
            ns = int((d * 1000).to_integral_value(ROUND_HALF_EVEN))
    except (ValueError, InvalidOperation, UnicodeDecodeError):
        return None
    return ns if -_MAX_NS < ns < _MAX_NS else None


def _ns_from_value(v) -> int | None:
    """A parsed µs value (int or float, not bool) to integer ns, else None. Floats go through
    their shortest round-trip text, which is the trace's own text for Kineto's 3-decimal values."""
    if type(v) is int:
        return v * 1000 if -_MAX_NS < v * 1000 < _MAX_NS else None
    if type(v) is float:
        return _ns_from_text(repr(v).encode()) if math.isfinite(v) else None
    return None


def _rank_label(pid) -> int:
    """TP rank from a SGLang merged file's pid label ``"[TP03-DP00] 1234"``; -1 otherwise."""
    if isinstance(pid, str):
        m = _RANK_FROM_PID.match(pid)
        if m:
            return int(m.group(1))
    return -1


def _read_bytes(path: Path) -> bytes:
    """The trace's JSON bytes through the one input opener (regular file, size caps, gzip)."""
    return inflate_trace(read_bytes(path, kind="trace"), path)


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """Read one trace file (``.json`` or gzip, detected by magic bytes).

    Returns the top-level ``distributedInfo``/``deviceProperties``, and the events the analyzer
    uses (GPU, runtime and the host ops that matter) as dicts with keys ``cat``, ``ph``, ``name``
    (str), ``ts_ns``/``dur_ns`` (int ns or None), ``label`` (TP rank from a merged file's pid, or
    -1) and ``args`` (dict). Well-formed traces take a typed msgspec decode that skips unused
    keys; anything it rejects goes through :func:`read_trace_json`, which either parses it or
    names the problem.

    Raises
    ------
    UserError
        As :func:`read_trace_json`.
    """
    raw = _read_bytes(path)
    try:
        doc = _TRACE_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        # RecursionError: msgspec bounds nesting; the slow path names the file in one line
        return _normalise_parsed(read_trace_json(path, raw))
    if not doc.traceEvents:
        raise UserError(f"{path}: the trace has no events")
    try:
        return _fast_events(doc)
    except _TooDeep:
        raise _TooDeep(path) from None


def _fast_events(doc) -> tuple[dict, list[dict]]:
    top = {"distributedInfo": _raw(doc.distributedInfo), "deviceProperties": _raw(doc.deviceProperties)}
    events = []
    for ev in doc.traceEvents:
        cat = ev.cat
        if cat in GPU_CATS or cat in RUNTIME_CATS:
            args = _raw(ev.args)
            pid = ev.pid
            events.append({"cat": cat, "ph": ev.ph or "X", "name": _raw(ev.name),
                           "ts_ns": _ns_from_text(bytes(ev.ts)), "dur_ns": _ns_from_text(bytes(ev.dur)),
                           "label": _rank_label(_raw(pid)) if bytes(pid).startswith(b'"[TP') else -1,
                           "args": args if isinstance(args, dict) else {}})
        elif cat in HOST_CATS and _HOST_KEEP_RAW.search(ev.name):
            # Only comm ops (External id, shapes) and step spans are read: a byte-level look at the
            # still-encoded name drops the other ~95 % of host ops without decoding them.
            name = _raw(ev.name)
            args = _raw(ev.args) if isinstance(name, str) and _looks_comm_op(name) else {}
            pid = ev.pid
            events.append({"cat": cat, "ph": ev.ph, "name": name,
                           "ts_ns": _ns_from_text(bytes(ev.ts)), "dur_ns": _ns_from_text(bytes(ev.dur)),
                           "label": _rank_label(_raw(pid)) if bytes(pid).startswith(b'"[TP') else -1,
                           "args": args if isinstance(args, dict) else {}})
    return top, events


def _normalise_parsed(doc: dict) -> tuple[dict, list[dict]]:
    """The slow path's events in :func:`read_trace`'s shape."""
    top = {k: doc.get(k) for k in ("distributedInfo", "deviceProperties")}
    top["_any_event_object"] = any(isinstance(ev, dict) for ev in doc["traceEvents"])
    events = []
    for ev in doc["traceEvents"]:
        if not isinstance(ev, dict):
            continue
        cat = ev.get("cat")
        if type(cat) is not str or not (cat in GPU_CATS or cat in RUNTIME_CATS or cat in HOST_CATS):
            continue
        args = ev.get("args")
        events.append({"cat": cat, "ph": ev.get("ph", "X"), "name": ev.get("name"),
                       "ts_ns": _ns_from_value(ev.get("ts")), "dur_ns": _ns_from_value(ev.get("dur")),
                       "label": _rank_label(ev.get("pid")), "args": args if isinstance(args, dict) else {}})
    return top, events


def _raw(value: msgspec.Raw):
    """Decode a raw JSON value; None if it cannot be decoded (e.g. a float out of range)."""
    try:
        return _RAW_DECODER.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except RecursionError:  # one kernel's args nested thousands deep: refuse the file, in one line
        raise _TooDeep() from None


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
        # orjson where it is safe, json for >64-bit integers (NCCL `Comms Id`) and NaN; nesting bounded
        doc = loads_json(raw, path)
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


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def rank_from_filename(path: Path) -> int | None:
    """TP rank from a file name: SGLang ``...-TP-3...``, ``rank-3``, ``rank_3``, ``tp3``; else None."""
    for pattern in _RANK_FROM_NAME:
        m = pattern.search(path.name)
        if m:
            return int(m.group(1))
    return None


class _Implausible(ValueError):
    """A message size no GPU can hold (see :mod:`fastverify.bounds`); :func:`_build` names the
    file and kernel."""


def _msg_bytes(args: dict) -> int:
    """Payload of a collective in bytes from c10d args (``In msg nelems`` × dtype), else from
    ``Input Dims``/``Input type`` of the launching op (first input); -1 when unknown.

    Raises
    ------
    _Implausible
        A size past ``MAX_MSG_BYTES`` (1 TiB) or a non-finite dimension (``inf`` in ``Input Dims``).
    """
    nelems = args.get("In msg nelems")
    dtype = args.get("dtype")
    if isinstance(nelems, int) and isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        b = nelems * _DTYPE_BYTES[dtype.lower()]
        if b > MAX_MSG_BYTES:
            raise _Implausible(f"'In msg nelems' = {nelems} ({dtype}) is {b:.3g} bytes, over 1 TiB")
        return b
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if isinstance(dims, list) and isinstance(types, list) and dims and types:
        first, t = dims[0], types[0]
        if isinstance(first, list) and first and isinstance(t, str) and t.lower() in _DTYPE_BYTES:
            if any(type(x) is float and not math.isfinite(x) for x in first):
                raise _Implausible(f"'Input Dims' {first!r:.80} holds a non-finite dimension")
            try:
                b = math.prod(int(x) for x in first) * _DTYPE_BYTES[t.lower()]
            except (TypeError, ValueError, OverflowError):
                return -1
            if b > MAX_MSG_BYTES and all(int(x) >= 0 for x in first):
                raise _Implausible(f"'Input Dims' {first!r:.80} ({t}) is {b:.3g} bytes, over 1 TiB")
            return b
    return -1


def load_trace(path: str | Path) -> list[RankEvents]:
    """Load one trace file into one :class:`RankEvents` per rank it holds (one, or several for a
    SGLang merged file).

    The rank comes from ``distributedInfo.rank``, else the file name, else the ``pid`` labels of a
    merged file; a single unnamed rank defaults to 0 and says so in ``meta["rank_source"]``.
    ``python_function`` events are skipped. GPU events are kernels, memcpys and memsets;
    ``gpu_user_annotation`` spans are not GPU work.

    Raises
    ------
    UserError
        Any problem from :func:`read_trace_json`, a trace without GPU events, or a
        ``distributedInfo.rank`` not below its ``world_size``.
    """
    path = Path(path)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # hundreds of thousands of short-lived objects and no cycles: GC passes only cost time
    try:
        return _load_trace(path)
    finally:
        if gc_was_enabled:
            gc.enable()


class _PerRank:
    """What one pass collects for one rank of a file (a merged file has several)."""

    def __init__(self) -> None:
        self.gpu: list[dict] = []
        self.runtime_ns: dict[int, int] = {}  # correlation -> host launch time (ns)
        self.graph_launches: list[dict] = []
        self.ops_by_ext: dict[int, dict] = {}  # External id -> comm cpu_op (name, args)
        self.step_candidates: list[dict] = []
        self.skipped = 0  # GPU events without a usable ts/dur
        self.classes: list[EventClass] | None = None  # a CPU-only trace: each event's class, decided already


def _load_trace(path: Path) -> list[RankEvents]:
    doc, events = read_trace(path)

    # One pass over the events, collected per pid label (-1 for every event of a plain file, so
    # that host and GPU events of one rank in a merged file are never paired with another's).
    per: dict[int, _PerRank] = {}
    step_res = [re.compile(p) for p, _ in STEP_PATTERNS]
    for ev in events:
        cat, name, args = ev["cat"], ev["name"], ev["args"]
        acc = per.get(ev["label"])
        if acc is None:
            acc = per[ev["label"]] = _PerRank()
        if cat in GPU_CATS:
            if ev["ph"] == "X" and ev["ts_ns"] is not None and ev["dur_ns"] is not None:
                acc.gpu.append(ev)
            else:
                acc.skipped += 1
        elif cat in RUNTIME_CATS:
            if ev["ts_ns"] is None:
                continue
            corr = args.get("correlation")
            if type(corr) is int:
                acc.runtime_ns[corr] = ev["ts_ns"]
            if isinstance(name, str) and GRAPH_LAUNCH.match(name):
                acc.graph_launches.append(ev)
        elif isinstance(name, str):  # host op
            ext = args.get("External id")
            if type(ext) is int and _looks_comm_op(name):
                acc.ops_by_ext[ext] = {"name": name, "args": args}
            if ev["ts_ns"] is not None and ev["dur_ns"] is not None and any(r.match(name) for r in step_res):
                acc.step_candidates.append(ev)

    timing = "trace"
    if not any(acc.gpu for acc in per.values()):
        skipped = sum(acc.skipped for acc in per.values())
        if skipped:
            raise UserError(f"{path}: {skipped} GPU events, none with a usable ts/dur "
                            "(finite numbers of µs within ±2**62 ns)")
        if not events and not doc.get("_any_event_object", True):
            raise UserError(f"{path}: 'traceEvents' holds no event objects; not a PyTorch profiler trace")
        per = _cpu_ranks(path, step_res)  # a TP run on CPU: CPU collectives (gloo) and CPU ops
        if not per:
            raise UserError(f"{path}: no GPU events (kernels, memcpy, memset) and no CPU all-reduces "
                            "(gloo:*, record_param_comms) in the trace; was it recorded with ProfilerActivity.CUDA?")
        from fastverify.trace.cpu import CPU_CLOCK

        timing = CPU_CLOCK

    dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    world = dist.get("world_size")
    meta = {
        "file": str(path),
        "world_size": world if type(world) is int and 1 <= world < 2**31 else None,
        "nccl_version": _str_or_none(dist.get("nccl_version")),
        "dist_backend": _str_or_none(dist.get("backend")),
        "gpu_name": _gpu_name(doc),
        "timing": timing,
    }
    if timing != "trace":
        meta["cpu_only"] = ("no GPU events: CPU ops and CPU collectives (gloo) on the host wall clock, "
                            "not GPU timings")

    labelled = sorted(k for k in per if k >= 0 and per[k].gpu)
    if labelled:  # SGLang merged file: ranks from the pid labels
        ranks = {k: per[k] for k in labelled}
        meta["rank_source"] = "pid label (merged file)"
    else:
        rank = dist.get("rank")
        meta["rank_source"] = "distributedInfo.rank"
        from_name = rank_from_filename(path)
        if not (type(rank) is int and 0 <= rank < 2**31):
            rank = from_name
            meta["rank_source"] = "file name"
        elif meta["world_size"] is not None and rank >= meta["world_size"]:
            # distributedInfo holds the global rank and world size together, so they must agree
            # even with DP/PP; a rank past the world is a broken or hand-edited trace.
            raise UserError(f"{path}: distributedInfo.rank = {rank} is not below its world_size = "
                            f"{meta['world_size']}; not one rank of that run")
        elif from_name is not None and from_name != rank:
            # With DP/PP the global rank in distributedInfo is not the TP rank in SGLang's name.
            meta["rank_conflict"] = (f"{path.name}: distributedInfo.rank = {rank} but the file name says "
                                     f"{from_name}; used {rank}")
        if rank is None:
            rank = 0
            meta["rank_source"] = "default (no rank in the trace or its name)"
        ranks = {rank: per[-1]}

    out = []
    for rank, acc in sorted(ranks.items()):
        m = dict(meta)
        if acc.skipped:
            m["skipped_gpu_events"] = acc.skipped
        out.append(_build(rank, path, acc, _find_steps(acc.step_candidates, acc.graph_launches), m))
    return out


def _cpu_ranks(path: Path, step_res: list[re.Pattern]) -> dict[int, _PerRank]:
    """Per pid label, the events of a CPU-only trace (:mod:`fastverify.trace.cpu`) in the shape
    :func:`_build` takes; labels without a CPU collective are left out (none: not a CPU TP trace)."""
    from fastverify.trace.cpu import read_host_events, split_rank_events

    by_label: dict[int, list[dict]] = {}
    try:
        host = read_host_events(path, _read_bytes(path))
    except _TooDeep:
        raise _TooDeep(path) from None
    for ev in host:
        by_label.setdefault(ev["label"], []).append(ev)
    per: dict[int, _PerRank] = {}
    for label, evs in by_label.items():
        got = split_rank_events(evs, step_res)
        if not got["events"]:
            continue
        acc = per[label] = _PerRank()
        acc.gpu = [{**e, "ph": "X"} for e in got["events"]]
        acc.classes = got["classes"]
        acc.step_candidates = got["steps"]
    return per


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


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
        return _str_or_none(props[0].get("name"))
    return None


def _find_steps(candidates: list[dict], graph_launches: list[dict]) -> list[Step]:
    """Host-side step windows (ns), sorted and non-overlapping.

    The first pattern of :data:`STEP_PATTERNS` with a match wins; otherwise each CUDA/HIP graph
    launch is one step (decode/verify replays); otherwise there are none (the whole trace).
    """
    for regex, _source in STEP_PATTERNS:
        r = re.compile(regex)
        found = [e for e in candidates if r.match(e["name"])]
        if found:
            return _non_overlapping([Step(e["name"], e["ts_ns"], e["ts_ns"] + e["dur_ns"]) for e in found])
    if graph_launches:
        launches = sorted(graph_launches, key=lambda e: e["ts_ns"])
        return _non_overlapping([Step(f"graph_launch#{i}", e["ts_ns"], e["ts_ns"] + max(e["dur_ns"] or 0, 1))
                                 for i, e in enumerate(launches)])
    return []


def _non_overlapping(windows: list[Step]) -> list[Step]:
    """Keep windows in start order, dropping any that starts inside the previous kept one
    (nested annotations of one step)."""
    out: list[Step] = []
    for w in sorted(windows, key=lambda w: w.start_ns):
        if not out or w.start_ns >= out[-1].end_ns:
            out.append(w)
    return out


def _build(rank: int, path: Path, acc: _PerRank, steps: list[Step], meta: dict) -> RankEvents:
    evs = acc.gpu
    n = len(evs)
    names: list[str] = []
    name_index: dict[str, int] = {}
    name_id = np.empty(n, dtype=np.int32)
    cls = np.empty(n, dtype=np.int8)
    msg = np.full(n, -1, dtype=np.int64)
    stream = np.empty(n, dtype=np.int64)
    launch_ns = np.empty(n, dtype=np.int64)
    unresolved: dict[str, int] = {}
    comm_codes = {EventClass.ALLREDUCE.code, EventClass.FUSED_ALLREDUCE.code, EventClass.OTHER_COMM.code,
                  EventClass.UNKNOWN_COMM.code, EventClass.EP_ALLTOALL.code}
    for i, ev in enumerate(evs):
        name = ev["name"]
        if not isinstance(name, str):
            name = str(name)
        j = name_index.get(name)
        if j is None:
            j = name_index[name] = len(names)
            names.append(name)
        name_id[i] = j
        args = ev["args"]
        got = classify_name(name) if acc.classes is None else None
        c = got.cls if got is not None else acc.classes[i]
        ext = args.get("External id")
        op = acc.ops_by_ext.get(ext) if type(ext) is int else None
        if acc.classes is not None:
            pass
        elif c is EventClass.OTHER_COMM and got.family != "nccl":  # SendRecv: all-to-all or p2p, by its op
            c = refine_from_op(c, got.family, args.get("Collective name") or
                               (op["args"].get("Collective name") or op["name"] if op else None))
        elif c is None:
            collective = args.get("Collective name") or (op["args"].get("Collective name") or op["name"] if op else None)
            c = resolve_from_op(collective)
            if c is EventClass.UNKNOWN_COMM:
                unresolved[name] = unresolved.get(name, 0) + 1
        elif ev["cat"] in ("gpu_memcpy", "gpu_memset", "Memcpy", "Memset"):
            c = EventClass.MEMORY
        cls[i] = c.code
        if c.code in comm_codes:
            try:
                b = _msg_bytes(args)
                if b < 0 and op is not None:
                    b = _msg_bytes(op["args"])
            except _Implausible as e:
                raise UserError(f"{path}: kernel {name[:60]!r}: {e}; no GPU holds such a message "
                                "(bound 1 TiB), the trace is corrupt or hand-edited") from None
            msg[i] = b if 0 <= b < 2**62 else -1
        s = args.get("stream") if acc.classes is None else ev["tid"]  # CPU trace: the thread
        stream[i] = s if type(s) is int and abs(s) < 2**62 else -1
        corr = args.get("correlation")
        # Host launch time: the runtime call with the kernel's correlation id (under CUDA-graph
        # replay, the graph launch); the kernel's own start when there is none.
        launch_ns[i] = acc.runtime_ns.get(corr, ev["ts_ns"]) if type(corr) is int else ev["ts_ns"]

    start_ns = np.fromiter((ev["ts_ns"] for ev in evs), dtype=np.int64, count=n)
    dur_ns = np.fromiter((ev["dur_ns"] for ev in evs), dtype=np.int64, count=n)
    negative = int((dur_ns < 0).sum())
    if negative:
        meta["negative_duration_events"] = negative
    if n and int(dur_ns.max()) > MAX_EVENT_NS:
        k = int(dur_ns.argmax())
        raise UserError(f"{path}: GPU event {str(evs[k]['name'])[:60]!r} lasts {int(dur_ns[k]) / 1000:.6g} µs, "
                        "over 1 hour (3.6e9 µs); no kernel of a serving trace runs that long, the trace is corrupt")
    implausible = int((dur_ns > _IMPLAUSIBLE_NS).sum())
    if implausible:
        meta["implausible_duration_events"] = implausible
    order = np.argsort(start_ns, kind="stable")
    step_idx = assign_steps(launch_ns, steps)
    meta["step_source"] = ("annotation" if steps and not steps[0].name.startswith("graph_launch#")
                           else "graph_launch" if steps else "none (whole trace is one window)")
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
        steps=steps,
        meta=meta,
    )


def _is_fastverify_profile(path: Path) -> bool:
    """A profile written by fastverify (its first key is ``"schema": "fastverify.profile"``, or
    ``"fastverify.verify_log"`` for ``profile --verify-log``), which a user may well have written
    into the trace folder: not a trace, so a folder scan skips it."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return b'"fastverify.profile"' in head or b'"fastverify.verify_log"' in head


def load_traces(paths: list[str | Path], *, force: bool = False) -> list[RankEvents]:
    """Load every trace under ``paths`` (files, or folders searched for ``*.json``/``*.json.gz``).

    Returns one :class:`RankEvents` per rank, sorted by rank. Traces that cannot come from one run
    (see :func:`merge_conflict`) are refused; with ``force`` they are merged and the first rank's
    ``meta["merge_conflict"]`` says why they should not have been.

    Raises
    ------
    UserError
        A path that does not exist, a folder without traces, a bad file (see :func:`load_trace`),
        two files claiming the same rank, or (without ``force``) traces of different runs.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and (f.name.endswith(".json") or f.name.endswith(".json.gz"))
                           and not _is_fastverify_profile(f))
            if not found:
                raise UserError(f"{p}: folder holds no .json or .json.gz trace files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or folder")
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]  # a file given twice counts once
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
    kinds = {r.meta["timing"]: r.origin for r in result.values()}
    if len(kinds) > 1:  # GPU kernel times and host wall clock must never be added up together
        raise UserError(f"{kinds.get('cpu_trace')}: a CPU-only trace (host clock), but {kinds.get('trace')} "
                        "has GPU events; profile the traces of one run at a time")
    ordered = [result[k] for k in sorted(result)]
    conflict = merge_conflict(ordered)
    if conflict and not force:
        raise UserError(f"{conflict}; these traces are not one run (pass --force to merge them anyway)")
    if conflict:
        ordered[0].meta["merge_conflict"] = f"merged with --force although {conflict}"
    return ordered


# Facts every rank of one run shares (distributedInfo and deviceProperties), with their wording.
_RUN_FACTS = (("world_size", "distributedInfo.world_size"), ("gpu_name", "GPU model (deviceProperties)"),
              ("nccl_version", "distributedInfo.nccl_version"), ("dist_backend", "distributedInfo.backend"))


def merge_conflict(ranks: list[RankEvents]) -> str | None:
    """Why ``ranks`` cannot be the ranks of one run, naming both files; None when they can.

    Every rank of one torch.distributed run records the same ``world_size``, NCCL version and
    backend in its ``distributedInfo`` (torch ``profiler/_utils``/Kineto write them per process from
    the one default group), and a TP group runs on one GPU model; a rank absent from a trace
    says nothing. A rank at or past another file's ``world_size`` cannot be in that run either.
    """
    for key, what in _RUN_FACTS:
        seen: dict = {}
        for r in ranks:
            v = r.meta.get(key)
            if v is None:
                continue
            if seen and v not in seen:
                other_v, other = next(iter(seen.items()))
                return f"{what} differs: {other_v!r} in {other}, {v!r} in {r.origin}"
            seen.setdefault(v, r.origin)
    worlds = [(r.meta["world_size"], r.origin) for r in ranks if r.meta.get("world_size")]
    for r in ranks:
        for world, origin in worlds:
            if r.rank >= world:
                return (f"rank {r.rank} of {r.origin} is not below world_size {world} of {origin}")
    return None
