"""A bundle's parts read into the cycle report's evidence: the server's traces split into cycles,
the verify all-reduce size, and the NCCL log, topology, IOMMU, NVML, P2P-check and sweep parts."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import orjson

from fastverify.cycle.flags import Evidence
from fastverify.cycle.split import forwards, split_cycles
from fastverify.errors import UserError
from fastverify.events import EventClass

__all__ = ["evidence", "json_part"]

_TRACE_SUFFIXES = (".json", ".json.gz")
_VERIFY_BS = re.compile(r"^step\[(?:TARGET_)?VERIFY bs=(\d+)")



def _traces(bundle, tmp: Path) -> tuple[list[str], str | None]:
    """Extract the server's traces (else the verify-log folder's) and return their paths and part."""
    for part in ("server_trace", "verify_log"):
        p = bundle.part(part)
        if p is None or p.status != "ok":
            continue
        names = [f for f in p.files if f.endswith(_TRACE_SUFFIXES) and "trace" in Path(f).name]
        if names:
            return [str(x) for x in bundle.extract(names, tmp / part)], part
    return [], None


def json_part(bundle, name: str, kind: type = dict):
    """The JSON of part ``name`` when it is a ``kind`` (a bundle is read, not trusted), else None.

    Raises
    ------
    UserError
        The member is not JSON (named with the bundle).
    """
    p = bundle.part(name)
    if p is None or p.status != "ok" or not p.files:
        return None
    try:
        doc = orjson.loads(bundle.read(p.files[0]))
    except orjson.JSONDecodeError as e:
        raise UserError(f"{bundle.path}: {p.files[0]} is not JSON ({e})") from None
    return doc if isinstance(doc, kind) else None


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
            sel = (t >= start) & (t < end) & (r.msg_bytes > 0) & (
                (r.cls == EventClass.ALLREDUCE.code) | (r.cls == EventClass.FUSED_ALLREDUCE.code))
            sizes += r.msg_bytes[sel].tolist()
    if sizes:
        return statistics.mode(sizes)
    shapes = meta.get("verify_shapes") if isinstance(meta.get("verify_shapes"), dict) else {}
    read = shapes.get("shapes_from") if isinstance(shapes.get("shapes_from"), dict) else {}
    hidden, k = shapes.get("hidden"), shapes.get("draft_tokens")
    if any(str(read.get(f, "default")).startswith("default") for f in ("hidden", "draft_tokens")):
        return None  # collect's defaults, not the server's: no size is known
    bs = [int(m.group(1)) for r in ranks for st in r.steps if (m := _VERIFY_BS.match(st.name))]
    if isinstance(hidden, int) and isinstance(k, int) and hidden > 0 and k > 0 and bs:
        return int(statistics.median_low(bs)) * k * hidden * 2
    return None


def evidence(bundle, tmp: Path) -> tuple[Evidence, list[str]]:
    """Parse every part of ``bundle`` the report uses; notes say what was missing."""
    notes = []
    files, part = _traces(bundle, tmp)
    ev = Evidence()
    server = json_part(bundle, "server_args")
    args_part = bundle.part("server_args")
    server_args = (server or {}).get("server_args", server) if isinstance(server, dict) else None
    if files:
        from fastverify.trace.load import load_traces

        try:
            ranks = load_traces(files, progress=False)
        except UserError as e:  # name the bundle's member, not the temporary folder it was read from
            raise UserError(str(e).replace(str(tmp / part) + "/", f"{bundle.path}: ")) from None
        ev.split = split_cycles(ranks)
        ev.sources["trace"] = f"{len(files)} trace file(s) from the bundle's {part}"
        ev.world_size = next((r.meta.get("world_size") for r in ranks if r.meta.get("world_size")), None)
        ev.msg_bytes = _msg_bytes(ranks, dict(args_part.meta) if args_part else {})
        if ev.split is not None and not any(r.cycles for r in ev.split.ranks):
            notes.append("the traces hold fewer than two forwards of one mode (draft stage, verify or decode) "
                         "per rank: no complete cycle; profile more steps (`collect --cycles N`)")
            ev.split = None
        elif ev.split is None:
            notes.append("the traces have no SGLang step spans (step[VERIFY ...]): no cycles to split; was the "
                         "profile taken with SGLang's /start_profile?")
    else:
        notes.append("no server trace in the bundle: the cycle split needs `fastverify collect --server URL` "
                     "while the server serves traffic")
    if ev.world_size is None and isinstance(server_args, dict) and isinstance(server_args.get("tp_size"), int):
        ev.world_size = server_args["tp_size"]
    p = bundle.part("nccl_log")
    if p is not None and p.status == "ok" and p.files:
        from fastverify.nccl.logparse import parse_nccl_log

        try:
            ev.nccl_log = parse_nccl_log(bundle.read(p.files[0]).decode(errors="replace"), source=p.files[0])
            ev.sources["nccl_log"] = p.files[0]
        except UserError as e:  # one unreadable part is a note; the rest of the report stands
            notes.append(f"nccl_log: not read ({e})")
    p = bundle.part("nvidia_smi_topo")
    if p is not None and p.status == "ok" and p.files:
        from fastverify.topo.diagnose import diagnose
        from fastverify.topo.matrix import parse_nvidia_smi_topo

        try:
            topo = parse_nvidia_smi_topo(bundle.read(p.files[0]).decode(errors="replace"), source=p.files[0])
            # the server's own NCCL_* settings are not in the bundle: NCCL's defaults, said in the flag
            ev.topo = diagnose(topo, ev.nccl_log, {})
            ev.sources["nvidia_smi_topo"] = p.files[0]
        except UserError as e:
            notes.append(f"nvidia_smi_topo: not read ({e})")
    ev.iommu = json_part(bundle, "host_iommu")
    ev.nvml = json_part(bundle, "nvml")
    ev.p2p_check = json_part(bundle, "p2p_check", list)
    ev.sweep = json_part(bundle, "sweep")
    if ev.sweep is not None:
        ev.sources["sweep"] = "sweep/tune.json"
    for part_ in bundle.manifest.parts:
        if part_.status != "ok":
            notes.append(f"{part_.name}: {part_.status} ({part_.reason})")
    return ev, notes
