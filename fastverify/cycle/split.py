"""Split each speculative cycle of each TP rank into forward modes, and each mode into compute,
all-reduce transfer and wait, other communication, memory and GPU idle by cause.

Forwards come from the host spans SGLang 0.5.23 writes when its profiler runs:
``model_executor/model_runner.py`` wraps every ``ModelRunner.forward`` in
``utils/profile_utils.py::build_step_span_name`` (``step[VERIFY bs=8]``, ``step[DRAFT bs=8]`` for
any forward of the draft model, ``step[EXTEND bs=1 toks=40]``, ``step[DECODE bs=8]``), and
``speculative/eagle_worker_v2.py`` wraps the drafter's stages in ``spec_utils.spec_stage_span``
(``draft``, ``draft_extend``). A stage span is one forward of its mode, holding the draft steps
inside it; a step span outside every stage span is one forward of its own mode.

A cycle starts at each ``draft`` stage (EAGLE) or, without a drafter on the GPUs (NGRAM), at each
verify forward (without speculative decoding: each decode forward), and runs to the next start;
the last start has no end and is left out. A GPU
event belongs to the forward whose host window holds its launch (its runtime call, or its graph
launch); launched between forwards it is ``outside`` (sampling and bookkeeping kernels).

All-reduce transfer and wait: the i-th all-reduce of one mode in the k-th cycle is matched across
ranks; the shortest duration is the transfer (the last rank to arrive waits for no one) and each
rank's excess is its wait (TraceLens's NcclAnalyser rule, as :func:`fastverify.analyze.match_collectives`).

GPU idle gaps (no event of the rank running) get a cause, first match wins:
``d2h_copy`` (after a device-to-host copy: ``.item()``, ``.tolist()``), ``host_sync`` (a blocking
``cudaStreamSynchronize``-like call overlaps the gap), ``launch_gap`` (the next event was launched
after the GPU ran dry: the host was late), else ``dependency`` (launched in time but waiting on
another stream or event). Times are µs per cycle (means over the rank's complete cycles).
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from fastverify.analyze import breakdown, union_ns
from fastverify.events import EventClass, RankEvents

MODES = ("draft", "verify", "draft_extend", "extend", "decode", "other", "outside")
"""Forward modes of a cycle; ``outside``: launched between forwards."""
CAUSES = ("d2h_copy", "host_sync", "launch_gap", "dependency")
_AR = np.array([EventClass.ALLREDUCE.code, EventClass.FUSED_ALLREDUCE.code], dtype=np.int8)
_STEP_MODE = {
    "VERIFY": "verify",
    "TARGET_VERIFY": "verify",
    "DRAFT": "draft",
    "DRAFT_EXTEND": "draft_extend",
    "DRAFT_EXTEND_V2": "draft_extend",
    "EXTEND": "extend",
    "MIXED": "extend",
    "SPLIT_PREFILL": "extend",
    "PREBUILT": "extend",
    "DECODE": "decode",
    "IDLE": "other",
}
_STEP = re.compile(r"^step\[([A-Z_0-9]+)")
_D2H = re.compile(r"(?i)memcpy\s*dtoh|device\s*->\s*(pinned|pageable|host)")


class ModeSplit(msgspec.Struct, frozen=True):
    """One forward mode of one rank, per cycle (µs; counts per cycle).

    ``allreduce_us`` is the kernel sum (= transfer + wait where matched; ``unmatched_us`` of it
    could not be matched across ranks). ``idle_us`` is GPU idle inside this mode's forwards, by
    cause in ``idle_causes_us``. ``eager_kernels``/``eager_us``: events launched one by one, outside
    any CUDA graph (all of a mode's events where it replays none: ``--disable-cuda-graph``, or a
    batch above the captured sizes); ``graph_kernels``: events replayed from a CUDA graph."""

    mode: str
    forwards: float
    compute_us: float
    allreduce_us: float
    allreduce_count: float
    transfer_us: float
    wait_us: float
    unmatched_us: float
    other_comm_us: float
    memory_us: float
    idle_us: float
    idle_causes_us: dict[str, float]
    eager_kernels: float = 0.0
    eager_us: float = 0.0
    graph_kernels: float = 0.0


class RankCycles(msgspec.Struct, frozen=True):
    """The cycles of one TP rank: ``cycle_us`` per cycle (median and mean of the GPU span from a
    cycle's first event to the next cycle's), the modes, and idle between forwards."""

    rank: int
    cycles: int
    cycle_median_us: float
    cycle_mean_us: float
    modes: tuple[ModeSplit, ...]
    between_idle_us: float
    between_causes_us: dict[str, float]
    straggler_count: int = 0


class CycleSplit(msgspec.Struct, frozen=True):
    """Per-rank cycles plus the cross-rank facts: ``anchor`` (what starts a cycle), ``clock``,
    ``matched`` all-reduces, of them ``waited`` (some rank waited over 2 µs and a tenth of the
    transfer), per rank how often it arrived last among those, and the straggler: the rank most
    often last, with its share of ``waited``; ``straggler_by_mode``: per mode the rank most often
    last, how often (``last``), of ``waited`` and of ``matched`` all-reduces."""

    anchor: str
    clock: str
    ranks: tuple[RankCycles, ...]
    matched: int
    waited: int
    straggler_rank: int | None
    straggler_share: float | None
    last_arrivals: dict[str, int]
    straggler_by_mode: dict[str, dict[str, int]] = {}
    notes: tuple[str, ...] = ()


def mode_of_step(name: str) -> str | None:
    """``step[VERIFY bs=8]`` → ``verify``; None for a name that is no SGLang step span."""
    m = _STEP.match(name)
    if m is None:
        return None
    return _STEP_MODE.get(m.group(1), "other")


def forwards(r: RankEvents) -> list[tuple[str, int, int]]:
    """``(mode, host start ns, host end ns)`` of each forward of one rank, sorted, none nested.

    A span of 0 ns or less is no forward (a forward's host window holds at least one launch, and
    one launch alone takes microseconds): kept, a 0 ns ``draft`` stage would hold none of its
    draft steps and each step would count as a forward (and a cycle) of its own."""
    out = [
        (s.name, s.start_ns, s.end_ns) for s in r.spans if s.name in ("draft", "draft_extend") and s.end_ns > s.start_ns
    ]
    stage_starts = np.array([s for _, s, _ in out], dtype=np.int64)
    stage_ends = np.array([e for _, _, e in out], dtype=np.int64)
    for st in r.steps:
        mode = mode_of_step(st.name)
        if mode is None or st.end_ns <= st.start_ns:
            continue
        if len(out) and len(stage_starts):
            j = int(np.searchsorted(stage_starts, st.start_ns, side="right")) - 1
            if j >= 0 and st.start_ns < stage_ends[j]:
                continue  # a draft step inside its stage span
        out.append((mode, st.start_ns, st.end_ns))
    out.sort(key=lambda f: f[1])
    kept: list[tuple[str, int, int]] = []
    for f in out:
        if not kept or f[1] >= kept[-1][2]:
            kept.append(f)
    return kept


def _boundaries(fwd: list[tuple[str, int, int]]) -> tuple[str, np.ndarray]:
    for mode, anchor in (("draft", "draft stage"), ("verify", "verify forward"), ("decode", "decode forward")):
        starts = [s for m, s, _ in fwd if m == mode]
        if len(starts) >= 2:
            return anchor, np.array(starts, dtype=np.int64)
    return "none", np.zeros(0, dtype=np.int64)


class _Rank:
    """One rank's events labelled with cycle, forward and mode (arrays over its events)."""

    def __init__(self, r: RankEvents, bounds: np.ndarray, fwd: list[tuple[str, int, int]]) -> None:
        self.r = r
        t = r.launch_ns if r.launch_ns is not None else r.start_ns
        self.cycle = np.searchsorted(bounds, t, side="right").astype(np.int64) - 1
        self.n_cycles = max(len(bounds) - 1, 0)
        self.cycle[self.cycle >= self.n_cycles] = -1  # after the last start: no complete cycle
        starts = np.array([s for _, s, _ in fwd], dtype=np.int64)
        ends = np.array([e for _, _, e in fwd], dtype=np.int64)
        f = np.searchsorted(starts, t, side="right") - 1
        inside = (f >= 0) & (t < ends[np.clip(f, 0, None)]) if len(starts) else np.zeros(len(t), bool)
        self.fwd = np.where(inside, f, -1)
        codes = np.array([MODES.index(m) for m, _, _ in fwd] or [0], dtype=np.int8)
        self.mode = np.where(inside, codes[np.clip(f, 0, None)], MODES.index("outside")).astype(np.int8)
        self.fwd_cycle = np.searchsorted(bounds, starts, side="right") - 1 if len(starts) else starts
        self.fwd_mode = codes[: len(fwd)]


