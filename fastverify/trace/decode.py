"""What every trace reader of this package shares: the typed msgspec decoders, the exact µs → ns
number parsing, pid labels, the event categories and name patterns, the slow-path JSON parser,
and the sentinels and exceptions.

The readers (:mod:`fastverify.trace.load`, :mod:`~fastverify.trace.columns`,
:mod:`~fastverify.trace.build`, :mod:`~fastverify.trace.load`) import this module at their top;
it imports none of them, so the trace modules form no import circle.

Times: a trace's ``ts``/``dur`` are µs; everything here returns int ns (Python ``int``), or None
where a value is not a finite number within ±2**62 ns.
"""

from __future__ import annotations

import gc
import math
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import msgspec

from fastverify.bounds import duplicate_json_key
from fastverify.errors import UserError
from fastverify.events import EventClass
from fastverify.inputs import inflate_trace, loads_json, read_bytes
from fastverify.trace.classify import classify_name

GPU_CATS = frozenset({"kernel", "Kernel", "gpu_memcpy", "gpu_memset", "Memcpy", "Memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})
GRAPH_LAUNCH = re.compile(r"^(cuda|hip)GraphLaunch")
# Runtime/driver calls that block the host until the GPU (a stream, the device, an event) is done:
# after one returns, the GPU idles until the host launches more work.
HOST_SYNC = re.compile(
    r"^(?:(?:cuda|hip)(?:Stream|Device|Event)Synchronize|(?:cuda|hip)Memcpy|"
    r"cu(?:Stream|Ctx|Event)Synchronize)$"
)
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
STEP_RES = [re.compile(p) for p, _ in STEP_PATTERNS]

_RANK_FROM_PID = re.compile(r"^\[TP(\d+)")
_NULL = msgspec.Raw(b"null")
_MAX_NS = 2**62

_COMM_OP = re.compile(
    r"(?i)all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|^nccl:|"
    r"record_param_comms|c10d::|symm_mem::|custom_ar|_C_custom_ar|sgl_kernel::.*reduce"
)

# The host ops the loader reads, in one search per distinct name: comm ops (_COMM_OP, which sets
# the case-blind flag for the whole pattern) or step spans (STEP_PATTERNS, case kept as STEP_RES
# matches them; each starts with ^, so search is match).
HOST_KEEP = re.compile(
    "|".join([_COMM_OP.pattern, *(f"(?-i:{p})" for p, _ in STEP_PATTERNS), f"(?-i:{STAGE_SPAN.pattern})"])
)

_COMM_CODES = frozenset(
    {
        EventClass.ALLREDUCE.code,
        EventClass.FUSED_ALLREDUCE.code,
        EventClass.OTHER_COMM.code,
        EventClass.UNKNOWN_COMM.code,
        EventClass.EP_ALLTOALL.code,
    }
)


class _TooDeep(UserError):
    """A value nested deeper than msgspec allows; re-raised naming the file by the reader."""

    def __init__(self, path: object = None):
        super().__init__(
            f"{path or 'a trace'}: JSON nested too deeply inside one event (over the parser's recursion limit)"
        )


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
        decoded here), ``default`` for a key not read or not in the event; so that the message
        size and collective name lookups (:mod:`fastverify.trace.build`) read either.

        Raises
        ------
        _TooDeep
            A raw value nested past msgspec's recursion limit.
        """
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
    :func:`ns_from_text`). An ``args`` that is not an object makes the typed decode fail and the
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


TRACE_DECODER = msgspec.json.Decoder(_Trace)
_RAW_DECODER = msgspec.json.Decoder()


def ns_from_text(text: bytes) -> int | None:
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
        return ns_from_text(repr(v).encode()) if math.isfinite(v) else None
    return None


def _rank_label(pid) -> int:
    """TP rank from a SGLang merged file's pid label ``"[TP03-DP00] 1234"``; -1 otherwise."""
    if isinstance(pid, str):
        m = _RANK_FROM_PID.match(pid)
        if m:
            return int(m.group(1))
    return -1


def _top(value):
    """A top-level key's raw value decoded; None when the key is absent."""
    return None if value is msgspec.UNSET else _raw(value)


def _raw(value: msgspec.Raw):
    """Decode a raw JSON value; None if it cannot be decoded (e.g. a float out of range).

    Raises
    ------
    _TooDeep
        The value is nested past msgspec's recursion limit (the caller names the file).
    """
    try:
        return _RAW_DECODER.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except RecursionError:  # one kernel's args nested thousands deep: refuse the file, in one line
        raise _TooDeep() from None


def looks_comm_op(name: str) -> bool:
    """Whether a host op's name is a collective's (NCCL, c10d, custom all-reduce, ...)."""
    return bool(_COMM_OP.search(name))


def reads_args(name) -> bool:
    """Whether building a rank's events (:func:`fastverify.trace.build._build`) may read more of a
    GPU event's ``args`` than its stream, correlation and External id: only for events whose name
    leaves the class open or makes them a collective (message size, collective name). A reader
    that sends columns between processes drops the other events' ``args``
    (:mod:`fastverify.trace.load`)."""
    c = classify_name(name if isinstance(name, str) else str(name))
    return c.cls is None or c.cls.code in _COMM_CODES


def _read_bytes(path: Path) -> bytes:
    """The trace's JSON bytes through the one input opener (regular file, size caps, gzip).

    Raises
    ------
    UserError
        Unreadable or oversized file, truncated/corrupt gzip.
    """
    return inflate_trace(read_bytes(path, kind="trace"), path)


def no_events(path: Path, raw: bytes) -> UserError:
    """The line for a trace whose ``traceEvents`` is empty: that, or, where the key stands twice in
    the text (a hand edit; a JSON parser keeps the last list silently), that it is given twice.
    Searched only on this error path, so a good trace pays nothing for it."""
    if raw.count(b'"traceEvents"') > 1 and duplicate_json_key(raw) == "traceEvents":
        return UserError(f"{path}: the key 'traceEvents' is given twice; which list holds is not known")
    return UserError(f"{path}: the trace has no events")


def read_trace_json(path: Path, raw: bytes | None = None) -> dict:
    """Parse one whole trace file into plain Python objects (slow path, any valid JSON).

    ``raw`` is the file's inflated bytes when the caller has them (else the file is read).

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
        doc = loads_json(raw, path, unique_keys=False)  # ~0.6 GB: a second parse for repeated keys costs too much
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
        raise no_events(path, raw)
    return doc
