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
from typing import Any

import msgspec
import numpy as np

from fastverify.bounds import MAX_EVENT_NS, MAX_MSG_BYTES
from fastverify.errors import UserError, path_text
from fastverify.events import EventClass, RankEvents, Step, assign_steps
from fastverify.inputs import inflate_trace, loads_json, read_bytes
from fastverify.trace.classify import classify_name, refine_from_op, resolve_from_op

GPU_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "gpu_memset", "Memcpy", "Memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})
GRAPH_LAUNCH = re.compile(r"^(cuda|hip)GraphLaunch")
# Runtime/driver calls that block the host until the GPU (a stream, the device, an event) is done:
# after one returns, the GPU idles until the host launches more work.
HOST_SYNC = re.compile(r"^(?:(?:cuda|hip)(?:Stream|Device|Event)Synchronize|(?:cuda|hip)Memcpy|"
                       r"cu(?:Stream|Ctx|Event)Synchronize)$")
# Coarse speculative stages around the draft model's forwards: SGLang 0.5.23
# speculative/spec_utils.py::spec_stage_span ("draft", "draft_extend"; "verify" in its docstring).
STAGE_SPAN = re.compile(r"^(?:draft|draft_extend|verify)$")

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


class _Args(msgspec.Struct, gc=False):
    """The keys of an event's ``args`` the analyzer reads, decoded in the one pass over the file;
    every other key is skipped unparsed. ``Input Dims``/``Input type`` (nested and on every
    ``cpu_op``) stay raw JSON text until a collective needs them (:meth:`get`)."""

    stream: Any = None
    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    in_msg_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    dtype: Any = None
    input_dims: msgspec.Raw | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="Input Dims")
    input_type: msgspec.Raw | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="Input type")

    def get(self, key: str, default=None):
        """``args[key]`` as a plain ``args`` dict would give it (``Input Dims``/``Input type``
        decoded here), ``default`` for a key not read or not in the event; so that
        :func:`_msg_bytes` and the collective name lookup read either."""
        field = _ARGS_FIELD.get(key)
        if field is None:
            return default
        v = getattr(self, field)
        if v is msgspec.UNSET or v is None:
            return default
        return _raw(v) if type(v) is msgspec.Raw else v


_ARGS_FIELD = {f.encode_name: f.name for f in msgspec.structs.fields(_Args)}


class _Event(msgspec.Struct, gc=False):
    """The keys of a trace event the analyzer reads; every other key is skipped unparsed, and
    ``ts``/``dur``/``pid`` stay raw JSON text (``ts``/``dur`` convert to integer ns exactly, see
    :func:`_ns_from_text`). An ``args`` that is not an object makes the typed decode fail and the
    file take the slow path (:func:`read_trace_json`), which reads such args as empty."""

    ph: str = ""
    cat: str = ""
    name: Any = None
    ts: msgspec.Raw = _NULL
    dur: msgspec.Raw = _NULL
    pid: msgspec.Raw = _NULL
    args: _Args | None = None


class _Trace(msgspec.Struct, gc=False):
    traceEvents: list[_Event]
    # UNSET, not null, when absent: the halves reader must tell a key given as null from no key
    distributedInfo: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    deviceProperties: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


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


