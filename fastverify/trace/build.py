"""One rank's collected events to :class:`~fastverify.events.RankEvents`.

A reader (:func:`fastverify.trace.load.read_trace`) collects per rank a :class:`_PerRank`: GPU
events as :class:`~fastverify.trace.columns.GpuColumns`, host launch times by correlation id,
graph launches, blocking syncs, comm ops by External id and step / stage spans (all ns). This
module turns that into the sorted per-event arrays of :class:`RankEvents`: an event class per
event (by distinct name; the launching op only where the name does not decide), the message size
of each collective (bytes), its stream, host launch time and step window. It also holds the
slow path's collector (:func:`_slow_ranks`), which fills :class:`_PerRank` from plain dicts.

Also here, CPU-only PyTorch profiler traces: a TP run on CPU over gloo (our CPU SGLang server), where the
trace holds host events only and the all-reduces are CPU events.

What such a trace holds (seen in traces that ``torch.profiler`` with ``ProfilerActivity.CPU``
writes around ``torch.distributed.all_reduce`` on a gloo group, torch 2.13 CPU and 2.14 CUDA
builds; also what ``fastverify.patch.verify.VerifyTrace`` writes on a CPU server):

- ``cpu_op`` events for every aten op, nested (``aten::matmul`` holds ``aten::mm``);
- ``c10d::allreduce_`` (``cpu_op``) on the calling thread: the call that hands the tensor to gloo,
  tens of µs; the caller then waits, untraced, for the collective;
- ``gloo:all_reduce`` (``user_annotation``) on one of gloo's worker threads: the collective
  itself, from start to the end of the exchange, waiting for the peer included — the CPU
  counterpart of an NCCL kernel; ``Input Dims``/``Input type`` give its size when the profiler
  records shapes. Other collectives are ``gloo:<name>`` the same way;
- on other builds ``record_param_comms`` (with a ``Collective name`` arg) around a collective, and
  SGLang's ``sgl_kernel::shm_allreduce`` on CPU (``sglang/srt/distributed/parallel_state.py``,
  ``GroupCoordinator.all_reduce``, when shared memory is available).

The events of a rank are then: the collectives (``gloo:*`` spans; ``record_param_comms`` only where
a rank has no ``gloo:*`` span, since it then is the collective's only trace, else it wraps the
hand-off; ``sgl_kernel::shm_*``), and as compute the outermost other ``cpu_op`` of each thread.
Hand-off ops (``c10d::*``, and any other comm-looking op) are dropped with what they hold, as the
CUDA runtime calls that launch kernels are in a GPU trace. All times are host wall clock: the
profile says ``timing.clock = "cpu_trace"``, never a GPU clock.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import numpy as np

from fastverify.bounds import MAX_EVENT_NS, MAX_MSG_BYTES
from fastverify.errors import UserError, path_text
from fastverify.events import EventClass, RankEvents, Step, assign_steps
from fastverify.trace.classify import classify_name, refine_from_op, resolve_from_op
from fastverify.trace.columns import GpuColumns
from fastverify.trace.decode import (
    _COMM_CODES,
    _NULL,
    GPU_CATS,
    GRAPH_LAUNCH,
    HOST_CATS,
    HOST_SYNC,
    RUNTIME_CATS,
    STAGE_SPAN,
    STEP_PATTERNS,
    STEP_RES,
    _ns_from_value,
    _rank_label,
    _raw,
    looks_comm_op,
    ns_from_text,
    read_trace_json,
)

_DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "c10::float": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "c10::half": 2,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "int": 4,
    "int32": 4,
    "long": 8,
    "int64": 8,
    "int8": 1,
    "signed char": 1,
    "unsigned char": 1,
    "uint8": 1,
    "byte": 1,
    "char": 1,
    "c10::float8_e4m3fn": 1,
    "float8_e4m3fn": 1,
    "c10::float8_e5m2": 1,
    "float8_e5m2": 1,
}

_RANK_FROM_NAME = (
    re.compile(r"-TP-(\d+)"),
    re.compile(r"(?i)(?:^|[^a-z])rank[-_]?(\d+)"),
    re.compile(r"(?i)(?:^|[^a-z])tp[-_]?(\d+)"),
)
_IMPLAUSIBLE_NS = 10 * 10**9  # a GPU kernel or copy of over 10 s in a serving trace is a broken event
_MEMORY_CATS = frozenset({"gpu_memcpy", "gpu_memset", "Memcpy", "Memset"})


class _PerRank:
    """What one pass collects for one rank of a file (a merged file has several)."""

    def __init__(self) -> None:
        self.gpu: GpuColumns = GpuColumns.from_dicts([])
        self.runtime_ns: dict[int, int] = {}  # correlation -> host launch time (ns)
        self.graph_launches: list[dict] = []  # {"ts_ns", "dur_ns", "correlation"}
        self.host_syncs: list[dict] = []  # blocking runtime calls (HOST_SYNC): {"name", "ts_ns", "dur_ns"}
        self.stage_candidates: list[dict] = []  # STAGE_SPAN host spans
        self.ops_by_ext: dict[int, dict] = {}  # External id -> comm cpu_op (name, args)
        self.step_candidates: list[dict] = []
        self.skipped = 0  # GPU events without a usable ts/dur
        self.classes: list[EventClass] | None = None  # a CPU-only trace: each event's class, decided already


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
            j = judged[name] = (looks_comm_op(name), any(r.match(name) for r in STEP_RES), bool(STAGE_SPAN.match(name)))
        comm, step, stage = j
        if comm:
            ext = args.get("External id")
            if type(ext) is int:
                acc.ops_by_ext[ext] = {"name": name, "args": args}
        if (step or stage) and ev["ts_ns"] is not None and ev["dur_ns"] is not None:
            (acc.step_candidates if step else acc.stage_candidates).append(ev)


def _slow_ranks(doc: dict) -> tuple[dict, dict[int, _PerRank]]:
    """The slow path (plain Python objects from :func:`fastverify.trace.decode.read_trace_json`)
    in :func:`fastverify.trace.load.read_trace`'s shape: ``(top, {pid label: _PerRank})``."""
    top = {k: doc.get(k) for k in ("distributedInfo", "deviceProperties")}
    top["_any_event_object"] = any(isinstance(ev, dict) for ev in doc["traceEvents"])
    per: dict[int, _PerRank] = {}
    gpu: dict[int, list[dict]] = {}
    # As the columnar reader: runtime and host ops are labelled by pid only in a merged file (its
    # GPU events carry [TP..] labels, or it has none); in a plain file they all belong to its rank.
    gpu_events = [
        ev for ev in doc["traceEvents"] if isinstance(ev, dict) and type(ev.get("cat")) is str and ev["cat"] in GPU_CATS
    ]
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
                acc.graph_launches.append(
                    {"ts_ns": ts, "dur_ns": dur, "correlation": corr if type(corr) is int else None}
                )
            elif isinstance(name, str) and HOST_SYNC.match(name) and dur is not None:
                acc.host_syncs.append({"name": name, "ts_ns": ts, "dur_ns": dur})
        else:
            _host_ops(acc, [{"name": name, "args": args, "ts_ns": ts, "dur_ns": dur}])
    for label, evs in gpu.items():
        per[label].gpu = GpuColumns.from_dicts(evs)
    return top, per


