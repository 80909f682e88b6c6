"""Load PyTorch profiler (Kineto) Chrome traces into :class:`~fastverify.events.RankEvents`: the
public :func:`load_trace` (one file) and :func:`load_traces` (files and folders of one run).

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

The work is split by job: :mod:`~fastverify.trace.decode` (shared decoders and number parsing),
:mod:`~fastverify.trace.columns` (reading one file's events) and :mod:`~fastverify.trace.build` (one
rank's events to :class:`RankEvents`, CPU-only traces included). This module reads one file
(:func:`read_trace`, a large one in two halves at once) and ties them together; its last part is the
several-file side (which files, how many to decode at once, and whether their
ranks are one run). The names other code imports from here are re-exported.

This module must not import torch: the trace path starts in well under a second.

Read one large trace file on two cores: the first half of its events here, the second in a
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

import gc
import re
import secrets
from pathlib import Path

import msgspec

from fastverify.errors import UserError, path_text
from fastverify.events import RankEvents
from fastverify.procs import quiet_child_signals, signals_held, usable_cores
from fastverify.progress import Progress
from fastverify.trace.build import (
    CPU_CLOCK,
    _build,
    _find_steps,
    _gpu_name,
    _host_ops,
    _PerRank,
    _slow_ranks,
    _str_or_none,
    rank_from_filename,
    read_host_events,
    split_rank_events,
)
from fastverify.trace.columns import GpuColumns, NotPlain, read_columns
from fastverify.trace.decode import (
    HOST_KEEP,
    HOST_SYNC,
    STAGE_SPAN,
    STEP_RES,
    TRACE_DECODER,
    _read_bytes,
    _TooDeep,
    _top,
    looks_comm_op,
    no_events,
    read_trace_json,
    reads_args,
)

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
    once its columns are read (the loader's :func:`done_with`, which may
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
    :data:`PEAK_BYTES_PER_JSON_BYTE` per byte of JSON.
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


__all__ = [
    "SPLIT_MIN_BYTES",
    "cut_points",
    "read_in_halves",
    "HOLD_DECODED",
    "HOST_SYNC",
    "MAX_TRACE_FILES",
    "PARALLEL_MIN_BYTES",
    "PEAK_BYTES_PER_JSON_BYTE",
    "STAGE_SPAN",
    "done_with",
    "json_size",
    "load_trace",
    "load_traces",
    "load_workers",
    "merge_conflict",
    "rank_from_filename",
    "read_trace",
    "read_trace_json",
]

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


def halves_pay(raw: bytes) -> bool:
    """Whether reading ``raw`` in two processes can be faster: enough JSON, two cores, ``fork``."""
    import sys

    return len(raw) >= SPLIT_MIN_BYTES and usable_cores() >= 2 and sys.platform.startswith("linux")


def read_trace(path: Path, *, halves: bool = False) -> tuple[dict, dict[int, _PerRank]]:
    """Read one trace file (``.json`` or gzip, detected by magic bytes) into per-rank columns.

    Returns the top-level ``distributedInfo``/``deviceProperties``, and per pid label (a TP rank
    of a SGLang merged file; -1 for every event of a plain file) what one pass collects: the GPU
    events as :class:`~fastverify.trace.columns.GpuColumns`, host launch times by correlation
    id, graph launches, comm ops by External id and step candidates. Well-formed traces take the
    columnar reader (:mod:`fastverify.trace.columns`); anything its typed decode rejects goes
    through :func:`read_trace_json`, which either parses it or names the problem. With ``halves``,
    a file of at least :data:`SPLIT_MIN_BYTES` of JSON on a box with two
    or more cores is read in two halves at once (:func:`read_in_halves`; same result).

    Raises
    ------
    UserError
        As :func:`read_trace_json`.
    """
    _HELD.clear()  # the file read before this one: freed now, before this one is decoded
    raw = _read_bytes(path)
    split = None
    if halves and halves_pay(raw):
        try:
            # a global looked up at call time, so a replaced load.read_in_halves is the one called
            split = read_in_halves(raw, HOST_KEEP, looks_comm_op, done_with=done_with)
        except _TooDeep:
            raise _TooDeep(path) from None
    if split is not None:
        top, got = split
    else:
        try:
            doc = TRACE_DECODER.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            # RecursionError: msgspec bounds nesting; the slow path names the file in one line
            return _slow_ranks(read_trace_json(path, raw))
        if not doc.traceEvents:
            raise no_events(path, raw)
        try:
            got = read_columns(doc, HOST_KEEP, looks_comm_op)
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


def _load_trace(path: Path, halves: bool = False) -> list[RankEvents]:
    """:func:`load_trace` with the garbage collector already off (see there for ranks and errors)."""
    doc, per = read_trace(path, halves=halves)
    step_res = STEP_RES

    timing = "trace"
    if not any(len(acc.gpu) for acc in per.values()):
        skipped = sum(acc.skipped for acc in per.values())
        if skipped:
            raise UserError(
                f"{path}: {skipped} GPU events, none with a usable ts/dur (finite numbers of µs within ±2**62 ns)"
            )
        if not per and not doc.get("_any_event_object", True):
            raise UserError(f"{path}: 'traceEvents' holds no event objects; not a PyTorch profiler trace")
        per = _cpu_ranks(path, step_res)  # a TP run on CPU: CPU collectives (gloo) and CPU ops
        if not per:
            raise UserError(
                f"{path}: no GPU events (kernels, memcpy, memset) and no CPU all-reduces "
                "(gloo:*, record_param_comms) in the trace; was it recorded with ProfilerActivity.CUDA?"
            )
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
        meta["cpu_only"] = "no GPU events: CPU ops and CPU collectives (gloo) on the host wall clock, not GPU timings"

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
            raise UserError(
                f"{path}: distributedInfo.rank = {rank} is not below its world_size = "
                f"{meta['world_size']}; not one rank of that run"
            )
        elif from_name is not None and from_name != rank:
            # With DP/PP the global rank in distributedInfo is not the TP rank in SGLang's name.
            meta["rank_conflict"] = (
                f"{path.name}: distributedInfo.rank = {rank} but the file name says {from_name}; used {rank}"
            )
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
    """Per pid label, the events of a CPU-only trace (:mod:`fastverify.trace.build`) in the shape
    :func:`~fastverify.trace.build._build` takes; labels without a CPU collective are left out
    (none: not a CPU TP trace).

    Raises
    ------
    UserError
        As :func:`read_trace_json`, or JSON nested too deeply inside one event.
    """
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


def load_traces(
    paths: list[str | Path],
    *,
    force: bool = False,
    workers: int | None = None,
    progress: bool = False,
    halves: bool = True,
) -> list[RankEvents]:
    """Load every trace under ``paths`` (files, or folders searched for ``*.json``/``*.json.gz``).

    Returns one :class:`RankEvents` per rank, sorted by rank. Traces that cannot come from one run
    (see :func:`merge_conflict`) are refused; with ``force`` they are
    merged and the first rank's ``meta["merge_conflict"]`` says why they should not have been.

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
    files = trace_files(paths)
    loaded = _load_files(files, workers=workers, progress=progress, halves=halves)
    return merge_ranks(files, loaded, force=force)