def read_trace(path: Path, *, halves: bool = False) -> tuple[dict, dict[int, _PerRank]]:
    """Read one trace file (``.json`` or gzip, detected by magic bytes) into per-rank columns.

    Returns the top-level ``distributedInfo``/``deviceProperties``, and per pid label (a TP rank
    of a SGLang merged file; -1 for every event of a plain file) what one pass collects: the GPU
    events as :class:`~fastverify.trace.columns.GpuColumns`, host launch times by correlation
    id, graph launches, comm ops by External id and step candidates. Well-formed traces take the
    columnar reader (:mod:`fastverify.trace.columns`); anything its typed decode rejects goes
    through :func:`read_trace_json`, which either parses it or names the problem. With ``halves``,
    a file of at least :data:`~fastverify.trace.halves.SPLIT_MIN_BYTES` of JSON on a box with two
    or more cores is read in two halves at once (:mod:`fastverify.trace.halves`; same result).

    Raises
    ------
    UserError
        As :func:`read_trace_json`.
    """
    _HELD.clear()  # the file read before this one: freed now, before this one is decoded
    raw = _read_bytes(path)
    split = None
    if halves and _halves_pay(raw):
        from fastverify.trace.halves import read_in_halves

        try:
            split = read_in_halves(raw, _HOST_KEEP, _looks_comm_op)
        except _TooDeep:
            raise _TooDeep(path) from None
    if split is not None:
        top, got = split
    else:
        try:
            doc = _TRACE_DECODER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            # RecursionError: msgspec bounds nesting; the slow path names the file in one line
            return _slow_ranks(read_trace_json(path, raw))
        if not doc.traceEvents:
            raise UserError(f"{path}: the trace has no events")
        from fastverify.trace.columns import NotPlain, read_columns

        try:
            got = read_columns(doc, _HOST_KEEP, _looks_comm_op)
        except _TooDeep:
            raise _TooDeep(path) from None
        except NotPlain:
            return _slow_ranks(read_trace_json(path, raw))
        top = {"distributedInfo": _top(doc.distributedInfo), "deviceProperties": _top(doc.deviceProperties)}
        done_with(doc)
        del doc
    per: dict[int, _PerRank] = {}
    for label, s in got.items():
        acc = per[label] = _PerRank()
        if s["gpu"] is not None:
            acc.gpu = s["gpu"]
        acc.skipped = s["skipped"]
        acc.runtime_ns = s["runtime_ns"]
        acc.graph_launches = s["graph_launches"]
        acc.host_syncs = s["host_syncs"]
        _host_ops(acc, s["host"])
    return top, per


_STEP_RES = [re.compile(p) for p, _ in STEP_PATTERNS]


HOLD_DECODED = False
"""When True, the decoded events of the file read last are kept (until the next file is read)
instead of freed object by object: ``fastverify profile --trace`` sets it, since it ends soon
after loading with ``os._exit`` (:func:`fastverify.cli.run`), where the memory goes at once.
Freeing the ~200k event structs of a 50 MB trace costs about 20 ms."""

_HELD: list = []


def done_with(doc) -> None:
    """Free ``doc`` (a typed decode), or keep it while :data:`HOLD_DECODED` (see there)."""
    if HOLD_DECODED:
        _HELD.append(doc)


def _halves_pay(raw: bytes) -> bool:
    """Whether reading ``raw`` in two processes can be faster: enough JSON, two cores, ``fork``."""
    import sys

    from fastverify.painter import usable_cores
    from fastverify.trace.halves import SPLIT_MIN_BYTES

    return len(raw) >= SPLIT_MIN_BYTES and usable_cores() >= 2 and sys.platform.startswith("linux")


def _host_ops(acc: _PerRank, host: list[dict]) -> None:
    """Comm ops by External id, step candidates and speculative stage spans from host op dicts
    (``name``, ``args`` with ``.get``, ns); each distinct name is judged once."""
    judged: dict[str, tuple[bool, bool, bool]] = {}
    for ev in host:
        name, args = ev["name"], ev["args"]
        if not isinstance(name, str):
            continue
        j = judged.get(name)
        if j is None:
            j = judged[name] = (_looks_comm_op(name), any(r.match(name) for r in _STEP_RES),
                                bool(STAGE_SPAN.match(name)))
        comm, step, stage = j
        if comm:
            ext = args.get("External id")
            if type(ext) is int:
                acc.ops_by_ext[ext] = {"name": name, "args": args}
        if (step or stage) and ev["ts_ns"] is not None and ev["dur_ns"] is not None:
            (acc.step_candidates if step else acc.stage_candidates).append(ev)


