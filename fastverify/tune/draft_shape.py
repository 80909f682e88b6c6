"""``fastverify tune --draft-shape``: choose the EAGLE draft shape (steps, topk, draft tokens) from
the server's own accept lengths and the measured cost of a cycle (:mod:`fastverify.tune.draft_model`),
read from verify logs, a bundle or an accept-histogram file (below).
``--draft-step-ms MS`` / ``--draft-extend-ms MS`` give the draft cost (label ``given``) when no
trace does; without either it is 0 (label ``assumed``: right for NGRAM, whose drafting is on the
host, wrong for an EAGLE drafter). Prints a per-depth table and the winner's SGLang flags, or one
JSON document (``--json``).

Raises :class:`fastverify.errors.UserError` (one line, exit 2) for a bad or missing input.

Where ``tune --draft-shape`` gets its accept lengths, verify costs and draft cost.

- ``--verify-log DIR`` (repeatable): ``verify-rank*.jsonl`` of ``fastverify launch
  --profile-verify DIR``: the histogram of ``accepted`` (one rank's records: in TP every rank
  records the same steps) and the median ``verify_ms`` per tokens per request at the most
  frequent batch; folders of runs at other draft tokens add points to the curve.
- ``--bundle FILE`` (``fastverify collect``): its verify-log part as above, its server args
  (``speculative_num_steps``, ``speculative_eagle_topk``) and its trace's cycle split for the
  draft cost (the ``draft`` mode per cycle / steps, and ``draft_extend``).
- ``--accept-histogram FILE``: ``{"steps": 5, "counts": [c0, ..., c5], "topk": 1, "verify_ms":
  [[2, 10.0], [6, 10.4]]}``: ``counts[a]`` request-verifies accepted ``a`` draft tokens
  (``steps + 1`` ints >= 0, not all 0); ``topk`` optional (default 1); ``verify_ms`` optional
  ``[tokens per request, ms]`` pairs (label ``given``), used when no records give the curve:
  each count once, each ms at least :data:`fastverify.bounds.MIN_TIME_US`. No key may appear
  twice in an object.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec
import numpy as np

from fastverify.bounds import MAX_COUNT, MAX_DRAFT_TOKENS, MIN_TIME_US, implausible_count
from fastverify.bundle import Bundle, open_bundle
from fastverify.console import cell, say
from fastverify.cycle.bundle_evidence import evidence, server_arguments
from fastverify.cycle.flags import mode_means
from fastverify.errors import UserError, path_text, schema_error, shown
from fastverify.inputs import decode_json, read_bytes
from fastverify.outputs import path_arg
from fastverify.tune.draft_model import (
    AcceptHistogram,
    CostCurve,
    CostPoint,
    DepthRow,
    DraftCost,
    DraftShapeReport,
    recommend,
)
from fastverify.verifylog import _rank_key, read_log_dir

HISTOGRAM_EXAMPLES = {"steps": "5", "counts": "[40, 30, 15, 8, 4, 3]", "topk": "1", "verify_ms": "[[6, 10.4]]"}


def read_histogram(path: Path) -> AcceptHistogram:
    """The ``--accept-histogram`` file (format in the module docstring).

    Raises
    ------
    UserError
        Not readable, not JSON, a field missing or of the wrong type (named, with an example),
        ``steps`` outside [1, 63], ``counts`` not ``steps + 1`` ints in [0, 1e9] or all 0,
        ``topk`` outside [1, 64], a ``verify_ms`` pair out of range, a tokens-per-request count
        given twice (both values named), a key given twice in one object.
    """
    data = read_bytes(Path(path), kind="json", what="an accept histogram")
    try:
        h = decode_json(data, path_text(path), AcceptHistogram, what="the accept histogram")
    except msgspec.ValidationError as e:
        raise schema_error(f"{path_text(path)}: invalid accept histogram", e, HISTOGRAM_EXAMPLES) from None
    where = f"{path_text(path)}: field"
    if not 1 <= h.steps < MAX_DRAFT_TOKENS:
        raise UserError(f'{where} "steps": {h.steps} is outside [1, {MAX_DRAFT_TOKENS - 1}] (e.g. "steps": 5)')
    if len(h.counts) != h.steps + 1:
        raise UserError(f'{where} "counts": {len(h.counts)} values, need steps + 1 = {h.steps + 1} (accepted 0..steps)')
    if any(not 0 <= c <= MAX_COUNT for c in h.counts) or sum(h.counts) == 0:
        raise UserError(f'{where} "counts": each must be in [0, {MAX_COUNT:g}] and not all 0')
    if not 1 <= h.topk <= MAX_DRAFT_TOKENS:
        raise UserError(f'{where} "topk": {h.topk} is outside [1, {MAX_DRAFT_TOKENS}]')
    floor_ms = MIN_TIME_US / 1000.0
    seen: dict[int, float] = {}
    for t, ms in h.verify_ms:
        if not (1 <= t <= MAX_DRAFT_TOKENS and np.isfinite(ms) and floor_ms <= ms <= 3.6e6):
            raise UserError(
                f'{where} "verify_ms": [{t}, {ms}] is not [tokens per request in 1..{MAX_DRAFT_TOKENS}, '
                f"ms in [{floor_ms:g}, 3.6e6]]"
            )
        if t in seen:
            raise UserError(
                f'{where} "verify_ms": {t} tokens per request given twice ({seen[t]:g} ms and {ms:g} ms); '
                "give each count once"
            )
        seen[t] = ms
    return h


def from_records(records: dict, source: str) -> tuple[AcceptHistogram | None, list[CostPoint], int | None, list[str]]:
    """From :func:`fastverify.verifylog.read_log_dir`'s records: the histogram of ``accepted`` of
    the lowest rank at its deepest tokens per request (assumed a chain: S = tokens per request − 1),
    the cost points (median ``verify_ms`` per tokens per request at the most frequent batch), that
    batch, and notes."""
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
    points = [
        CostPoint(tokens_per_request=t, verify_ms=round(float(np.median(v)), 6), records=len(v))
        for t, v in sorted(by_t.items())
    ]
    if len(set(batches)) > 1:
        notes.append(
            f"{source}: verify cost taken at batch {batch} ({batches.count(batch)} of {len(recs)} records; "
            "other batches left out)"
        )
    with_acc = [r for r in recs if r.accepted is not None]
    if not with_acc:
        return (
            None,
            points,
            batch,
            notes
            + [
                f"{source}: no record carries accepted (an older fastverify, or the "
                "accept sampler was not wrapped): no accept lengths from it"
            ],
        )
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
    return [
        CostPoint(
            tokens_per_request=t,
            verify_ms=round(float(np.median([p.verify_ms for p in ps])), 6),
            records=sum(p.records for p in ps),
        )
        for t, ps in sorted(by_t.items())
    ]


def from_dirs(dirs: list[Path], label: str = "measured"):
    """Histogram (of the deepest run), cost curve and notes from verify-log folders."""
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
        notes.append(
            f"the folders ran different batches ({', '.join(map(str, sorted(batches)))}): the cost curve mixes them"
        )
    curve = CostCurve(
        batch=min(batches) if len(batches) == 1 else None,
        points=_merge_points(groups),
        label=label,
        source=", ".join(f"{path_text(d)} (verify records)" for d in dirs),
    )
    return hist, curve, notes


def _mode_ms(mode: dict) -> float:
    """A mode's GPU time per cycle (ms): compute, all-reduce, other comm, memory and idle (µs)."""
    return sum(mode[k] for k in ("compute_us", "allreduce_us", "other_comm_us", "memory_us", "idle_us")) / 1000.0


