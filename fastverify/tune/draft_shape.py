"""``fastverify tune --draft-shape``: choose the EAGLE draft shape (steps, topk, draft tokens) from
the server's own accept lengths and the measured cost of a cycle (:mod:`fastverify.tune.draft_model`),
read from verify logs, a bundle or an accept-histogram file (:mod:`fastverify.tune.draft_inputs`).
``--draft-step-ms MS`` / ``--draft-extend-ms MS`` give the draft cost (label ``given``) when no
trace does; without either it is 0 (label ``assumed``: right for NGRAM, whose drafting is on the
host, wrong for an EAGLE drafter). Prints a per-depth table and the winner's SGLang flags, or one
JSON document (``--json``).

Raises :class:`fastverify.errors.UserError` (one line, exit 2) for a bad or missing input.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec
import numpy as np

from fastverify.console import cell, say
from fastverify.errors import UserError, path_text, shown
from fastverify.output_paths import path_arg
from fastverify.tune.draft_inputs import from_bundle, from_dirs, read_histogram
from fastverify.tune.draft_model import CostCurve, CostPoint, DepthRow, DraftCost, DraftShapeReport, recommend

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
