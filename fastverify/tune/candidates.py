"""The figures ``tune`` shows: every candidate (NCCL settings and registry backends) with a point,
a range and the evidence each number came from, and the JSON document both modes print.

Evidence order, per message size of the verify step (the first that has the size wins):

1. a profile of the user's server (``--profile``, GPU clock only): the measured median time per
   all-reduce call of that size (``allreduce_by_msg_size[].median_us``);
2. an ``all_reduce_perf`` table from the user's box (``--perf-table``): NCCL measured there
   (:meth:`fastverify.nccl.perftable.PerfTable.time_us`, in place, as ``torch.distributed``'s
   all-reduce runs);
3. the NCCL log (``--nccl-log``): NCCL's own TUNING table (``latency + bytes / (1000 × bw)``,
   NCCL's ``src/graph/tuning.cc`` model, fastest enabled pair), else the cost model with the
   transports the log shows;
4. the topology: NCCL's cost model with the PCIe correction (:mod:`fastverify.tune.predict`),
   its range the point x/÷ the cost model's own misses on the published NCCL boxes
   (:func:`fastverify.tune.ranges.nccl_fit`), or unknown where they cannot tell.

NCCL-setting candidates are the cost model's ratio to the baseline applied to the baseline's
figure. A backend's figure is its published per-size model (sum over sizes × counts of
``estimate``); a size it cannot take (more rows than ``max_rows``) stays on NCCL at the baseline's
figure. With a profile's transfer / wait split, a faster kernel replaces the transfer only:
"wait kept" = wait + kernel, "wait shrinks" = kernel; the range spans both and the point is the
wait-kept bound. A backend with no comparable published measurement is listed as
"no published data: measure with fastverify tune", one whose range is unknown at a size as
"unknown at this size: measure with fastverify tune"; neither is ranked. A backend that fits no
size of the step (more rows than ``max_rows`` at every size) is not a candidate. The verdict per
size and each backend's crossover: :func:`fastverify.tune.per_size.per_size_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from fastverify.registry import BackendName, Role, backend_info, names, unreachable_reason
from fastverify.tune.per_size import per_size_json, per_size_rows, tuning_time_us

PREDICTED = "predicted"
MEASURED = "measured"
NO_DATA = "no published data: measure with fastverify tune"
UNKNOWN = "unknown at this size: measure with fastverify tune"
MEASURE_HINT = "predicted from published measurements of other boxes: measure with `fastverify tune` on this box"
SCHEMA = "fastverify.tune"
SCHEMA_VERSION = 2  # 2: change_pct (new vs baseline, - = less time) replaced vs_baseline_pct (+ = faster)


@dataclass(frozen=True)
class Figure:
    """One candidate's all-reduce time per verify step (µs), with where it came from.

    ``point_us`` / ``range_us`` are ``None`` for a backend without comparable published data or
    with an unknown range at some size (listed, not ranked; ``status`` says which); ``range_us``
    is None too for a baseline whose range is unknown at some size. ``per_call_us`` / ``per_call_range``
    hold one all-reduce of each size (µs; a range None where unknown). ``evidence``: one line per
    source used (a file path, or ``"published: …"``); ``sources``: published measurement ids;
    ``bounds``: ``wait_kept_us`` / ``wait_shrinks_us`` of a profile's split; ``nccl``: the
    :class:`fastverify.tune.predict.Candidate` behind an NCCL-settings figure; ``verify``: the
    verify-time / tok/s figures (:func:`with_verify`)."""

    backend: BackendName
    name: str
    settings: Mapping[str, str]
    point_us: float | None
    range_us: tuple[float, float] | None
    evidence: tuple[str, ...]
    label: str = PREDICTED
    is_baseline: bool = False
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    bounds: Mapping[str, float] | None = None
    transport: str | None = None
    nccl: Any = field(default=None, compare=False, repr=False)
    verify: Mapping[str, Any] | None = None
    per_call_us: Mapping[int, float] = field(default_factory=dict, compare=False, repr=False)
    per_call_range: Mapping[int, tuple[float, float] | None] = field(default_factory=dict, compare=False,
                                                                     repr=False)
    status: str | None = None

    @property
    def ranked(self) -> bool:
        return self.point_us is not None


@dataclass(frozen=True)
class Prediction:
    """``baseline`` (also among ``candidates``); ``candidates`` ranked fastest first, then the
    unranked ones; ``not_candidates`` one line per backend ruled out; ``per_size`` one row per size
    and ``crossover_bytes`` per backend name (:func:`fastverify.tune.per_size.per_size_rows`)."""

    baseline: Figure
    candidates: tuple[Figure, ...]
    not_candidates: tuple[str, ...]
    notes: tuple[str, ...] = ()
    per_size: tuple[Mapping[str, Any], ...] = ()
    crossover_bytes: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def best(self) -> Figure:
        return self.candidates[0]

    @property
    def best_nccl(self) -> Figure:
        return next(c for c in self.candidates if c.nccl is not None)


def _dedup(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


# --- the NCCL baseline, per size, in evidence order -------------------------------------------------


def log_transport(log) -> str | None:
    """``"SHM"`` when the NCCL log shows any intra-node GPU pair on SHM, ``"P2P"`` when every pair
    it shows is on P2P, ``None`` when it shows no transport (the ring runs at its slowest hop)."""
    kinds = {t.kind for t in (log.transports if log is not None else ()) if t.kind in ("P2P", "SHM")}
    if not kinds:
        return None
    return "SHM" if "SHM" in kinds else "P2P"


def _baseline(workload, base, *, perf, log, enabled, nccl_fit) -> Figure:
    """The current environment's figure: per size, the first evidence that has it."""
    from fastverify.nccl import model as M
    from fastverify.topo import diagnose as D

    profile_ok = workload.measured_on_gpu and workload.profile_backend in (None, BackendName.nccl.value)
    by_size = dict(workload.allreduce_us_by_size) if profile_ok else {}
    lt = log_transport(log)
    point = low = high = 0.0
    evidence: list[str] = []
    labels: set[str] = set()
    sources: list[str] = []
    notes: list[str] = []
    per_model = {s.msg_bytes: s.time_us for s in base.per_size}
    per_call: dict[int, float] = {}
    per_range: dict[int, tuple[float, float] | None] = {}
    unknown = False
    for nbytes, count in workload.msg_sizes:
        t = per_call[nbytes] = by_size.get(nbytes)
        if t is not None:
            evidence.append(f"measured: {workload.source}, median per call ({workload.clock})")
            labels.add(MEASURED)
            per_range[nbytes] = (t, t)
            point, low, high = point + count * t, low + count * t, high + count * t
            continue
        t, column = perf.verify_time_us(nbytes) if perf is not None else (None, None)
        per_call[nbytes] = t
        if t is not None:
            evidence.append(f"measured on your box: all_reduce_perf {perf.source} ({column} column)")
            labels.add(MEASURED)
            per_range[nbytes] = (t, t)
            point, low, high = point + count * t, low + count * t, high + count * t
            continue
        t = per_call[nbytes] = tuning_time_us(log, nbytes, enabled)
        if t is not None:
            evidence.append(f"predicted: NCCL's own TUNING table in the NCCL log {log.source}")
            labels.add(PREDICTED)
            what = "NCCL's TUNING-table point (the cost model's misses)"
        elif lt is not None and lt != base.transport:
            t = D.CALIBRATION[M.Transport(lt)].predict(nbytes, base.inputs).time_us
            evidence.append(f"predicted: NCCL cost model with the transport the NCCL log {log.source} shows ({lt}; "
                            f"the topology alone says {base.transport})")
            what = "the NCCL cost model's point"
        else:
            t = per_model[nbytes]
            seen = f", as the NCCL log {log.source} shows" if lt is not None else ""
            evidence.append(f"predicted: NCCL cost model ({base.transport}{seen}) on the topology; point = the "
                            "cost model")
            what = "the NCCL cost model's point"
        per_call[nbytes] = t
        labels.add(PREDICTED)
        rf = nccl_fit(nbytes, workload.tp)
        evidence.append(rf.text(what))
        if rf.known:
            lo, hi = t * rf.low, t * rf.high
            per_range[nbytes] = (lo, hi)
        else:
            unknown, lo, hi, per_range[nbytes] = True, t, t, None
        point, low, high = point + count * t, low + count * lo, high + count * hi
    if workload.measured_on_gpu and not profile_ok:
        notes.append(f"the profile ran with backend {workload.profile_backend}, not NCCL: its times are not "
                     "the NCCL baseline's")
    if workload.allreduce_us_by_size and not workload.measured_on_gpu:
        notes.append(f"the profile's times ({workload.clock}) are not GPU timings and are not used")
    label = MEASURED if labels == {MEASURED} else PREDICTED
    name = f"baseline (current environment, NCCL_P2P_LEVEL {base.p2p_level})"
    return Figure(BackendName.nccl, name, MappingProxyType({}), point, None if unknown else (low, high),
                  _dedup(evidence), label, is_baseline=True, sources=_dedup(sources),
                  notes=_dedup(list(base.notes) + notes), transport=lt or base.transport, nccl=base,
                  per_call_us=MappingProxyType(per_call), per_call_range=MappingProxyType(per_range))