def from_bundle(source, split=None):
    """Histogram, cost curve, draft cost (None: not in the trace) and notes from a bundle:
    ``source`` its path, or a :class:`fastverify.bundle.Bundle` already open (so the archive is
    read once); ``split``: its cycle split when the caller has it (else the trace is read here).
    Server arguments out of bounds (``speculative_num_steps`` outside [1, 63],
    ``speculative_eagle_topk`` outside [1, 64]) are left out, with a note.

    Raises
    ------
    UserError
        No verify-log part, the bundle or a verify record cannot be read (a member named
        ``BUNDLE:member``).
    """
    if isinstance(source, Bundle):
        return _from_open_bundle(source, split)
    with open_bundle(Path(source)) as bundle:
        return _from_open_bundle(bundle, split)


def _server_fact(sargs: dict, key: str, upper: int, notes: list[str]) -> int | None:
    value = sargs.get(key)
    if value is None:
        return None
    why = implausible_count(value, lower=1, upper=upper, what=key)
    if why is not None:
        notes.append(f"server_args: {key} {why}: left out")
        return None
    return value


def _from_open_bundle(bundle, split):
    where = path_text(bundle.path)
    part = bundle.part("verify_log")
    if part is None or part.status != "ok":
        raise UserError(f"{where}: the bundle has no verify-log part (collect with --verify-log DIR)")
    notes: list[str] = []
    sargs = server_arguments(bundle, notes) or {}
    names = [f for f in part.files if f.endswith(".jsonl")]
    try:  # the records are read from the bundle's copies: messages name BUNDLE:member
        hist, curve, got = from_dirs(sorted({f.parent for f in bundle.local(names)}))
    except UserError as e:
        raise UserError(bundle.rename(str(e))) from None
    notes += [bundle.rename(n) for n in got]
    if split is None:
        split = evidence(bundle)[0].split
    curve = msgspec.structs.replace(curve, source=f"{where}: verify-log part")
    topk = _server_fact(sargs, "speculative_eagle_topk", MAX_DRAFT_TOKENS, notes)
    steps = _server_fact(sargs, "speculative_num_steps", MAX_DRAFT_TOKENS - 1, notes)
    draft = None
    if split is not None:
        means = mode_means(split)
        if "draft" in means and steps is not None:
            draft = DraftCost(
                draft_step_ms=round(_mode_ms(means["draft"]) / steps, 6),
                draft_extend_ms=round(_mode_ms(means["draft_extend"]), 6) if "draft_extend" in means else 0.0,
                label="measured",
                source=f"{where}: trace cycle split (draft / {steps} steps, draft_extend)",
            )
    if hist is not None and isinstance(topk, int) and topk > 1:
        hist = msgspec.structs.replace(hist, topk=topk)
    return hist, curve, draft, notes


