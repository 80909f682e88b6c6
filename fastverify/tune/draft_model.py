"""The EAGLE draft-shape model: per chain depth, accept length, verify and cycle cost, tok/s.

tok/s per stream = accept length / cycle time. A chain draft (topk 1) of ``k`` steps verifies
``k + 1`` tokens per request and per cycle costs
``cycle_ms(k) = k x draft_step_ms + verify_ms(k + 1 tokens per request) + draft_extend_ms``.
An all-reduce-bound verify barely grows with tokens, so a deeper chain raises the accept length
almost for free; after a faster all-reduce it grows again, and the best depth moves.

Accept length by depth (exact for chains): a run at ``S`` steps accepts ``A`` draft tokens per
request per verify (bonus excluded; :mod:`fastverify.patch.verify`); a chain of depth ``k <= S``
(the first ``k`` draft tokens of the longer chain) would have accepted ``min(A, k)``, so its accept
length is ``E[min(A, k)] + 1``. Depths above ``S`` are not derivable, and one tree run (topk > 1)
gives no other tree shape. Labels, strongest first: ``measured``, ``given``,
``derived`` (exact from measured facts, or interpolated), ``assumed``, ``extrapolated`` (beyond
the measured cost curve); a row's label is its weakest part's.

The verify cost curve must be a cost (every point at least
:data:`fastverify.bounds.MIN_TIME_US`) and must not fall as tokens per request grow (more rows
verified never cost less); a measured curve may dip by run-to-run noise, up to
:data:`MEASURED_NOISE`. Depths run up to ``MAX_DRAFT_TOKENS - 1`` (:mod:`fastverify.bounds`): no
recommendation past fastverify's own limit of draft tokens per request.
"""

from __future__ import annotations

import msgspec
import numpy as np

from fastverify.bounds import MAX_DRAFT_TOKENS, MIN_TIME_US
from fastverify.errors import UserError

SCHEMA = "fastverify.draft_shape"
SCHEMA_VERSION = 1
LABELS = ("measured", "given", "derived", "assumed", "extrapolated")
"""From strongest to weakest; a row's label is the weakest of its parts."""
MEASURED_NOISE = 0.05
"""Largest fall of a measured verify cost from one point to the next (a fraction of the lower-token
point) still taken as run-to-run noise: medians of separate runs at a flat, all-reduce-bound cost
differ by a few percent either way. A given curve (the user's figures) may not fall at all."""
MAX_DEPTH = MAX_DRAFT_TOKENS - 1
"""Deepest chain considered: ``MAX_DEPTH + 1`` = ``MAX_DRAFT_TOKENS`` tokens per request."""


