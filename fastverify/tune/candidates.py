"""The figures ``tune`` shows: every candidate (NCCL settings and registry backends) with a point,
a range and the evidence each number came from (printed as JSON by :mod:`fastverify.tune.printer`).

The baseline, per message size, from the first evidence that has the size: (1) ``--profile`` on
a GPU clock, the measured median per call; (2) ``--perf-table``, NCCL measured on the box (in
place, as ``torch.distributed`` runs it); (3) ``--nccl-log``, NCCL's own TUNING table (``latency +
bytes / (1000 × bw)``, NCCL ``src/graph/tuning.cc``, fastest enabled pair), else the cost model
on the log's transports; (4) the topology, NCCL's cost model with the PCIe correction
(:mod:`fastverify.tune.predict`), its range from the model's own misses on published NCCL boxes
(:func:`fastverify.tune.backend_model.nccl_fit`). An NCCL setting is the cost model's ratio to the
baseline x the baseline's figure. A backend is its published per-size model summed over sizes x
counts; a size above its ``max_rows`` stays on NCCL; with a profile's wait / transfer split the
kernel replaces the transfer only (point: wait kept; range down to wait shrinks). No comparable
data (:data:`NO_DATA`) or an unknown range (:data:`UNKNOWN`): listed, not ranked; no size fits:
not a candidate.

Per message size of a verify step, NCCL's own time from its log (:func:`tuning_time_us`), the
verdict and each backend's crossover (always *predicted* unless the figures are measured).
Per size (:func:`per_size_rows`): the best NCCL figure and every backend with a figure at that
size, fastest point first; where the two fastest ranges overlap the size is "too close to call:
measure", where one is unknown it is unknown. ``crossover_bytes`` per backend: the smallest size
of the step, among those where the backend's range is known, at which NCCL's point is at or below
the backend's (None when it never is), usable as the backend's workspace cap (the backend below it,
NCCL from it on); a backend whose range is unknown at every size has no crossover.

The figures are :class:`Figure` (``per_call_us`` / ``per_call_range`` per size in µs, ``nccl`` set
on an NCCL-settings figure). This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from fastverify.nccl.model import Transport
from fastverify.registry import BackendName, Role, backend_info, names, unreachable_reason
from fastverify.topo.diagnose import CALIBRATION
from fastverify.tune import backend_model
from fastverify.tune.backend_model import UNKNOWN
from fastverify.tune.verify_time import verify_reduction

PREDICTED = "predicted"
MEASURED = "measured"
NO_DATA = "no published data: measure with fastverify tune"
TOO_CLOSE = "too close to call: measure"
MEASURE_HINT = "predicted from published measurements of other boxes: measure with `fastverify tune` on this box"


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
    per_call_range: Mapping[int, tuple[float, float] | None] = field(default_factory=dict, compare=False, repr=False)
    status: str | None = None

    @property
    def ranked(self) -> bool:
        return self.point_us is not None


@dataclass(frozen=True)
class PredictedRanking:
    """``baseline`` (also among ``candidates``); ``candidates`` ranked fastest first, then the
    unranked ones; ``not_candidates`` one line per backend ruled out; ``per_size`` one row per size
    and ``crossover_bytes`` per backend name (:func:`per_size_rows`)."""

    baseline: Figure
    candidates: tuple[Figure, ...]
    not_candidates: tuple[str, ...]
    notes: tuple[str, ...] = ()
    per_size: tuple[Mapping[str, Any], ...] = ()
    crossover_bytes: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def too_close(self) -> dict[str, str]:
        """Backend name -> ``<name>: too close to call: measure (…)``: :func:`too_close_calls` of
        the candidates as they stand (scaled to the user's figures or not)."""
        return too_close_calls(self.candidates)

    @property
    def best(self) -> Figure:
        """The fastest candidate whose lead is not too close to call."""
        close = self.too_close
        return next(c for c in self.candidates if c.name not in close)

    @property
    def best_nccl(self) -> Figure:
        return next(c for c in self.candidates if c.nccl is not None)


def dedup(items) -> tuple[str, ...]:
    """The non-empty ``items`` once each, in first-seen order."""
    return tuple(dict.fromkeys(i for i in items if i))


# --- the NCCL baseline, per size, in evidence order -------------------------------------------------


def log_transport(log) -> str | None:
    """``"SHM"`` when the NCCL log shows any intra-node GPU pair on SHM, ``"P2P"`` when every pair
    it shows is on P2P, ``None`` when it shows no transport (the ring runs at its slowest hop)."""
    kinds = {t.kind for t in (log.transports if log is not None else ()) if t.kind in ("P2P", "SHM")}
    if not kinds:
        return None
    return "SHM" if "SHM" in kinds else "P2P"


def baseline_figure(workload, base, *, perf, log, enabled, nccl_fit) -> Figure:
    """The current environment's figure: per size, the first evidence that has it."""
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
        t, said = _measured_call(workload, by_size, perf, nbytes)
        per_call[nbytes] = t
        if t is not None:
            evidence.append(said)
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
            t = CALIBRATION[Transport(lt)].predict(nbytes, base.inputs).time_us
            evidence.append(
                f"predicted: NCCL cost model with the transport the NCCL log {log.source} shows ({lt}; "
                f"the topology alone says {base.transport})"
            )
            what = "the NCCL cost model's point"
        else:
            t = per_model[nbytes]
            seen = f", as the NCCL log {log.source} shows" if lt is not None else ""
            evidence.append(
                f"predicted: NCCL cost model ({base.transport}{seen}) on the topology; point = the cost model"
            )
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
        notes.append(
            f"the profile ran with backend {workload.profile_backend}, not NCCL: its times are not the NCCL baseline's"
        )
    if workload.allreduce_us_by_size and not workload.measured_on_gpu:
        notes.append(f"the profile's times ({workload.clock}) are not GPU timings and are not used")
    label = MEASURED if labels == {MEASURED} else PREDICTED
    name = f"baseline (current environment, NCCL_P2P_LEVEL {base.p2p_level})"
    return Figure(
        BackendName.nccl,
        name,
        MappingProxyType({}),
        point,
        None if unknown else (low, high),
        dedup(evidence),
        label,
        is_baseline=True,
        sources=dedup(sources),
        notes=dedup(list(base.notes) + notes),
        transport=lt or base.transport,
        nccl=base,
        per_call_us=MappingProxyType(per_call),
        per_call_range=MappingProxyType(per_range),
    )


def _measured_call(workload, by_size: Mapping[int, float], perf, nbytes: int) -> tuple[float | None, str]:
    """One all-reduce of ``nbytes`` as measured (µs) and the evidence line: the profile's median
    per call, else the perf table's; ``(None, "")`` where neither has the size."""
    t = by_size.get(nbytes)
    if t is not None:
        return t, f"measured: {workload.source}, median per call ({workload.clock})"
    t, column = perf.verify_time_us(nbytes) if perf is not None else (None, None)
    if t is not None:
        return t, f"measured on your box: all_reduce_perf {perf.source} ({column} column)"
    return None, ""


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
    ev = (
        f"predicted: NCCL cost model ratio to the baseline ({c.transport}, {c.p2p_pairs}/{c.pairs} pairs P2P) "
        "x the baseline's figure and range",
    )
    return Figure(
        BackendName.nccl,
        c.name,
        c.settings,
        baseline.point_us * ratio,
        rng,
        dedup(ev),
        PREDICTED,
        sources=baseline.sources,
        notes=c.notes,
        transport=c.transport,
        nccl=c,
        per_call_us=MappingProxyType(per_call),
        per_call_range=MappingProxyType(per_range),
    )


# --- backends -------------------------------------------------------------------------------------------


def backend_figure(info, workload, baseline: Figure, *, sm, pcie_gen, p2p_ok, estimate) -> Figure | str:
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
        est = estimate(info.name, nbytes, world_size=workload.tp, sm=sm, pcie_gen=pcie_gen, p2p=p2p_ok, elem_bytes=elem)
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
        kernel, kernel_lo, kernel_hi = (
            kernel + count * est.point_us,
            kernel_lo + count * est.low_us,
            kernel_hi + count * est.high_us,
        )
    name = n
    if len(all_rows) == len(workload.msg_sizes):
        return (
            f"{n}: not a candidate: it takes at most {info.max_rows} rows and every all-reduce of the verify "
            f"step has more ({', '.join(map(str, sorted(set(all_rows))))} rows)"
        )
    if missing or unknown:
        status = NO_DATA if missing else UNKNOWN
        said = ", ".join(f"{b:,} B" for b in (missing or unknown))
        return Figure(
            info.name,
            name,
            MappingProxyType({}),
            None,
            None,
            (f"{status} ({said})", *evidence),
            PREDICTED,
            sources=dedup(sources),
            notes=dedup(notes),
            status=status,
            per_call_us=MappingProxyType(per_call),
            per_call_range=MappingProxyType(per_range),
        )
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
        evidence.append(
            f"measured: {workload.source}: wait for the slowest rank {wait:,.1f} us per step "
            "(transfer/wait split); range from wait shrinks (kernel only) to wait kept (wait + kernel)"
        )
    else:
        point, rng = kernel + fallback, (kernel_lo + fallback, kernel_hi + fallback)
    if fallback:
        evidence.append("sizes above the backend's rows: the baseline's figure")
    notes.append(MEASURE_HINT)
    return Figure(
        info.name,
        name,
        MappingProxyType({}),
        point,
        rng,
        dedup(evidence),
        PREDICTED,
        sources=dedup(sources),
        notes=dedup(notes),
        bounds=bounds,
        per_call_us=MappingProxyType(per_call),
        per_call_range=MappingProxyType(per_range),
    )


def predict_candidates(
    workload,
    ranked: Sequence,
    *,
    sm: int,
    pcie_gen: int,
    p2p_ok: bool | None,
    p2p_source: str,
    nvlink_full: bool | None,
    perf=None,
    log=None,
    enabled=None,
    sglang_version: str | None = None,
    estimate=None,
    nccl_fit=None,
) -> PredictedRanking:
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
        :func:`fastverify.tune.backend_model.nccl_fit`, the baseline's range factor per size (likewise).

    Returns
    -------
    PredictedRanking
    """
    if estimate is None:
        estimate = backend_model.estimate
    if nccl_fit is None:
        nccl_fit = backend_model.nccl_fit
    smt = (sm // 10, sm % 10)
    base = next(c for c in ranked if c.is_baseline)
    baseline = baseline_figure(workload, base, perf=perf, log=log, enabled=enabled, nccl_fit=nccl_fit)
    figures = [baseline] + [_settings_figure(c, base.allreduce_us, baseline) for c in ranked if not c.is_baseline]
    refused: list[str] = []
    assumed = p2p_ok is None
    for name in names(tunable=True):
        info = backend_info(name)
        if info.role is Role.fused_norm and not workload.hidden:
            refused.append(f"{name.value}: the workload has no hidden size (a trace profile); give --model")
            continue
        # The registry's dtype limit (pcie_ipc: SGLang serves bf16 only) comes first, with its source.
        reason = unreachable_reason(
            info,
            sm=smt,
            world_size=workload.tp,
            p2p_ok=True if assumed else p2p_ok,
            p2p_source=p2p_source,
            sglang_version=sglang_version,
            nvlink_full=nvlink_full,
            dtype=workload.dtype,
        )
        if reason is not None:
            if p2p_ok is False and info.needs_p2p:
                reason = reason.split("; run `")[0]  # the check was run: asking for it again says nothing
            refused.append(reason)
            continue
        fig = backend_figure(
            info, workload, baseline, sm=smt, pcie_gen=pcie_gen, p2p_ok=True if assumed else p2p_ok, estimate=estimate
        )
        if isinstance(fig, str):
            refused.append(fig)
            continue
        if info.needs_p2p and assumed:
            fig = replace(
                fig,
                notes=fig.notes
                + (
                    f"assumes P2P between every GPU pair, which is not proven ({p2p_source}): run "
                    "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json",
                ),
            )
        figures.append(fig)
    ranked_f = sorted(
        (f for f in figures if f.ranked),
        key=lambda f: (round(f.point_us, 6), not f.is_baseline, len(f.settings), f.name),
    )
    unranked = [f for f in figures if not f.ranked]
    cands = tuple(ranked_f + unranked)
    rows, cross = per_size_rows(workload, cands)
    return PredictedRanking(baseline, cands, tuple(refused), per_size=rows, crossover_bytes=MappingProxyType(cross))


def too_close_calls(cands: Sequence[Figure]) -> dict[str, str]:
    """Backends ranked ahead of the fastest NCCL figure whose range reaches into its range: name ->
    one line ``<name>: too close to call: measure (…)``. Such a backend is listed at its point but
    never the winner: the ranges cannot order it against NCCL."""
    at = next((i for i, f in enumerate(cands) if f.ranked and f.nccl is not None), None)
    if at is None:
        return {}
    nccl = cands[at]
    out: dict[str, str] = {}
    for f in cands[:at]:  # ranked ahead of the first NCCL figure: backends with faster points
        if f.range_us is None or nccl.range_us is None:
            why = f"{nccl.name}'s range is unknown" if nccl.range_us is None else "its range is unknown"
        elif f.range_us[1] >= nccl.range_us[0]:
            why = (
                f"its predicted range {f.range_us[0]:,.1f}..{f.range_us[1]:,.1f} µs reaches {nccl.name}'s "
                f"{nccl.range_us[0]:,.1f}..{nccl.range_us[1]:,.1f} µs"
            )
        else:
            continue
        out[f.name] = f"{f.name}: {TOO_CLOSE} ({why})"
    return out


# --- verify time and tok/s ------------------------------------------------------------------------------


def with_verify(
    pred: PredictedRanking, workload, *, accept_length: float | None, tok_s: float | None, user=None
) -> PredictedRanking:
    """Each ranked figure with ``verify`` = ``verify_ms`` / ``tok_s`` at its point and range
    (:func:`fastverify.tune.verify_time.verify_reduction` against the baseline's point; ``user``: the
    user's own figures, :class:`fastverify.tune.user_figures.UserFigures`)."""
    b = pred.baseline.point_us

    def one(f: Figure) -> Figure:
        if not f.ranked:
            return f
        reds = [
            verify_reduction(workload, b, v, accept_length=accept_length, tok_s=tok_s, user=user)
            for v in (f.point_us, *(f.range_us or ()))
        ]
        ms = [r["verify_predicted_us"] / 1e3 for r in reds]
        rates = [r["tok_s_predicted"] for r in reds]
        v = {
            "verify_ms": ms[0],
            "verify_ms_range": [ms[1], ms[2]] if len(ms) == 3 else None,
            "tok_s": rates[0],
            "tok_s_range": [rates[2], rates[1]] if len(rates) == 3 and None not in rates else None,
            "tok_s_reason": reds[0]["t_rest_basis"] if rates[0] is None else None,
            "reduction": reds[0],
        }
        return replace(f, verify=MappingProxyType(v))

    cands = tuple(one(f) for f in pred.candidates)
    base = next(f for f in cands if f.is_baseline)
    return replace(pred, baseline=base, candidates=cands)


# --- per message size: the verdict and each backend's crossover ----------------------------------------


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
    cross: dict[str, int | None] = {
        f.name: None for f in kernels if any(f.per_call_range.get(b) is not None for b, _ in workload.msg_sizes)
    }
    for nbytes, count in workload.msg_sizes:
        entries = [
            {
                "name": f.name,
                "backend": f.backend.value,
                "point_us": f.per_call_us[nbytes],
                "range_us": f.per_call_range.get(nbytes),
            }
            for f in (best_nccl, *kernels)
            if f.per_call_us.get(nbytes) is not None
        ]
        entries.sort(key=lambda e: e["point_us"])
        verdict = entries[0]["name"] if entries else UNKNOWN
        if len(entries) >= 2:
            a, b = entries[0]["range_us"], entries[1]["range_us"]
            verdict = UNKNOWN if a is None or b is None else TOO_CLOSE if a[1] >= b[0] else entries[0]["name"]
        n_point = best_nccl.per_call_us.get(nbytes)
        for f in kernels:
            k = f.per_call_us.get(nbytes)
            if (
                f.name in cross
                and cross[f.name] is None
                and f.per_call_range.get(nbytes) is not None
                and k is not None
                and n_point is not None
                and n_point <= k
            ):
                cross[f.name] = nbytes
        rows.append(
            {
                "msg_bytes": nbytes,
                "count": count,
                "entries": entries,
                "verdict": verdict,
                "winner": verdict if verdict not in (UNKNOWN, TOO_CLOSE) else None,
            }
        )
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
    return [
        {
            **row,
            "entries": [
                {
                    **e,
                    "point_us": rnd(e["point_us"]),
                    "range_us": None if e["range_us"] is None else [rnd(x) for x in e["range_us"]],
                }
                for e in row["entries"]
            ],
        }
        for row in rows
    ]