def _settings_figure(c, base_model_us: float, baseline: Figure) -> Figure:
    """An NCCL-settings candidate: the cost model's ratio to the baseline, applied to the
    baseline's figure and range (the published range is that of the current settings)."""
    ratio = c.allreduce_us / base_model_us if base_model_us > 0 else 1.0
    rng = None if baseline.range_us is None else (baseline.range_us[0] * ratio, baseline.range_us[1] * ratio)
    base_model = {s.msg_bytes: s.time_us for s in baseline.nccl.per_size}
    per_call, per_range = {}, {}
    for s in c.per_size:  # the same size's ratio, applied to the baseline's per-call figure and range
        k = s.time_us / base_model[s.msg_bytes] if base_model.get(s.msg_bytes) else 1.0
        per_call[s.msg_bytes] = baseline.per_call_us[s.msg_bytes] * k
        r = baseline.per_call_range.get(s.msg_bytes)
        per_range[s.msg_bytes] = None if r is None else (r[0] * k, r[1] * k)
    ev = (f"predicted: NCCL cost model ratio to the baseline ({c.transport}, {c.p2p_pairs}/{c.pairs} pairs P2P) "
          "x the baseline's figure and range",)
    return Figure(BackendName.nccl, c.name, c.settings, baseline.point_us * ratio, rng,
                  _dedup(ev), PREDICTED, sources=baseline.sources, notes=c.notes, transport=c.transport, nccl=c,
                  per_call_us=MappingProxyType(per_call), per_call_range=MappingProxyType(per_range))