def _load_one(path: Path) -> tuple[str, object]:
    """:func:`load_trace` in a worker: ("ok", ranks) or ("error", the one-line message)."""
    try:
        return "ok", load_trace(path)
    except UserError as e:
        return "error", str(e)


def _load_files(
    files: list[Path], *, workers: int | None, progress: bool, halves: bool = True
) -> list[list[RankEvents]]:
    """:func:`load_trace` of every file, in file order; in parallel where ``workers`` > 1.

    Raises
    ------
    UserError
        The first file in file order that could not be read (its one-line message).
    """

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


# The several-file side of loading traces: which files a ``--trace`` run reads (folders searched,
# duplicates and fastverify's own profiles dropped), how many to decode at once, and whether the
# ranks read can be the ranks of one run.
#
# :func:`load_traces` is the public entry point that uses these; nothing in this part reads a trace's
# events.

MAX_TRACE_FILES = 1024
"""Most trace files one ``--trace`` run reads: one per rank of one run (SGLang writes one per TP
rank, and tune bounds TP at 64; a DP x TP x PP x EP run of 1,024 GPUs is far past any PCIe box).
A folder with more is the wrong folder (a whole /tmp), refused before any is read."""

PEAK_BYTES_PER_JSON_BYTE = 4
"""A worker's peak memory per byte of inflated trace JSON, rounded up: 207 MB peak RSS (interpreter
and imports included) for the 53.7 MB HTA ``df_index_resolver`` trace, measured with
``/usr/bin/time`` on the benchmark machine (the trace benchmark)."""