def _gaps(x: _Rank) -> dict:
    """GPU idle gaps of one rank inside its complete cycles, with mode and cause (µs sums)."""
    r = x.r
    sel = np.flatnonzero(x.cycle >= 0)
    out = {"mode": {}, "between": {c: 0.0 for c in CAUSES}}
    if len(sel) < 2:
        return out
    s, d = r.start_ns[sel], r.dur_ns[sel]
    e = s + d
    us, ue = union_ns(s, e)
    g0, g1 = ue[:-1], us[1:]
    nxt = np.searchsorted(s, g1, side="left")  # events are sorted by start
    by_end = np.argsort(e, kind="stable")
    prv = by_end[np.clip(np.searchsorted(e[by_end], g0, side="right") - 1, 0, None)]
    launch = (r.launch_ns[sel] if r.launch_ns is not None else s)[nxt]
    names = np.array([bool(_D2H.search(n)) for n in r.names], dtype=bool)[r.name_id[sel]]
    cause = np.full(len(g0), CAUSES.index("dependency"), dtype=np.int8)
    cause[launch > g0] = CAUSES.index("launch_gap")
    if r.host_syncs:
        ss = np.array([w.start_ns for w in r.host_syncs], dtype=np.int64)
        reach = np.maximum.accumulate(np.array([w.end_ns for w in r.host_syncs], dtype=np.int64))
        j = np.searchsorted(ss, g1, side="left") - 1
        cause[(j >= 0) & (reach[np.clip(j, 0, None)] >= g0)] = CAUSES.index("host_sync")
    cause[names[prv]] = CAUSES.index("d2h_copy")
    fwd = x.fwd[sel]
    same = (fwd[prv] == fwd[nxt]) & (fwd[prv] >= 0)
    mode = x.mode[sel][prv]
    gap_us = (g1 - g0) / 1000.0
    for k in np.flatnonzero(g1 > g0).tolist():
        c = CAUSES[int(cause[k])]
        if same[k]:
            slot = out["mode"].setdefault(MODES[int(mode[k])], {c2: 0.0 for c2 in CAUSES})
        else:
            slot = out["between"]
        slot[c] += float(gap_us[k])
    return out