# --- backends -------------------------------------------------------------------------------------------


def _backend_figure(info, workload, baseline: Figure, *, sm, pcie_gen, p2p_ok, estimate) -> Figure | str:
    """A registry backend's figure, or one line saying why it is not a candidate."""
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}.get(workload.dtype, 2)
    n = info.name.value
    kernel = kernel_lo = kernel_hi = 0.0
    fallback = 0.0  # sizes left on NCCL, at the baseline's per-size share
    evidence: list[str] = []
    sources: list[str] = []
    notes: list[str] = []
    missing, unknown, all_rows = [], [], []
    per_call: dict[int, float] = {}
    per_range: dict[int, tuple[float, float] | None] = {}
    for nbytes, count in workload.msg_sizes:
        rows = nbytes // (elem * workload.hidden) if workload.hidden else None
        if info.max_rows is not None and rows is not None and rows > info.max_rows:
            fallback += count * baseline.per_call_us[nbytes]
            all_rows.append(rows)
            notes.append(f"{nbytes:,} B ({rows} rows) is above {n}'s {info.max_rows} rows: stays on NCCL")
            continue
        est = estimate(info.name, nbytes, world_size=workload.tp, sm=sm, pcie_gen=pcie_gen, p2p=p2p_ok)
        if est is None:
            missing.append(nbytes)
            continue
        per_call[nbytes] = est.point_us
        per_range[nbytes] = None if est.low_us is None else (est.low_us, est.high_us)
        evidence.append(est.evidence)
        sources += est.sources
        notes += est.notes
        if est.low_us is None:
            unknown.append(nbytes)
            continue
        kernel, kernel_lo, kernel_hi = kernel + count * est.point_us, kernel_lo + count * est.low_us, \
            kernel_hi + count * est.high_us
    name = n
    if len(all_rows) == len(workload.msg_sizes):
        return (f"{n}: not a candidate: it takes at most {info.max_rows} rows and every all-reduce of the verify "
                f"step has more ({', '.join(map(str, sorted(set(all_rows))))} rows)")
    if missing or unknown:
        status = NO_DATA if missing else UNKNOWN
        said = ", ".join(f"{b:,} B" for b in (missing or unknown))
        return Figure(info.name, name, MappingProxyType({}), None, None, (f"{status} ({said})", *evidence),
                      PREDICTED, sources=_dedup(sources), notes=_dedup(notes), status=status,
                      per_call_us=MappingProxyType(per_call), per_call_range=MappingProxyType(per_range))
    if info.role is Role.fused_norm:
        notes.append(f"{n} fuses the residual add + RMSNorm into the all-reduce: its time is the fused op's")
    wait = workload.allreduce_wait_us if workload.measured_on_gpu else None
    bounds = None
    if wait is not None:
        # A faster kernel replaces the transfer, not the wait for a slower rank (the straggler's
        # own compute); whether that wait shrinks with it is unknown, so both bounds are given.
        kept, shrinks = wait + kernel + fallback, kernel + fallback
        bounds = MappingProxyType({"wait_kept_us": kept, "wait_shrinks_us": shrinks, "wait_us": wait})
        point, rng = kept, (kernel_lo + fallback, wait + kernel_hi + fallback)
        evidence.append(f"measured: {workload.source}: wait for the slowest rank {wait:,.1f} us per step "
                        "(transfer/wait split); range from wait shrinks (kernel only) to wait kept (wait + kernel)")
    else:
        point, rng = kernel + fallback, (kernel_lo + fallback, kernel_hi + fallback)
    if fallback:
        evidence.append("sizes above the backend's rows: the baseline's figure")
    notes.append(MEASURE_HINT)
    return Figure(info.name, name, MappingProxyType({}), point, rng, _dedup(evidence), PREDICTED,
                  sources=_dedup(sources), notes=_dedup(notes), bounds=bounds,
                  per_call_us=MappingProxyType(per_call), per_call_range=MappingProxyType(per_range))


