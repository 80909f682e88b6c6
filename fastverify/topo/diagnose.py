"""The diagnosis behind ``fastverify topo``: which GPU pairs NCCL runs over P2P and which over SHM,
whether a PCIe IPC all-reduce can run, the NCCL_P2P_LEVEL to use, settings NCCL would ignore, and
the predicted all-reduce time of the verify step's messages under the current and the recommended
settings.

Inputs, any of: a topology (``nvidia-smi topo -m`` text, or NVML on a live box), an
``NCCL_DEBUG=INFO`` log (what NCCL really did: transports per pair, graph, version, settings it
read), an ``all_reduce_perf`` table (NCCL measured on the box), and the environment's ``NCCL_*``
settings. What a log shows is reported as seen; what comes from the topology alone is labelled
predicted; the table's times are measured. Any one input is enough for a (partial) diagnosis; where
inputs disagree the log's transports win and ``Diagnosis.warnings`` says so. The pair rules are in
the transports section below.

Whether the PCIe IPC and SGLang custom all-reduces can run on the diagnosed pairs
(:func:`pcie_ipc_fit`, :func:`custom_ar_fit`). PCIe IPC all-reduce (FlashInfer
``PcieIpcAllReduceWorkspace``): world size 2, 4 or 8 on one node, and CUDA peer access between
every pair. SGLang's custom all-reduce: the world sizes and NVLink rule of
:func:`fastverify.registry.backend_info` (SGLang 0.5.23 ``custom_all_reduce.py`` /
``custom_all_reduce_utils.py``), plus peer access.

What the NCCL log and the ``all_reduce_perf`` table say on their own, beside the GPU pairs
(:func:`log_notes`, :func:`nccl_tuning`, :func:`measured_times`, :func:`perf_warnings`). The log:
NCCL's own TUNING lines (model table, the choice it gives each verify size, launched sizes), the
settings it read or rejected, its failed graph search and warnings. The table: NCCL's measured time
of each verify size, and where the table does not match the box.

Which transport NCCL gives each GPU pair, P2P or SHM, now and at the recommended level.

Rules (NCCL ``src/graph/paths.cc`` ``ncclTopoCheckP2p``): a pair uses P2P when its NCCL path type
is at most ``NCCL_P2P_LEVEL`` (default PXB) and NVML reports P2P read and write support;
otherwise NCCL routes it through the CPU and uses SHM. nvidia-smi's NODE is NCCL's PHB. What an
NCCL log shows wins over the topology's rule, and each disagreement is one warning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from fastverify.nccl import model as M
from fastverify.nccl.checks import Finding, Severity, validate_env
from fastverify.nccl.debuglog import NcclLog
from fastverify.nccl.model import enabled_algos_protos
from fastverify.nccl.perftable import PerfTable
from fastverify.nccl.version import NcclVersion
from fastverify.registry import BackendName, backend_info
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
    topo: Topology | None,
    log: NcclLog | None,
    level: str,
    level_source: str,
    env_off: str | None,
    box: Topology | None = None,
) -> tuple[list[PairReport], list[int], list[str]]:
    """Every GPU pair the evidence knows, at P2P level ``level`` (``env_off``: the setting that
    turns P2P off for every pair, else None). Returns the pairs, the GPUs (topology's, else the
    log's) and the warnings where the log and the topology disagree. ``box``: the whole box where
    ``topo`` is a part of it (a TP group); only a GPU the box lacks is warned of, and the log's
    pairs outside ``topo`` are left out."""
    ev = _log_pairs(log)
    warnings: list[str] = []
    if topo is not None and log is not None:
        warnings += _stray_gpus(box or topo, log, ev)
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


DEFAULT_HIDDEN = 7168  # Kimi-K2 / DeepSeek-V3 hidden size (config.json)
DEFAULT_DRAFT_TOKENS = 4  # SGLang's auto default for DeepSeek-V3/Kimi (speculative_hook.py)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
_LEGACY_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")  # NCCL_P2P_LEVEL=0..5 (paths.cc)

# The PCIe correction of fastverify.nccl.model fitted by model.fit over 8 B..4 MiB on the two
# all_reduce_perf tables (P2P disabled, P2P unlocked) of one 8x RTX 4090 box (2x EPYC 7542, all
# pairs SYS; blog.chlc.cc); the tests re-fit and compare. Held-out median error 4.7 % / 6.6 %.
# One box: a prediction for others, not a measurement.
CALIBRATION = {
    M.Transport.SHM: M.CorrectedModel(
        1.427508763214285,
        {M.Proto.LL: 0.5471045232094344, M.Proto.SIMPLE: 0.6259045643247795},
        fitted_on=M.Transport.SHM,
    ),
    M.Transport.P2P: M.CorrectedModel(
        1.363210043928571,
        {M.Proto.LL: 0.5870247488345354, M.Proto.SIMPLE: 0.7623050161320486},
        fitted_on=M.Transport.P2P,
    ),
}
CALIBRATION_NOTE = (
    "predicted: NCCL's cost model (src/graph/tuning.cc) with a PCIe correction fitted on one "
    "8x RTX 4090 all-SYS box; measure with `fastverify tune` before relying on it"
)


@dataclass(frozen=True)
class MessagePrediction:
    """Predicted all-reduce time of one verify message (µs); ``label`` is always "predicted"."""

    tokens: int
    msg_bytes: int
    now_us: float
    now_algo_proto: str
    recommended_us: float
    recommended_algo_proto: str
    label: str = "predicted"


@dataclass
class Diagnosis:
    """Everything ``fastverify topo`` reports; :meth:`as_dict` is its ``--json`` form.

    ``warnings``: where pieces of evidence disagree (the log against the topology, a GPU the log
    names that the topology lacks, a perf table of another world size). ``nccl_tuning``: NCCL's own
    TUNING lines of the log (model table, the choice it gives each verify size, launched sizes),
    ``None`` without. ``perf_table``: :meth:`PerfTable.summary` of the ``all_reduce_perf`` table;
    ``measured``: its time for each verify size (µs, measured, interpolated between sizes).
    ``advice``: the box's options ranked by :func:`fastverify.tune.advice.rank_options`, the
    ranking ``tune --predict`` prints (:func:`with_advice`; entries of
    :func:`fastverify.topo_command.advice_entries`), ``None`` where it could not run;
    ``advice_notes``: where its evidence stops, or the one line saying why there is none.
    ``scope``: the one line saying which GPUs of the box the diagnosis is about where it is not the
    whole box (``topo --tp N`` below the GPU count: the TP group,
    :meth:`fastverify.topo.matrix.Topology.first_gpus`); None for the whole box.
    """

    sources: list[str]
    n_gpus: int
    nccl_version: str | None
    p2p_level_now: str
    p2p_level_now_source: str
    p2p_level_recommended: str | None
    pairs: list[PairReport]
    pcie_ipc_allreduce: dict
    custom_allreduce: dict
    findings: list[Finding]
    log_notes: list[str]
    predictions: list[MessagePrediction]
    prediction_note: str
    actions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    nccl_tuning: dict | None = None
    perf_table: dict | None = None
    measured: list[dict] = field(default_factory=list)
    advice: list[dict] | None = None
    advice_notes: list[str] = field(default_factory=list)
    scope: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["findings"] = [
            {"name": f.name, "value": f.value, "severity": f.severity.value, "reason": f.reason, "fix": f.fix}
            for f in self.findings
        ]
        return d


def current_p2p_level(env: Mapping[str, str]) -> tuple[str, str]:
    """The P2P level NCCL will use and why: ``NCCL_P2P_DISABLE=1`` → LOC; a valid ``NCCL_P2P_LEVEL``
    (exact upper-case name or legacy 0..5); else the default PXB (an invalid value is ignored by
    NCCL, which is what the findings report)."""
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1":
        return "LOC", "NCCL_P2P_DISABLE=1"
    value = env.get("NCCL_P2P_LEVEL")
    if value is not None:
        if value in NCCL_PATH_ORDER:
            return value, f"NCCL_P2P_LEVEL={value}"
        if value.strip().isdigit():
            return _LEGACY_LEVELS[min(int(value), 5)], f"NCCL_P2P_LEVEL={value} (legacy number)"
        return "PXB", f"default (NCCL ignores NCCL_P2P_LEVEL={value!r})"
    return "PXB", "default"


def diagnose(
    topo: Topology | None,
    log: NcclLog | None,
    env: Mapping[str, str] | None = None,
    *,
    nccl_version: str | None = None,
    hidden: int = DEFAULT_HIDDEN,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    pcie_gen: int = 4,
    sm: int = 89,
    perf: PerfTable | None = None,
    box: Topology | None = None,
) -> Diagnosis:
    """Build the diagnosis from whatever evidence is given; partial evidence gives a partial one.

    Parameters
    ----------
    topo, log, perf
        Any of: the topology, an NCCL_DEBUG=INFO log, an ``all_reduce_perf`` table (measured on the
        box). Where two disagree the log's transports win over the topology's rule, and each
        disagreement is one line in ``warnings``; a GPU the log names but the topology lacks is a
        warning and its pairs are left out. With no input at all the CLI reads NVML.
    env : mapping, default ``os.environ``
        Where the ``NCCL_*`` settings are read.
    nccl_version : str, optional
        Used when the log has none (e.g. from ``ncclGetVersion`` of the installed library).
    hidden, draft_tokens, batches
        Verify message sizes: ``batch × draft_tokens × hidden × 2`` bytes (bf16).
    pcie_gen, sm
        Used by the cost model when the topology does not say (offline text has neither).
    box : Topology, optional
        The whole box when ``topo`` is a part of it (the TP group,
        :meth:`fastverify.topo.matrix.Topology.first_gpus`): the diagnosis is about ``topo``'s GPUs,
        and a GPU the log names is warned of only when the box lacks it.

    Returns
    -------
    Diagnosis
        Never refuses for missing evidence: what the input cannot tell is said in ``log_notes`` /
        ``actions`` (e.g. a log with only ``NCCL_P2P_LEVEL set by environment to LOC``: every pair on
        SHM, by the environment).
    """
    env = dict(os.environ if env is None else env)
    if log and log.env:
        # The log shows what NCCL read when it ran; that run is what is being diagnosed.
        env.update(log.env)
    version = (log.version if log and log.version else None) or nccl_version
    nv = NcclVersion.parse(version) if version else None
    findings = [f for f in validate_env(env, nv) if f.severity is not Severity.OK]
    level, level_source = current_p2p_level(env)
    env_off = None if level != "LOC" else level_source  # P2P off for every pair by the environment
    pairs, gpus, warnings = pair_reports(topo, log, level, level_source, env_off, box)
    recommended, pairs = recommend_level(pairs, level)
    n = _world_size(gpus, log, perf)
    notes = log_notes(log) if log else []
    if not gpus and log is not None:
        notes.append(partial_note(log, env_off, n))
    if perf is not None:
        # a world size to compare with: the topology's, or the communicator's nRanks in the log
        # (the GPUs of the log's pairs can be an excerpt of the ring)
        known = (n, "topology") if topo else ((log.n_ranks, "log's communicator") if log and log.comms else (None, ""))
        warnings += perf_warnings(perf, *known)
    preds, note = _predictions(n, pairs, log, hidden, draft_tokens, batches, pcie_gen, sm, nv, env)
    diag = Diagnosis(
        sources=list(
            dict.fromkeys(
                s
                for s in (topo.source if topo else None, log.source if log else None, perf.source if perf else None)
                if s
            )
        ),
        n_gpus=n,
        nccl_version=str(nv) if nv else None,
        p2p_level_now=level,
        p2p_level_now_source=level_source,
        p2p_level_recommended=recommended,
        pairs=pairs,
        pcie_ipc_allreduce=pcie_ipc_fit(n, pairs),
        custom_allreduce=custom_ar_fit(n, pairs),
        findings=findings,
        log_notes=notes,
        predictions=preds,
        prediction_note=note,
        warnings=warnings,
        nccl_tuning=nccl_tuning(log, hidden, draft_tokens, batches, env, nv, sm) if log else None,
        perf_table=perf.summary() if perf else None,
        measured=measured_times(perf, hidden, draft_tokens, batches) if perf else [],
    )
    diag.actions = _actions(diag, log)
    return diag


def _world_size(gpus: list[int], log: NcclLog | None, perf: PerfTable | None) -> int:
    """The GPU count: the pairs' GPUs, else the log's communicator or printing devices, or the
    perf table's ranks. One device printing is no world size (rank 0 alone prints the TUNING
    lines); 0 = unknown."""
    if gpus:
        return len(gpus)
    n = (log.n_ranks or (len(log.devices) if len(log.devices) >= 2 else 0)) if log else 0
    if perf is not None and perf.n_ranks:
        n = max(n, perf.n_ranks)
    return n


def _ring_transport(pairs: list[PairReport], which: str) -> M.Transport:
    kinds = {getattr(p, which) for p in pairs}
    return M.Transport.SHM if "SHM" in kinds else M.Transport.P2P


def _predictions(n, pairs, log, hidden, draft_tokens, batches, pcie_gen, sm, nv, env):
    """The predicted all-reduce time of each verify size under the current and the recommended
    transports (:data:`CALIBRATION`), and the note saying on what; ``[]`` and why not where the
    model does not apply (no pair known, one GPU, NVLink, NET)."""
    if not pairs:
        return [], (
            "no prediction: no GPU pair is known from this input (add --nvidia-smi, or an NCCL log "
            "with transport lines)"
            if n != 1
            else "one GPU: no all-reduce"
        )
    if n < 2:
        return [], "one GPU: no all-reduce"
    if any((p.link or "").startswith("NV") for p in pairs):
        return [], "no prediction: NVLink pairs, and the calibration covers PCIe boxes only"
    if any(p.transport_now == "NET" for p in pairs):
        return [], (
            "no prediction: NCCL uses the NET transport between GPUs of one host (P2P and SHM both "
            "unusable, or a NIC judged faster; see NCCL_NET_DISABLE_INTRA)"
        )
    if env.get("NCCL_SHM_DISABLE", "").strip() == "1" and any(p.transport_now == "SHM" for p in pairs):
        return [], "no prediction: NCCL_SHM_DISABLE=1 sends the non-P2P pairs over NET, which is not modelled"
    graph = next((g for g in (log.graphs if log else ()) if g.pattern == 4), None)
    kw = dict(version=nv, pcie_gen=pcie_gen, sm=sm)
    if graph is not None and graph.bw_intra_gbps > 0:
        kw.update(graph_bw_intra_gbps=graph.bw_intra_gbps, graph_n_channels=graph.n_channels)
    now_t, rec_t = _ring_transport(pairs, "transport_now"), _ring_transport(pairs, "transport_recommended")
    now_in, notes = M.inputs_for_env(env, n, p2p=now_t is M.Transport.P2P, **kw)
    rec_in, _ = M.inputs_for_env(env, n, p2p=rec_t is M.Transport.P2P, **kw)
    out = []
    for b in batches:
        tokens = b * draft_tokens
        nbytes = tokens * hidden * 2
        p_now = CALIBRATION[now_t].predict(nbytes, now_in)
        p_rec = CALIBRATION[rec_t].predict(nbytes, rec_in)
        out.append(
            MessagePrediction(
                tokens,
                nbytes,
                round(p_now.time_us, 1),
                f"{p_now.algo.value}/{p_now.proto.value}",
                round(p_rec.time_us, 1),
                f"{p_rec.algo.value}/{p_rec.proto.value}",
            )
        )
    graph_src = (
        f"graph from the log: {graph.n_channels} ch x {graph.bw_intra_gbps:g} GB/s"
        if graph
        else f"graph derived for PCIe Gen{pcie_gen} x16, sm_{sm}"
    )
    return out, "; ".join([CALIBRATION_NOTE, graph_src, f"{n} ranks", *notes])


def with_advice(d: Diagnosis, log: NcclLog | None, advice: list[dict] | None, notes: list[str]) -> Diagnosis:
    """``d`` with the shared ranking (``advice``, ``notes``) as its recommendation: the actions
    keep what the diagnosis alone finds (settings to fix, pairs without P2P, NCCL's failed graph
    search), and drop its own NCCL_P2P_LEVEL and PCIe IPC advice, which the ranking weighs."""
    return replace(d, advice=advice, advice_notes=list(notes), actions=_actions(d, log, ranked=advice is not None))


def _actions(d: Diagnosis, log: NcclLog | None, *, ranked: bool = False) -> list[str]:
    acts = []
    for f in d.findings:
        if f.severity is Severity.ERROR:
            acts.append(f"fix {f.name}={f.value!r}: {f.reason}" + (f" ({f.fix})" if f.fix else ""))
    shm = [p for p in d.pairs if p.transport_now == "SHM"]
    if d.p2p_level_now_source.startswith("NCCL_P2P_DISABLE"):
        acts.append(
            "NCCL_P2P_DISABLE=1 turns P2P off for every pair whatever NCCL_P2P_LEVEL says: remove it "
            "first if P2P is wanted"
        )
    elif d.p2p_level_recommended and ranked:
        pass  # the ranking says whether the wider level is worth it, against the backends
    elif d.p2p_level_recommended:
        gain = [p for p in shm if p.transport_recommended == "P2P"]
        known = all(p.hw_p2p is True for p in gain)
        gain_pct = _predicted_gain_pct(d.predictions)
        verb = "set" if known else "try"
        acts.append(
            f"{verb} NCCL_P2P_LEVEL={d.p2p_level_recommended}: {len(gain)} pair(s) now on SHM would use P2P"
            + (
                ""
                if known
                else " if the driver allows P2P there (unknown from this input; check with `fastverify p2p`)"
            )
            + f"; predicted all-reduce change {gain_pct:+.0f} % at the smallest verify size, within the "
            "model's error (~10 %), so measure it: NCCL keeps cross-root-port and cross-socket pairs on "
            "SHM by default because P2P there is often no faster and ACS/IOMMU can make it slow or hang"
        )
    elif d.p2p_level_now == "LOC" and not any(p.link for p in d.pairs):
        acts.append(
            f"{d.p2p_level_now_source} turns P2P off for every pair (all on SHM): if P2P is wanted, remove it "
            "or set the level that covers the pairs' path type (add --nvidia-smi to see which)"
        )
    seen_shm = [f"{p.a}-{p.b}" for p in shm if p.seen and p.link is None]
    if seen_shm and not d.p2p_level_recommended:
        acts.append(
            f"the log shows SHM for pair(s) {', '.join(seen_shm)}: add --nvidia-smi (their path type) to "
            "see whether a higher NCCL_P2P_LEVEL would give them P2P"
        )
    hw_no = [p for p in shm if p.hw_p2p is False]
    if hw_no:
        acts.append(
            f"{len(hw_no)} pair(s) cannot use P2P (the driver refuses it, or NCCL's log shows it re-routed "
            "them through the CPU): they stay on SHM whatever the level; consumer GPUs on stock drivers are "
            "the usual cause"
        )
    if d.pcie_ipc_allreduce.get("possible") and not ranked:
        acts.append(
            "try FlashInfer's PCIe IPC all-reduce for the verify step: `fastverify tune` measures it, "
            "`fastverify launch --p2p-check FILE` deploys it (launch sets SGLang's switch after the P2P proof)"
        )
    timed = [m for m in d.measured if m["time_us"] is not None]
    if timed:
        m = min(timed, key=lambda x: x["msg_bytes"])
        smallest = min(x["msg_bytes"] for x in d.measured)
        which = (
            "the smallest verify message"
            if m["msg_bytes"] == smallest
            else f"the smallest verify message it covers (the smallest, {smallest:,} B, is outside it)"
        )
        acts.append(
            f"your all_reduce_perf table ({m['source']}) measures NCCL at {m['time_us']:,.1f} µs for "
            f"{which} ({m['msg_bytes']:,} B, {m['column']} column, {m['basis']}): that, not the model, is the "
            f"baseline; rank backends against it with `fastverify tune --perf-table {m['source']}`"
        )
    if log and log.graph_fallbacks:
        acts.append("NCCL's graph search failed on this box: try NCCL_PROTO=LL for the small verify all-reduces")
    if not acts and not ranked:
        acts.append("nothing to change from this input; measure the candidates with `fastverify tune`")
    return acts


def _predicted_gain_pct(preds: list[MessagePrediction]) -> float:
    if not preds or preds[0].now_us <= 0:
        return 0.0
    return 100.0 * (preds[0].recommended_us - preds[0].now_us) / preds[0].now_us


def pcie_ipc_fit(n: int, pairs: list[PairReport]) -> dict:
    """``{"possible": True | False | None, "reason"}`` for FlashInfer's PCIe IPC all-reduce on
    ``n`` GPUs (None: unknown from this input)."""
    if not pairs and n in (0, 2, 4, 8):
        return {
            "possible": None,
            "reason": "unknown from this input: no GPU pair known (add --nvidia-smi, or run "
            "`fastverify p2p` on the box)",
        }
    if n not in (2, 4, 8):
        return {"possible": False, "reason": f"world size {n}: FlashInfer's PCIe IPC all-reduce takes 2, 4 or 8 GPUs"}
    no = [f"{p.a}-{p.b}" for p in pairs if p.hw_p2p is False]
    if no:
        return {
            "possible": False,
            "reason": f"no CUDA peer access for pair(s) {', '.join(no)} (NVML); it needs every pair",
        }
    unknown = [p for p in pairs if p.hw_p2p is None]
    if unknown:
        return {
            "possible": None,
            "reason": "peer access unknown from this input: run the real P2P check on the box (fastverify p2p)",
        }
    return {
        "possible": True,
        "reason": "every pair reports CUDA peer access; deploy it with `fastverify launch "
        "--backend pcie_ipc --p2p-check FILE` (launch sets SGLang's switch after the proof)",
    }


def custom_ar_fit(n: int, pairs: list[PairReport]) -> dict:
    """``{"possible": True | False | None, "reason"}`` for SGLang's custom all-reduce on ``n``
    GPUs, by the registry's rule (the one launch and tune apply)."""
    info = backend_info(BackendName.custom_ar)
    if n == 0:
        return {"possible": None, "reason": "unknown from this input: the number of GPUs is not known"}
    all_nvlink = bool(pairs) and all((p.link or "").startswith("NV") for p in pairs)
    if info.world_sizes is not None and n not in info.world_sizes:
        return {
            "possible": False,
            "reason": f"SGLang's custom all-reduce runs on {list(info.world_sizes)} GPUs; {n} GPUs",
        }
    if not any(p.link for p in pairs) and n not in (info.world_sizes_without_nvlink or ()):
        return {
            "possible": None,
            "reason": f"{n} GPUs: SGLang's custom all-reduce needs 2 GPUs or full NVLink, and "
            "the links are unknown from this input",
        }
    if n not in (info.world_sizes_without_nvlink or ()) and not all_nvlink:
        return {"possible": False, "reason": f"SGLang's custom all-reduce needs 2 GPUs or full NVLink; {n} PCIe GPUs"}
    if any(p.hw_p2p is False for p in pairs):
        return {"possible": False, "reason": "no CUDA peer access between the GPUs"}
    return {
        "possible": None if any(p.hw_p2p is None for p in pairs) else True,
        "reason": "2 GPUs (or full NVLink); needs working peer access",
    }


