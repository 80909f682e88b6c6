"""Per message size of a verify step: NCCL's own time from its log (:func:`tuning_time_us`), the
verdict, and each backend's crossover (always *predicted* unless the figures are measured).

Per size (:func:`per_size_rows`): the best NCCL figure and every backend with a figure at that
size, fastest point first; where the two fastest ranges overlap the size is "too close to call:
measure", where one is unknown it is unknown. ``crossover_bytes`` per backend: the smallest size
of the step, among those where the backend's range is known, at which NCCL's point is at or below
the backend's (None when it never is), usable as the backend's workspace cap (the backend below it,
NCCL from it on); a backend whose range is unknown at every size has no crossover.

The figures are :class:`fastverify.tune.candidates.Figure` (``per_call_us`` / ``per_call_range``
per size in µs, ``nccl`` set on an NCCL-settings figure). This module imports neither torch nor
any GPU library.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastverify.tune.ranges import UNKNOWN

__all__ = ["TOO_CLOSE", "UNKNOWN", "per_size_json", "per_size_rows", "tuning_time_us"]

TOO_CLOSE = "too close to call: measure"


def per_size_rows(workload, figures: Sequence) -> tuple[tuple[dict, ...], dict[str, int | None]]:
    """Per message size of ``workload``: the fastest NCCL figure and every backend with a figure
    at that size, fastest point first (µs per call), and the verdict; and per backend the
    crossover size (the module docstring).

    Each row: ``msg_bytes``, ``count``, ``entries`` (``name``, ``backend``, ``point_us``,
    ``range_us`` or None where unknown), ``verdict`` (the fastest name, :data:`TOO_CLOSE` where
    the two fastest ranges overlap, :data:`UNKNOWN` where one of them has no range) and
    ``winner`` (the name, None unless the verdict is one).
    """
    nccl = [f for f in figures if f.nccl is not None and f.ranked] or [f for f in figures if f.nccl is not None]
    best_nccl = min(nccl, key=lambda f: f.point_us)
    kernels = [f for f in figures if f.nccl is None and f.per_call_us]
    rows = []
    cross: dict[str, int | None] = {f.name: None for f in kernels
                                    if any(f.per_call_range.get(b) is not None for b, _ in workload.msg_sizes)}
    for nbytes, count in workload.msg_sizes:
        entries = [{"name": f.name, "backend": f.backend.value, "point_us": f.per_call_us[nbytes],
                    "range_us": f.per_call_range.get(nbytes)}
                   for f in (best_nccl, *kernels) if f.per_call_us.get(nbytes) is not None]
        entries.sort(key=lambda e: e["point_us"])
        verdict = entries[0]["name"] if entries else UNKNOWN
        if len(entries) >= 2:
            a, b = entries[0]["range_us"], entries[1]["range_us"]
            verdict = UNKNOWN if a is None or b is None else TOO_CLOSE if a[1] >= b[0] else entries[0]["name"]
        n_point = best_nccl.per_call_us.get(nbytes)
        for f in kernels:
            k = f.per_call_us.get(nbytes)
            if f.name in cross and cross[f.name] is None and f.per_call_range.get(nbytes) is not None \
                    and k is not None and n_point is not None and n_point <= k:
                cross[f.name] = nbytes
        rows.append({"msg_bytes": nbytes, "count": count, "entries": entries, "verdict": verdict,
                     "winner": verdict if verdict not in (UNKNOWN, TOO_CLOSE) else None})
    return tuple(rows), cross


def tuning_time_us(log, nbytes: int, enabled: tuple[frozenset, frozenset | None] | None) -> float | None:
    """NCCL's own predicted time of one AllReduce of ``nbytes`` from the log's TUNING table: the
    fastest (algorithm, protocol) with a bandwidth > 0 (NCCL prints 0 for disabled pairs) among
    those the environment enables; ``lat + nbytes / (1000 × bw)`` µs with bw in GB/s
    (NCCL ``src/graph/tuning.cc``, ``ncclTopoGetAlgoTime``)."""
    rows = (log.tuning or {}).get("AllReduce") if log is not None else None
    if not rows:
        return None
    algos, protos = enabled if enabled else (None, None)
    times = []
    for (algo, proto), (lat, bw) in rows.items():
        if not (bw and bw > 0 and lat is not None and lat >= 0):
            continue
        if algos is not None and not any(a.value.upper() == algo.upper() for a in algos):
            continue
        if protos is not None and not any(p.value.upper() == proto.upper() for p in protos):
            continue
        times.append(lat + nbytes / (1000.0 * bw))
    return min(times) if times else None


def per_size_json(rows, rnd) -> list[dict]:
    """``rows`` (:func:`per_size_rows`) for the JSON document, µs rounded by ``rnd``."""
    return [{**row, "entries": [{**e, "point_us": rnd(e["point_us"]), "range_us": None if e["range_us"] is None
                                 else [rnd(x) for x in e["range_us"]]} for e in row["entries"]]} for row in rows]