def _workload_json(workload) -> dict:
    """The workload part of ``tune --json`` (predict and measure alike): source, TP, the all-reduces
    per step by size, dtype, hidden size (None for a trace profile without ``--hidden``) and notes."""
    return {"source": workload.source, "tp": workload.tp, "allreduce_count": workload.allreduce_count,
            "msg_sizes": [{"msg_bytes": b, "count": c} for b, c in workload.msg_sizes],
            "dtype": workload.dtype, "hidden": workload.hidden, "notes": list(workload.notes)}


def predict_candidates(workload, ranked: Sequence, *, sm: int, pcie_gen: int, p2p_ok: bool | None,
                       p2p_source: str, nvlink_full: bool | None, perf=None, log=None, enabled=None,
                       sglang_version: str | None = None, estimate=None, nccl_fit=None) -> Prediction:
    """Every candidate for ``workload``: the NCCL settings ``ranked`` by the cost model
    (:func:`fastverify.tune.predict.rank_nccl_settings`) and every tunable registry backend that
    :func:`fastverify.registry.unreachable_reason` allows on the box, ranked by point estimate.

    Parameters
    ----------
    workload : Workload
    ranked : sequence of fastverify.tune.predict.Candidate
        Includes the baseline (``is_baseline``).
    sm : int
        Compute capability × 10 (``--sm``).
    pcie_gen : int
    p2p_ok, p2p_source
        P2P between every pair: proven / refuted / unknown (None), and how that was learnt. Unknown
        P2P is *assumed* for the prediction (said in the candidate's notes); refuted P2P rules the
        P2P backends out.
    nvlink_full : bool or None
        Every pair of the first ``tp`` GPUs on NVLink (the topology's links).
    perf : PerfTable or None
        ``--perf-table``: NCCL measured on the box.
    log : NcclLog or None
        ``--nccl-log``.
    enabled : (algos, protos) or None
        What the current environment enables (for the log's TUNING table).
    estimate : callable
        :func:`fastverify.tune.backend_model.estimate` (a parameter for the leave-one-box-out
        benchmark).
    nccl_fit : callable
        :func:`fastverify.tune.ranges.nccl_fit`, the baseline's range factor per size (likewise).

    Returns
    -------
    Prediction
    """
    if estimate is None:
        from fastverify.tune.backend_model import estimate
    if nccl_fit is None:
        from fastverify.tune.ranges import nccl_fit
    smt = (sm // 10, sm % 10)
    base = next(c for c in ranked if c.is_baseline)
    baseline = _baseline(workload, base, perf=perf, log=log, enabled=enabled, nccl_fit=nccl_fit)
    figures = [baseline] + [_settings_figure(c, base.allreduce_us, baseline) for c in ranked if not c.is_baseline]
    refused: list[str] = []
    assumed = p2p_ok is None
    for name in names(tunable=True):
        info = backend_info(name)
        if info.role is Role.fused_norm and not workload.hidden:
            refused.append(f"{name.value}: the workload has no hidden size (a trace profile); give --model")
            continue
        # The registry's dtype limit (pcie_ipc: SGLang serves bf16 only) comes first, with its source.
        reason = unreachable_reason(info, sm=smt, world_size=workload.tp, p2p_ok=True if assumed else p2p_ok,
                                    p2p_source=p2p_source, sglang_version=sglang_version, nvlink_full=nvlink_full,
                                    dtype=workload.dtype)
        if reason is not None:
            if p2p_ok is False and info.needs_p2p:
                reason = reason.split("; run `")[0]  # the check was run: asking for it again says nothing
            refused.append(reason)
            continue
        fig = _backend_figure(info, workload, baseline, sm=smt, pcie_gen=pcie_gen, p2p_ok=True if assumed else p2p_ok,
                              estimate=estimate)
        if isinstance(fig, str):
            refused.append(fig)
            continue
        if info.needs_p2p and assumed:
            fig = replace(fig, notes=fig.notes + (
                f"assumes P2P between every GPU pair, which is not proven ({p2p_source}): run "
                "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json",))
        figures.append(fig)
    ranked_f = sorted((f for f in figures if f.ranked),
                      key=lambda f: (round(f.point_us, 6), not f.is_baseline, len(f.settings), f.name))
    unranked = [f for f in figures if not f.ranked]
    cands = tuple(ranked_f + unranked)
    rows, cross = per_size_rows(workload, cands)
    return Prediction(baseline, cands, tuple(refused), per_size=rows, crossover_bytes=MappingProxyType(cross))


# --- verify time and tok/s ------------------------------------------------------------------------------


def with_verify(pred: Prediction, workload, *, accept_length: float | None, tok_s: float | None,
                user=None) -> Prediction:
    """Each ranked figure with ``verify`` = ``verify_ms`` / ``tok_s`` at its point and range
    (:func:`fastverify.tune.predict.verify_reduction` against the baseline's point; ``user``: the
    user's own figures, :class:`fastverify.tune.user_figures.UserFigures`)."""
    from fastverify.tune.predict import verify_reduction

    b = pred.baseline.point_us

    def one(f: Figure) -> Figure:
        if not f.ranked:
            return f
        reds = [verify_reduction(workload, b, v, accept_length=accept_length, tok_s=tok_s, user=user)
                for v in (f.point_us, *(f.range_us or ()))]
        ms = [r["verify_predicted_us"] / 1e3 for r in reds]
        rates = [r["tok_s_predicted"] for r in reds]
        v = {"verify_ms": ms[0], "verify_ms_range": [ms[1], ms[2]] if len(ms) == 3 else None,
             "tok_s": rates[0], "tok_s_range": [rates[2], rates[1]] if len(rates) == 3 and None not in rates else None,
             "tok_s_reason": reds[0]["t_rest_basis"] if rates[0] is None else None, "reduction": reds[0]}
        return replace(f, verify=MappingProxyType(v))

    cands = tuple(one(f) for f in pred.candidates)
    base = next(f for f in cands if f.is_baseline)
    return replace(pred, baseline=base, candidates=cands)


# --- JSON ---------------------------------------------------------------------------------------------


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), nd) + 0.0  # + 0.0: no -0.0