def _slow_ranks(doc: dict) -> tuple[dict, dict[int, _PerRank]]:
    """The slow path (plain Python objects from :func:`read_trace_json`) in :func:`read_trace`'s shape."""
    from fastverify.trace.columns import GpuColumns

    top = {k: doc.get(k) for k in ("distributedInfo", "deviceProperties")}
    top["_any_event_object"] = any(isinstance(ev, dict) for ev in doc["traceEvents"])
    per: dict[int, _PerRank] = {}
    gpu: dict[int, list[dict]] = {}
    # As the columnar reader: runtime and host ops are labelled by pid only in a merged file (its
    # GPU events carry [TP..] labels, or it has none); in a plain file they all belong to its rank.
    gpu_events = [ev for ev in doc["traceEvents"] if isinstance(ev, dict) and type(ev.get("cat")) is str
                  and ev["cat"] in GPU_CATS]
    merged = not gpu_events or any(_rank_label(ev.get("pid")) >= 0 for ev in gpu_events)
    for ev in doc["traceEvents"]:
        if not isinstance(ev, dict):
            continue
        cat = ev.get("cat")
        if type(cat) is not str or not (cat in GPU_CATS or cat in RUNTIME_CATS or cat in HOST_CATS):
            continue
        args = ev.get("args")
        args = args if isinstance(args, dict) else {}
        label = _rank_label(ev.get("pid")) if merged or cat in GPU_CATS else -1
        acc = per.get(label)
        if acc is None:
            acc = per[label] = _PerRank()
        name = ev.get("name")
        ts, dur = _ns_from_value(ev.get("ts")), _ns_from_value(ev.get("dur"))
        if cat in GPU_CATS:
            if ev.get("ph", "X") == "X" and ts is not None and dur is not None:
                gpu.setdefault(label, []).append({"name": name, "cat": cat, "ts_ns": ts, "dur_ns": dur, "args": args})
            else:
                acc.skipped += 1
        elif cat in RUNTIME_CATS:
            if ts is None:
                continue
            corr = args.get("correlation")
            if type(corr) is int:
                acc.runtime_ns[corr] = ts
            if isinstance(name, str) and GRAPH_LAUNCH.match(name):
                acc.graph_launches.append({"ts_ns": ts, "dur_ns": dur, "correlation": corr})
            elif isinstance(name, str) and HOST_SYNC.match(name) and dur is not None:
                acc.host_syncs.append({"name": name, "ts_ns": ts, "dur_ns": dur})
        else:
            _host_ops(acc, [{"name": name, "args": args, "ts_ns": ts, "dur_ns": dur}])
    for label, evs in gpu.items():
        per[label].gpu = GpuColumns.from_dicts(evs)
    return top, per


def _top(value):
    """A top-level key's raw value decoded; None when the key is absent."""
    return None if value is msgspec.UNSET else _raw(value)


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