_LOG_PROTO = {"LL": M.Proto.LL, "LL128": M.Proto.LL128, "SIMPLE": M.Proto.SIMPLE}  # names as the log prints them


def log_notes(log: NcclLog) -> list[str]:
    """One line each for what the log itself reports: a failed graph search, the settings NCCL
    read or rejected, pairs without P2P, the first five NCCL warnings."""
    notes = []
    if log.graph_fallbacks:
        notes.append(
            "NCCL's topology search failed ('falling back to simple order', pattern "
            f"{', '.join(map(str, log.graph_fallbacks))}): it then picks the Simple protocol for most sizes; "
            "NCCL_PROTO=LL (small messages) or a graph file (NCCL_GRAPH_FILE) avoids that"
        )
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
        return (
            f"partial: the log shows no GPU pair, but {env_off} (P2P disabled) puts every pair on SHM "
            f"(NCCL src/graph/paths.cc); {gpus}"
        )
    what = [
        k
        for k, v in (
            ("the TUNING table", log.tuning),
            ("NCCL's per-size choices", log.calls),
            ("the settings NCCL read", log.env),
            ("the version", log.version),
        )
        if v
    ]
    return (
        f"partial: the log shows no GPU pair (no 'via' transport lines, no GRAPH path dump){'; it holds ' if what else ''}"
        f"{', '.join(what)}; {gpus}; capture NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV,TUNING for the pairs"
    )


