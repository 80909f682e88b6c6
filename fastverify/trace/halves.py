"""Read one large trace file on two cores: the first half of its events here, the second in a
forked worker process, with the same result as reading it whole.

A profile of one big rank file (or of a SGLang file that merges every rank) spends most of its
time in the one typed decode and the columns built from it (:mod:`fastverify.trace.columns`),
all on one core. Here the JSON text is cut between two events of ``traceEvents``, near the
middle, and each part is made a document of its own:

* first part:  ``<text up to the end of event k>,{"ph":"<marker>"}]}``
* second part: ``{"traceEvents":[{"ph":"<marker>"},<text from event k+1 to the end>``

where ``<marker>`` holds a random nonce drawn for this read (why such a cut is safe:
:func:`cut_points`). Any decode error makes the caller read the file whole. The parts' columns are
joined in file order, which is the order the whole-file reader keeps; the package's tests check the
result equal to the whole-file read, field for field. Memory use: :class:`_Worker`.
"""

from __future__ import annotations

import re
import secrets

import msgspec

from fastverify.procs import quiet_child_signals, signals_held
from fastverify.trace.columns import GpuColumns, NotPlain, read_columns
from fastverify.trace.decode import TRACE_DECODER, _TooDeep, _top, reads_args

__all__ = ["SPLIT_MIN_BYTES", "cut_points", "read_in_halves"]

SPLIT_MIN_BYTES = 16 << 20
"""Below this much JSON a file is read in one process: forking and the joins cost about 10 ms,
more than half of decoding 16 MiB saves on 2 cores."""

SECOND_SHARE = 0.45
"""The worker's share of the text: the parent also joins the parts, so it takes the smaller one."""

_BETWEEN_OBJECTS = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")

_TEXT: dict = {}  # the inflated text, set while the worker is forked (it reads it from here)


def cut_points(raw: bytes, share: float = SECOND_SHARE) -> tuple[int, int] | None:
    """``(end, start)``: the first part of ``raw`` ends at ``end`` (just after a ``}``) and the
    second starts at ``start`` (a ``{``), at the first place between two objects at or after
    ``1 - share`` of the text; None where there is none.

    The cut is where ``}``, a comma and ``{`` follow each other with only white space between.
    Such a place is either inside a string (then the first part cannot parse: the string ends at
    the marker's first quote and a bare name follows) or between two objects of some array. Both
    parts parse, and each has its marker at the right end of its ``traceEvents``, only when that
    array is the document's ``traceEvents``: the first part's marker must be the last event of its
    ``traceEvents`` (so the array closed there is that key's value) and the second part's marker
    the first of its own (so no later ``traceEvents`` key replaced it). Any other outcome makes
    :func:`read_in_halves` return None (the tests place cuts in strings, nested arrays and other
    top-level arrays).
    """
    m = _BETWEEN_OBJECTS.search(raw, int(len(raw) * (1.0 - share)))
    if m is None:
        return None
    return m.start() + 1, m.end() - 1


def _marker() -> tuple[bytes, str]:
    """A marker event for this read's cut, and its ``ph`` (a random nonce no trace holds)."""
    tag = "fastverify-cut-" + secrets.token_hex(16)
    return b'{"ph":"' + tag.encode() + b'"}', tag


def _second_half(start: int, marker: bytes, tag: str, host_keep, looks_comm_op) -> tuple:
    """In the worker: decode and read the second part (see the module docstring)."""
    raw = _TEXT["raw"]
    part = b"".join((b'{"traceEvents":[', marker, b",", memoryview(raw)[start:]))
    doc = TRACE_DECODER.decode(part)
    del part
    events = doc.traceEvents
    if len(events) < 2 or events[0].ph != tag:
        return ("refused",)
    del events[0]
    facts: dict = {}
    got = read_columns(doc, host_keep, looks_comm_op, facts)
    for s in got.values():  # the args the parent never reads do not travel
        g = s["gpu"]
        if g is not None:  # names are strings here (read_columns refuses others)
            need = {n: reads_args(n) for n in set(g.name)}
            g.args = [a if need[n] else None for n, a in zip(g.name, g.args)]
    top = (doc.distributedInfo, doc.deviceProperties)  # raw text, or UNSET: absent in this half
    _TEXT["keep"] = doc  # freed with the worker at its os._exit, not one object at a time
    return "ok", len(events), top, got, facts


def _worker_call(start: int, marker: bytes, tag: str, host_keep, looks_comm_op) -> tuple:
    try:
        return _second_half(start, marker, tag, host_keep, looks_comm_op)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, _TooDeep, NotPlain):
        return ("refused",)


def _free(doc) -> None:
    """The default ``done_with`` of :func:`read_in_halves`: keep nothing (the decode is freed)."""