def load_trace(path: str | Path, *, halves: bool = False) -> list[RankEvents]:
    """Load one trace file into one :class:`RankEvents` per rank it holds (one, or several for a
    SGLang merged file).

    The rank comes from ``distributedInfo.rank``, else the file name, else the ``pid`` labels of a
    merged file; a single unnamed rank defaults to 0 and says so in ``meta["rank_source"]``.
    ``python_function`` events are skipped. GPU events are kernels, memcpys and memsets;
    ``gpu_user_annotation`` spans are not GPU work. ``halves``: a large file may be read on two
    cores at once (:func:`read_trace`); the result is the same.

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
        return _load_trace(path, halves)
    finally:
        if gc_was_enabled:
            gc.enable()


class _PerRank:
    """What one pass collects for one rank of a file (a merged file has several)."""

    def __init__(self) -> None:
        from fastverify.trace.columns import GpuColumns

        self.gpu: GpuColumns = GpuColumns.from_dicts([])
        self.runtime_ns: dict[int, int] = {}  # correlation -> host launch time (ns)
        self.graph_launches: list[dict] = []  # {"ts_ns", "dur_ns", "correlation"}
        self.host_syncs: list[dict] = []  # blocking runtime calls (HOST_SYNC): {"name", "ts_ns", "dur_ns"}
        self.stage_candidates: list[dict] = []  # STAGE_SPAN host spans
        self.ops_by_ext: dict[int, dict] = {}  # External id -> comm cpu_op (name, args)
        self.step_candidates: list[dict] = []
        self.skipped = 0  # GPU events without a usable ts/dur
        self.classes: list[EventClass] | None = None  # a CPU-only trace: each event's class, decided already


def _load_trace(path: Path, halves: bool = False) -> list[RankEvents]:
    doc, per = read_trace(path, halves=halves)
    step_res = _STEP_RES

    timing = "trace"
    if not any(len(acc.gpu) for acc in per.values()):
        skipped = sum(acc.skipped for acc in per.values())
        if skipped:
            raise UserError(f"{path}: {skipped} GPU events, none with a usable ts/dur "
                            "(finite numbers of µs within ±2**62 ns)")
        if not per and not doc.get("_any_event_object", True):
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
        "file": path_text(path),
        "world_size": world if type(world) is int and 1 <= world < 2**31 else None,
        "nccl_version": _str_or_none(dist.get("nccl_version")),
        "dist_backend": _str_or_none(dist.get("backend")),
        "gpu_name": _gpu_name(doc),
        "timing": timing,
    }
    if timing != "trace":
        meta["cpu_only"] = ("no GPU events: CPU ops and CPU collectives (gloo) on the host wall clock, "
                            "not GPU timings")

    labelled = sorted(k for k in per if k >= 0 and len(per[k].gpu))
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
        ranks = {rank: per.get(-1) or _PerRank()}

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
    from fastverify.trace.columns import GpuColumns
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
        acc.gpu = GpuColumns.from_dicts(got["events"])
        acc.classes = got["classes"]
        acc.step_candidates = got["steps"]
        acc.stage_candidates = [e for e in evs if STAGE_SPAN.match(e["name"])]  # draft / draft_extend
    return per


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


_COMM_OP = re.compile(r"(?i)all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|^nccl:|"
                      r"record_param_comms|c10d::|symm_mem::|custom_ar|_C_custom_ar|sgl_kernel::.*reduce")


# The host ops the loader reads, in one search per distinct name: comm ops (_COMM_OP, which sets
# the case-blind flag for the whole pattern) or step spans (STEP_PATTERNS, case kept as _STEP_RES
# matches them; each starts with ^, so search is match).
_HOST_KEEP = re.compile("|".join([_COMM_OP.pattern, *(f"(?-i:{p})" for p, _ in STEP_PATTERNS),
                                  f"(?-i:{STAGE_SPAN.pattern})"]))


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


_MEMORY_CATS = frozenset({"gpu_memcpy", "gpu_memset", "Memcpy", "Memset"})
_COMM_CODES = frozenset({EventClass.ALLREDUCE.code, EventClass.FUSED_ALLREDUCE.code, EventClass.OTHER_COMM.code,
                         EventClass.UNKNOWN_COMM.code, EventClass.EP_ALLTOALL.code})


def reads_args(name) -> bool:
    """Whether :func:`_build` may read more of a GPU event's ``args`` than its stream,
    correlation and External id: only for events whose name leaves the class open or makes them a
    collective (message size, collective name). A reader that sends columns between processes
    drops the other events' ``args`` (:mod:`fastverify.trace.halves`)."""
    c = classify_name(name if isinstance(name, str) else str(name))
    return c.cls is None or c.cls.code in _COMM_CODES


def _int_column(values: list) -> np.ndarray:
    """int64 array of ``values``: each an int within ±2**62 as it is, anything else -1."""
    if set(map(type, values)) <= {int}:
        try:
            a = np.array(values, dtype=np.int64)
        except OverflowError:
            a = None
        if a is not None and (not len(a) or (int(a.min()) > -2**62 and int(a.max()) < 2**62)):
            return a
    return np.fromiter((s if type(s) is int and abs(s) < 2**62 else -1 for s in values), dtype=np.int64,
                       count=len(values))


