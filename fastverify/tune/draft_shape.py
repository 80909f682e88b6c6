"""``fastverify tune --draft-shape``: choose the EAGLE draft shape (steps, topk, draft tokens) from
the server's own accept lengths and the measured cost of a cycle.

tok/s per stream = accept length / cycle time. A chain draft (topk 1) of ``k`` steps verifies
``k + 1`` tokens per request (``--speculative-num-draft-tokens k+1``), and per cycle costs

    cycle_ms(k) = k x draft_step_ms + verify_ms(k + 1 tokens per request) + draft_extend_ms

When the verify is all-reduce bound, ``verify_ms`` barely grows with tokens (small all-reduces are
latency-bound), so a deeper chain raises the accept length almost for free; after a faster
all-reduce it grows again, and the best depth moves.

Accept length by depth (exact for chains): a run at ``S`` steps gives, per request per verify,
``A`` = the accepted draft tokens (bonus excluded; the ``accepted`` of the verify records,
:mod:`fastverify.patch.verify`). A chain of depth ``k <= S`` would have accepted ``min(A, k)``
(its draft tokens are the first ``k`` of the longer chain), so its accept length is
``E[min(A, k)] + 1`` (+1: the bonus token). Depths above ``S`` are not derivable. A tree
(topk > 1) accepts along one branch of many; one run's records do not give other tree shapes:
each needs a short run of its own.

Inputs
------
- ``--verify-log DIR`` (repeatable): ``verify-rank*.jsonl`` of ``fastverify launch
  --profile-verify DIR``; the histogram of ``accepted`` (one rank's records: in TP every rank
  records the same steps) and the cost curve: median ``verify_ms`` per tokens per request at the
  most frequent batch. Several folders (runs at other draft tokens) add points to the curve.
- ``--bundle FILE``: a bundle of ``fastverify collect``: its verify-log part as above, its
  server_args part (``speculative_num_steps``, ``speculative_eagle_topk``), and its trace's cycle
  split for the draft cost (the ``draft`` mode per cycle / steps, and ``draft_extend``).
- ``--accept-histogram FILE``: a JSON document
  ``{"steps": 5, "counts": [c0, ..., c5], "topk": 1, "verify_ms": [[2, 10.0], [6, 10.4]]}``:
  ``counts[a]`` = request-verifies that accepted ``a`` draft tokens (``steps + 1`` ints >= 0, not
  all 0); ``topk`` optional (default 1); ``verify_ms`` optional, ``[tokens per request, ms]``
  pairs (label ``given``), used when no records give the curve.
- ``--draft-step-ms MS`` / ``--draft-extend-ms MS``: the draft cost (label ``given``) when no
  trace gives it; without either, 0 (label ``assumed``: right for NGRAM, whose drafting is on the
  host, wrong for an EAGLE drafter).

Labels (weakest wins in a row): ``measured`` (read from this server), ``given`` (a flag or the
file), ``derived`` (computed exactly from measured facts: E[min(A,k)]+1, or the verify cost
interpolated between measured points), ``assumed``, ``extrapolated`` (beyond the measured cost
curve: linear from the two nearest points, flat from one; said so in the row).

Raises :class:`fastverify.errors.UserError` (one line, exit 2) for a bad or missing input.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import msgspec
import numpy as np

from fastverify.bounds import MAX_COUNT, MAX_DRAFT_TOKENS
from fastverify.errors import UserError, path_text, schema_error

SCHEMA = "fastverify.draft_shape"
SCHEMA_VERSION = 1
LABELS = ("measured", "given", "derived", "assumed", "extrapolated")
"""From strongest to weakest; a row's label is the weakest of its parts."""
MAX_ROWS = 10
"""Most depth rows printed (the JSON holds all): keeps the table within 15 lines."""