def rank_from_filename(path: Path) -> int | None:
    """TP rank from a file name: SGLang ``...-TP-3...``, ``rank-3``, ``rank_3``, ``tp3``; else None."""
    for pattern in _RANK_FROM_NAME:
        m = pattern.search(path.name)
        if m:
            return int(m.group(1))
    return None


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


def _gpu_name(doc: dict) -> str | None:
    """The first ``deviceProperties`` entry's ``name`` (the GPU model); None when absent."""
    props = doc.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return _str_or_none(props[0].get("name"))
    return None


def _find_steps(candidates: list[dict], graph_launches: list[dict]) -> list[Step]:
    """Host-side step windows (ns), sorted and non-overlapping.

    The first pattern of :data:`~fastverify.trace.decode.STEP_PATTERNS` with a match wins;
    otherwise each CUDA/HIP graph launch is one step (decode/verify replays); otherwise there are
    none (the whole trace).
    """
    for regex, _source in STEP_PATTERNS:
        r = re.compile(regex)
        found = [e for e in candidates if r.match(e["name"])]
        if found:
            return _non_overlapping([Step(e["name"], e["ts_ns"], e["ts_ns"] + e["dur_ns"]) for e in found])
    if graph_launches:
        launches = sorted(graph_launches, key=lambda e: e["ts_ns"])
        return _non_overlapping(
            [
                Step(f"graph_launch#{i}", e["ts_ns"], e["ts_ns"] + max(e["dur_ns"] or 0, 1))
                for i, e in enumerate(launches)
            ]
        )
    return []