def _build(rank: int, path: Path, acc: _PerRank, steps: list[Step], meta: dict) -> RankEvents:
    """One rank's columns to :class:`RankEvents`: classes by distinct name (the launching op only
    where the name does not decide), message sizes of collectives, streams and launch times."""
    g = acc.gpu
    n = len(g)
    texts = g.name if all(type(x) is str for x in g.name) else [x if isinstance(x, str) else str(x) for x in g.name]
    name_index = {name: j for j, name in enumerate(dict.fromkeys(texts))}  # first-seen order
    names: list[str] = list(name_index)
    ids = [name_index[x] for x in texts]
    name_id = np.array(ids, dtype=np.int32) if n else np.empty(0, dtype=np.int32)
    unresolved: dict[str, int] = {}
    if acc.classes is not None:  # a CPU-only trace: classes decided by its reader
        cls = np.fromiter((c.code for c in acc.classes), dtype=np.int8, count=n)
    else:
        got = [classify_name(nm) for nm in names]
        base = np.array([-1 if c.cls is None else c.cls.code for c in got], dtype=np.int8)
        cls = base[name_id] if n else np.empty(0, dtype=np.int8)
        # the launching op decides: SendRecv (all-to-all or p2p), and kernels whose name says nothing
        needs_op = {j for j, c in enumerate(got)
                    if c.cls is None or (c.cls is EventClass.OTHER_COMM and c.family != "nccl")}
        memory = [i for i, cat in enumerate(g.cat) if cat in _MEMORY_CATS]
        if memory:
            m = np.array(memory, dtype=np.intp)
            m = m[~np.isin(name_id[m], np.array(sorted(needs_op), dtype=np.int32))] if needs_op else m
            cls[m] = EventClass.MEMORY.code
        if needs_op:
            for i in np.flatnonzero(np.isin(name_id, np.array(sorted(needs_op), dtype=np.int32))).tolist():
                c = got[ids[i]]
                args = g.args_dict(i)
                ext = g.external_id[i]
                op = acc.ops_by_ext.get(ext) if type(ext) is int else None
                collective = args.get("Collective name") or (op["args"].get("Collective name") or op["name"]
                                                             if op else None)
                if c.cls is None:
                    k = resolve_from_op(collective)
                    if k is EventClass.UNKNOWN_COMM:
                        unresolved[names[ids[i]]] = unresolved.get(names[ids[i]], 0) + 1
                else:
                    k = refine_from_op(c.cls, c.family, collective)
                cls[i] = k.code
    msg = np.full(n, -1, dtype=np.int64)
    for i in np.flatnonzero(np.isin(cls, np.array(sorted(_COMM_CODES), dtype=np.int8))).tolist():
        args = g.args_dict(i)
        ext = g.external_id[i]
        op = acc.ops_by_ext.get(ext) if type(ext) is int else None
        try:
            b = _msg_bytes(args)
            if b < 0 and op is not None:
                b = _msg_bytes(op["args"])
        except _Implausible as e:
            raise UserError(f"{path}: kernel {names[ids[i]][:60]!r}: {e}; no GPU holds such a message "
                            "(bound 1 TiB), the trace is corrupt or hand-edited") from None
        msg[i] = b if 0 <= b < 2**62 else -1
    streams = g.stream if acc.classes is None else g.tid  # CPU trace: the thread
    stream = _int_column(streams)
    # Host launch time: the runtime call with the kernel's correlation id (under CUDA-graph
    # replay, the graph launch); the kernel's own start when there is none.
    start_ns = g.ts_ns
    dur_ns = g.dur_ns
    rt = acc.runtime_ns
    if rt and set(map(type, g.correlation)) <= {int, type(None)}:  # the keys are ints: one C-level lookup each
        launch_ns = np.fromiter(map(rt.get, g.correlation, start_ns.tolist()), dtype=np.int64, count=n)
    elif rt:
        launch_ns = np.fromiter((rt.get(c, t) if type(c) is int else t for c, t in zip(g.correlation, start_ns.tolist())),
                                dtype=np.int64, count=n)
    else:
        launch_ns = start_ns.copy()
    negative = int((dur_ns < 0).sum())
    if negative:
        meta["negative_duration_events"] = negative
    if n and int(dur_ns.max()) > MAX_EVENT_NS:
        k = int(dur_ns.argmax())
        raise UserError(f"{path}: GPU event {str(g.name[k])[:60]!r} lasts {int(dur_ns[k]) / 1000:.6g} µs, "
                        "over 1 hour (3.6e9 µs); no kernel of a serving trace runs that long, the trace is corrupt")
    implausible = int((dur_ns > _IMPLAUSIBLE_NS).sum())
    if implausible:
        meta["implausible_duration_events"] = implausible
    order = np.argsort(start_ns, kind="stable")
    step_idx = assign_steps(launch_ns, steps)
    graph_corr = {e.get("correlation") for e in acc.graph_launches} - {None}
    in_graph = (np.fromiter((c in graph_corr for c in g.correlation), dtype=bool, count=n) if graph_corr
                else np.zeros(n, dtype=bool))
    meta["step_source"] = ("annotation" if steps and not steps[0].name.startswith("graph_launch#")
                           else "graph_launch" if steps else "none (whole trace is one window)")
    if unresolved:
        meta["unresolved_comm_kernels"] = unresolved
    return RankEvents(
        rank=rank,
        origin=path_text(path),
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
        launch_ns=launch_ns[order],
        in_graph=in_graph[order],
        spans=_windows(acc.stage_candidates),
        host_syncs=_windows(acc.host_syncs),
    )


