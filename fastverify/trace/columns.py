"""The columnar trace reader: one typed decode, then every field the analyzer uses as a column.

:mod:`fastverify.trace.load` decodes a trace once with msgspec into the small ``_Event`` struct of
:mod:`fastverify.trace.decode`: every key the analyzer never reads is skipped unparsed, ``name``
and the few ``args`` keys it reads (``stream``, ``correlation``, ``External id`` and a
collective's name and size) are decoded in that same pass, and ``ts``/``dur``/``pid`` stay raw
JSON text. This module turns those events
into columns without a Python call per field per event:

* the events are sorted into GPU work (kernels, memcpy, memset), runtime calls (launches) and host
  ops in one pass;
* ``ts``/``dur`` become int64 ns vectorised, one ``msgspec`` call over a column's raw texts joined
  into a JSON array (:func:`ns_column`, exact; see there);
* a host op is judged by its name once per distinct name, not once per event;
* a collective's ``Input Dims``/``Input type`` (raw text on every ``cpu_op``) are decoded only for
  the few events that need them (message size).

The results are :class:`GpuColumns` per TP rank, which :func:`fastverify.trace.build._build` turns
into :class:`~fastverify.events.RankEvents`; a trace that the typed decode rejects takes the
dict-based slow path (:func:`fastverify.trace.build._slow_ranks`), which ends in the same columns
(:func:`GpuColumns.from_dicts`).
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from fastverify.trace.decode import (
    _MAX_NS,
    GPU_CATS,
    GRAPH_LAUNCH,
    HOST_CATS,
    HOST_SYNC,
    RUNTIME_CATS,
    _rank_label,
    _raw,
    ns_from_text,
)

__all__ = ["GpuColumns", "NS_EXACT_FLOAT_US", "NotPlain", "ns_column", "read_columns"]


class NotPlain(ValueError):
    """A trace the typed decode accepted but whose columns it cannot give exactly as the slow path
    reads them; the reader takes the slow path (:func:`fastverify.trace.load.read_trace`)."""


NS_EXACT_FLOAT_US = 2**41
"""Below this many µs (about 25 days) a ``ts``/``dur`` with at most 3 decimals converts to ns
exactly through float64: the value's own rounding (≤ 1000·2**-12/2 = 0.122 ns after × 1000) plus
the product's (≤ ulp(2**51)/2 = 0.125 ns) stay under the 0.5 ns that ``rint`` forgives. Larger
values take the per-value text path (:func:`fastverify.trace.decode.ns_from_text`)."""

# Texts that the float path must not take: more than 3 decimals (ties round half to even on the
# exact decimal), exponents, and anything that is not a plain number (null, strings, NaN, bools).
# Two C-speed tests (a delete-translate and a literal-led regex) instead of one alternation: 5x faster.
_NUMBER_BYTES = b"0123456789.,-"
_FOUR_DECIMALS = re.compile(rb"\.[0-9]{4}")
_ANY = msgspec.json.Decoder()


def ns_column(raws: list) -> tuple[np.ndarray, np.ndarray]:
    """Raw JSON numbers of µs (``ts`` or ``dur`` texts) to int64 ns, with a validity mask.

    Returns ``(ns, ok)``, both shape (n,): ``ns`` int64 (0 where not ok), ``ok`` bool, False for
    a text that is not a finite number within ±2**62 ns (the per-value rule of
    :func:`fastverify.trace.decode.ns_from_text`, which this matches value for value).

    Three routes, all exact: plain numbers with at most 3 decimals below :data:`NS_EXACT_FLOAT_US`
    go through one float64 array (``rint(µs × 1000)``); integers of any size (old Kineto's epoch
    µs) through int64; anything else (more decimals, exponents, null, strings, huge floats) through
    the text rule, one value at a time.
    """
    n = len(raws)
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    joined = b",".join(raws)
    if not joined.translate(None, _NUMBER_BYTES) and not _FOUR_DECIMALS.search(joined):
        vals = _ANY.decode(b"[" + joined + b"]")
        if b"." not in joined:  # integers only
            big = max(abs(min(vals)), abs(max(vals)))
            if big * 1000 < _MAX_NS:
                return np.array(vals, dtype=np.int64) * 1000, np.ones(n, dtype=bool)
        else:
            try:
                f = np.array(vals, dtype=np.float64)
            except OverflowError:  # an integer past a float's range beside decimals: the text rule below
                f = None
            if f is not None and float(np.abs(f).max()) < NS_EXACT_FLOAT_US:
                return np.rint(f * 1000.0).astype(np.int64), np.ones(n, dtype=bool)
    got = [ns_from_text(bytes(r)) for r in raws]
    ok = np.fromiter((g is not None for g in got), dtype=bool, count=n)
    return np.fromiter((g or 0 for g in got), dtype=np.int64, count=n), ok


class GpuColumns:
    """The GPU events (kernels, memcpy, memset) of one rank, one list/array entry per event.

    Attributes
    ----------
    name : list
        Decoded names (str, or whatever the trace holds there).
    cat : list[str]
        Trace category (``kernel``, ``gpu_memcpy``, ...).
    ts_ns, dur_ns : np.ndarray, int64, shape (n,)
        Start and duration, ns; meaningful where ``ok``.
    ok : np.ndarray, bool, shape (n,)
        ``ph`` is ``X`` and both times are usable.
    stream, correlation, external_id : list
        Those ``args`` values as decoded (None where absent).
    args : list
        The ``args`` of each event: the typed decode's used keys (fast path,
        :class:`fastverify.trace.decode._Args` or None) or a dict (slow path); read them with
        :meth:`args_dict` when an event needs more than the three keys above.
    tid : list or None
        The thread of each event (CPU-only traces, where the "stream" is the thread).
    """

    __slots__ = ("name", "cat", "ts_ns", "dur_ns", "ok", "stream", "correlation", "external_id", "args", "tid")

    def __init__(self, name, cat, ts_ns, dur_ns, ok, stream, correlation, external_id, args, tid=None):
        self.name, self.cat, self.ts_ns, self.dur_ns, self.ok = name, cat, ts_ns, dur_ns, ok
        self.stream, self.correlation, self.external_id, self.args, self.tid = (
            stream,
            correlation,
            external_id,
            args,
            tid,
        )

    def __len__(self) -> int:
        return len(self.name)

    @classmethod
    def from_dicts(cls, evs: list[dict]) -> GpuColumns:
        """Columns of the slow path's / CPU reader's event dicts (keys ``name``, ``cat``,
        ``ts_ns``, ``dur_ns``, ``args`` dict, optional ``tid``); all rows are taken as usable."""
        n = len(evs)
        args = [e["args"] for e in evs]
        return cls(
            name=[e["name"] for e in evs],
            cat=[e["cat"] for e in evs],
            ts_ns=np.fromiter((e["ts_ns"] for e in evs), dtype=np.int64, count=n),
            dur_ns=np.fromiter((e["dur_ns"] for e in evs), dtype=np.int64, count=n),
            ok=np.ones(n, dtype=bool),
            stream=[a.get("stream") for a in args],
            correlation=[a.get("correlation") for a in args],
            external_id=[a.get("External id") for a in args],
            args=args,
            tid=[e["tid"] for e in evs] if evs and "tid" in evs[0] else None,
        )

    @classmethod
    def concat(cls, parts: list[GpuColumns]) -> GpuColumns:
        """The rows of ``parts`` one after the other, in that order."""

        def join(key):
            cols = [getattr(p, key) for p in parts]
            return None if any(c is None for c in cols) else [x for c in cols for x in c]

        arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in ("ts_ns", "dur_ns", "ok")}
        return cls(
            join("name"),
            join("cat"),
            arrays["ts_ns"],
            arrays["dur_ns"],
            arrays["ok"],
            join("stream"),
            join("correlation"),
            join("external_id"),
            join("args"),
            join("tid"),
        )

    def __getstate__(self) -> dict:
        # Pickled when a worker process sends its part of a file (fastverify.trace.load): the
        # names (long kernel names, each repeated thousands of times) travel once each.
        state = {k: getattr(self, k) for k in self.__slots__}
        for k in ("name", "cat"):
            v = state[k]
            if all(type(x) is str for x in v):
                index: dict[str, int] = {}
                ids = [index.setdefault(x, len(index)) for x in v]
                state[k] = (list(index), np.array(ids, dtype=np.int32))
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            if k in ("name", "cat") and type(v) is tuple:
                distinct, ids = v
                v = [distinct[i] for i in ids.tolist()]
            setattr(self, k, v)

    def take(self, idx) -> GpuColumns:
        """The rows at ``idx`` (a sequence of ints, or a bool mask), in that order."""
        ix = (
            np.flatnonzero(idx)
            if getattr(getattr(idx, "dtype", None), "kind", "") == "b"
            else np.asarray(idx, dtype=np.intp)
        )
        pick = ix.tolist()

        def sub(v):
            return None if v is None else [v[i] for i in pick]

        return GpuColumns(
            sub(self.name),
            sub(self.cat),
            self.ts_ns[ix],
            self.dur_ns[ix],
            self.ok[ix],
            sub(self.stream),
            sub(self.correlation),
            sub(self.external_id),
            sub(self.args),
            sub(self.tid),
        )

    def args_dict(self, i: int):
        """The ``args`` of event ``i``: a dict (slow path) or the typed decode's keys, read alike
        with ``.get`` (:meth:`fastverify.trace.decode._Args.get`); ``{}`` when absent."""
        a = self.args[i]
        if a is None:
            return {}
        return a


def _labels(evs: list) -> list[int] | None:
    """TP rank per event from a SGLang merged file's pid labels; None when no event has one."""
    pids = [e.pid for e in evs]
    if b'"[TP' not in b",".join(pids):
        return None
    return [_rank_label(_raw(p)) if bytes(p).startswith(b'"[TP') else -1 for p in pids]