class AcceptHistogram(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Accepted draft tokens per request per verify of one run at ``steps`` (chain depth S):
    ``counts[a]`` request-verifies accepted ``a`` (0..S); ``topk`` of the run; ``verify_ms``:
    optional ``[tokens per request, ms]`` pairs (the file form, label given)."""

    steps: int
    counts: list[int]
    topk: int = 1
    verify_ms: list[tuple[int, float]] = []


HISTOGRAM_EXAMPLES = {"steps": "5", "counts": "[40, 30, 15, 8, 4, 3]", "topk": "1", "verify_ms": "[[6, 10.4]]"}


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


def verify_at(curve: CostCurve, tokens: int) -> tuple[float, str]:
    """Verify ms at ``tokens`` per request and its label: a measured point (the curve's label),
    linear between two points (``derived``), else ``extrapolated`` (linear from the two nearest
    points, flat from a single one; never below 0)."""
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
    slope = (y[j] - y[i]) / (x[j] - x[i])
    return max(0.0, y[i] + slope * (tokens - x[i])), "extrapolated"


def depth_rows(hist: AcceptHistogram, curve: CostCurve, draft: DraftCost, hist_label: str) -> list[DepthRow]:
    """One :class:`DepthRow` per chain depth 1..S (a tree: only its own shape, the run's)."""
    depths = range(1, hist.steps + 1) if hist.topk == 1 else [hist.steps]
    rows = []
    for k in depths:
        tokens = k + 1 if hist.topk == 1 else max(p.tokens_per_request for p in curve.points)
        acc = accept_length(hist.counts, k)
        acc_label = hist_label if k == hist.steps else _weakest(hist_label, "derived")
        v_ms, v_label = verify_at(curve, tokens)
        cycle = k * draft.draft_step_ms + v_ms + draft.draft_extend_ms
        rows.append(DepthRow(depth=k, tokens_per_request=tokens, accept_length=round(acc, 4), accept_label=acc_label,
                             verify_ms=round(v_ms, 4), verify_label=v_label, cycle_ms=round(cycle, 4),
                             tok_s=round(acc / (cycle / 1000.0), 2) if cycle > 0 else 0.0,
                             label=_weakest(acc_label, v_label, draft.label)))
    return rows


def chain_flags(k: int) -> str:
    return f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"


def tree_note(hist: AcceptHistogram) -> str:
    return (f"a tree run (topk {hist.topk}): one run's records do not give other tree shapes (a tree accepts "
            "along one of many branches; E[min(A,k)]+1 holds for chains only). Measure each shape with a short "
            "run: `fastverify launch --profile-verify DIR_<shape> -- <sglang command> --speculative-num-steps S "
            "--speculative-eagle-topk K --speculative-num-draft-tokens N`, then `fastverify tune --draft-shape "
            "--verify-log DIR_<shape>` for each, and compare their measured tok/s")


def recommend(hist: AcceptHistogram, curve: CostCurve, draft: DraftCost, *, hist_label: str = "measured",
              sources: list[str] | None = None, notes: list[str] | None = None) -> DraftShapeReport:
    """The per-depth table and the best chain depth (highest tok/s per stream; ties: shallower).

    Raises
    ------
    UserError
        The histogram is empty or the curve has no point.
    """
    if sum(hist.counts) <= 0:
        raise UserError("the accept histogram holds no request-verify (all counts 0)")
    if not curve.points:
        raise UserError("no verify cost: give --verify-log DIR or --bundle FILE (records with batch and tokens), "
                        "or verify_ms pairs in the --accept-histogram file")
    notes = list(notes or [])
    rows = depth_rows(hist, curve, draft, hist_label)
    tree = hist.topk > 1
    best = None if tree else max(rows, key=lambda r: (r.tok_s, -r.depth))
    cur = next((r for r in rows if r.depth == hist.steps), None)
    if tree:
        notes.insert(0, tree_note(hist))
    elif any(r.verify_label == "extrapolated" for r in rows):
        notes.append("verify cost extrapolated outside the measured tokens per request "
                     f"({', '.join(str(p.tokens_per_request) for p in curve.points)}): measure more points with a "
                     "short run per draft-token count and pass each folder as another --verify-log")
    if draft.label == "assumed":
        notes.append("draft cost assumed 0 ms (no trace and no --draft-step-ms / --draft-extend-ms): right for "
                     "NGRAM (host drafting), not for an EAGLE drafter")
    change = (round(100.0 * (best.tok_s - cur.tok_s) / cur.tok_s, 2)
              if best is not None and cur is not None and cur.tok_s > 0 else None)
    return DraftShapeReport(steps=hist.steps, topk=hist.topk, tree=tree, current_depth=hist.steps,
                            best_depth=best.depth if best else None, rows=rows,
                            flags=chain_flags(best.depth) if best else None, tok_s_change_pct=change,
                            verify_command=("fastverify launch --profile-verify after/ -- <sglang command> <flags>; "
                                            "then fastverify profile --verify-log before/ after/"),
                            cost=curve, draft=draft, histogram=list(hist.counts), sources=list(sources or []),
                            notes=notes)


# --- inputs --------------------------------------------------------------------------------------


def read_histogram(path: Path) -> AcceptHistogram:
    """The ``--accept-histogram`` file (format in the module docstring).

    Raises
    ------
    UserError
        Not readable, not JSON, a field missing or of the wrong type (named, with an example),
        ``steps`` outside [1, 63], ``counts`` not ``steps + 1`` ints in [0, 1e9] or all 0,
        ``topk`` outside [1, 64], a ``verify_ms`` pair out of range.
    """
    from fastverify.inputs import read_bytes

    data = read_bytes(Path(path), kind="json", what="an accept histogram")
    try:
        h = msgspec.json.decode(data, type=AcceptHistogram)
    except msgspec.ValidationError as e:
        raise schema_error(f"{path_text(path)}: invalid accept histogram", e, HISTOGRAM_EXAMPLES) from None
    except msgspec.DecodeError as e:
        raise UserError(f"{path_text(path)}: not JSON ({' '.join(str(e).split())})") from None
    where = f"{path_text(path)}: field"
    if not 1 <= h.steps < MAX_DRAFT_TOKENS:
        raise UserError(f'{where} "steps": {h.steps} is outside [1, {MAX_DRAFT_TOKENS - 1}] (e.g. "steps": 5)')
    if len(h.counts) != h.steps + 1:
        raise UserError(f'{where} "counts": {len(h.counts)} values, need steps + 1 = {h.steps + 1} (accepted 0..steps)')
    if any(not 0 <= c <= MAX_COUNT for c in h.counts) or sum(h.counts) == 0:
        raise UserError(f'{where} "counts": each must be in [0, {MAX_COUNT:g}] and not all 0')
    if not 1 <= h.topk <= MAX_DRAFT_TOKENS:
        raise UserError(f'{where} "topk": {h.topk} is outside [1, {MAX_DRAFT_TOKENS}]')
    for t, ms in h.verify_ms:
        if not (1 <= t <= MAX_DRAFT_TOKENS and np.isfinite(ms) and 0 <= ms <= 3.6e6):
            raise UserError(f'{where} "verify_ms": [{t}, {ms}] is not [tokens per request in 1..{MAX_DRAFT_TOKENS}, '
                            "ms in [0, 3.6e6]]")
    return h


def from_records(records: dict, source: str) -> tuple[AcceptHistogram | None, list[CostPoint], int | None, list[str]]:
    """From :func:`fastverify.verifylog.read_log_dir`'s records: the histogram of ``accepted`` of
    the lowest rank at its deepest tokens per request (assumed a chain: S = tokens per request − 1),
    the cost points (median ``verify_ms`` per tokens per request at the most frequent batch), that
    batch, and notes."""
    from fastverify.verifylog import _rank_key

    rank = sorted(records, key=_rank_key)[0]
    recs = [r for r in records[rank] if r.batch and r.tokens is not None and r.tokens % r.batch == 0]
    notes = []
    if not recs:
        return None, [], None, [f"{source}: no record carries batch and tokens: no verify cost from it"]
    batches = [r.batch for r in recs]
    batch = max(set(batches), key=lambda b: (batches.count(b), -b))
    by_t: dict[int, list[float]] = {}
    for r in recs:
        if r.batch == batch:
            by_t.setdefault(r.tokens // r.batch, []).append(r.verify_ms)
    points = [CostPoint(tokens_per_request=t, verify_ms=round(float(np.median(v)), 6), records=len(v))
              for t, v in sorted(by_t.items())]
    if len(set(batches)) > 1:
        notes.append(f"{source}: verify cost taken at batch {batch} ({batches.count(batch)} of {len(recs)} records; "
                     "other batches left out)")
    with_acc = [r for r in recs if r.accepted is not None]
    if not with_acc:
        return None, points, batch, notes + [f"{source}: no record carries accepted (an older fastverify, or the "
                                             "accept sampler was not wrapped): no accept lengths from it"]
    depth = max(r.tokens // r.batch for r in with_acc) - 1
    if depth < 1:
        return None, points, batch, notes + [f"{source}: 1 token per request: no draft tokens, no accept lengths"]
    counts = [0] * (depth + 1)
    for r in with_acc:
        if r.tokens // r.batch - 1 == depth:
            for a in r.accepted:
                counts[min(a, depth)] += 1
    return AcceptHistogram(steps=depth, counts=counts), points, batch, notes


def _merge_points(groups: list[list[CostPoint]]) -> list[CostPoint]:
    """Points of several runs: per tokens per request, the median of the runs' medians (ms) and
    the records summed (one run per shape is the usual case)."""
    by_t: dict[int, list[CostPoint]] = {}
    for g in groups:
        for p in g:
            by_t.setdefault(p.tokens_per_request, []).append(p)
    return [CostPoint(tokens_per_request=t, verify_ms=round(float(np.median([p.verify_ms for p in ps])), 6),
                      records=sum(p.records for p in ps)) for t, ps in sorted(by_t.items())]


def _from_dirs(dirs: list[Path], label: str = "measured"):
    """Histogram (of the deepest run), cost curve and notes from verify-log folders."""
    from fastverify.verifylog import read_log_dir

    hist, groups, batches, notes = None, [], set(), []
    for d in dirs:
        got = read_log_dir(d)
        h, pts, batch, n = from_records(got["records"], path_text(d))
        notes += n
        if pts:
            groups.append(pts)
            batches.add(batch)
        if h is not None and (hist is None or h.steps > hist.steps):
            hist = h
    if len(batches) > 1:
        notes.append(f"the folders ran different batches ({', '.join(map(str, sorted(batches)))}): the cost curve "
                     "mixes them")
    curve = CostCurve(batch=min(batches) if len(batches) == 1 else None, points=_merge_points(groups), label=label,
                      source=", ".join(f"{path_text(d)} (verify records)" for d in dirs))
    return hist, curve, notes


def _mode_ms(mode: dict) -> float:
    """A mode's GPU time per cycle (ms): compute, all-reduce, other comm, memory and idle (µs)."""
    return sum(mode[k] for k in ("compute_us", "allreduce_us", "other_comm_us", "memory_us", "idle_us")) / 1000.0


def _from_bundle(path: Path, split=None):
    """Histogram, cost curve, draft cost (None: not in the trace) and notes from a bundle;
    ``split``: its cycle split when the caller has it (else the trace is read here)."""
    from fastverify.bundle import open_bundle
    from fastverify.cycle.command import _json_part, evidence
    from fastverify.cycle.flags import mode_means

    bundle = open_bundle(path)
    part = bundle.part("verify_log")
    if part is None or part.status != "ok":
        raise UserError(f"{path_text(path)}: the bundle has no verify-log part (collect with --verify-log DIR)")
    server = _json_part(bundle, "server_args") or {}
    sargs = server.get("server_args", server) if isinstance(server, dict) else {}
    with tempfile.TemporaryDirectory(prefix="fastverify-draft-shape-") as tmp:
        names = [f for f in part.files if f.endswith(".jsonl")]
        files = bundle.extract(names, Path(tmp) / "verify_log")
        hist, curve, notes = _from_dirs(sorted({f.parent for f in files}))
        if split is None:
            split = evidence(bundle, Path(tmp) / "ev")[0].split
    curve = msgspec.structs.replace(curve, source=f"{path_text(path)}: verify-log part")
    topk = sargs.get("speculative_eagle_topk") if isinstance(sargs, dict) else None
    steps = sargs.get("speculative_num_steps") if isinstance(sargs, dict) else None
    draft = None
    if split is not None:
        means = mode_means(split)
        if "draft" in means and isinstance(steps, int) and steps > 0:
            draft = DraftCost(draft_step_ms=round(_mode_ms(means["draft"]) / steps, 6),
                              draft_extend_ms=round(_mode_ms(means["draft_extend"]), 6) if "draft_extend" in means
                              else 0.0, label="measured",
                              source=f"{path_text(path)}: trace cycle split (draft / {steps} steps, draft_extend)")
    if hist is not None and isinstance(topk, int) and topk > 1:
        hist = msgspec.structs.replace(hist, topk=topk)
    return hist, curve, draft, notes


# --- the command ---------------------------------------------------------------------------------


def add_arguments(group) -> None:
    """The flags of ``tune --draft-shape`` on an argparse group (or parser)."""
    group.add_argument("--draft-shape", action="store_true",
                       help="recommend --speculative-num-steps / -eagle-topk / -num-draft-tokens from accept lengths "
                            "and the measured cycle cost (per-depth table: accept length, cycle ms, tok/s)")
    group.add_argument("--accept-histogram", type=Path, metavar="FILE", default=None,
                       help='JSON {"steps": S, "counts": [S+1 ints: request-verifies that accepted 0..S draft '
                            'tokens], "topk": 1, "verify_ms": [[tokens per request, ms], ...]}')
    group.add_argument("--verify-log", type=Path, metavar="DIR", action="append", default=None,
                       help="verify records of `fastverify launch --profile-verify DIR` (repeat: one per run)")
    group.add_argument("--bundle", type=Path, metavar="FILE", default=None,
                       help="a bundle of `fastverify collect` (verify log, server args, trace)")
    group.add_argument("--draft-step-ms", type=float, metavar="MS", default=None,
                       help="drafter ms per draft step when no trace gives it [default: 0, assumed]")
    group.add_argument("--draft-extend-ms", type=float, metavar="MS", default=None,
                       help="drafter's draft-extend ms per cycle when no trace gives it [default: 0, assumed]")


def _given_ms(name: str, value: float | None) -> float | None:
    if value is not None and not (np.isfinite(value) and 0 <= value <= 3.6e6):
        raise UserError(f"--{name} {value!r}: not a time in [0, 3.6e6] ms")
    return value


def build(args: argparse.Namespace) -> DraftShapeReport:
    """The report from the flags (see :func:`add_arguments`).

    Raises
    ------
    UserError
        No input, ``--bundle`` with ``--verify-log``, no accept histogram or no verify cost in
        what was given, a bad file or flag value.
    """
    dirs, bundle, hist_file = args.verify_log or [], args.bundle, args.accept_histogram
    if bundle is not None and dirs:
        raise UserError("--bundle and --verify-log: give one source of verify records")
    if bundle is None and not dirs and hist_file is None:
        raise UserError("--draft-shape needs --verify-log DIR, --bundle FILE or --accept-histogram FILE")
    step_ms, ext_ms = _given_ms("draft-step-ms", args.draft_step_ms), _given_ms("draft-extend-ms", args.draft_extend_ms)
    hist = draft = None
    curve = CostCurve(batch=None, points=[], label="measured", source="")
    notes: list[str] = []
    if bundle is not None:
        hist, curve, draft, notes = _from_bundle(bundle)
    elif dirs:
        hist, curve, notes = _from_dirs(dirs)
    hist_label, sources = "measured", []
    if hist_file is not None:
        file_hist = read_histogram(hist_file)
        if hist is not None:
            notes.append(f"accept histogram from {path_text(hist_file)}, not the records")
        hist, hist_label = file_hist, "given"
        sources.append(f"{path_text(hist_file)} (accept histogram)")
        if not curve.points and file_hist.verify_ms:
            curve = CostCurve(batch=None, label="given", source=f"{path_text(hist_file)} (verify_ms)",
                              points=[CostPoint(tokens_per_request=t, verify_ms=ms, records=0)
                                      for t, ms in sorted(dict(file_hist.verify_ms).items())])
    elif hist is not None:
        sources.append(f"{curve.source}: accepted")
    if hist is None:
        raise UserError("no accept lengths: " + ("; ".join(notes) or "the records carry no accepted tokens")
                        + " (or give --accept-histogram FILE)")
    if curve.source:
        sources.append(curve.source)
    if step_ms is not None or ext_ms is not None:
        draft = DraftCost(draft_step_ms=step_ms or 0.0, draft_extend_ms=ext_ms or 0.0, label="given",
                          source="--draft-step-ms / --draft-extend-ms")
    elif draft is None:
        draft = DraftCost(draft_step_ms=0.0, draft_extend_ms=0.0, label="assumed", source="none given")
    sources.append(f"draft cost: {draft.source}")
    return recommend(hist, curve, draft, hist_label=hist_label, sources=sources, notes=notes)


def _shown(rows: list[DepthRow], best: int | None, current: int | None) -> list[DepthRow]:
    """At most :data:`MAX_ROWS` rows: all when they fit, else 1, the current, the best and its
    neighbours, the deepest, and evenly spaced others."""
    if len(rows) <= MAX_ROWS:
        return rows
    keep = {1, rows[-1].depth, *(d for d in (current, best) if d is not None)}
    if best is not None:
        keep |= {best - 1, best + 1}
    for d in np.linspace(1, rows[-1].depth, MAX_ROWS).round().astype(int):
        if len(keep) >= MAX_ROWS:
            break
        keep.add(int(d))
    return [r for r in rows if r.depth in keep]


def print_report(rep: DraftShapeReport, console) -> None:
    """The per-depth table (≤ :data:`MAX_ROWS` rows), the winner's flags and how to verify it."""
    from rich.table import Table

    what = "tree run: its own shape only" if rep.tree else f"chain depths 1-{rep.steps} from one run at {rep.steps}"
    batch = f"verify cost at batch {rep.cost.batch}" if rep.cost.batch is not None else "batch not known"
    console.print(f"# draft shape: {what}; tok/s per stream = accept length / cycle time; {batch}",
                  markup=False, highlight=False)
    t = Table(box=None, pad_edge=False)
    for col in ("depth", "draft tok/req", "accept len", "verify ms", "cycle ms", "tok/s", "label"):
        t.add_column(col, justify="left" if col == "label" else "right")
    for r in _shown(rep.rows, rep.best_depth, rep.current_depth):
        mark = " *" if r.depth == rep.best_depth else (" (now)" if r.depth == rep.current_depth else "")
        t.add_row(f"{r.depth}{mark}", str(r.tokens_per_request), f"{r.accept_length:.3f}", f"{r.verify_ms:.3f}",
                  f"{r.cycle_ms:.3f}", f"{r.tok_s:.1f}", r.label)
    console.print(t)
    if rep.flags is not None:
        gain = "" if rep.tok_s_change_pct is None else \
            f" ({rep.tok_s_change_pct:+.1f} % tok/s vs depth {rep.current_depth}: more tokens per second)"
        console.print(f"best: depth {rep.best_depth}{gain}: {rep.flags}", markup=False, highlight=False)
        console.print(f"verify: {rep.verify_command}", markup=False, highlight=False)
    for n in rep.notes:
        console.print(f"# note: {n}", markup=False, highlight=False)


def run(args: argparse.Namespace, console) -> int:
    """``tune --draft-shape``: print the table (or, with ``args.json``, one JSON document on
    stdout); returns 0. Raises :class:`UserError` as :func:`build`."""
    rep = build(args)
    if getattr(args, "json", False):
        import sys

        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rep), indent=2).decode() + "\n")
    else:
        print_report(rep, console)
    return 0
