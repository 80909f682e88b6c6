"""Compute vs all-reduce split of per-rank event tables: the numbers of a fastverify profile.

Definitions (per rank, all times in µs, from ns integers):

- ``window_us``: last GPU event end − first GPU event start (HTA's ``kernel_time``).
- ``busy_us``: length of the union of all GPU events; ``idle_us = window_us − busy_us``.
- ``compute_us``, ``allreduce_us``, ``other_comm_us``, ``ep_alltoall_us`` (expert-parallel
  dispatch/combine), ``memory_us``, ``unknown_comm_us``: length of
  the union of each class's intervals (so two overlapping kernels of one class count once).
  ``allreduce_us`` includes fused all-reduce + RMSNorm kernels; ``fused_allreduce_us`` is their part.
- ``exposed_comm_us``: time where communication (all-reduce, EP all-to-all or other) runs and no
  compute does.
- ``comm_compute_overlap_pct``: |comm ∩ compute| / |comm| × 100 (HTA ``get_comm_comp_overlap``;
  None when there is no communication).
- ``hta``: HTA's temporal breakdown (``hta/analyzers/breakdown_analysis.py``) with our
  classification: ``kernel_time_us``, ``idle_us``, ``compute_us`` and
  ``non_compute_us = kernel_time − compute − idle``.

Across ranks, the i-th collective of each rank is matched (TraceLens's NcclAnalyser does the same
per process group): ``transfer_us`` = the shortest duration among ranks, each rank's
``wait_us`` = its duration − transfer. The rank with the shortest duration is the one the others
waited for: the straggler.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from fastverify.bounds import MIN_TIME_US
from fastverify.events import CLASSES, EventClass, RankEvents

_BIT = {c: 1 << i for i, c in enumerate(CLASSES)}
_COMPUTE = _BIT[EventClass.COMPUTE]
_AR = _BIT[EventClass.ALLREDUCE] | _BIT[EventClass.FUSED_ALLREDUCE]
_COMM = _AR | _BIT[EventClass.OTHER_COMM] | _BIT[EventClass.EP_ALLTOALL]
_COLLECTIVE_CODES = np.array(
    [
        EventClass.ALLREDUCE.code,
        EventClass.FUSED_ALLREDUCE.code,
        EventClass.OTHER_COMM.code,
        EventClass.EP_ALLTOALL.code,
    ],
    dtype=np.int8,
)
_AR_CODES = np.array([EventClass.ALLREDUCE.code, EventClass.FUSED_ALLREDUCE.code], dtype=np.int8)


def union_ns(start_ns: np.ndarray, end_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals ``[start, end)`` (int64 ns, any order) into sorted disjoint ones.

    Returns ``(starts, ends)``, both int64 of the same length ≤ the input's.
    """
    if len(start_ns) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(start_ns, kind="stable")
    s, e = start_ns[order], end_ns[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    seg = np.cumsum(new) - 1
    starts = s[new]
    ends = np.zeros(len(starts), dtype=np.int64)
    np.maximum.at(ends, seg, e)
    return starts, ends


def time_by_mask_ns(start_ns: np.ndarray, dur_ns: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Time (ns) spent in each combination of running event classes.

    Returns an int64 array of length ``2**len(CLASSES)``: entry ``m`` is the time during which
    exactly the classes in bitmask ``m`` (bit ``i`` = ``CLASSES[i]``) have at least one event
    running. Entry 0 is never filled (gaps are measured as window − busy by the caller).
    """
    nbits = len(CLASSES)
    out = np.zeros(1 << nbits, dtype=np.int64)
    times, deltas = [], []
    end_ns = start_ns + dur_ns
    for i, _c in enumerate(CLASSES):
        sel = cls == i
        if not sel.any():
            continue
        s, e = union_ns(start_ns[sel], end_ns[sel])
        times += [s, e]
        deltas += [np.full(len(s), 1 << i, np.int64), np.full(len(e), -(1 << i), np.int64)]
    if not times:
        return out
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    mask = np.cumsum(d)
    span = np.diff(t)
    np.add.at(out, mask[:-1], span)
    out[0] = 0
    return out


def _sum_masks(by_mask: np.ndarray, any_of: int, none_of: int = 0) -> int:
    m = np.arange(len(by_mask))
    sel = ((m & any_of) != 0) & ((m & none_of) == 0)
    return int(by_mask[sel].sum())


def breakdown(start_ns: np.ndarray, dur_ns: np.ndarray, cls: np.ndarray) -> dict:
    """The split of one window of events (a rank, or one step of a rank). See the module docstring.

    Parameters
    ----------
    start_ns, dur_ns : int64 arrays, shape (n,)
    cls : int8 array, shape (n,), ``EventClass.code`` values

    Returns
    -------
    dict of floats in µs (and counts); empty-window values are 0.
    """
    if len(start_ns) == 0:
        return {"events": 0, "window_us": 0.0}
    end_ns = start_ns + dur_ns
    window = int(end_ns.max() - start_ns.min())
    bm = time_by_mask_ns(start_ns, dur_ns, cls)
    busy = int(bm.sum())
    comm = _sum_masks(bm, _COMM)
    overlap = _sum_masks(bm, _COMM) - _sum_masks(bm, _COMM, _COMPUTE)
    compute = _sum_masks(bm, _COMPUTE)
    idle = window - busy

    def us(x: int) -> float:
        return round(x / 1000.0, 3)

    counts = dict(enumerate(np.bincount(cls.astype(np.intp), minlength=len(CLASSES)).tolist())) if len(cls) else {}
    ar_sel = np.isin(cls, _AR_CODES)
    return {
        "events": int(len(start_ns)),
        "window_us": us(window),
        "busy_us": us(busy),
        "idle_us": us(idle),
        "compute_us": us(compute),
        "allreduce_us": us(_sum_masks(bm, _AR)),
        "fused_allreduce_us": us(_sum_masks(bm, _BIT[EventClass.FUSED_ALLREDUCE])),
        "other_comm_us": us(_sum_masks(bm, _BIT[EventClass.OTHER_COMM])),
        "ep_alltoall_us": us(_sum_masks(bm, _BIT[EventClass.EP_ALLTOALL])),
        "memory_us": us(_sum_masks(bm, _BIT[EventClass.MEMORY])),
        "unknown_comm_us": us(_sum_masks(bm, _BIT[EventClass.UNKNOWN_COMM])),
        "exposed_comm_us": us(_sum_masks(bm, _COMM, _COMPUTE)),
        "allreduce_exposed_us": us(_sum_masks(bm, _AR, _COMPUTE)),
        "other_exposed_us": us(busy - compute - _sum_masks(bm, _AR, _COMPUTE)),
        "comm_compute_overlap_pct": round(100.0 * overlap / comm, 3) if comm else None,
        "allreduce_kernel_sum_us": us(int(dur_ns[ar_sel].sum())),
        "allreduce_count": int(ar_sel.sum()),
        "counts": {c.value: counts.get(c.code, 0) for c in CLASSES},
        "hta": {
            "kernel_time_us": us(window),
            "idle_us": us(idle),
            "compute_us": us(compute),
            "non_compute_us": us(window - compute - idle),
            "comm_compute_overlap_pct": round(100.0 * overlap / comm, 3) if comm else None,
        },
    }


def grouped_percentiles(values: np.ndarray, groups: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """Percentiles ``qs`` (0-100) of ``values`` within each group, all groups in one sort.

    ``values`` and ``groups`` have shape (n,) (``values`` int64 ns or float64; ``groups`` any
    integer ids). Returns float64, shape (len(qs), number of distinct groups), groups in
    ascending id order. Each entry equals ``np.percentile(values[groups == g], q)`` bit for bit:
    numpy's default "linear" method (virtual index ``(n - 1) * q / 100``, the two neighbours, and
    numpy's own two-sided lerp from ``numpy/lib/_function_base_impl.py::_lerp``), so that a
    profile's numbers do not change with the batching. 808 separate ``np.percentile`` calls took
    44-78 ms on a 53.7 MB trace; this takes one ``lexsort``.
    """
    values = np.asarray(values)
    groups = np.asarray(groups)
    if not len(values):
        return np.zeros((len(qs), 0))
    order = np.lexsort((values, groups))
    v, g = values[order], groups[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.r_[starts, len(v)])
    out = np.empty((len(qs), len(starts)))
    for k, q in enumerate(qs):
        vi = (counts - 1) * np.true_divide(q, 100)
        prev = np.floor(vi)
        gamma = vi - prev
        lo = np.clip(prev.astype(np.intp), 0, counts - 1)
        hi = np.clip(lo + 1, 0, counts - 1)
        a, b = v[starts + lo], v[starts + hi]
        diff = b - a
        res = np.add(a, diff * gamma)
        np.subtract(b, diff * (1 - gamma), out=res, where=gamma >= 0.5, casting="unsafe")
        out[k] = res
    return out


def median(values) -> float:
    """The median as ``np.median`` computes it (the mean of the two middle values for an even
    count), without ``np.median``'s import of ``numpy.ma`` (30-45 ms of a trace job's start)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = len(x)
    if n == 0:
        return float("nan")
    m = n // 2
    return float(x[m]) if n % 2 else float((x[m - 1] + x[m]) / 2)


def short_allreduces(r: RankEvents) -> tuple[int, int]:
    """``(short, total)``: the all-reduce kernels (fused ones included) of rank ``r`` that last under
    :data:`fastverify.bounds.MIN_TIME_US` (0 ns included), and all of its all-reduce kernels. A
    kernel that short did no all-reduce one can time: a hand-made or broken trace."""
    sel = np.isin(r.cls, _AR_CODES)
    return int((r.dur_ns[sel] < MIN_TIME_US * 1000.0).sum()), int(sel.sum())


def by_message_size(ranks: list[RankEvents]) -> list[dict]:
    """All-reduce latency per message size over all ranks: count, median, p90, min, max, sum (µs).

    Events with unknown size (``msg_bytes == -1``) form their own row with ``msg_bytes`` None.
    """
    sizes, durs = [], []
    for r in ranks:
        sel = np.isin(r.cls, _AR_CODES)
        sizes.append(r.msg_bytes[sel])
        durs.append(r.dur_ns[sel])
    if not sizes:
        return []
    size = np.concatenate(sizes)
    dur = np.concatenate(durs)
    rows = []
    if not len(size):
        return rows
    pct = grouped_percentiles(dur, size, (50, 90))
    for j, b in enumerate(sorted(set(size.tolist()))):  # not np.unique: it imports numpy.ma
        d = dur[size == b]
        rows.append(
            {
                "msg_bytes": int(b) if b >= 0 else None,
                "count": int(len(d)),
                "median_us": round(float(pct[0, j]) / 1000.0, 3),
                "p90_us": round(float(pct[1, j]) / 1000.0, 3),
                "min_us": round(int(d.min()) / 1000.0, 3),
                "max_us": round(int(d.max()) / 1000.0, 3),
                "sum_us": round(int(d.sum()) / 1000.0, 3),
            }
        )
    return rows


def match_collectives(ranks: list[RankEvents]) -> dict:
    """Match the i-th collective of every rank and split each into transfer and wait.

    Returns a dict with ``matched`` (count), ``per_rank`` (rank → wait_us, transfer_us,
    straggler_count), ``straggler_rank`` (the rank most often the last to arrive, None with one
    rank), ``collectives`` (one record per matched collective) and ``warnings``.
    """
    seqs = {r.rank: np.flatnonzero(np.isin(r.cls, _COLLECTIVE_CODES)) for r in ranks}
    warnings: list[str] = []
    if len(ranks) < 2:
        return {
            "matched": 0,
            "per_rank": {},
            "straggler_rank": None,
            "collectives": [],
            "warnings": ["one rank only: transfer vs wait needs the traces of several ranks"],
        }
    counts = {k: len(v) for k, v in seqs.items()}
    n = min(counts.values())
    if len(set(counts.values())) > 1:
        warnings.append(f"ranks have different collective counts {counts}; matched the first {n} of each")
    by_rank = {r.rank: r for r in ranks}
    rank_ids = sorted(seqs)
    dur = np.stack([by_rank[k].dur_ns[seqs[k][:n]] for k in rank_ids])  # (ranks, n)
    cls = np.stack([by_rank[k].cls[seqs[k][:n]] for k in rank_ids])
    if n and (cls != cls[0]).any():
        bad = int(np.argmax((cls != cls[0]).any(axis=0)))
        warnings.append(f"collective #{bad} has different kinds across ranks; the traces may not cover the same window")
    transfer = dur.min(axis=0) if n else np.zeros(0, np.int64)
    wait = dur - transfer
    last = dur.argmin(axis=0) if n else np.zeros(0, np.int64)
    straggler_counts = Counter(int(rank_ids[i]) for i in last)
    ref = by_rank[rank_ids[0]]
    collectives = []
    for i in range(n):
        ev = seqs[rank_ids[0]][i]
        collectives.append(
            {
                "index": i,
                "kind": CLASSES[int(cls[0, i])].value,
                "name": ref.names[int(ref.name_id[ev])],
                "msg_bytes": int(ref.msg_bytes[ev]) if ref.msg_bytes[ev] >= 0 else None,
                "step": int(ref.step[ev]),
                "label": ref.label[ev] if ref.label is not None else None,
                "duration_us": {str(k): round(int(dur[j, i]) / 1000.0, 3) for j, k in enumerate(rank_ids)},
                "transfer_us": round(int(transfer[i]) / 1000.0, 3),
                "straggler_rank": int(rank_ids[int(last[i])]),
            }
        )
    per_rank = {
        str(k): {
            "wait_us": round(int(wait[j].sum()) / 1000.0, 3),
            "transfer_us": round(int(transfer.sum()) / 1000.0, 3),
            "allreduce_wait_us": round(int(wait[j][np.isin(cls[j], _AR_CODES)].sum()) / 1000.0, 3),
            "allreduce_transfer_us": round(int(transfer[np.isin(cls[j], _AR_CODES)].sum()) / 1000.0, 3),
            "straggler_count": straggler_counts.get(int(k), 0),
        }
        for j, k in enumerate(rank_ids)
    }
    straggler = max(straggler_counts, key=lambda k: (straggler_counts[k], -k)) if n else None
    return {
        "matched": n,
        "per_rank": per_rank,
        "straggler_rank": straggler,
        "collectives": collectives,
        "warnings": warnings,
    }


def by_position(ranks: list[RankEvents]) -> list[dict]:
    """All-reduce latency by position within a step (position p = the p-th all-reduce of a step):
    the per-layer view. Position 0 of a TP decoder forward is the embedding all-reduce, then two
    per layer (attention output, MLP/MoE output). Median and p90 over steps and ranks, µs."""
    acc: dict[int, list[int]] = {}
    labels: dict[int, str] = {}
    sizes: dict[int, set] = {}
    for r in ranks:
        sel = np.flatnonzero(np.isin(r.cls, _AR_CODES) & (r.step >= 0))
        if len(sel) == 0:
            continue
        steps = r.step[sel]
        # position = running index within each step (events are sorted by start)
        first = np.r_[0, np.flatnonzero(np.diff(steps)) + 1]
        pos = np.arange(len(sel)) - np.repeat(first, np.diff(np.r_[first, len(sel)]))
        for p, ev in zip(pos.tolist(), sel.tolist()):
            acc.setdefault(p, []).append(int(r.dur_ns[ev]))
            sizes.setdefault(p, set()).add(int(r.msg_bytes[ev]))
            if r.label is not None:
                labels.setdefault(p, r.label[ev])
    rows = []
    if not acc:
        return rows
    positions = sorted(acc)
    d_all = np.concatenate([np.array(acc[p], dtype=np.int64) for p in positions])
    g_all = np.repeat(np.array(positions, dtype=np.int64), [len(acc[p]) for p in positions])
    pct = grouped_percentiles(d_all, g_all, (50, 90))
    for j, p in enumerate(positions):
        s = sizes[p] - {-1}
        rows.append(
            {
                "position": p,
                "label": labels.get(p),
                "count": len(acc[p]),
                "msg_bytes": (min(s) if len(s) == 1 else None),
                "median_us": round(float(pct[0, j]) / 1000.0, 3),
                "p90_us": round(float(pct[1, j]) / 1000.0, 3),
            }
        )
    return rows


def top_kernels(r: RankEvents, k: int = 15) -> list[dict]:
    """The ``k`` event names with the largest summed duration on one rank (µs)."""
    total = np.bincount(r.name_id, weights=r.dur_ns, minlength=len(r.names))
    count = np.bincount(r.name_id, minlength=len(r.names))
    cls_of = np.zeros(len(r.names), dtype=np.int8)
    cls_of[r.name_id] = r.cls
    order = np.argsort(-total, kind="stable")[:k]
    return [
        {
            "name": r.names[i],
            "class": CLASSES[int(cls_of[i])].value,
            "count": int(count[i]),
            "sum_us": round(float(total[i]) / 1000.0, 3),
        }
        for i in order
        if count[i]
    ]


_STEP_FIELDS = (
    "window_us",
    "busy_us",
    "idle_us",
    "compute_us",
    "allreduce_us",
    "other_comm_us",
    "memory_us",
    "exposed_comm_us",
    "allreduce_kernel_sum_us",
    "allreduce_count",
)


def step_median(steps: list[dict]) -> dict | None:
    """Median over steps of each per-step quantity (µs; counts as medians too); None without steps."""
    if not steps:
        return None
    return {"steps": len(steps), **{k: round(median([s[k] for s in steps]), 3) for k in _STEP_FIELDS}}


def analyze_rank(r: RankEvents) -> dict:
    """Whole-rank split plus one split per step (see :func:`breakdown`)."""
    out = {"rank": r.rank, "origin": r.origin, **breakdown(r.start_ns, r.dur_ns, r.cls)}
    steps = []
    for i, s in enumerate(r.steps):
        sel = r.step == i
        if not sel.any():
            continue
        b = breakdown(r.start_ns[sel], r.dur_ns[sel], r.cls[sel])
        b.pop("hta", None)
        steps.append({"index": i, "name": s.name, "gpu_start_us": round(int(r.start_ns[sel].min()) / 1000.0, 3), **b})
    out["steps"] = steps
    out["step_median"] = step_median(steps)
    out["outside_steps_events"] = int((r.step < 0).sum()) if r.steps else 0
    # sorted(set()) rather than np.unique, which imports numpy.ma (30-45 ms of a trace job's start)
    unknown = [r.names[i] for i in sorted(set(r.name_id[r.cls == EventClass.UNKNOWN_COMM.code].tolist()))]
    out["unknown_comm_kernels"] = unknown
    out["top_kernels"] = top_kernels(r)
    out["meta"] = r.meta
    return out


def analyze(ranks: list[RankEvents]) -> dict:
    """All analyses of a set of ranks: the body of a profile (see :mod:`fastverify.profile.build`)."""
    per_rank = [analyze_rank(r) for r in ranks]
    matched = match_collectives(ranks)
    for rr in per_rank:
        pr = matched["per_rank"].get(str(rr["rank"]))
        if pr:
            rr["allreduce_wait_us"] = pr["allreduce_wait_us"]
            rr["allreduce_transfer_us"] = round(max(rr["allreduce_kernel_sum_us"] - pr["allreduce_wait_us"], 0.0), 3)
        else:
            rr["allreduce_wait_us"] = None
            rr["allreduce_transfer_us"] = None
    return {
        "ranks": per_rank,
        "allreduce_by_msg_size": by_message_size(ranks),
        "allreduce_by_position": by_position(ranks),
        "cross_rank": {k: v for k, v in matched.items()},
    }