def _groups(labels: list[int] | None, n: int) -> dict[int, list[int] | None]:
    """Event indices per label (None: every event, label -1)."""
    if labels is None:
        return {-1: None}
    out: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        out.setdefault(lab, []).append(i)
    return out


def read_columns(doc, host_keep: re.Pattern, looks_comm_op, facts: dict | None = None) -> dict[int, dict]:
    """Per pid label (-1 for a plain file), what the loader needs from a typed-decoded trace.

    Parameters
    ----------
    doc : fastverify.trace.decode._Trace
        The typed decode of one file (names and the used ``args`` keys already decoded).
    host_keep : re.Pattern[str]
        Superset filter over a host op's name (comm ops, step spans).
    looks_comm_op : callable(str) -> bool
        The exact comm-op test on a name (only such ops keep their args).
    facts : dict, optional
        Filled with what decided the pid labels, for a reader that splits a file in parts
        (:mod:`fastverify.trace.load`): ``gpu`` (any GPU event), ``gpu_labelled`` (a GPU pid
        carries a ``[TP..]`` label), ``merged`` (runtime and host ops were labelled by pid) and
        ``tp_pids`` (a runtime or kept host op's pid carries a label).

    Raises
    ------
    NotPlain
        A GPU event whose name is not a string.

    Returns
    -------
    dict[int, dict]
        ``{label: {"gpu": GpuColumns, "skipped": int, "runtime_ns": {correlation: ns},
        "graph_launches": [{"ts_ns", "dur_ns", "correlation"}], "host": [event dict],
        "host_syncs": [{"name", "ts_ns", "dur_ns"}]}}``; ``host`` dicts have
        ``name``, ``cat``, ``ph``, ``ts_ns``, ``dur_ns``, ``args`` (read with ``.get``; kept only
        for comm ops).
    """
    gpu: list = []
    runtime: list = []
    host: list = []
    bucket = {
        **{c: gpu.append for c in GPU_CATS},
        **{c: runtime.append for c in RUNTIME_CATS},
        **{c: host.append for c in HOST_CATS},
    }
    for ev in doc.traceEvents:
        put = bucket.get(ev.cat)
        if put is not None:
            put(ev)

    out: dict[int, dict] = {}

    def slot(label: int) -> dict:
        s = out.get(label)
        if s is None:
            s = out[label] = {
                "gpu": None,
                "skipped": 0,
                "runtime_ns": {},
                "graph_launches": [],
                "host": [],
                "host_syncs": [],
            }
        return s

    if gpu and not all(type(e.name) is str for e in gpu):
        # a number as a kernel name: msgspec reads one past 64 bits as a float, the slow path's
        # parser as the integer it is, and the name is shown; the slow path reads such a file
        raise NotPlain("a GPU event's name is not a string")
    gpu_labels = _gpu_rows(gpu, slot) if gpu else None
    # A merged file labels every event's pid; a file whose GPU events carry no label has none.
    merged = bool(gpu) and gpu_labels is not None or not gpu
    tp_pids = False
    if runtime:
        tp_pids = _runtime_rows(runtime, merged, facts is not None, slot)
    if host:
        tp_pids = _host_rows(host, host_keep, looks_comm_op, merged, facts is not None, slot) or tp_pids
    if facts is not None:
        facts.update(gpu=bool(gpu), gpu_labelled=gpu_labels is not None, merged=merged, tp_pids=tp_pids)
    return out