def _non_overlapping(windows: list[Step]) -> list[Step]:
    """Keep windows in start order, dropping any that starts inside the previous kept one
    (nested annotations of one step)."""
    out: list[Step] = []
    for w in sorted(windows, key=lambda w: w.start_ns):
        if not out or w.start_ns >= out[-1].end_ns:
            out.append(w)
    return out


def _windows(evs: list[dict]) -> list[Step]:
    """Host spans (``name``, ``ts_ns``, ``dur_ns``) as :class:`Step` windows sorted by start."""
    return sorted(
        (
            Step(e["name"], e["ts_ns"], e["ts_ns"] + e["dur_ns"])
            for e in evs
            if e["ts_ns"] is not None and e["dur_ns"] is not None
        ),
        key=lambda w: w.start_ns,
    )


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


def int_column(values: list) -> np.ndarray:
    """int64 array of ``values``: each an int within ±2**62 as it is, anything else -1."""
    if set(map(type, values)) <= {int}:
        try:
            a = np.array(values, dtype=np.int64)
        except OverflowError:
            a = None
        if a is not None and (not len(a) or (int(a.min()) > -(2**62) and int(a.max()) < 2**62)):
            return a
    return np.fromiter(
        (s if type(s) is int and abs(s) < 2**62 else -1 for s in values), dtype=np.int64, count=len(values)
    )


def _classes(acc: _PerRank, names: list[str], ids: list[int], name_id: np.ndarray) -> tuple[np.ndarray, dict]:
    """Each GPU event's class code, int8 shape (n,) (-1: none), and the comm kernels no launching
    op resolved (``{name: count}``). Classes go by distinct name; memcpy/memset are MEMORY; the
    launching op (by External id) decides SendRecv and kernels whose name says nothing."""
    g = acc.gpu
    n = len(g)
    unresolved: dict[str, int] = {}
    if acc.classes is not None:  # a CPU-only trace: classes decided by its reader
        return np.fromiter((c.code for c in acc.classes), dtype=np.int8, count=n), unresolved
    got = [classify_name(nm) for nm in names]
    base = np.array([-1 if c.cls is None else c.cls.code for c in got], dtype=np.int8)
    cls = base[name_id] if n else np.empty(0, dtype=np.int8)
    # the launching op decides: SendRecv (all-to-all or p2p), and kernels whose name says nothing
    needs_op = {
        j for j, c in enumerate(got) if c.cls is None or (c.cls is EventClass.OTHER_COMM and c.family != "nccl")
    }
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
            collective = args.get("Collective name") or (
                op["args"].get("Collective name") or op["name"] if op else None
            )
            if c.cls is None:
                k = resolve_from_op(collective)
                if k is EventClass.UNKNOWN_COMM:
                    unresolved[names[ids[i]]] = unresolved.get(names[ids[i]], 0) + 1
            else:
                k = refine_from_op(c.cls, c.family, collective)
            cls[i] = k.code
    return cls, unresolved


def _msg_column(path: Path, acc: _PerRank, cls: np.ndarray, names: list[str], ids: list[int]) -> np.ndarray:
    """Message size of each collective in bytes, int64 shape (n,) (-1: not a collective, or unknown).

    Raises
    ------
    UserError
        A size no GPU can hold (:class:`_Implausible`), naming the file and the kernel.
    """
    g = acc.gpu
    msg = np.full(len(g), -1, dtype=np.int64)
    for i in np.flatnonzero(np.isin(cls, np.array(sorted(_COMM_CODES), dtype=np.int8))).tolist():
        args = g.args_dict(i)
        ext = g.external_id[i]
        op = acc.ops_by_ext.get(ext) if type(ext) is int else None
        try:
            b = _msg_bytes(args)
            if b < 0 and op is not None:
                b = _msg_bytes(op["args"])
        except _Implausible as e:
            raise UserError(
                f"{path}: kernel {names[ids[i]][:60]!r}: {e}; no GPU holds such a message "
                "(bound 1 TiB), the trace is corrupt or hand-edited"
            ) from None
        msg[i] = b if 0 <= b < 2**62 else -1
    return msg


def _launch_ns(acc: _PerRank) -> np.ndarray:
    """Host launch time of each GPU event, int64 ns shape (n,): the runtime call with the kernel's
    correlation id (under CUDA-graph replay, the graph launch); the kernel's own start when there
    is none."""
    g = acc.gpu
    n = len(g)
    start_ns = g.ts_ns
    rt = acc.runtime_ns
    if rt and set(map(type, g.correlation)) <= {int, type(None)}:  # the keys are ints: one C-level lookup each
        return np.fromiter(map(rt.get, g.correlation, start_ns.tolist()), dtype=np.int64, count=n)
    if rt:
        return np.fromiter(
            (rt.get(c, t) if type(c) is int else t for c, t in zip(g.correlation, start_ns.tolist())),
            dtype=np.int64,
            count=n,
        )
    return start_ns.copy()