def read_in_halves(raw: bytes, host_keep, looks_comm_op, done_with=_free):
    """:func:`fastverify.trace.columns.read_columns` of the whole of ``raw``, computed in two
    halves (here and in a forked worker), with the top-level ``distributedInfo`` and
    ``deviceProperties``; None when the text cannot be cut or the halves do not make the whole
    (then the caller reads it whole). ``done_with`` is called with the first half's typed decode
    once its columns are read (the loader's :func:`fastverify.trace.load.done_with`, which may
    keep it alive instead of freeing it here).

    Returns
    -------
    tuple or None
        ``(top, got)``: ``top`` a dict of the two top-level values (decoded, None when absent),
        ``got`` as :func:`~fastverify.trace.columns.read_columns` returns it.

    Raises
    ------
    fastverify.trace.decode._TooDeep
        From the first half's columns (the caller names the file).
    """
    cut = cut_points(raw)
    if cut is None:
        return None
    end, start = cut
    marker, tag = _marker()
    worker = _Worker(raw, start, marker, tag, host_keep, looks_comm_op)
    try:
        first = b"".join((memoryview(raw)[:end], b",", marker, b"]}"))
        try:
            doc = TRACE_DECODER.decode(first)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return None
        del first
        events = doc.traceEvents
        if len(events) < 2 or events[-1].ph != tag:
            return None
        del events[-1], events
        facts: dict = {}
        try:
            got_a = read_columns(doc, host_keep, looks_comm_op, facts)
        except NotPlain:
            return None
        top_a = (doc.distributedInfo, doc.deviceProperties)
        done_with(doc)
        del doc
        reply = worker.result()  # ("refused",) also when it died (killed, out of memory)
    finally:
        worker.stop()
    if reply[0] != "ok":
        return None
    _, n_b, top_b, got_b, facts_b = reply
    if not n_b or not _labels_agree(facts, facts_b):
        return None
    if any(a is not msgspec.UNSET and b is not msgspec.UNSET for a, b in zip(top_a, top_b)):
        return None  # a top-level key on both sides of the cut (even as null): duplicated, read it whole
    top = {
        "distributedInfo": _top(top_a[0] if top_a[0] is not msgspec.UNSET else top_b[0]),
        "deviceProperties": _top(top_a[1] if top_a[1] is not msgspec.UNSET else top_b[1]),
    }
    return top, _join(got_a, got_b)


def _labels_agree(a: dict, b: dict) -> bool:
    """Each half labelled its runtime and host ops as the whole file would have: a file is read as
    merged (ops labelled by pid) when its GPU events carry ``[TP..]`` labels or it has none. A half
    that decided otherwise is still right when none of its ops' pids carries a label."""
    gpu = a["gpu"] or b["gpu"]
    merged = gpu and (a["gpu_labelled"] or b["gpu_labelled"]) or not gpu
    return all(h["merged"] == merged or not h["tp_pids"] for h in (a, b))


def _join(a: dict, b: dict) -> dict:
    """Per label, ``a``'s then ``b``'s: GPU rows, skipped counts, launch times (``b`` after ``a``,
    as one pass over the file updates them), graph launches and host ops."""
    out: dict[int, dict] = {}
    for label in [*a, *(k for k in b if k not in a)]:
        sa, sb = a.get(label), b.get(label)
        if sa is None or sb is None:
            out[label] = sa if sb is None else sb
            continue
        gpu = [g for g in (sa["gpu"], sb["gpu"]) if g is not None]
        runtime = sa["runtime_ns"]
        runtime.update(sb["runtime_ns"])
        out[label] = {
            "gpu": GpuColumns.concat(gpu) if len(gpu) > 1 else (gpu[0] if gpu else None),
            "skipped": sa["skipped"] + sb["skipped"],
            "runtime_ns": runtime,
            "graph_launches": sa["graph_launches"] + sb["graph_launches"],
            "host": sa["host"] + sb["host"],
            "host_syncs": sa["host_syncs"] + sb["host_syncs"],
        }
    return out


class _Worker:
    """The forked process that reads the second half: it starts on its part at once (the text and
    the cut are in its copy of this process's memory) and sends one pickled reply on a pipe.

    Memory: the worker shares the parent's inflated text (fork, copy on write) and decodes its half
    into its own objects; each side also copies its part of the text once. Measured on the 53.7 MB
    ``df_index_resolver`` trace: parent peak 189 MB (the whole-file reader's: 205 MB), worker 80 MB
    of its own pages (``/proc/self/smaps_rollup``, private), so both together stay within
    :data:`fastverify.trace.load.PEAK_BYTES_PER_JSON_BYTE` per byte of JSON.
    """

    def __init__(self, raw: bytes, start: int, marker: bytes, tag: str, host_keep, looks_comm_op) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._answered = False
        self._conn, child_end = ctx.Pipe(duplex=False)
        _TEXT["raw"] = raw
        try:
            self._proc = ctx.Process(
                target=_serve,
                args=(child_end, self._conn, start, marker, tag, host_keep, looks_comm_op),
                daemon=True,
                name="fastverify-half",
            )
            with signals_held():
                self._proc.start()
        finally:
            _TEXT.clear()
            child_end.close()

    def result(self) -> tuple:
        """The worker's reply; ``("refused",)`` when it died before sending one."""
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            return ("refused",)
        self._answered = True
        return reply

    def stop(self) -> None:
        """Reap the worker: once it has answered it is only exiting, and a thread waits for that
        (the exit of a process of ~150 MB takes about 7 ms); otherwise (an early answer, an error
        or Ctrl-C here) it is killed and reaped now."""
        import threading

        self._conn.close()
        if self._answered:
            threading.Thread(target=self._proc.join, name="fastverify-half-reaper", daemon=True).start()
            return
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()


def _serve(conn, parent_end, start: int, marker: bytes, tag: str, host_keep, looks_comm_op) -> None:
    import os

    quiet_child_signals()
    parent_end.close()
    try:
        conn.send(_worker_call(start, marker, tag, host_keep, looks_comm_op))
        conn.close()
    except BaseException:  # noqa: BLE001 - the parent stopped waiting (pipe closed): nothing to say
        pass
    os._exit(0)  # its objects go with the process, unfreed one by one