def figure_dict(f: Figure, number: int | None, baseline_us: float | None) -> dict:
    """One candidate of the JSON document; ``change_pct`` = (its time - the baseline's) / the
    baseline's x 100 (negative: less time)."""
    v = f.verify or {}
    change = (100.0 * (f.point_us - baseline_us) / baseline_us
              if f.point_us is not None and baseline_us else None)
    return {
        "candidate": number, "backend": f.backend.value, "name": f.name, "settings": dict(f.settings),
        "is_baseline": f.is_baseline, "label": f.label,
        "allreduce_us_per_step": _r(f.point_us),
        "allreduce_us_per_step_range": None if f.range_us is None else [_r(x) for x in f.range_us],
        "change_pct": _r(change, 2), "evidence": list(f.evidence), "sources": list(f.sources),
        "bounds": None if f.bounds is None else {k: _r(x) for k, x in f.bounds.items()},
        "transport": f.transport,
        "verify_ms": _r(v.get("verify_ms"), 4),
        "verify_ms_range": [_r(x, 4) for x in v["verify_ms_range"]] if v.get("verify_ms_range") else None,
        "tok_s": _r(v.get("tok_s"), 2),
        "tok_s_range": [_r(x, 2) for x in v["tok_s_range"]] if v.get("tok_s_range") else None,
        "tok_s_reason": v.get("tok_s_reason"), "status": f.status,
        "per_call": [{"msg_bytes": b, "point_us": _r(t), "range_us": None if (r := f.per_call_range.get(b)) is None
                      else [_r(r[0]), _r(r[1])]} for b, t in f.per_call_us.items() if t is not None],
        "notes": list(f.notes),
    }