def nccl_tuning(
    log: NcclLog, hidden: int, draft_tokens: int, batches: tuple[int, ...], env: Mapping[str, str], nv, sm: int
) -> dict | None:
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
            if (
                algo not in ("TREE", "RING")
                or algo not in on_a
                or proto not in on_p
                or proto not in _LOG_PROTO
                or bw <= 0
            ):
                continue
            f = M.tree_correction_factor(_LOG_PROTO[proto], nbytes) if algo == "TREE" else 1.0
            times[(algo, proto)] = lat + nbytes / (1000.0 * bw * f)
        if times:
            order = [(a, p) for a in ("TREE", "RING") for p in ("LL", "LL128", "SIMPLE")]
            best = min(times, key=lambda k: (times[k], order.index(k)))
            verify.append(
                {
                    "tokens": b * draft_tokens,
                    "msg_bytes": nbytes,
                    "algo_proto": f"{best[0]}/{best[1]}",
                    "time_us": round(times[best], 1),
                    "label": "predicted",
                }
            )
    choices: dict[tuple, dict] = {}
    for c in calls:
        choices.setdefault(
            (c.size_bytes, c.algo, c.proto),
            {"size_bytes": c.size_bytes, "algo": c.algo, "proto": c.proto, "time_us": c.time_us, "line": c.line},
        )
    return {
        "model_table": [{"algo": a, "proto": p, "latency_us": lat, "algbw_gbps": bw} for a, p, lat, bw in rows],
        "verify_choice": verify,
        "launched": sorted(choices.values(), key=lambda d: (d["size_bytes"], d["line"])),
        "basis": f"NCCL's own TUNING lines in {log.source}",
    }


