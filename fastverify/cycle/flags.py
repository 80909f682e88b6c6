"""Anomaly flags with their evidence, and the answer: how much of a cycle a faster all-reduce can
remove (the transfer) and how much it cannot (wait, idle, compute), and what to do first.

Evidence comes as typed inputs (:class:`Evidence`), each optional: the cycle split of the server's
traces, the NCCL_DEBUG=INFO log, the host's IOMMU/ACS facts, the box's own measured sweep and
the published NCCL measurements (``fastverify/data/published_allreduce.json``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import msgspec

from fastverify.bounds import MAX_MSG_BYTES, MIN_TIME_US, implausible_count, implausible_work_us
from fastverify.cycle.split import CAUSES, CycleSplit
from fastverify.registry import BackendName
from fastverify.tune.backend_model import comparable

SLOW_FACTOR = 2.0
"""A transfer per all-reduce this many times the reference (the box's own sweep, else the median
of published NCCL boxes of the same world size) is flagged."""
SKEW_SHARE = 0.5
"""A rank last to arrive in at least this share of the all-reduces where some rank waited, with
the wait at least :data:`WAIT_SHARE` of all-reduce time, is a straggler."""
WAIT_SHARE = 0.2
IDLE_SHARE = 0.05
"""GPU idle (in a mode, or between forwards) above this share of the cycle is flagged; so are
kernels launched outside a CUDA graph."""
GRAPHED_MODES = ("verify", "decode")
"""Forwards SGLang 0.5.23 replays from a CUDA graph by default on GPUs: its
``model_executor/runner/decode_cuda_graph_runner.py`` runs DECODE and TARGET_VERIFY batches up to
the captured ``max_bs`` (``--cuda-graph-max-bs-decode``, ``can_run_graph``); such a forward
replaying none ran everything eager."""
_CAUSE_TEXT = {
    "d2h_copy": "after a device-to-host copy (.item()/.tolist(): a GPU->CPU sync)",
    "host_sync": "while the host blocked in cudaStreamSynchronize-like calls",
    "launch_gap": "waiting for the host to launch the next kernel (host-bound)",
    "dependency": "waiting on another stream or event",
}


class Flag(msgspec.Struct, frozen=True):
    """One anomaly: ``kind`` (``rank_skew``, ``p2p_off``, ``iommu_acs``, ``slow_transfer``,
    ``idle``, ``eager_kernels``), what was found, the evidence lines, and the fix."""

    kind: str
    finding: str
    evidence: tuple[str, ...]
    fix: str
    setup: bool = True  # a setup problem (fix before any swap), not a kernel choice


class Answer(msgspec.Struct, frozen=True):
    """Per cycle, mean over TP ranks (ms): what a faster all-reduce can remove and what it cannot."""

    cycle_ms: float
    removable_ms: float
    not_removable_ms: dict[str, float]
    by_mode_ms: dict[str, dict[str, float]]
    next_action: str
    actions: tuple[str, ...]
    basis: str


@dataclass
class Evidence:
    """What a bundle holds, parsed; every part optional."""

    split: CycleSplit | None = None
    nccl_log: object | None = None  # fastverify.nccl.debuglog.NcclLog
    iommu: dict | None = None
    sweep: dict | None = None
    p2p_check: list | None = None  # rows of `fastverify p2p`
    nvml: dict | None = None  # fastverify.topo.matrix.Topology.as_dict of NVML
    topo: object | None = None  # fastverify.topo.diagnose.Diagnosis of `nvidia-smi topo -m`, NCCL's defaults
    world_size: int | None = None
    msg_bytes: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


def _list(value) -> list:
    """``value`` when it is a list (a bundle's JSON is read, not trusted), else empty."""
    return value if isinstance(value, list) else []


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def mode_means(split: CycleSplit) -> dict[str, dict[str, float]]:
    """Per mode, the mean over ranks of each per-cycle quantity (µs)."""
    keys = (
        "compute_us",
        "allreduce_us",
        "allreduce_count",
        "transfer_us",
        "wait_us",
        "unmatched_us",
        "other_comm_us",
        "memory_us",
        "idle_us",
        "forwards",
        "eager_kernels",
        "eager_us",
        "graph_kernels",
    )
    modes: dict[str, list] = {}
    for r in split.ranks:
        for m in r.modes:
            modes.setdefault(m.mode, []).append(m)
    out = {}
    for mode, rows in modes.items():
        out[mode] = {k: _mean(getattr(m, k) for m in rows) * len(rows) / len(split.ranks) for k in keys}
        out[mode]["idle_causes_us"] = {c: _mean(m.idle_causes_us.get(c, 0.0) for m in rows) for c in CAUSES}
    return out


def _baseline_sizes(ev: Evidence) -> list:
    """The size rows of the measured sweep's baseline candidate (as read: any JSON)."""
    if not ev.sweep or ev.sweep.get("label") != "measured":
        return []
    base = next((c for c in _list(ev.sweep.get("candidates")) if isinstance(c, dict) and c.get("is_baseline")), None)
    return _list((base or {}).get("sizes"))


def dropped_sweep_point(ev: Evidence) -> str | None:
    """A note when the measured sweep has a point at the verify size (``ev.msg_bytes``) whose time
    is no time of work (0, negative, under ``MIN_TIME_US``, past the bounds, not a number): that
    point is not used, and no other size stands in for it; None otherwise."""
    size = ev.msg_bytes
    for s in _baseline_sizes(ev):
        if isinstance(s, dict) and size and s.get("msg_bytes") == size:
            why = implausible_work_us(s.get("median_us"))
            if why is not None:
                return (
                    f"sweep: its point at the verify size {size:,} B (median_us {s.get('median_us')!r}) is "
                    f"dropped: {why}; the slow-transfer check does not use the box's sweep at another size"
                )
    return None


def _reference(ev: Evidence) -> tuple[float, str] | None:
    """Reference NCCL time (µs) per all-reduce at the verify size: this box's sweep (its point at
    the verify size, else the nearest swept size, said), else published. A sweep whose point at
    the verify size is dropped (:func:`dropped_sweep_point`) is not used."""
    size = ev.msg_bytes
    if size and dropped_sweep_point(ev) is None:
        rows = [
            s
            for s in _baseline_sizes(ev)
            if isinstance(s, dict)  # a time of work, > 0
            and implausible_count(s.get("msg_bytes"), upper=MAX_MSG_BYTES) is None
            and implausible_work_us(s.get("median_us")) is None
        ]
        if rows:
            best = min(rows, key=lambda s: abs(s["msg_bytes"] - size))
            near = "" if best["msg_bytes"] == size else f", the nearest swept size to the verify size {size:,} B"
            return best["median_us"], (
                f"this box's measured sweep: NCCL {best['median_us']:.1f} µs at "
                f"{best['msg_bytes']:,} B{near} ({ev.sources.get('sweep', 'sweep')})"
            )
    if size and ev.world_size and ev.world_size >= 2:
        times = sorted(t for m in comparable(BackendName.nccl, ev.world_size) if (t := m.time_at(size)))
        if times:
            med = statistics.median(times)
            return med, (
                f"published NCCL on {len(times)} {ev.world_size}-GPU PCIe boxes at {size:,} B: median "
                f"{med:.1f} µs (range {times[0]:.1f}-{times[-1]:.1f}; fastverify/data/published_allreduce.json)"
            )
    return None


def _skew(split: CycleSplit, means: dict) -> Flag | None:
    ar = sum(m["allreduce_us"] for m in means.values())
    wait = sum(m["wait_us"] for m in means.values())
    if split.straggler_rank is None or not ar or wait / ar < WAIT_SHARE or (split.straggler_share or 0) < SKEW_SHARE:
        return None
    r = split.straggler_rank
    waits = {x.rank: sum(m.wait_us for m in x.modes) for x in split.ranks}  # µs per cycle, each rank's own
    others = [x for x in split.ranks if x.rank != r]
    own = [waits[x.rank] for x in others]
    others_ar = sum(m.allreduce_us for x in others for m in x.modes)
    return Flag(
        "rank_skew",
        f"TP rank {r} arrives last: each of the other {len(others)} ranks waits {_mean(own) / 1000:.3f} ms "
        f"per cycle for it (mean over them; range {min(own) / 1000:.3f}-{max(own) / 1000:.3f} ms), "
        f"{100 * sum(own) / others_ar if others_ar else 0:.0f} % of their all-reduce time",
        (
            f"rank {r} last in {split.last_arrivals.get(str(r), 0)} of {split.waited} all-reduces where a rank "
            f"waited ({100 * split.straggler_share:.0f} %), of {split.matched} matched across "
            f"{len(split.ranks)} ranks",
            "all-reduce wait per cycle by TP rank (ms): "
            + ", ".join(
                f"{k}: {v / 1000:.3f}" + (" (last to arrive)" if k == r else "") for k, v in sorted(waits.items())
            ),
        ),
        f"look at TP rank {r} first: MoE expert load imbalance (SGLang --enable-eplb), its GPU clocks and "
        "temperature (nvidia-smi -q -d CLOCK,PERFORMANCE), and its host thread (CPU pinning, numactl); "
        "a faster all-reduce does not remove this wait",
    )


def _log_p2p(ev: Evidence) -> tuple[list[str], str | None]:
    """Evidence lines from the NCCL log (pairs over SHM, a disabling setting) and the setting."""
    log = ev.nccl_log
    if log is None:
        return [], None
    kinds = log.transport_kinds()
    shm = sorted(p for p, k in kinds.items() if k == "SHM")
    env = log.p2p_disabled_by_env
    evid = []
    if shm or (log.uses_shm and not log.uses_p2p):
        evid.append(
            f"{ev.sources.get('nccl_log', 'NCCL log')}: "
            + (
                f"{len(shm)} of {len(kinds)} GPU pairs run over SHM (host memory): "
                + ", ".join(f"{a}-{b}" for a, b in shm[:8])
                + (" ..." if len(shm) > 8 else "")
                if kinds
                else "transport SHM"
            )
        )
    if env:
        evid.append(f"NCCL read {env} from the environment")
    return evid, env


def _box_p2p(ev: Evidence) -> list[str]:
    """Evidence lines from the real P2P check and NVML's P2P status per pair."""
    evid = []
    bad = [r for r in _list(ev.p2p_check) if isinstance(r, dict) and r.get("ok") is False]
    if bad:
        r = bad[0]
        evid.append(
            f"P2P check: {len(bad)} of {len(_list(ev.p2p_check))} directions failed, e.g. GPU "
            f"{r.get('dst')} on GPU {r.get('src')}'s memory: {r.get('reason')}"
        )
    d = ev.topo
    if d is not None:
        shm = [f"{q.a}-{q.b}" for q in d.pairs if q.transport_now == "SHM"]
        if shm and not any(q.seen for q in d.pairs):  # predicted from the topology, no NCCL log saw them
            evid.append(
                f"{ev.sources.get('nvidia_smi_topo', 'topology')}: under NCCL_P2P_LEVEL={d.p2p_level_now} "
                f"({d.p2p_level_now_source}) NCCL puts {len(shm)} of {len(d.pairs)} GPU pairs on SHM "
                f"({', '.join(shm[:8])}{' ...' if len(shm) > 8 else ''}); predicted by NCCL's path rule, "
                "assuming the server sets no NCCL_P2P_LEVEL"
                + (f"; {d.p2p_level_recommended} would put them on P2P" if d.p2p_level_recommended else "")
            )
    read = (ev.nvml or {}).get("p2p_read")
    refused = sorted(k for k, v in read.items() if v is False) if isinstance(read, dict) else []
    if refused:
        evid.append(
            f"NVML: P2P read refused on {len(refused)} GPU pairs ({', '.join(refused[:8])}"
            + (" ..." if len(refused) > 8 else "")
            + ")"
        )
    return evid


def _p2p(ev: Evidence) -> Flag | None:
    log_evid, env = _log_p2p(ev)
    box_evid = _box_p2p(ev)
    if not (log_evid or box_evid):
        return None
    fix = (
        f"remove {env} from the server's environment"
        if env
        else "let NCCL use P2P: NCCL_P2P_LEVEL=SYS (check it with `fastverify topo --nccl-log`), a driver with "
        "P2P enabled, and in the BIOS/kernel IOMMU off or passthrough (iommu=pt) and PCIe ACS off"
    )
    tested = [e for e in box_evid if e.startswith(("P2P check", "NVML"))]
    finding = (
        "P2P is off: NCCL moves the all-reduces through host memory (SHM)"
        if log_evid
        else "P2P does not work on this box (NCCL then falls back to SHM, and IPC all-reduces cannot run)"
        if tested
        else "predicted from the topology: NCCL's default P2P level puts some GPU pairs on SHM (host memory)"
    )
    return Flag("p2p_off", finding, tuple(log_evid + box_evid), fix)


def _iommu(ev: Evidence) -> Flag | None:
    info = ev.iommu
    if not info:
        return None
    tokens = [t for t in _list(info.get("cmdline_iommu_tokens")) if isinstance(t, str)]
    on = [t for t in tokens if t.split("=", 1)[-1] in ("on", "force", "1")] and "iommu=pt" not in tokens
    acs = [
        a
        for a in _list(info.get("acs"))
        if isinstance(a, dict) and any(f in str(a.get("acsctl", "")) for f in ("SrcValid+", "ReqRedir+"))
    ]
    if not (on or acs):
        return None
    evid = []
    if on:
        evid.append(f"kernel command line: {' '.join(tokens)} (IOMMU translating, not passthrough)")
    if implausible_count(info.get("iommu_groups"), lower=1) is None:  # a JSON true is no count
        evid.append(f"{info['iommu_groups']} IOMMU groups in /sys/kernel/iommu_groups")
    for a in acs[:4]:
        evid.append(f"ACSCtl on {a.get('device')}: {a.get('acsctl')}")
    return Flag(
        "iommu_acs",
        "IOMMU/ACS can route peer-to-peer traffic through the CPU root complex",
        tuple(evid),
        "set iommu=pt (or the IOMMU off) on the kernel command line and disable PCIe ACS "
        "(BIOS, or setpci ECAP_ACS+0x6.w=0000 on the bridges), then rerun `fastverify collect`",
    )


def _slow(ev: Evidence, means: dict) -> Flag | None:
    """The slow-transfer flag: the trace's time per verify all-reduce (its transfer where the
    ranks' all-reduces were matched, else its whole time) at least ``SLOW_FACTOR`` times the
    reference; None below that, or where the trace's time is under ``MIN_TIME_US`` (0-ns kernels:
    no ratio is formed)."""
    v = means.get("verify")
    if not v or not v["allreduce_count"] or ev.split is None or ev.split.clock != "trace":
        return None  # a CPU server's gloo timings are never set against GPU NCCL figures
    separated = bool(v["transfer_us"] or v["wait_us"])  # matched across ranks: the wait is apart
    per = (v["transfer_us"] if separated else v["allreduce_us"]) / v["allreduce_count"]
    if per < MIN_TIME_US:  # 0-ns kernels: no time of work to set against the reference, no ratio
        return None
    ref = _reference(ev)
    if ref is None or per < SLOW_FACTOR * ref[0]:
        return None
    what = "transfer" if separated else "all-reduce time (wait not separated)"
    return Flag(
        "slow_transfer",
        f"verify all-reduces take {per:.1f} µs each ({what}), {per / ref[0]:.1f}x the reference",
        (
            f"trace: {v['allreduce_count']:g} verify all-reduces per cycle, {per:.1f} µs {what} each"
            + (f" at {ev.msg_bytes:,} B" if ev.msg_bytes else ""),
            ref[1],
        ),
        "fix the transport first (P2P, IOMMU/ACS above), then `fastverify tune` for NCCL settings or a "
        "PCIe-aware backend",
        setup=False,
    )


def _idle(split: CycleSplit, means: dict, cycle_us: float) -> list[Flag]:
    out = []
    if not cycle_us:
        return out
    between = {c: _mean(r.between_causes_us.get(c, 0.0) for r in split.ranks) for c in CAUSES}
    places = [(f"in {m} forwards", v["idle_causes_us"]) for m, v in means.items() if m != "outside"]
    places.append(("between forwards", between))
    for where, causes in places:
        total = sum(causes.values())
        if total / cycle_us < IDLE_SHARE:
            continue
        top = max(causes, key=causes.get)
        evid = tuple(f"{c}: {v / 1000:.3f} ms per cycle ({_CAUSE_TEXT[c]})" for c, v in causes.items() if v)
        fix = {
            "d2h_copy": "find the GPU->CPU read in the cycle (a .item()/.tolist() on the host path, e.g. "
            "sglang#26171 for EAGLE-3) and keep the value on the GPU or read it asynchronously",
            "host_sync": "remove the blocking synchronize from the cycle's host path",
            "launch_gap": "the host launches too slowly: keep the forward in a CUDA graph, check the CPU is "
            "not throttled or shared (pin the scheduler threads)",
            "dependency": "look at the streams: a kernel waits on another stream's event",
        }[top]
        out.append(
            Flag(
                "idle",
                f"{'GPU' if split.clock == 'trace' else 'CPU-clock'} idle {where}: {total / 1000:.3f} ms per cycle "
                f"({100 * total / cycle_us:.0f} % of the cycle), mostly {_CAUSE_TEXT[top]}",
                evid,
                fix,
            )
        )
    return out + _eager(split, means, cycle_us)


def _eager(split: CycleSplit, means: dict, cycle_us: float) -> list[Flag]:
    """``eager_kernels``: a mode that replays a CUDA graph but launches some kernels one by one, and
    a :data:`GRAPHED_MODES` forward of a GPU trace that replays none (everything eager)."""
    out = []
    replaying = [m for m, v in means.items() if v["graph_kernels"]]
    for m, v in means.items():
        if not v["eager_kernels"] or v["eager_us"] / cycle_us < IDLE_SHARE:
            continue
        if v["graph_kernels"]:
            out.append(
                Flag(
                    "eager_kernels",
                    f"{v['eager_kernels']:g} kernels per cycle of {m} run outside its CUDA "
                    f"graph ({v['eager_us'] / 1000:.3f} ms)",
                    (f"{m}: some kernels replay from a graph, {v['eager_kernels']:g} do not",),
                    "check why the forward falls back to eager launches (capture sizes: "
                    "--cuda-graph-max-bs-decode, the batch seen here)",
                )
            )
        elif m in GRAPHED_MODES and split.clock == "trace":
            why = (
                f"other modes replay CUDA graphs ({', '.join(replaying)}): the {m} batch fit no captured graph "
                "(a batch above the captured sizes, --cuda-graph-max-bs-decode)"
                if replaying
                else "no mode replays a CUDA graph: the server ran without them (--disable-cuda-graph or "
                "--cuda-graph-backend-decode=disabled)"
            )
            out.append(
                Flag(
                    "eager_kernels",
                    f"{m} forwards run everything eager: {v['eager_kernels']:g} kernels per "
                    f"cycle launched one by one, none from a CUDA graph "
                    f"({v['eager_us'] / 1000:.3f} ms)",
                    (f"{m}: 0 kernels replay from a graph, {v['eager_kernels']:g} do not", why),
                    "serve with CUDA graphs on (no --disable-cuda-graph) and captured up to the batch seen "
                    "here (--cuda-graph-max-bs-decode): each eager kernel waits for its own host launch",
                )
            )
    return out


def flags(ev: Evidence) -> list[Flag]:
    """Every flag the evidence supports, setup problems first."""
    out: list[Flag] = []
    for f in (_p2p(ev), _iommu(ev)):
        if f is not None:
            out.append(f)
    if ev.split is not None:
        means = mode_means(ev.split)
        cycle = _mean(r.cycle_mean_us for r in ev.split.ranks)
        for f in (_skew(ev.split, means), _slow(ev, means)):
            if f is not None:
                out.append(f)
        out += _idle(ev.split, means, cycle)
    return out


def answer(ev: Evidence, found: list[Flag]) -> Answer | None:
    """The removable / not removable split per cycle and the next action; None without a split."""
    split = ev.split
    if split is None or not split.ranks:
        return None
    means = mode_means(split)
    cycle = _mean(r.cycle_mean_us for r in split.ranks)
    transfer = sum(m["transfer_us"] for m in means.values())
    unmatched = sum(m["unmatched_us"] for m in means.values())
    wait = sum(m["wait_us"] for m in means.values())
    idle = sum(m["idle_us"] for m in means.values()) + _mean(r.between_idle_us for r in split.ranks)
    compute = sum(m["compute_us"] for m in means.values())
    other = sum(m["other_comm_us"] + m["memory_us"] for m in means.values())
    removable = transfer + unmatched
    basis = (
        "transfer = the shortest duration of each all-reduce across the ranks' traces (the last rank to "
        "arrive waits for no one)"
    )
    if unmatched:
        basis += (
            f"; {unmatched / 1000:.3f} ms of all-reduce time could not be matched across ranks and is "
            "counted as removable: an upper bound"
        )
    by_mode = {
        m: {
            "transfer": round(v["transfer_us"] / 1000, 4),
            "wait": round(v["wait_us"] / 1000, 4),
            "unmatched": round(v["unmatched_us"] / 1000, 4),
            "compute": round(v["compute_us"] / 1000, 4),
            "idle": round(v["idle_us"] / 1000, 4),
            "other": round((v["other_comm_us"] + v["memory_us"]) / 1000, 4),
        }
        for m, v in means.items()
    }
    setup = [f for f in found if f.setup]
    swap = cycle > 0 and removable / cycle >= 0.1
    if setup and swap:
        action = "both: fix the setup first, then swap the backend"
    elif setup:
        action = "fix the setup first"
    elif swap:
        action = "swap the backend (`fastverify tune --write-env`, then `fastverify launch`)"
    else:
        action = "neither helps much: the cycle is compute-bound"
    return Answer(
        cycle_ms=round(cycle / 1000, 4),
        removable_ms=round(removable / 1000, 4),
        not_removable_ms={
            "wait": round(wait / 1000, 4),
            "idle": round(idle / 1000, 4),
            "compute": round(compute / 1000, 4),
            "other": round(other / 1000, 4),
        },
        by_mode_ms=by_mode,
        next_action=action,
        actions=tuple(f.fix for f in setup),
        basis=basis,
    )