def _build(rank: int, path: Path, acc: _PerRank, steps: list[Step], meta: dict) -> RankEvents:
    """One rank's columns to :class:`RankEvents`, sorted by start: classes by distinct name (the
    launching op only where the name does not decide), message sizes of collectives (bytes),
    streams and launch times (ns). Adds counts of odd events to ``meta`` (written in place).

    Raises
    ------
    UserError
        An implausible message size (over 1 TiB), or a GPU event lasting over 1 hour.
    """
    g = acc.gpu
    n = len(g)
    texts = g.name if all(type(x) is str for x in g.name) else [x if isinstance(x, str) else str(x) for x in g.name]
    name_index = {name: j for j, name in enumerate(dict.fromkeys(texts))}  # first-seen order
    names: list[str] = list(name_index)
    ids = [name_index[x] for x in texts]
    name_id = np.array(ids, dtype=np.int32) if n else np.empty(0, dtype=np.int32)
    cls, unresolved = _classes(acc, names, ids, name_id)
    msg = _msg_column(path, acc, cls, names, ids)
    streams = g.stream if acc.classes is None else g.tid  # CPU trace: the thread
    stream = int_column(streams)
    start_ns = g.ts_ns
    dur_ns = g.dur_ns
    launch_ns = _launch_ns(acc)
    negative = int((dur_ns < 0).sum())
    if negative:
        meta["negative_duration_events"] = negative
    if n and int(dur_ns.max()) > MAX_EVENT_NS:
        k = int(dur_ns.argmax())
        raise UserError(
            f"{path}: GPU event {str(g.name[k])[:60]!r} lasts {int(dur_ns[k]) / 1000:.6g} µs, "
            "over 1 hour (3.6e9 µs); no kernel of a serving trace runs that long, the trace is corrupt"
        )
    implausible = int((dur_ns > _IMPLAUSIBLE_NS).sum())
    if implausible:
        meta["implausible_duration_events"] = implausible
    order = np.argsort(start_ns, kind="stable")
    step_idx = assign_steps(launch_ns, steps)
    graph_corr = {e.get("correlation") for e in acc.graph_launches} - {None}
    in_graph = (
        np.fromiter((c in graph_corr for c in g.correlation), dtype=bool, count=n)
        if graph_corr
        else np.zeros(n, dtype=bool)
    )
    meta["step_source"] = (
        "annotation"
        if steps and not steps[0].name.startswith("graph_launch#")
        else "graph_launch"
        if steps
        else "none (whole trace is one window)"
    )
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


CPU_CLOCK = "cpu_trace"
"""``timing.clock`` of a profile made from CPU-only traces."""

_GLOO = re.compile(r"^gloo:")
_SHM = re.compile(r"^sgl_kernel::shm_")
_PARAM_COMMS = "record_param_comms"
_ALLREDUCE = re.compile(r"(?i)all_?reduce")
_HOST_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})


class _CpuEvent(msgspec.Struct, gc=False):
    """The keys of an event a CPU-only trace is read from, as raw JSON text until used. ``tid``
    too: a CPU trace's collectives run on gloo's own threads, so the thread separates them from
    the calling op. ``args`` whole: the collective and compute classes read any key of it."""

    ph: str = ""
    cat: str = ""
    name: msgspec.Raw = _NULL
    ts: msgspec.Raw = _NULL
    dur: msgspec.Raw = _NULL
    pid: msgspec.Raw = _NULL
    args: msgspec.Raw = _NULL
    tid: msgspec.Raw = _NULL


class _CpuTrace(msgspec.Struct, gc=False):
    traceEvents: list[_CpuEvent]


_DECODER = msgspec.json.Decoder(_CpuTrace)


def collective_class(name: str, args: dict) -> EventClass | None:
    """The class of a CPU collective event (see the module docstring), None for any other event.

    ``gloo:all_reduce`` / ``sgl_kernel::shm_allreduce`` → ALLREDUCE, other ``gloo:*`` /
    ``sgl_kernel::shm_*`` → OTHER_COMM; ``record_param_comms`` by its ``Collective name``.
    """
    if _GLOO.match(name) or _SHM.match(name):
        return EventClass.ALLREDUCE if _ALLREDUCE.search(name) else EventClass.OTHER_COMM
    if name == _PARAM_COMMS:
        coll = args.get("Collective name")
        if isinstance(coll, str) and _ALLREDUCE.search(coll):
            return EventClass.ALLREDUCE
        return EventClass.OTHER_COMM
    return None