def _gpu_rows(gpu: list, slot) -> list[int] | None:
    """Put the GPU events (typed-decode ``_Event``, names all str) as :class:`GpuColumns` into
    ``slot(label)["gpu"]`` / ``["skipped"]`` per pid label; returns the labels (None: unlabelled)."""
    ts, ts_ok = ns_column([e.ts for e in gpu])
    dur, dur_ok = ns_column([e.dur for e in gpu])
    ok = ts_ok & dur_ok & np.fromiter(((e.ph or "X") == "X" for e in gpu), dtype=bool, count=len(gpu))
    args = [e.args for e in gpu]
    cols = GpuColumns(
        name=[e.name for e in gpu],
        cat=[e.cat for e in gpu],
        ts_ns=ts,
        dur_ns=dur,
        ok=ok,
        stream=[None if a is None else a.stream for a in args],
        correlation=[None if a is None else a.correlation for a in args],
        external_id=[None if a is None else a.external_id for a in args],
        args=args,
    )
    gpu_labels = _labels(gpu)
    for label, idx in _groups(gpu_labels, len(gpu)).items():
        part = cols if idx is None else cols.take(idx)
        s = slot(label)
        s["skipped"] = int((~part.ok).sum())
        s["gpu"] = part.take(part.ok) if s["skipped"] else part
    return gpu_labels