def _cycle_spans(x: _Rank) -> np.ndarray:
    """GPU span (ns) of each complete cycle: first event start to the next cycle's first start."""
    r = x.r
    firsts = np.full(x.n_cycles + 1, -1, dtype=np.int64)
    valid = np.flatnonzero(x.cycle >= 0)
    for c in range(x.n_cycles):
        idx = valid[x.cycle[valid] == c]
        if len(idx):
            firsts[c] = int(r.start_ns[idx].min())
    tail = np.flatnonzero((x.cycle < 0) & (r.start_ns > (firsts[x.n_cycles - 1] if x.n_cycles else 0)))
    last_end = int((r.start_ns[valid] + r.dur_ns[valid]).max()) if len(valid) else 0
    firsts[x.n_cycles] = int(r.start_ns[tail].min()) if len(tail) else last_end
    spans = np.diff(firsts)
    ok = (firsts[:-1] >= 0) & (firsts[1:] >= 0) & (spans > 0)
    return spans[ok]


def _match(xs: list[_Rank]) -> tuple[dict, dict[int, int], int, int, list[str]]:
    """Transfer and wait per rank and mode (ns sums over its complete cycles), matching the i-th
    all-reduce of each (cycle, mode) across ranks. Returns (per rank: mode → (transfer, wait)),
    per rank how often it arrived last where someone waited, matched count, count where someone
    waited, notes."""
    notes: list[str] = []
    keys, durs = [], []
    n_cycles = min(x.n_cycles for x in xs)
    if len({x.n_cycles for x in xs}) > 1:
        notes.append(f"ranks have {sorted({x.n_cycles for x in xs})} complete cycles; matched the first {n_cycles}")
    for x in xs:
        sel = np.flatnonzero(np.isin(x.r.cls, _AR) & (x.cycle >= 0) & (x.cycle < n_cycles))
        group = x.cycle[sel] * len(MODES) + x.mode[sel]
        order = np.argsort(group, kind="stable")  # events are in start order within each group
        g = group[order]
        first = np.r_[0, np.flatnonzero(np.diff(g)) + 1] if len(g) else np.zeros(0, np.int64)
        pos = np.arange(len(g)) - np.repeat(first, np.diff(np.r_[first, len(g)])) if len(g) else g
        keys.append(g * 1_000_000 + pos)
        durs.append(x.r.dur_ns[sel][order])
    common = keys[0]
    for k in keys[1:]:
        common = np.intersect1d(common, k)
    total = sum(len(k) for k in keys)
    if len(xs) < 2 or not len(common):
        return {}, {}, 0, 0, notes
    if total != len(common) * len(xs):
        notes.append(
            f"{total - len(common) * len(xs)} all-reduces have no counterpart on every rank "
            "(different counts in a cycle and mode); their time is counted, not split into wait and transfer"
        )
    mat = np.stack([_pick(k, d, common) for k, d in zip(keys, durs)])  # (ranks, matched)
    transfer = mat.min(axis=0)
    last = mat.argmin(axis=0)
    # "last to arrive" only where someone waited: more than 2 µs and a tenth of the transfer
    waited = (mat.max(axis=0) - transfer) > np.maximum(2000, transfer // 10)
    mode = (common // 1_000_000) % len(MODES)
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for j, x in enumerate(xs):
        per = out[x.r.rank] = {}
        for m in np.unique(mode).tolist():
            sel = mode == m
            per[MODES[m]] = (float(transfer[sel].sum()), float((mat[j, sel] - transfer[sel]).sum()))
    arrivals = {x.r.rank: int(((last == j) & waited).sum()) for j, x in enumerate(xs)}
    by_mode = {}
    for m in np.unique(mode[waited]).tolist():
        sel = waited & (mode == m)
        counts = {x.r.rank: int((last[sel] == j).sum()) for j, x in enumerate(xs)}
        top = max(counts, key=lambda k: (counts[k], -k))
        by_mode[MODES[m]] = {
            "rank": top,
            "last": counts[top],
            "waited": int(sel.sum()),
            "matched": int((mode == m).sum()),
        }
    out["_stragglers"] = by_mode
    return out, arrivals, len(common), int(waited.sum()), notes


def _pick(keys: np.ndarray, values: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``values`` at the positions of ``want`` in ``keys`` (every wanted key is present)."""
    order = np.argsort(keys, kind="stable")
    return values[order][np.searchsorted(keys[order], want)]


def _mode_splits(x: _Rank, matched: dict[str, tuple[float, float]], gaps: dict) -> list[ModeSplit]:
    r, n = x.r, max(x.n_cycles, 1)
    out = []
    known = r.in_graph is not None  # None: a live run, launches not known (nothing counted eager)
    graph = r.in_graph if known else np.ones(len(r.start_ns), bool)
    for code, mode in enumerate(MODES):
        sel = np.flatnonzero((x.cycle >= 0) & (x.mode == code))
        fwd = (
            int(((x.fwd_mode == code) & (x.fwd_cycle >= 0) & (x.fwd_cycle < x.n_cycles)).sum())
            if mode != "outside"
            else 0
        )
        if not len(sel) and not fwd:
            continue
        b = breakdown(r.start_ns[sel], r.dur_ns[sel], r.cls[sel]) if len(sel) else {}
        ar = sel[np.isin(r.cls[sel], _AR)]
        ar_sum = float(r.dur_ns[ar].sum())
        tr, wt = matched.get(mode, (0.0, 0.0))
        causes = gaps["mode"].get(mode, {c: 0.0 for c in CAUSES})
        eager = sel[~graph[sel]]
        out.append(
            ModeSplit(
                mode=mode,
                forwards=round(fwd / n, 3),
                compute_us=round(b.get("compute_us", 0.0) / n, 3),
                allreduce_us=round(ar_sum / 1000.0 / n, 3),
                allreduce_count=round(len(ar) / n, 3),
                transfer_us=round(tr / 1000.0 / n, 3),
                wait_us=round(wt / 1000.0 / n, 3),
                unmatched_us=round(max(ar_sum - tr - wt, 0.0) / 1000.0 / n, 3),
                other_comm_us=round((b.get("other_comm_us", 0.0) + b.get("ep_alltoall_us", 0.0)) / n, 3),
                memory_us=round(b.get("memory_us", 0.0) / n, 3),
                idle_us=round(sum(causes.values()) / n, 3),
                idle_causes_us={c: round(v / n, 3) for c, v in causes.items()},
                eager_kernels=round(len(eager) / n, 3),
                eager_us=round(float(r.dur_ns[eager].sum()) / 1000.0 / n, 3),
                graph_kernels=round((len(sel) - len(eager)) / n, 3) if known else 0.0,
            )
        )
    return out


def split_cycles(ranks: list[RankEvents]) -> CycleSplit | None:
    """The cycle split of a set of TP ranks (one trace each); None when no rank has SGLang step
    spans (no forwards to find cycles in)."""
    per = []
    anchor = None
    for r in sorted(ranks, key=lambda r: r.rank):
        fwd = forwards(r)
        if not fwd:
            continue
        a, bounds = _boundaries(fwd)
        anchor = anchor or a
        per.append(_Rank(r, bounds, fwd))
    if not per:
        return None
    notes = []
    if any(x.n_cycles == 0 for x in per):
        notes.append("a rank has fewer than two cycle starts: no complete cycle on it")
    matched, arrivals, n_matched, n_waited, match_notes = _match(per) if len(per) > 1 else ({}, {}, 0, 0, [])
    by_mode = matched.pop("_stragglers", {})
    notes += match_notes
    if len(per) < 2:
        notes.append(
            "one rank only: all-reduce wait cannot be told from transfer (needs every rank's trace); "
            "its whole all-reduce time is shown as unmatched"
        )
    out = []
    for x in per:
        gaps = _gaps(x)
        spans = _cycle_spans(x)
        n = max(x.n_cycles, 1)
        out.append(
            RankCycles(
                rank=x.r.rank,
                cycles=x.n_cycles,
                cycle_median_us=round(float(np.median(spans)) / 1000.0, 3) if len(spans) else 0.0,
                cycle_mean_us=round(float(spans.mean()) / 1000.0, 3) if len(spans) else 0.0,
                modes=tuple(_mode_splits(x, matched.get(x.r.rank, {}), gaps)),
                between_idle_us=round(sum(gaps["between"].values()) / n, 3),
                between_causes_us={c: round(v / n, 3) for c, v in gaps["between"].items()},
                straggler_count=arrivals.get(x.r.rank, 0),
            )
        )
    straggler = share = None
    if arrivals and n_waited:
        straggler = max(arrivals, key=lambda k: (arrivals[k], -k))
        share = round(arrivals[straggler] / n_waited, 4)
    clock = per[0].r.meta.get("timing", "trace")
    return CycleSplit(
        anchor=anchor or "none",
        clock=clock,
        ranks=tuple(out),
        matched=n_matched,
        waited=n_waited,
        straggler_rank=straggler,
        straggler_share=share,
        last_arrivals={str(k): v for k, v in arrivals.items()},
        straggler_by_mode=by_mode,
        notes=tuple(notes),
    )