def read_host_events(path: Path, raw: bytes) -> list[dict]:
    """Every complete (``ph: X``) host event of the trace with a usable ts/dur, as dicts with
    ``name``, ``cat``, ``ts_ns``, ``dur_ns``, ``tid``, ``label`` (TP rank of a merged file's pid,
    else -1) and ``args``. ``raw`` is the file's (inflated) bytes.

    Raises
    ------
    UserError
        JSON the typed decode rejects and the slow path cannot read
        (:func:`~fastverify.trace.decode.read_trace_json`); ``_TooDeep`` (a UserError) for a
        value nested past the parser's limit (the caller names the file).
    """
    out = []
    try:
        doc = _DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        parsed = read_trace_json(path, raw)
        for ev in parsed["traceEvents"]:
            cat = ev.get("cat") if isinstance(ev, dict) else None
            if type(cat) is not str or cat not in _HOST_CATS or ev.get("ph", "X") != "X":
                continue
            name, args = ev.get("name"), ev.get("args")
            _append(
                out,
                name,
                ev.get("cat"),
                _ns_from_value(ev.get("ts")),
                _ns_from_value(ev.get("dur")),
                ev.get("tid"),
                _rank_label(ev.get("pid")),
                args,
            )
        return out
    for ev in doc.traceEvents:
        if ev.cat not in _HOST_CATS or (ev.ph or "X") != "X":
            continue
        pid = _raw(ev.pid)
        _append(
            out,
            _raw(ev.name),
            ev.cat,
            ns_from_text(bytes(ev.ts)),
            ns_from_text(bytes(ev.dur)),
            _raw(ev.tid),
            _rank_label(pid),
            _raw(ev.args),
        )
    return out


def _append(out: list, name, cat, ts, dur, tid, label, args) -> None:
    if not isinstance(name, str) or ts is None or dur is None or dur < 0:
        return
    out.append(
        {
            "name": name,
            "cat": cat,
            "ts_ns": ts,
            "dur_ns": dur,
            "tid": tid if type(tid) is int or isinstance(tid, str) else repr(tid),
            "label": label,
            "args": args if isinstance(args, dict) else {},
        }
    )


def split_rank_events(events: list[dict], step_regexes: list[re.Pattern]) -> dict:
    """The events of one rank of a CPU-only trace, per the module docstring.

    Returns
    -------
    dict
        ``{"events": [event dict, ...], "classes": [EventClass, ...], "steps": [step event, ...]}``
        — the collectives and outermost compute ops (same order as ``classes``), and the step
        spans; empty ``events`` when the rank has no CPU collective.
    """
    steps = [e for e in events if any(r.match(e["name"]) for r in step_regexes)]
    has_gloo = any(_GLOO.match(e["name"]) for e in events)
    picked: list[tuple[dict, EventClass | None]] = []  # None: a hand-off op, dropped with its children
    for e in events:
        name = e["name"]
        c = collective_class(name, e["args"])
        if c is not None and name == _PARAM_COMMS and has_gloo:
            c = None  # wraps the hand-off to gloo; the gloo span is the collective
            picked.append((e, None))
        elif c is not None:
            picked.append((e, c))
        elif e["cat"] == "user_annotation":
            continue  # step spans and other annotations: regions, not work
        elif looks_comm_op(name):
            picked.append((e, None))
        else:
            picked.append((e, EventClass.COMPUTE))
    if not any(c is not None and c is not EventClass.COMPUTE for _, c in picked):
        return {"events": [], "classes": [], "steps": steps}
    # Outermost per thread: sorted by start (longest first on ties), an event that starts before
    # the end of the last kept one of its thread is nested in it.
    picked.sort(key=lambda p: (str(p[0]["tid"]), p[0]["ts_ns"], -p[0]["dur_ns"]))
    kept_events, kept_cls = [], []
    tid, reach = object(), None
    for e, c in picked:
        if e["tid"] != tid:
            tid, reach = e["tid"], None
        end = e["ts_ns"] + e["dur_ns"]
        if reach is not None and e["ts_ns"] < reach:
            continue
        reach = end
        if c is not None:
            kept_events.append(e)
            kept_cls.append(c)
    return {"events": kept_events, "classes": kept_cls, "steps": steps}
