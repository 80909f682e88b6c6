"""A bundle's parts read into the cycle report's evidence: the server's traces split into cycles,
the verify all-reduce size, and the NCCL log, topology, IOMMU, NVML, P2P-check and sweep parts."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from fastverify.bounds import (
    MAX_BATCH,
    MAX_DRAFT_TOKENS,
    MAX_HIDDEN,
    MAX_WORLD_SIZE,
    MIN_TIME_US,
    duplicate_json_key,
    implausible_count,
)
from fastverify.cycle.flags import Evidence, dropped_sweep_point
from fastverify.cycle.split import forwards, mode_of_step, split_cycles
from fastverify.errors import UserError, one_line
from fastverify.events import EventClass
from fastverify.inputs import loads_json
from fastverify.nccl.debuglog import parse_nccl_log
from fastverify.topo.diagnose import diagnose
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.topo.p2p_proof import CHECK_SCHEMA, CHECK_VERSION
from fastverify.trace.load import load_traces

__all__ = ["evidence", "json_part", "p2p_rows", "server_arguments"]

_TRACE_SUFFIXES = (".json", ".json.gz")
_VERIFY_BS = re.compile(r"^step\[(?:TARGET_)?VERIFY bs=(\d+)")
_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _traces(bundle) -> tuple[list[str], str | None]:
    """The bundle's copies of the server's traces (else the verify-log folder's), and their part."""
    for part in ("server_trace", "verify_log"):
        p = bundle.part(part)
        if p is None or p.status != "ok":
            continue
        names = [f for f in p.files if f.endswith(_TRACE_SUFFIXES) and "trace" in Path(f).name]
        if names:
            return [str(x) for x in bundle.local(names)], part
    return [], None


def json_part(bundle, name: str, kind: type | tuple[type, ...] = dict, notes: list[str] | None = None):
    """The JSON of part ``name`` when it is a ``kind`` (a type or a tuple of types; a bundle is
    read, not trusted), else None.

    A member that cannot be read (over its size cap), is not JSON, gives one key twice in an
    object or is not a ``kind`` is a note in ``notes`` naming ``BUNDLE:member`` (the rest of the report stands); without ``notes``, it
    raises.

    Raises
    ------
    UserError
        Only when ``notes`` is None: the member cannot be read, is not JSON or gives a key
        twice in one object (named ``BUNDLE:member``).
    """
    p = bundle.part(name)
    if p is None or p.status != "ok" or not p.files:
        return None
    member = p.files[0]
    try:
        data = bundle.read(member)
        doc = loads_json(data, bundle.where(member))
        if (key := duplicate_json_key(data)) is not None:  # a parser keeps the last value silently
            raise UserError(
                f"{bundle.where(member)}: the key {one_line(repr(key), 80)} is given twice in one "
                "object; which value holds is not known"
            )
    except UserError as e:
        if notes is None:
            raise
        notes.append(f"{name}: not read ({e})")
        return None
    if not isinstance(doc, kind):
        if notes is not None:
            want = " or ".join(_JSON_TYPES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
            notes.append(
                f"{name}: not read ({bundle.where(member)}: {_JSON_TYPES.get(type(doc), 'a value')}, not {want})"
            )
        return None
    return doc


def _bad_p2p_row(row) -> str | None:
    """Why ``row`` is no result of the P2P check (``{src, dst, ok, reason[, timed_out]}`` of two
    GPU ordinals below :data:`~fastverify.bounds.MAX_WORLD_SIZE`), or None when it is one."""
    if not isinstance(row, dict):
        return f"a result is {_JSON_TYPES.get(type(row), 'a value')}, not an object"
    for key in ("src", "dst"):
        if (why := implausible_count(row.get(key), upper=MAX_WORLD_SIZE - 1, what="GPU ordinal")) is not None:
            return f"{key}: {why}"
    if row["src"] == row["dst"]:
        return f"src and dst are both GPU {row['src']}: a direction is two GPUs"
    if type(row.get("ok")) is not bool:
        return f"ok is {one_line(repr(row.get('ok')), 60)}, not true or false"
    if not isinstance(row.get("reason", ""), str) or not (
        row.get("timed_out") is None or type(row.get("timed_out")) is bool
    ):
        return "reason is not a string or timed_out not true or false"
    return None


def p2p_rows(bundle, notes: list[str]) -> list[dict] | None:
    """The P2P check's results (``[{src, dst, ok, reason}, ...]``) from the p2p_check part: the
    ``results`` of the document ``fastverify p2p`` prints (schema ``fastverify.p2p_check`` version
    2, what collect stores), or an older bare list of them; None when there is no such part or it
    cannot be read (a note). A result that is not one (a GPU ordinal of 10**18, ``"ok": "yes"``)
    or gives a direction again is left out, and a note says how many, naming ``BUNDLE:member``."""
    doc = json_part(bundle, "p2p_check", (dict, list), notes)
    if doc is None:
        return None
    where = bundle.where(bundle.part("p2p_check").files[0])
    if isinstance(doc, dict):
        if doc.get("schema") != CHECK_SCHEMA or doc.get("version") != CHECK_VERSION:
            notes.append(
                f"p2p_check: not read ({where}: schema {one_line(repr(doc.get('schema')), 80)} version "
                f"{one_line(repr(doc.get('version')), 20)}, not {CHECK_SCHEMA!r} version {CHECK_VERSION})"
            )
            return None
        doc = doc.get("results")
        if not isinstance(doc, list):
            notes.append(f"p2p_check: not read ({where}: its results are not a list)")
            return None
    kept, bad, seen = [], [], set()
    for row in doc:
        why = _bad_p2p_row(row)
        if why is None and (row["src"], row["dst"]) in seen:
            why = f"direction ({row['src']}, {row['dst']}) given again"
        if why is None:
            seen.add((row["src"], row["dst"]))
            kept.append(row)
        else:
            bad.append(why)
    if bad:
        notes.append(f"p2p_check: {len(bad)} of {len(doc)} results left out ({where}: {bad[0]})")
    return kept


def _msg_bytes(ranks, meta: dict) -> int | None:
    """The verify all-reduce payload (bytes): the most common size of the verify forwards' own
    all-reduces where the traces record sizes (eager launches), else the verify batch (the step
    spans' ``bs=``) x draft tokens x hidden x 2 B (bf16) as collect read them from the server
    (``meta``: the server_args part's facts; never collect's defaults)."""
    sizes = []
    for r in ranks:  # the verify forwards' own all-reduces, not the drafter's (another shape)
        t = r.launch_ns if r.launch_ns is not None else r.start_ns
        for mode, start, end in forwards(r):
            if mode != "verify":
                continue
            sel = (
                (t >= start)
                & (t < end)
                & (r.msg_bytes > 0)
                & ((r.cls == EventClass.ALLREDUCE.code) | (r.cls == EventClass.FUSED_ALLREDUCE.code))
            )
            sizes += r.msg_bytes[sel].tolist()
    if sizes:
        return statistics.mode(sizes)
    shapes = meta.get("verify_shapes") if isinstance(meta.get("verify_shapes"), dict) else {}
    read = shapes.get("shapes_from") if isinstance(shapes.get("shapes_from"), dict) else {}
    hidden, k = shapes.get("hidden"), shapes.get("draft_tokens")
    if any(str(read.get(f, "default")).startswith("default") for f in ("hidden", "draft_tokens")):
        return None  # collect's defaults, not the server's: no size is known
    bs = [int(m.group(1)) for r in ranks for st in r.steps if (m := _VERIFY_BS.match(st.name))]
    bs = [b for b in bs if 1 <= b <= MAX_BATCH]
    if (
        implausible_count(hidden, lower=1, upper=MAX_HIDDEN) is None
        and bs
        and implausible_count(k, lower=1, upper=MAX_DRAFT_TOKENS) is None
    ):
        return int(statistics.median_low(bs)) * k * hidden * 2
    return None


def server_arguments(bundle, notes: list[str]) -> dict | None:
    """The server's arguments from the server_args part (SGLang nests them under ``server_args``)."""
    server = json_part(bundle, "server_args", notes=notes)
    args = server.get("server_args", server) if isinstance(server, dict) else None
    return args if isinstance(args, dict) else None


def _text_part(bundle, name: str, notes: list[str]) -> tuple[str, str] | None:
    """``(BUNDLE:member, text)`` of a text part that is ok, else None; unreadable: a note."""
    p = bundle.part(name)
    if p is None or p.status != "ok" or not p.files:
        return None
    try:
        return bundle.where(p.files[0]), bundle.read(p.files[0]).decode(errors="replace")
    except UserError as e:
        notes.append(f"{name}: not read ({e})")
        return None


def _read_traces(bundle, ev: Evidence, notes: list[str]):
    """The trace part split into cycles (``ev.split``, world size, message size); the ranks read."""
    files, part = _traces(bundle)
    if not files:
        notes.append(_no_trace_note(bundle))
        return None
    try:
        ranks = load_traces(files, progress=False)
    except UserError as e:  # name the bundle's member, not the temporary copy it was read from
        raise UserError(bundle.rename(str(e))) from None
    ev.split = split_cycles(ranks)
    ev.sources["trace"] = f"{len(files)} trace file(s) from the bundle's {part}"
    sizes = [r.meta.get("world_size") for r in ranks]
    ev.world_size = next((w for w in sizes if implausible_count(w, lower=1, upper=MAX_WORLD_SIZE) is None), None)
    if ev.split is not None and not any(r.cycles for r in ev.split.ranks):
        notes.append(
            "the traces hold fewer than two forwards of one mode (draft stage, verify or decode) "
            "per rank: no complete cycle; profile more steps (`collect --cycles N`)"
        )
        ev.split = None
    elif ev.split is not None and (short := _short_cycle(ev.split)) is not None:
        notes.append(short)
        ev.split = None
    elif ev.split is None:
        zero = any(mode_of_step(st.name) for r in ranks for st in r.steps)
        notes.append(
            "the traces' SGLang step spans (step[VERIFY ...]) all last 0 ns: no time was measured, no cycles to split"
            if zero
            else "the traces have no SGLang step spans (step[VERIFY ...]): no "
            "cycles to split; was the profile taken with SGLang's /start_profile?"
        )
    return ranks


def _no_trace_note(bundle) -> str:
    """Why the bundle holds no server trace: the files collect left out (their names, not regular
    files), else the part's own reason when it did not succeed, else that none was collected."""
    p = bundle.part("server_trace")
    meta = dict(p.meta) if p is not None and isinstance(p.meta, dict) else {}
    left = []
    for key, why in (
        ("left_out_control_chars", "whose name holds control characters"),
        ("left_out_not_utf8", "whose name is not UTF-8"),
        ("left_out_not_regular", "that are no regular files (links, FIFOs)"),
    ):
        names = meta.get(key)
        if isinstance(names, list) and names:
            left.append(f"{len(names)} trace file(s) {why} ({one_line(', '.join(map(str, names[:3])), 200)})")
    if left:
        return f"no server trace in the bundle: collect left out {'; '.join(left)}"
    if p is not None and p.status == "failed":
        return f"no server trace in the bundle: server_trace failed ({one_line(str(p.reason), 300)})"
    return (
        "no server trace in the bundle: the cycle split needs `fastverify collect --server URL` "
        "while the server serves traffic"
    )


def _short_cycle(split) -> str | None:
    """Why the cycles of ``split`` cannot be measured times (a rank whose cycles run under
    :data:`~fastverify.bounds.MIN_TIME_US`: a trace of 0-length events), or None when they can."""
    for r in split.ranks:
        if r.cycles and min(r.cycle_mean_us, r.cycle_median_us) < MIN_TIME_US:
            return (
                f"TP rank {r.rank}'s cycle lasts {r.cycle_mean_us:g} µs over its {r.cycles} complete cycles, "
                f"below {MIN_TIME_US:g} µs, less than any measured work takes: the trace's times are no "
                "measurements; no cycle split and no verdict"
            )
    return None


def evidence(bundle) -> tuple[Evidence, list[str]]:
    """Parse every part of ``bundle`` (:class:`fastverify.bundle.Bundle`) the report uses; notes
    say what was missing, and which part could not be read (named ``BUNDLE:member``).

    Every part but the trace is read as far as it can be: a member over its size cap, not JSON,
    of the wrong JSON type or not parseable is a note and the rest of the report stands. The
    trace is the report's subject: one that cannot be read is an error.

    Raises
    ------
    UserError
        A trace of the bundle cannot be read (one line naming ``BUNDLE:member``).
    """
    notes: list[str] = []
    ev = Evidence()
    server_args = server_arguments(bundle, notes)
    ranks = _read_traces(bundle, ev, notes)
    if ranks is not None:
        args_part = bundle.part("server_args")
        ev.msg_bytes = _msg_bytes(ranks, dict(args_part.meta) if args_part else {})
    tp = server_args.get("tp_size") if server_args else None
    if ev.world_size is None and implausible_count(tp, lower=1, upper=MAX_WORLD_SIZE) is None:
        ev.world_size = tp
    if (got := _text_part(bundle, "nccl_log", notes)) is not None:
        try:
            ev.nccl_log = parse_nccl_log(got[1], source=got[0])
            ev.sources["nccl_log"] = got[0]
        except UserError as e:  # one unreadable part is a note; the rest of the report stands
            notes.append(f"nccl_log: not read ({e})")
    if (got := _text_part(bundle, "nvidia_smi_topo", notes)) is not None:
        try:
            topo = parse_nvidia_smi_topo(got[1], source=got[0])
            # the server's own NCCL_* settings are not in the bundle: NCCL's defaults, said in the flag
            ev.topo = diagnose(topo, ev.nccl_log, {})
            ev.sources["nvidia_smi_topo"] = got[0]
        except UserError as e:
            notes.append(f"nvidia_smi_topo: not read ({e})")
    json_part(bundle, "doctor", notes=notes)  # not used by the report, but never silently unreadable
    ev.iommu = json_part(bundle, "host_iommu", notes=notes)
    ev.nvml = json_part(bundle, "nvml", notes=notes)
    ev.p2p_check = p2p_rows(bundle, notes)
    ev.sweep = json_part(bundle, "sweep", notes=notes)
    if ev.sweep is not None:
        ev.sources["sweep"] = "sweep/tune.json"
        if (dropped := dropped_sweep_point(ev)) is not None:
            notes.append(dropped)
    for part_ in bundle.manifest.parts:
        if part_.status != "ok":
            notes.append(f"{part_.name}: {part_.status} ({part_.reason})")
    return ev, notes