class AcceptHistogram(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Accepted draft tokens per request per verify of one run at ``steps`` (chain depth S):
    ``counts[a]`` request-verifies accepted ``a`` (0..S); ``topk`` of the run; ``verify_ms``:
    optional ``[tokens per request, ms]`` pairs (the file form, label given)."""

    steps: int
    counts: list[int]
    topk: int = 1
    verify_ms: list[tuple[int, float]] = []


class CostPoint(msgspec.Struct, frozen=True):
    """Verify cost at ``tokens_per_request``: median ``verify_ms`` (ms) of ``records`` steps."""

    tokens_per_request: int
    verify_ms: float
    records: int


class CostCurve(msgspec.Struct, frozen=True):
    """Verify ms vs tokens per request at ``batch`` requests (None: not known), sorted by tokens."""

    batch: int | None
    points: list[CostPoint]
    label: str
    source: str


class DraftCost(msgspec.Struct, frozen=True):
    """Drafter cost per cycle: ``draft_step_ms`` per draft step and ``draft_extend_ms`` (ms)."""

    draft_step_ms: float
    draft_extend_ms: float
    label: str
    source: str


class DepthRow(msgspec.Struct, frozen=True):
    """One chain depth: accept length (tokens per request per cycle), verify and cycle ms, tok/s
    per stream, each with its label; ``label`` the weakest."""

    depth: int
    tokens_per_request: int
    accept_length: float
    accept_label: str
    verify_ms: float
    verify_label: str
    cycle_ms: float
    tok_s: float
    label: str


class DraftShapeReport(msgspec.Struct, frozen=True, kw_only=True):
    """The document of ``tune --draft-shape --json``. ``tok_s_change_pct`` = (best − current) / current
    × 100 of tok/s per stream: positive is a gain (more tokens per second), negative a loss."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    steps: int
    topk: int
    tree: bool
    current_depth: int | None
    best_depth: int | None
    rows: list[DepthRow]
    flags: str | None
    tok_s_change_pct: float | None
    verify_command: str
    cost: CostCurve
    draft: DraftCost
    histogram: list[int]
    sources: list[str]
    notes: list[str]


def _weakest(*labels: str) -> str:
    return max(labels, key=LABELS.index)


def accept_length(counts: list[int], k: int) -> float:
    """``E[min(A, k)] + 1`` (tokens per request per cycle) for ``counts[a]`` of ``A = a``."""
    c = np.asarray(counts, dtype=np.float64)
    a = np.arange(len(c))
    return float((np.minimum(a, k) * c).sum() / c.sum() + 1.0)


def check_curve(curve: CostCurve) -> list[str]:
    """Refuse a verify cost curve that is no cost; returns notes on a measured dip taken as noise.

    Raises
    ------
    UserError
        One line naming ``curve.source`` and the point: a verify ms below
        :data:`~fastverify.bounds.MIN_TIME_US` (0 included), or a cost that falls as tokens per
        request grow (a measured one by more than :data:`MEASURED_NOISE`).
    """
    notes = []
    floor_ms = MIN_TIME_US / 1000.0
    for p in curve.points:
        if not p.verify_ms >= floor_ms:  # NaN too
            raise UserError(
                f"{curve.source}: verify cost {p.verify_ms:g} ms at {p.tokens_per_request} tokens per "
                f"request is not a verify time (at least {floor_ms:g} ms); fix or re-measure that point"
            )
    tol = MEASURED_NOISE if curve.label == "measured" else 0.0
    for a, b in zip(curve.points, curve.points[1:]):
        if b.tokens_per_request <= a.tokens_per_request:
            raise UserError(
                f"{curve.source}: {b.tokens_per_request} tokens per request given twice ({a.verify_ms:g} "
                f"ms and {b.verify_ms:g} ms) or out of order; give each count once"
            )
        if b.verify_ms >= a.verify_ms:
            continue
        fall = (
            f"verify cost falls from {a.verify_ms:g} ms at {a.tokens_per_request} to {b.verify_ms:g} ms at "
            f"{b.tokens_per_request} tokens per request"
        )
        if b.verify_ms < a.verify_ms * (1.0 - tol):
            allowed = f"by more than run-to-run noise ({tol:.0%})" if tol else "(a given curve may not fall)"
            raise UserError(
                f"{curve.source}: {fall} {allowed}; verifying more tokens never costs less: fix or "
                "re-measure that point"
            )
        notes.append(f"{fall}, within run-to-run noise ({tol:.0%}): beyond the points the curve is held flat")
    return notes


def verify_at(curve: CostCurve, tokens: int) -> tuple[float, str]:
    """Verify ms at ``tokens`` per request and its label: a measured point (the curve's label),
    linear between two points (``derived``), else ``extrapolated``: flat from a single point;
    above the points the line through the two highest, never falling; below them the line through
    the two lowest, never under the lowest point scaled by ``tokens / its tokens`` (a cost of a
    fixed part plus a part per token, both >= 0, is at least that)."""
    pts = curve.points
    x = [p.tokens_per_request for p in pts]
    y = [p.verify_ms for p in pts]
    if tokens in x:
        return y[x.index(tokens)], curve.label
    if x[0] < tokens < x[-1]:
        return float(np.interp(tokens, x, y)), _weakest(curve.label, "derived")
    if len(x) == 1:
        return y[0], "extrapolated"
    i, j = (0, 1) if tokens < x[0] else (-2, -1)
    slope = max(0.0, (y[j] - y[i]) / (x[j] - x[i]))
    end = 0 if tokens < x[0] else -1  # the nearest point: the line runs from it
    line = y[end] + slope * (tokens - x[end])
    return (max(line, y[0] * tokens / x[0]) if tokens < x[0] else line), "extrapolated"


def depth_rows(hist: AcceptHistogram, curve: CostCurve, draft: DraftCost, hist_label: str) -> list[DepthRow]:
    """One :class:`DepthRow` per chain depth 1..S (a tree: only its own shape, the run's)."""
    depths = range(1, min(hist.steps, MAX_DEPTH) + 1) if hist.topk == 1 else [hist.steps]
    rows = []
    for k in depths:
        tokens = k + 1 if hist.topk == 1 else max(p.tokens_per_request for p in curve.points)
        acc = accept_length(hist.counts, k)
        acc_label = hist_label if k == hist.steps else _weakest(hist_label, "derived")
        v_ms, v_label = verify_at(curve, tokens)
        cycle = k * draft.draft_step_ms + v_ms + draft.draft_extend_ms
        rows.append(
            DepthRow(
                depth=k,
                tokens_per_request=tokens,
                accept_length=round(acc, 4),
                accept_label=acc_label,
                verify_ms=round(v_ms, 4),
                verify_label=v_label,
                cycle_ms=round(cycle, 4),
                tok_s=round(acc / (cycle / 1000.0), 2),
                label=_weakest(acc_label, v_label, draft.label),
            )
        )
    return rows


def chain_flags(k: int) -> str:
    return f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"


def tree_note(hist: AcceptHistogram) -> str:
    return (
        f"a tree run (topk {hist.topk}): one run's records do not give other tree shapes (a tree accepts "
        "along one of many branches; E[min(A,k)]+1 holds for chains only). Measure each shape with a short "
        "run: `fastverify launch --profile-verify DIR_<shape> -- <sglang command> --speculative-num-steps S "
        "--speculative-eagle-topk K --speculative-num-draft-tokens N`, then `fastverify tune --draft-shape "
        "--verify-log DIR_<shape>` for each, and compare their measured tok/s"
    )


def recommend(
    hist: AcceptHistogram,
    curve: CostCurve,
    draft: DraftCost,
    *,
    hist_label: str = "measured",
    sources: list[str] | None = None,
    notes: list[str] | None = None,
) -> DraftShapeReport:
    """The per-depth table and the best chain depth (highest tok/s per stream; ties: shallower).

    Chain depths stop at :data:`MAX_DEPTH` (``MAX_DRAFT_TOKENS`` tokens per request); a note says
    when the run was deeper and when the best depth lies at that limit.

    Raises
    ------
    UserError
        The histogram is empty, the curve has no point or is no cost (:func:`check_curve`), or a
        draft cost is not a time in [0, 3.6e6] ms.
    """
    if sum(hist.counts) <= 0:
        raise UserError("the accept histogram holds no request-verify (all counts 0)")
    if not curve.points:
        raise UserError(
            "no verify cost: give --verify-log DIR or --bundle FILE (records with batch and tokens), "
            "or verify_ms pairs in the --accept-histogram file"
        )
    for what, ms in (("draft step", draft.draft_step_ms), ("draft extend", draft.draft_extend_ms)):
        if not 0 <= ms <= 3.6e6:  # NaN too
            raise UserError(f"{draft.source}: {what} {ms!r} ms is not a time in [0, 3.6e6] ms")
    notes = [*(notes or []), *check_curve(curve)]
    rows = depth_rows(hist, curve, draft, hist_label)
    tree = hist.topk > 1
    best = None if tree else max(rows, key=lambda r: (r.tok_s, -r.depth))
    cur = next((r for r in rows if r.depth == hist.steps), None)
    if not tree and hist.steps > MAX_DEPTH:
        notes.append(
            f"the run drafted {hist.steps} steps ({hist.steps + 1} tokens per request), past fastverify's "
            f"limit of {MAX_DRAFT_TOKENS} draft tokens per request: depths 1-{MAX_DEPTH} only (exact from "
            "the same records)"
        )
    if best is not None and best.depth == MAX_DEPTH:
        notes.append(
            f"the best depth lies at fastverify's limit ({MAX_DEPTH} steps, {MAX_DRAFT_TOKENS} draft tokens "
            "per request): a deeper chain is not considered"
        )
    if tree:
        notes.insert(0, tree_note(hist))
    elif any(r.verify_label == "extrapolated" for r in rows):
        notes.append(
            "verify cost extrapolated outside the measured tokens per request "
            f"({', '.join(str(p.tokens_per_request) for p in curve.points)}): measure more points with a "
            "short run per draft-token count and pass each folder as another --verify-log"
        )
    if draft.label == "assumed":
        notes.append(
            "draft cost assumed 0 ms (no trace and no --draft-step-ms / --draft-extend-ms): right for "
            "NGRAM (host drafting), not for an EAGLE drafter"
        )
    change = (
        round(100.0 * (best.tok_s - cur.tok_s) / cur.tok_s, 2)
        if best is not None and cur is not None and cur.tok_s > 0
        else None
    )
    return DraftShapeReport(
        steps=hist.steps,
        topk=hist.topk,
        tree=tree,
        current_depth=hist.steps,
        best_depth=best.depth if best else None,
        rows=rows,
        flags=chain_flags(best.depth) if best else None,
        tok_s_change_pct=change,
        verify_command=(
            "fastverify launch --profile-verify after/ -- <sglang command> <flags>; "
            "then fastverify profile --verify-log before/ after/"
        ),
        cost=curve,
        draft=draft,
        histogram=list(hist.counts),
        sources=list(sources or []),
        notes=notes,
    )