MAX_ROWS = 10
"""Most depth rows printed (the JSON holds all): keeps the table within 15 lines."""


def add_arguments(group) -> None:
    """The flags of ``tune --draft-shape`` on an argparse group (or parser)."""
    group.add_argument(
        "--draft-shape",
        action="store_true",
        help="recommend --speculative-num-steps / -eagle-topk / -num-draft-tokens from accept lengths "
        "and the measured cycle cost (per-depth table: accept length, cycle ms, tok/s)",
    )
    group.add_argument(
        "--accept-histogram",
        type=path_arg,
        metavar="FILE",
        default=None,
        help='JSON {"steps": S, "counts": [S+1 ints: request-verifies that accepted 0..S draft '
        'tokens], "topk": 1, "verify_ms": [[tokens per request, ms], ...]}',
    )
    group.add_argument(
        "--verify-log",
        type=path_arg,
        metavar="DIR",
        action="append",
        default=None,
        help="verify records of `fastverify launch --profile-verify DIR` (repeat: one per run)",
    )
    group.add_argument(
        "--bundle",
        type=path_arg,
        metavar="FILE",
        default=None,
        help="a bundle of `fastverify collect` (verify log, server args, trace)",
    )
    group.add_argument(
        "--draft-step-ms",
        type=float,
        metavar="MS",
        default=None,
        help="drafter ms per draft step when no trace gives it [default: 0, assumed]",
    )
    group.add_argument(
        "--draft-extend-ms",
        type=float,
        metavar="MS",
        default=None,
        help="drafter's draft-extend ms per cycle when no trace gives it [default: 0, assumed]",
    )


def _given_ms(name: str, value: float | None) -> float | None:
    if value is not None and not (np.isfinite(value) and 0 <= value <= 3.6e6):
        raise UserError(f"--{name} {value!r}: not a time in [0, 3.6e6] ms")
    return value


