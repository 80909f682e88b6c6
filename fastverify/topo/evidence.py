"""What the NCCL log and the ``all_reduce_perf`` table say on their own, beside the GPU pairs.

The log: NCCL's own TUNING lines (model table, the choice it gives each verify size, launched
sizes), the settings it read or rejected, its failed graph search and warnings. The table:
NCCL's measured time of each verify size, and where the table does not match the box.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastverify.nccl import model as M
from fastverify.nccl.enabled import enabled_algos_protos
from fastverify.nccl.logrecords import NcclLog
from fastverify.nccl.perftable import PerfTable

_LOG_PROTO = {"LL": M.Proto.LL, "LL128": M.Proto.LL128, "SIMPLE": M.Proto.SIMPLE}  # names as the log prints them


def log_notes(log: NcclLog) -> list[str]:
    """One line each for what the log itself reports: a failed graph search, the settings NCCL
    read or rejected, pairs without P2P, the first five NCCL warnings."""
    notes = []
    if log.graph_fallbacks:
        notes.append("NCCL's topology search failed ('falling back to simple order', pattern "
                     f"{', '.join(map(str, log.graph_fallbacks))}): it then picks the Simple protocol for most sizes; "
                     "NCCL_PROTO=LL (small messages) or a graph file (NCCL_GRAPH_FILE) avoids that")
    for name, value in sorted(log.env.items()):
        notes.append(f"NCCL read {name}={value} from the environment")
    for name, value in sorted(log.env_invalid.items()):
        notes.append(f"NCCL rejected {name}={value} and used its default")
    for a, b in log.p2p_unavailable:
        notes.append(f"NCCL could not enable P2P between devices {a} and {b}")
    for w in log.warnings[:5]:
        notes.append(f"NCCL WARN: {w.message}")
    return notes


def partial_note(log: NcclLog, env_off: str | None, n: int) -> str:
    """What a log without GPU pairs (no ``via`` lines, no GRAPH path dump) still says."""
    gpus = f"{n} GPUs" if n > 1 else "the number of GPUs is unknown"
    if env_off:
        return (f"partial: the log shows no GPU pair, but {env_off} (P2P disabled) puts every pair on SHM "
                f"(NCCL src/graph/paths.cc); {gpus}")
    what = [k for k, v in (("the TUNING table", log.tuning), ("NCCL's per-size choices", log.calls),
                           ("the settings NCCL read", log.env), ("the version", log.version)) if v]
    return (f"partial: the log shows no GPU pair (no 'via' transport lines, no GRAPH path dump){'; it holds ' if what else ''}"
            f"{', '.join(what)}; {gpus}; capture NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV,TUNING for the pairs")


def nccl_tuning(log: NcclLog, hidden: int, draft_tokens: int, batches: tuple[int, ...], env: Mapping[str, str],
                 nv, sm: int) -> dict | None:
    """NCCL's own TUNING evidence in the log: the AllReduce model table (latency µs, algBw GB/s per
    algorithm/protocol), the choice that table gives each verify size (``ncclTopoGetAlgoTime``:
    ``lat + bytes / (1000 · algBw)``, Tree's algBw × ``treeCorrectionFactor``; NCCL src/graph/tuning.cc
    and enqueue.cc, as in :func:`fastverify.nccl.model.predict`), and the per-size choices NCCL
    printed for the collectives it launched. ``None`` when the log has neither."""
    rows = log.tuning_rows("AllReduce")
    calls = [c for c in log.calls if c.func in (None, "AllReduce")]
    if not rows and not calls:
        return None
    enabled = enabled_algos_protos(env, nv, sm)
    on_a = {a.value.upper() for a in enabled.algos}
    # The table already holds 0/0 where NCCL's own rule turned a cell off; an explicit NCCL_PROTO
    # (e.g. a --set being evaluated) is applied on top.
    on_p = {p.value.upper() for p in enabled.protos} if enabled.protos_set else set(_LOG_PROTO)
    verify = []
    for b in batches:
        nbytes = b * draft_tokens * hidden * 2
        times = {}
        for algo, proto, lat, bw in rows:
            if algo not in ("TREE", "RING") or algo not in on_a or proto not in on_p or proto not in _LOG_PROTO \
                    or bw <= 0:
                continue
            f = M.tree_correction_factor(_LOG_PROTO[proto], nbytes) if algo == "TREE" else 1.0
            times[(algo, proto)] = lat + nbytes / (1000.0 * bw * f)
        if times:
            order = [(a, p) for a in ("TREE", "RING") for p in ("LL", "LL128", "SIMPLE")]
            best = min(times, key=lambda k: (times[k], order.index(k)))
            verify.append({"tokens": b * draft_tokens, "msg_bytes": nbytes, "algo_proto": f"{best[0]}/{best[1]}",
                           "time_us": round(times[best], 1), "label": "predicted"})
    choices: dict[tuple, dict] = {}
    for c in calls:
        choices.setdefault((c.size_bytes, c.algo, c.proto), {
            "size_bytes": c.size_bytes, "algo": c.algo, "proto": c.proto, "time_us": c.time_us, "line": c.line})
    return {"model_table": [{"algo": a, "proto": p, "latency_us": lat, "algbw_gbps": bw} for a, p, lat, bw in rows],
            "verify_choice": verify, "launched": sorted(choices.values(), key=lambda d: (d["size_bytes"], d["line"])),
            "basis": f"NCCL's own TUNING lines in {log.source}"}


def measured_times(perf: PerfTable, hidden: int, draft_tokens: int, batches: tuple[int, ...]) -> list[dict]:
    """Measured NCCL time of each verify size from the user's all_reduce_perf table, read as
    ``tune`` reads it (:meth:`PerfTable.verify_time_us`: the in-place column, interpolated between
    measured sizes; None outside them); ``column`` names the column read."""
    out = []
    for b in sorted(set(batches)):
        nbytes = b * draft_tokens * hidden * 2
        t, column = perf.verify_time_us(nbytes)
        exact = nbytes in perf.sizes
        out.append({"tokens": b * draft_tokens, "msg_bytes": nbytes, "time_us": None if t is None else round(t, 1),
                    "column": column,
                    "basis": ("measured" if exact else "interpolated between measured sizes") if t is not None
                    else f"outside the measured sizes {min(perf.sizes)}-{max(perf.sizes)} B",
                    "source": perf.source, "label": "measured"})
    return out


def perf_warnings(perf: PerfTable, n: int | None, what: str) -> list[str]:
    """The table against the box (several nodes, another world size), and the rows it dropped."""
    out = []
    several = perf.several_nodes(n or None)
    if several:
        out.append(several)
    elif perf.n_ranks and n and perf.n_ranks != n:
        out.append(f"{perf.source} was measured on {perf.n_ranks} ranks, the {what} has {n}: its times are for "
                   "another world size")
    if (dropped := perf.dropped_warning()) is not None:
        out.append(dropped)
    out += [f"{perf.source}: {p}" for p in perf.problems if "data row dropped" not in p]  # a second table
    return out