PARALLEL_MIN_BYTES = 16 << 20
"""Below this much JSON in all, files are read one after the other: starting worker processes
costs more (30-100 ms measured on 2 cores) than reading two 3 MB traces takes."""

# Facts every rank of one run shares (distributedInfo and deviceProperties), with their wording.
_RUN_FACTS = (
    ("world_size", "distributedInfo.world_size"),
    ("gpu_name", "GPU model (deviceProperties)"),
    ("nccl_version", "distributedInfo.nccl_version"),
    ("dist_backend", "distributedInfo.backend"),
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


def trace_files(paths: list[str | Path]) -> list[Path]:
    """The trace files under ``paths`` (files as given, folders searched for ``*.json`` /
    ``*.json.gz``, sorted by name), each once, in that order.

    Raises
    ------
    UserError
        A path that does not exist, a folder without traces or with a non-regular file named like
        one, or more than :data:`MAX_TRACE_FILES` files.
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
        raise UserError(
            f"{len(files):,} trace files under {', '.join(path_text(p) for p in paths)[:200]}: more than "
            f"{MAX_TRACE_FILES:,}, the ranks one run can have; give the folder of one profile"
        )
    return files


def merge_ranks(files: list[Path], loaded: list[list[RankEvents]], *, force: bool) -> list[RankEvents]:
    """The ranks of every file (``loaded[i]`` read from ``files[i]``) as one run, sorted by rank.

    With ``force``, traces that cannot be one run (:func:`merge_conflict`) are merged anyway and
    the first rank's ``meta["merge_conflict"]`` (written in place) says why they should not have been.

    Raises
    ------
    UserError
        Two files claiming the same rank, CPU-only and GPU traces together, or (without ``force``)
        traces of different runs.
    """
    result: dict[int, RankEvents] = {}
    for f, ranks in zip(files, loaded):
        for r in ranks:
            if r.rank in result:
                if r.meta.get("rank_source", "").startswith("default") or result[r.rank].meta.get(
                    "rank_source", ""
                ).startswith("default"):
                    raise UserError(
                        f"{f}: no rank in the trace (distributedInfo) or its file name, and "
                        f"{result[r.rank].origin} is rank {r.rank} too; name files with -TP-<rank>"
                    )
                raise UserError(f"{f}: rank {r.rank} also claimed by {result[r.rank].origin}")
            result[r.rank] = r
    kinds = {r.meta["timing"]: r.origin for r in result.values()}
    if len(kinds) > 1:  # GPU kernel times and host wall clock must never be added up together
        raise UserError(
            f"{kinds.get('cpu_trace')}: a CPU-only trace (host clock), but {kinds.get('trace')} "
            "has GPU events; profile the traces of one run at a time"
        )
    ordered = [result[k] for k in sorted(result)]
    conflict = merge_conflict(ordered)
    if conflict and not force:
        raise UserError(f"{conflict}; these traces are not one run (pass --force to merge them anyway)")
    if conflict:
        ordered[0].meta["merge_conflict"] = f"merged with --force although {conflict}"
    return ordered


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
                return f"rank {r.rank} of {r.origin} is not below world_size {world} of {origin}"
    return None


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
    cores = usable_cores()
    need = PEAK_BYTES_PER_JSON_BYTE * max(sizes)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 0
    by_memory = max(1, int(avail // 2 // need)) if need and avail else cores
    return max(1, min(cores, len(files), by_memory))