def _runtime_rows(runtime: list, merged: bool, want_pids: bool, slot) -> bool:
    """Runtime calls: host launch time (ns) per correlation id, CUDA/HIP graph launches and
    blocking syncs, into ``slot(label)``, labelled by pid only when ``merged``. Returns whether
    any pid carries a ``[TP..]`` label (looked at when ``merged`` or ``want_pids``)."""
    rts, rts_ok = ns_column([e.ts for e in runtime])
    corr = [None if e.args is None else e.args.correlation for e in runtime]
    labels = _labels(runtime) if merged or want_pids else None
    tp_pids = labels is not None
    if not merged:
        labels = None
    ts_list = rts.tolist()
    ok_list = rts_ok.tolist()
    if labels is None:
        slot(-1)["runtime_ns"].update({c: t for c, t, ok in zip(corr, ts_list, ok_list) if ok and type(c) is int})
    else:
        for c, t, ok, lab in zip(corr, ts_list, ok_list, labels):
            if ok and type(c) is int:
                slot(lab)["runtime_ns"][c] = t
    names = [e.name for e in runtime]
    distinct = set(n for n in names if type(n) is str)
    launches = {nm for nm in distinct if GRAPH_LAUNCH.match(nm)}
    syncs = {nm for nm in distinct if HOST_SYNC.match(nm)}
    if launches or syncs:
        for i, nm in enumerate(names):
            if not (ok_list[i] and type(nm) is str and (nm in launches or nm in syncs)):
                continue
            dest = slot(labels[i] if labels is not None else -1)
            dur_ns = ns_from_text(bytes(runtime[i].dur))
            if nm in launches:
                c = corr[i]  # only an int id can match a kernel's; anything else is no id
                dest["graph_launches"].append(
                    {"ts_ns": ts_list[i], "dur_ns": dur_ns, "correlation": c if type(c) is int else None}
                )
            elif dur_ns is not None:
                dest["host_syncs"].append({"name": nm, "ts_ns": ts_list[i], "dur_ns": dur_ns})
    return tp_pids


def _host_rows(host: list, host_keep: re.Pattern, looks_comm_op, merged: bool, want_pids: bool, slot) -> bool:
    """Host ops: only comm ops (External id, shapes) and step spans matter, judged once per name;
    into ``slot(label)["host"]``, labelled by pid only when ``merged``. Returns whether a kept
    op's pid carries a ``[TP..]`` label (looked at when ``merged`` or ``want_pids``)."""
    keep = {nm: bool(host_keep.search(nm)) for nm in {e.name for e in host if type(e.name) is str}}
    kept = [e for e in host if type(e.name) is str and keep[e.name]]
    if not kept:
        return False
    labels = _labels(kept) if merged or want_pids else None
    tp_pids = labels is not None
    if not merged:
        labels = None
    ts, ts_ok = ns_column([e.ts for e in kept])
    dur, dur_ok = ns_column([e.dur for e in kept])
    ts_l, dur_l = ts.tolist(), dur.tolist()
    ts_okl, dur_okl = ts_ok.tolist(), dur_ok.tolist()
    comm = {nm: looks_comm_op(nm) for nm in keep if keep[nm]}
    for i, ev in enumerate(kept):
        a = ev.args
        slot(labels[i] if labels is not None else -1)["host"].append(
            {
                "cat": ev.cat,
                "ph": ev.ph,
                "name": ev.name,
                "ts_ns": ts_l[i] if ts_okl[i] else None,
                "dur_ns": dur_l[i] if dur_okl[i] else None,
                "args": a if a is not None and comm[ev.name] else {},
            }
        )
    return tp_pids