def _windows(evs: list[dict]) -> list[Step]:
    """Host spans (``name``, ``ts_ns``, ``dur_ns``) as :class:`Step` windows sorted by start."""
    return sorted((Step(e["name"], e["ts_ns"], e["ts_ns"] + e["dur_ns"]) for e in evs
                   if e["ts_ns"] is not None and e["dur_ns"] is not None), key=lambda w: w.start_ns)


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


MAX_TRACE_FILES = 1024
"""Most trace files one ``--trace`` run reads: one per rank of one run (SGLang writes one per TP
rank, and tune bounds TP at 64; a DP x TP x PP x EP run of 1,024 GPUs is far past any PCIe box).
A folder with more is the wrong folder (a whole /tmp), refused before any is read."""


def load_traces(paths: list[str | Path], *, force: bool = False, workers: int | None = None,
                progress: bool = False, halves: bool = True) -> list[RankEvents]:
    """Load every trace under ``paths`` (files, or folders searched for ``*.json``/``*.json.gz``).

    Returns one :class:`RankEvents` per rank, sorted by rank. Traces that cannot come from one run
    (see :func:`merge_conflict`) are refused; with ``force`` they are merged and the first rank's
    ``meta["merge_conflict"]`` says why they should not have been.

    Several files are decoded in worker processes (``workers``; default :func:`load_workers`),
    each holding one file at a time; a large file read here is read in two halves at once
    (:func:`read_trace`) unless ``halves`` is False or ``workers`` is 1; ``progress`` prints a
    line per file on stderr once loading has taken over 2 s (:mod:`fastverify.progress`).

    Raises
    ------
    UserError
        A path that does not exist, a folder without traces, more than :data:`MAX_TRACE_FILES`
        files, a bad file (see :func:`load_trace`), two files claiming the same rank, or (without
        ``force``) traces of different runs.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            named = sorted(f for f in p.iterdir() if f.name.endswith(".json") or f.name.endswith(".json.gz"))
            odd = [f for f in named if not f.is_file() and not f.is_dir()]
            if odd:  # a FIFO or device named like a trace: refused as it is when given directly
                raise UserError(f"{odd[0]}: not a regular file (a trace folder's *.json / *.json.gz must be files)")
            found = [f for f in named if f.is_file() and not _is_fastverify_profile(f)]
            if not found:
                raise UserError(f"{p}: folder holds no .json or .json.gz trace files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or folder")
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]  # a file given twice counts once
    if len(files) > MAX_TRACE_FILES:
        raise UserError(f"{len(files):,} trace files under {', '.join(path_text(p) for p in paths)[:200]}: more than "
                        f"{MAX_TRACE_FILES:,}, the ranks one run can have; give the folder of one profile")
    result: dict[int, RankEvents] = {}
    for f, loaded in zip(files, _load_files(files, workers=workers, progress=progress, halves=halves)):
        for r in loaded:
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


PEAK_BYTES_PER_JSON_BYTE = 4
"""A worker's peak memory per byte of inflated trace JSON, rounded up: 207 MB peak RSS (interpreter
and imports included) for the 53.7 MB HTA ``df_index_resolver`` trace, measured with
``/usr/bin/time`` on the benchmark machine (``benchmarks/bench_trace.py``)."""


PARALLEL_MIN_BYTES = 16 << 20
"""Below this much JSON in all, files are read one after the other: starting worker processes
costs more (30-100 ms measured on 2 cores) than reading two 3 MB traces takes."""


def json_size(path: Path) -> int:
    """Bytes of JSON a trace file holds: its size, or for gzip the trailer's ISIZE (the inflated
    size modulo 2**32; RFC 1952), whichever is larger (0 when unreadable)."""
    import stat

    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never opened here (the reader refuses it)
            return 0
        size = st.st_size
        with open(path, "rb") as f:
            if f.read(2) != b"\x1f\x8b" or size < 18:
                return size
            f.seek(-4, 2)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:
        return 0


def load_workers(files: list[Path]) -> int:
    """How many files to decode at once: 1 below :data:`PARALLEL_MIN_BYTES` of JSON in all, else
    one per usable core, no more than the files, and no more
    than fit in half of the memory available now at :data:`PEAK_BYTES_PER_JSON_BYTE` times the
    largest file's JSON (so peak memory stays under about ``workers x 4 x`` that size)."""
    import os

    if len(files) < 2:
        return 1
    sizes = [json_size(f) for f in files]
    if sum(sizes) < PARALLEL_MIN_BYTES:
        return 1
    from fastverify.painter import usable_cores

    cores = usable_cores()
    need = PEAK_BYTES_PER_JSON_BYTE * max(sizes)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 0
    by_memory = max(1, int(avail // 2 // need)) if need and avail else cores
    return max(1, min(cores, len(files), by_memory))


def _load_one(path: Path) -> tuple[str, object]:
    """:func:`load_trace` in a worker: ("ok", ranks) or ("error", the one-line message)."""
    try:
        return "ok", load_trace(path)
    except UserError as e:
        return "error", str(e)


def _load_files(files: list[Path], *, workers: int | None, progress: bool,
                halves: bool = True) -> list[list[RankEvents]]:
    """:func:`load_trace` of every file, in file order; in parallel where ``workers`` > 1."""
    from fastverify.progress import Progress

    bar = Progress("loading traces", len(files), enabled=progress)
    w = load_workers(files) if workers is None else max(1, min(workers, len(files)))
    if w == 1:
        out = []
        for i, f in enumerate(files):
            out.append(load_trace(f, halves=halves and workers != 1))
            bar.update(i + 1, f.name)
        return out
    import multiprocessing
    import sys
    from concurrent.futures import ProcessPoolExecutor

    # fork where it is safe (Linux: no threads yet, numpy's BLAS held to one), spawn elsewhere
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    from concurrent.futures import as_completed

    from fastverify.painter import quiet_child_signals, signals_held

    got: list = [None] * len(files)
    pool = ProcessPoolExecutor(max_workers=w, mp_context=ctx, initializer=quiet_child_signals)
    try:
        with signals_held():  # the workers are forked at the first submit
            futures = {pool.submit(_load_one, f): i for i, f in enumerate(files)}
        for done, fut in enumerate(as_completed(futures), 1):
            i = futures[fut]
            got[i] = fut.result()
            bar.update(done, files[i].name)
    except BaseException:
        # Ctrl-C, SIGTERM or a broken worker: stop the workers now instead of letting them finish
        # their files (the parent says the one line)
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():
            if child.name.startswith(("ForkProcess", "SpawnProcess")):
                child.kill()
                child.join()
        raise
    pool.shutdown()
    for f, (status, value) in zip(files, got):
        if status == "error":
            raise UserError(value)
    return [value for _, value in got]