def measured_times(perf: PerfTable, hidden: int, draft_tokens: int, batches: tuple[int, ...]) -> list[dict]:
    """Measured NCCL time of each verify size from the user's all_reduce_perf table, read as
    ``tune`` reads it (:meth:`PerfTable.verify_time_us`: the in-place column, interpolated between
    measured sizes; None outside them); ``column`` names the column read."""
    out = []
    for b in sorted(set(batches)):
        nbytes = b * draft_tokens * hidden * 2
        t, column = perf.verify_time_us(nbytes)
        exact = nbytes in perf.sizes
        out.append(
            {
                "tokens": b * draft_tokens,
                "msg_bytes": nbytes,
                "time_us": None if t is None else round(t, 1),
                "column": column,
                "basis": ("measured" if exact else "interpolated between measured sizes")
                if t is not None
                else f"outside the measured sizes {min(perf.sizes)}-{max(perf.sizes)} B",
                "source": perf.source,
                "label": "measured",
            }
        )
    return out


def perf_warnings(perf: PerfTable, n: int | None, what: str) -> list[str]:
    """The table against the box (several nodes, another world size), and the rows it dropped."""
    out = []
    several = perf.several_nodes(n or None)
    if several:
        out.append(several)
    elif perf.n_ranks and n and perf.n_ranks != n:
        out.append(
            f"{perf.source} was measured on {perf.n_ranks} ranks, the {what} has {n}: its times are for "
            "another world size"
        )
    if (dropped := perf.dropped_warning()) is not None:
        out.append(dropped)
    out += [f"{perf.source}: {p}" for p in perf.problems if "data row dropped" not in p]  # a second table
    return out