def build(args: argparse.Namespace) -> DraftShapeReport:
    """The report from the flags (see :func:`add_arguments`).

    Raises
    ------
    UserError
        No input, ``--bundle`` with ``--verify-log``, one ``--verify-log`` folder given twice, no
        accept histogram or no verify cost in what was given, a bad file or flag value, a verify
        cost that is no cost (:func:`fastverify.tune.draft_model.check_curve`).
    """
    dirs, bundle, hist_file = args.verify_log or [], args.bundle, args.accept_histogram
    _no_folder_twice(dirs)
    if bundle is not None and dirs:
        raise UserError("--bundle and --verify-log: give one source of verify records")
    if bundle is None and not dirs and hist_file is None:
        raise UserError("--draft-shape needs --verify-log DIR, --bundle FILE or --accept-histogram FILE")
    step_ms, ext_ms = _given_ms("draft-step-ms", args.draft_step_ms), _given_ms("draft-extend-ms", args.draft_extend_ms)
    hist = draft = None
    curve = CostCurve(batch=None, points=[], label="measured", source="")
    notes: list[str] = []
    if bundle is not None:
        hist, curve, draft, notes = from_bundle(bundle)
    elif dirs:
        hist, curve, notes = from_dirs(dirs)
    hist_label, sources = "measured", []
    if hist_file is not None:
        file_hist = read_histogram(hist_file)
        if hist is not None:
            notes.append(f"accept histogram from {path_text(hist_file)}, not the records")
        hist, hist_label = file_hist, "given"
        sources.append(f"{path_text(hist_file)} (accept histogram)")
        if not curve.points and file_hist.verify_ms:
            curve = CostCurve(
                batch=None,
                label="given",
                source=f"{path_text(hist_file)} (verify_ms)",
                points=[
                    CostPoint(tokens_per_request=t, verify_ms=ms, records=0) for t, ms in sorted(file_hist.verify_ms)
                ],
            )
    elif hist is not None:
        sources.append(f"{curve.source}: accepted")
    if hist is None:
        raise UserError(
            "no accept lengths: "
            + ("; ".join(notes) or "the records carry no accepted tokens")
            + " (or give --accept-histogram FILE)"
        )
    if curve.source:
        sources.append(curve.source)
    if step_ms is not None or ext_ms is not None:
        draft = DraftCost(
            draft_step_ms=step_ms or 0.0,
            draft_extend_ms=ext_ms or 0.0,
            label="given",
            source="--draft-step-ms / --draft-extend-ms",
        )
    elif draft is None:
        draft = DraftCost(draft_step_ms=0.0, draft_extend_ms=0.0, label="assumed", source="none given")
    sources.append(f"draft cost: {draft.source}")
    return recommend(hist, curve, draft, hist_label=hist_label, sources=sources, notes=notes)


def _no_folder_twice(dirs: list[Path]) -> None:
    """Refuse one ``--verify-log`` folder named twice (its records would count twice)."""
    seen: dict[Path, Path] = {}
    for d in dirs:
        key = Path(os.path.realpath(d))
        if key in seen:
            raise UserError(
                f"--verify-log {path_text(d)}: the same folder as --verify-log {path_text(seen[key])}; "
                "give each run's folder once"
            )
        seen[key] = d


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

    what = (
        "tree run: its own shape only"
        if rep.tree
        else f"chain depths 1-{rep.rows[-1].depth} from one run at {rep.steps}"
    )
    batch = f"verify cost at batch {rep.cost.batch}" if rep.cost.batch is not None else "batch not known"
    say(console, f"# draft shape: {what}; tok/s per stream = accept length / cycle time; {batch}")
    t = Table(box=None, pad_edge=False)
    for col in ("depth", "draft tok/req", "accept len", "verify ms", "cycle ms", "tok/s", "label"):
        t.add_column(col, justify="left" if col == "label" else "right")
    for r in _shown(rep.rows, rep.best_depth, rep.current_depth):
        mark = " *" if r.depth == rep.best_depth else (" (now)" if r.depth == rep.current_depth else "")
        t.add_row(
            cell(f"{r.depth}{mark}"),
            cell(r.tokens_per_request),
            f"{r.accept_length:.3f}",
            f"{r.verify_ms:.3f}",
            f"{r.cycle_ms:.3f}",
            f"{r.tok_s:.1f}",
            cell(r.label),
        )
    console.print(t)
    if rep.flags is not None:
        gain = (
            ""
            if rep.tok_s_change_pct is None
            else " (the run's own depth)"
            if rep.best_depth == rep.current_depth
            else f" ({rep.tok_s_change_pct:+.1f} % tok/s vs depth {rep.current_depth}: more tokens per second)"
        )
        say(console, f"best: depth {rep.best_depth}{gain}: {rep.flags}")
        console.print(shown(f"verify: {rep.verify_command}", limit=None), markup=False, highlight=False)
    for n in rep.notes:
        say(console, f"# note: {n}")


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
