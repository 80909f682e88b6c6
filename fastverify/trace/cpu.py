"""CPU-only PyTorch profiler traces: a TP run on CPU over gloo (our CPU SGLang server), where the
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

import re
from pathlib import Path

import msgspec

from fastverify.events import EventClass
from fastverify.trace.decode import (
    _NULL,
    _ns_from_value,
    _rank_label,
    _raw,
    looks_comm_op,
    ns_from_text,
    read_trace_json,
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
