"""The JSON document ``tune --json`` prints, one shape for both modes: schema and version, mode,
label, the workload, the box, the baseline and every candidate (``change_pct`` = new vs
baseline, negative is less time) with its evidence, and the notes. Every float is rounded and
never ``-0.0``; a non-finite one is null.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastverify.tune.candidates import MEASURED, PREDICTED, Figure, PredictedRanking, dedup, per_size_json
from fastverify.tune.trial import Clock
from fastverify.tune.verify_time import verify_reduction

SCHEMA = "fastverify.tune"
SCHEMA_VERSION = 2  # 2: change_pct (new vs baseline, - = less time) replaced vs_baseline_pct (+ = faster)


def _workload_json(workload) -> dict:
    """The workload part of ``tune --json`` (predict and measure alike): source, TP, the all-reduces
    per step by size, dtype, hidden size (None for a trace profile without ``--hidden``) and notes."""
    return {
        "source": workload.source,
        "tp": workload.tp,
        "allreduce_count": workload.allreduce_count,
        "msg_sizes": [{"msg_bytes": b, "count": c} for b, c in workload.msg_sizes],
        "dtype": workload.dtype,
        "hidden": workload.hidden,
        "notes": list(workload.notes),
    }


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), nd) + 0.0  # + 0.0: no -0.0


def figure_dict(f: Figure, number: int | None, baseline_us: float | None) -> dict:
    """One candidate of the JSON document; ``change_pct`` = (its time - the baseline's) / the
    baseline's x 100 (negative: less time)."""
    v = f.verify or {}
    change = 100.0 * (f.point_us - baseline_us) / baseline_us if f.point_us is not None and baseline_us else None
    return {
        "candidate": number,
        "backend": f.backend.value,
        "name": f.name,
        "settings": dict(f.settings),
        "is_baseline": f.is_baseline,
        "label": f.label,
        "allreduce_us_per_step": _r(f.point_us),
        "allreduce_us_per_step_range": None if f.range_us is None else [_r(x) for x in f.range_us],
        "change_pct": _r(change, 2),
        "evidence": list(f.evidence),
        "sources": list(f.sources),
        "bounds": None if f.bounds is None else {k: _r(x) for k, x in f.bounds.items()},
        "transport": f.transport,
        "verify_ms": _r(v.get("verify_ms"), 4),
        "verify_ms_range": [_r(x, 4) for x in v["verify_ms_range"]] if v.get("verify_ms_range") else None,
        "tok_s": _r(v.get("tok_s"), 2),
        "tok_s_range": [_r(x, 2) for x in v["tok_s_range"]] if v.get("tok_s_range") else None,
        "tok_s_reason": v.get("tok_s_reason"),
        "status": f.status,
        "per_call": [
            {
                "msg_bytes": b,
                "point_us": _r(t),
                "range_us": None if (r := f.per_call_range.get(b)) is None else [_r(r[0]), _r(r[1])],
            }
            for b, t in f.per_call_us.items()
            if t is not None
        ],
        "notes": list(f.notes),
    }


def prediction_document(pred: PredictedRanking, workload, *, box: Mapping[str, Any], notes: Sequence[str] = ()) -> dict:
    """``tune --predict --json``: one document, every figure labelled predicted (or measured where
    the user's own profile / perf table gave every size)."""
    base_us = pred.baseline.point_us
    red = (pred.baseline.verify or {}).get("reduction") or {}
    cands = [figure_dict(f, i if f.ranked else None, base_us) for i, f in enumerate(pred.candidates, 1)]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "mode": "predict",
        "label": PREDICTED,
        "workload": _workload_json(workload),
        "box": dict(box),
        "accept_length": red.get("accept_length"),
        "accept_length_source": red.get("accept_length_source"),
        "t_rest_basis": red.get("t_rest_basis"),
        "verify_baseline_basis": red.get("verify_baseline_basis"),
        "baseline": figure_dict(
            pred.baseline, next(i for i, f in enumerate(pred.candidates, 1) if f.is_baseline), base_us
        ),
        "candidates": cands,
        "not_candidates": list(pred.not_candidates),
        "per_size": per_size_json(pred.per_size, _r),
        "crossover_bytes": dict(pred.crossover_bytes),
        "too_close_to_call": dict(pred.too_close),
        "winner": pred.best.name,
        "tok_s_reason": red.get("t_rest_basis") if red.get("tok_s_baseline") is None else None,
        "notes": list(dedup([*pred.notes, *notes])),
    }


