"""Which transport NCCL gives each GPU pair, P2P or SHM, now and at the recommended level.

Rules (NCCL ``src/graph/paths.cc`` ``ncclTopoCheckP2p``): a pair uses P2P when its NCCL path type
is at most ``NCCL_P2P_LEVEL`` (default PXB) and NVML reports P2P read and write support;
otherwise NCCL routes it through the CPU and uses SHM. nvidia-smi's NODE is NCCL's PHB. What an
NCCL log shows wins over the topology's rule, and each disagreement is one warning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from fastverify.nccl.debuglog import NcclLog
from fastverify.topo.matrix import NCCL_PATH_ORDER, Topology, nccl_path_type, p2p_allowed


@dataclass(frozen=True)
class PairReport:
    """One GPU pair (a < b). ``transport_*`` is "P2P" or "SHM"; ``seen`` = from the NCCL log;
    ``basis`` says where ``transport_now`` comes from: "seen in log", "predicted" (the topology and
    NCCL's path rule) or "environment: NCCL_P2P_LEVEL=LOC" (P2P off for every pair)."""

    a: int
    b: int
    link: str | None  # nvidia-smi connection (PIX, PXB, PHB, NODE, SYS, NV#)
    nccl_path: str | None
    hw_p2p: bool | None  # NVML P2P read+write support (None: unknown)
    transport_now: str
    transport_recommended: str
    seen: bool
    basis: str = ""


class _LogPairs(NamedTuple):
    """What an NCCL log says per GPU pair ``(a, b)``, ``a < b``: the transport it shows
    (``seen``), the path type of its GRAPH dump (``paths``), the pairs where NCCL could not
    enable P2P (``refused``). All empty without a log."""

    seen: dict
    paths: dict[tuple[int, int], str]
    refused: set


def _path_rank(path: str) -> int:
    """Position of an NCCL path type in NCCL's order; an unknown name ranks after SYS."""
    return NCCL_PATH_ORDER.index(path) if path in NCCL_PATH_ORDER else len(NCCL_PATH_ORDER)


def _log_pairs(log: NcclLog | None) -> _LogPairs:
    """The per-pair evidence of ``log`` (:class:`_LogPairs`)."""
    if not log:
        return _LogPairs({}, {}, set())
    return _LogPairs(log.transport_kinds(), _paths_from_log(log), {tuple(sorted(p)) for p in log.p2p_unavailable})


def _paths_from_log(log: NcclLog) -> dict[tuple[int, int], str]:
    """(a, b) with a < b → the NCCL path type the log's GRAPH dump shows between the two GPUs
    (keyed by the ranks of its topology dump), e.g. PHB where NCCL found no P2P."""
    out: dict[tuple[int, int], str] = {}
    ranks = log.gpu_ranks
    for (src, dst), info in log.gpu_paths().items():
        if src in ranks and dst in ranks and ranks[src] != ranks[dst]:
            a, b = sorted((ranks[src], ranks[dst]))
            if _path_rank(info.path_type) > _path_rank(out.get((a, b), "LOC")):
                out[(a, b)] = info.path_type
    return out


def _hw_p2p(topo: Topology | None, a: int, b: int) -> bool | None:
    """NVML's P2P read and write support both ways: False when any is refused, None when unknown."""
    if topo is None:
        return None
    r = [topo.p2p_read.get((a, b)), topo.p2p_write.get((a, b)), topo.p2p_read.get((b, a)), topo.p2p_write.get((b, a))]
    if any(v is False for v in r):
        return False
    if all(v is True for v in r):
        return True
    return None


def pair_reports(
    topo: Topology | None, log: NcclLog | None, level: str, level_source: str, env_off: str | None
) -> tuple[list[PairReport], list[int], list[str]]:
    """Every GPU pair the evidence knows, at P2P level ``level`` (``env_off``: the setting that
    turns P2P off for every pair, else None). Returns the pairs, the GPUs (topology's, else the
    log's) and the warnings where the log and the topology disagree."""
    ev = _log_pairs(log)
    warnings: list[str] = []
    if topo is not None and log is not None:
        warnings += _stray_gpus(topo, log, ev)
    gpus = sorted(topo.gpu_indices) if topo else sorted({d for pair in (*ev.seen, *ev.paths) for d in pair})
    if not gpus and log is not None and env_off and len(log.devices) >= 2:
        gpus = list(log.devices)  # P2P off for all: every pair of the devices that printed is on SHM
    pairs: list[PairReport] = []
    disagree: dict[str, list[str]] = {"SHM": [], "P2P": []}  # the log's transport against the level's rule
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            report, against = _pair(topo, a, b, level, env_off, ev)
            if report is not None:
                pairs.append(report)
            if against is not None:
                disagree[against].append(f"{a}-{b}")
    if disagree["SHM"]:
        warnings.append(
            f"{log.source} shows SHM for pair(s) {', '.join(disagree['SHM'])} although their path is "
            f"within NCCL_P2P_LEVEL={level} ({level_source}): NCCL found no peer access there (driver or "
            "ACS/IOMMU), so P2P is not recommended for them; the log's transport is what is shown"
        )
    if disagree["P2P"]:
        warnings.append(
            f"{log.source} shows P2P for pair(s) {', '.join(disagree['P2P'])} whose path NCCL_P2P_LEVEL="
            f"{level} ({level_source}) does not allow: the log was taken with other settings than these; "
            "the log's transport is what is shown"
        )
    return pairs, gpus, warnings


def _pair(
    topo: Topology | None, a: int, b: int, level: str, env_off: str | None, ev: _LogPairs
) -> tuple[PairReport | None, str | None]:
    """Pair ``(a, b)``'s report (None when nothing tells its transport), and the log's transport
    where it disagrees with the level's rule ("SHM" or "P2P"; else None)."""
    link = topo.link(a, b) if topo else None
    path = nccl_path_type(link) if link else None
    hw = _hw_p2p(topo, a, b)
    if (a, b) in ev.refused:
        hw = False  # NCCL said it could not enable P2P for this pair
    seen_path = ev.paths.get((a, b))
    if seen_path is not None:
        if path is not None and _path_rank(seen_path) > _path_rank(path) and _path_rank(path) <= _path_rank("PXB"):
            hw = False  # NCCL re-routed a switch-local pair through the CPU: no P2P there
        path = seen_path
        if link is None:
            link = seen_path
    against = None
    if (a, b) in ev.seen:
        now, was_seen, basis = ev.seen[(a, b)], True, "seen in log"
        if link is not None and now == "SHM" and p2p_allowed(link, level) and hw is not False:
            hw = False  # NCCL tried P2P (the level allows it) and fell back: no peer access there
            against = "SHM"
        elif link is not None and now == "P2P" and not p2p_allowed(link, level):
            against = "P2P"
    elif link is not None:
        now, was_seen, basis = ("P2P" if p2p_allowed(link, level) and hw is not False else "SHM"), False, "predicted"
    elif env_off:
        now, was_seen, basis = "SHM", False, f"environment: {env_off}"
    else:
        return None, None
    return PairReport(a, b, link, path, hw, now, "SHM" if hw is False else "P2P", was_seen, basis), against


def recommend_level(pairs: list[PairReport], level: str) -> tuple[str | None, list[PairReport]]:
    """The widest NCCL path type among pairs whose hardware can do P2P, None when ``level``
    already covers every such pair; without a recommendation each pair's recommended transport
    is its current one."""
    capable = [p.nccl_path for p in pairs if p.hw_p2p is not False and p.nccl_path]
    recommended = max(capable, key=NCCL_PATH_ORDER.index) if capable else None
    if recommended is not None and NCCL_PATH_ORDER.index(recommended) <= NCCL_PATH_ORDER.index(level):
        recommended = None  # the current level already covers every pair that can do P2P
    if recommended is None:
        pairs = [replace(p, transport_recommended=p.transport_now) for p in pairs]
    return recommended, pairs


def _stray_gpus(topo: Topology, log: NcclLog, ev: _LogPairs) -> list[str]:
    """One warning naming the GPUs the log names but the topology lacks (their pairs are left out)."""
    have = set(topo.gpu_indices)
    named = {d for pair in (*ev.seen, *ev.paths, *ev.refused) for d in pair}
    stray = sorted(named - have)
    if not stray:
        return []
    lines = sorted({t.line for t in log.transports if t.src_dev in stray or t.dst_dev in stray} - {0})
    where = f" (line {lines[0]}{' and more' if len(lines) > 1 else ''})" if lines else ""
    return [
        (
            f"{log.source} names GPU(s) {', '.join(map(str, stray))}{where}, which {topo.source} does not have "
            f"(GPUs {_span(sorted(have))}): their pairs are left out, the rest is kept; a log from another box, "
            "or taken under another CUDA_VISIBLE_DEVICES?"
        )
    ]


def _span(xs: list[int]) -> str:
    return (
        f"{xs[0]}-{xs[-1]}" if xs and xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2 else ", ".join(map(str, xs))
    )