def prediction_document(pred: Prediction, workload, *, box: Mapping[str, Any], notes: Sequence[str] = ()) -> dict:
    """``tune --predict --json``: one document, every figure labelled predicted (or measured where
    the user's own profile / perf table gave every size)."""
    base_us = pred.baseline.point_us
    red = (pred.baseline.verify or {}).get("reduction") or {}
    cands = [figure_dict(f, i if f.ranked else None, base_us)
             for i, f in enumerate(pred.candidates, 1)]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "mode": "predict", "label": PREDICTED,
        "workload": _workload_json(workload),
        "box": dict(box),
        "accept_length": red.get("accept_length"), "accept_length_source": red.get("accept_length_source"),
        "t_rest_basis": red.get("t_rest_basis"), "verify_baseline_basis": red.get("verify_baseline_basis"),
        "baseline": figure_dict(pred.baseline, next(i for i, f in enumerate(pred.candidates, 1) if f.is_baseline),
                                base_us),
        "candidates": cands,
        "not_candidates": list(pred.not_candidates),
        "per_size": per_size_json(pred.per_size, _r),
        "crossover_bytes": dict(pred.crossover_bytes),
        "tok_s_reason": red.get("t_rest_basis") if red.get("tok_s_baseline") is None else None,
        "notes": list(_dedup([*pred.notes, *notes])),
    }


def measured_document(ranking, workload, *, accept_length: float | None, tok_s: float | None,
                      box: Mapping[str, Any], notes: Sequence[str] = ()) -> dict:
    """``tune --json`` in measure mode: the same shape with measured figures. The label is
    ``measured`` for GPU (CUDA events) timings and ``CPU wall clock`` for a gloo run, which
    measures the machinery, not the GPU. Each candidate's ``sizes`` lists its trial's rows, one per
    message size: ``msg_bytes``, ``count_per_step``, ``median_us`` / ``p90_us`` (µs per call, ``None``
    where not measured)."""
    from fastverify.tune.trial import Clock

    gpu = ranking.clock is Clock.CUDA_EVENTS
    label = MEASURED if gpu else "CPU wall clock"
    base = ranking.baseline
    base_us = base.step_us if base is not None else None

    def one(c, number) -> dict:
        lo = sum(s.count_per_step * s.median_us for s in c.result.sizes if s.median_us is not None)
        hi = sum(s.count_per_step * (s.p90_us if s.p90_us is not None else s.median_us)
                 for s in c.result.sizes if s.median_us is not None)
        verify_ms = tok = None
        if gpu and base_us:  # CPU wall-clock times say nothing about a GPU verify step
            from fastverify.tune.predict import verify_reduction

            r = verify_reduction(workload, base_us, c.step_us, accept_length=accept_length, tok_s=tok_s)
            verify_ms, tok = r["verify_predicted_us"] / 1e3, r["tok_s_predicted"]
        return {
            "candidate": number, "backend": c.spec.backend, "name": c.spec.name, "settings": dict(c.spec.env),
            "is_baseline": c is base, "label": label, "clock": c.result.clock.value if c.result.clock else None,
            "allreduce_us_per_step": _r(c.step_us), "allreduce_us_per_step_range": [_r(lo), _r(hi)],
            "change_pct": _r(100.0 * (c.step_us - base_us) / base_us, 2) if base_us else None,
            "evidence": [f"{label}: fastverify tune trial {c.spec.trial_id} (median per call; range to p90)"],
            "verify_ms": _r(verify_ms, 4), "tok_s": _r(tok, 2),
            "sizes": [{"msg_bytes": s.msg_bytes, "count_per_step": s.count_per_step, "median_us": _r(s.median_us),
                       "p90_us": _r(s.p90_us)} for s in c.result.sizes],
        }

    cands = [one(c, i) for i, c in enumerate(ranking.candidates, 1)]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "mode": "measure", "label": label,
        "workload": _workload_json(workload),
        "box": dict(box),
        "baseline": next((d for d, c in zip(cands, ranking.candidates) if c is base), None),
        "candidates": cands,
        "not_ranked": [{"name": s.name, "status": r.status.value, "reason": r.reason} for s, r in ranking.not_ok],
        "notes": list(_dedup([*ranking.notes, *notes])),
    }