def measured_document(
    ranking,
    workload,
    *,
    accept_length: float | None,
    tok_s: float | None,
    box: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> dict:
    """``tune --json`` in measure mode: the same shape with measured figures. The label is
    ``measured`` for GPU (CUDA events) timings and ``CPU wall clock`` for a gloo run, which
    measures the machinery, not the GPU. Each candidate's ``sizes`` lists its trial's rows, one per
    message size: ``msg_bytes``, ``count_per_step``, ``median_us`` / ``p90_us`` (µs per call, ``None``
    where not measured); ``server_env`` is what SGLang's start-up set for the trial and
    ``environment`` the ranks' environment as recorded (:class:`~fastverify.tune.trial.TrialResult`);
    the trials not ranked carry both too."""
    gpu = ranking.clock is Clock.CUDA_EVENTS
    label = MEASURED if gpu else "CPU wall clock"
    base = ranking.baseline
    base_us = base.step_us if base is not None else None

    def one(c, number) -> dict:
        lo = sum(s.count_per_step * s.median_us for s in c.result.sizes if s.median_us is not None)
        hi = sum(
            s.count_per_step * (s.p90_us if s.p90_us is not None else s.median_us)
            for s in c.result.sizes
            if s.median_us is not None
        )
        verify_ms = tok = None
        if gpu and base_us:  # CPU wall-clock times say nothing about a GPU verify step
            r = verify_reduction(workload, base_us, c.step_us, accept_length=accept_length, tok_s=tok_s)
            verify_ms, tok = r["verify_predicted_us"] / 1e3, r["tok_s_predicted"]
        return {
            "candidate": number,
            "backend": c.spec.backend,
            "name": c.spec.name,
            "settings": dict(c.spec.env),
            "is_baseline": c is base,
            "label": label,
            "clock": c.result.clock.value if c.result.clock else None,
            "allreduce_us_per_step": _r(c.step_us),
            "allreduce_us_per_step_range": [_r(lo), _r(hi)],
            "change_pct": _r(100.0 * (c.step_us - base_us) / base_us, 2) if base_us else None,
            "evidence": [f"{label}: fastverify tune trial {c.spec.trial_id} (median per call; range to p90)"],
            "verify_ms": _r(verify_ms, 4),
            "tok_s": _r(tok, 2),
            "sizes": [
                {
                    "msg_bytes": s.msg_bytes,
                    "count_per_step": s.count_per_step,
                    "median_us": _r(s.median_us),
                    "p90_us": _r(s.p90_us),
                }
                for s in c.result.sizes
            ],
            "server_env": dict(c.spec.server_env),
            "environment": dict(c.result.environment),
        }

    cands = [one(c, i) for i, c in enumerate(ranking.candidates, 1)]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "mode": "measure",
        "label": label,
        "workload": _workload_json(workload),
        "box": dict(box),
        "baseline": next((d for d, c in zip(cands, ranking.candidates) if c is base), None),
        "candidates": cands,
        "not_ranked": [
            {
                "name": s.name,
                "status": r.status.value,
                "reason": r.reason,
                "server_env": dict(s.server_env),
                "environment": dict(r.environment),
            }
            for s, r in ranking.not_ok
        ],
        "notes": list(dedup([*ranking.notes, *notes])),
    }
