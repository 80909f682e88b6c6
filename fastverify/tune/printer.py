"""The words ``tune --predict`` prints: the decision and its evidence in a few lines.

Without ``--explain``: one header line (workload, topology, NCCL version), a table of the top
:data:`TOP` ranked candidates plus the baseline and each unranked backend (one setting per line in
the candidate column, never cut), one line of the verdict per message size (:func:`per_size_line`:
the winner, "too close to call: measure" or unknown, and each backend's crossover), the winner's
all-reduce and verify change, tok/s only when ``--tok-s`` gave a rate to start from (no tok/s
without a cycle), one next command, and one line counting what ``--explain`` adds. With
``--explain``: every candidate with its range, the per-size table (:func:`per_size_table_lines`),
and every evidence line, note and ruled-out backend.

A change is always new vs baseline, ``(new - old) / old x 100``: ``-`` means less time
(:func:`fastverify.tune.verify_time.change_pct`). Every figure carries its label: ``predicted``,
``measured`` or ``measured-by-user``.

The JSON document ``tune --json`` prints, one shape for both modes: schema and version, mode,
label, the workload, the box, the baseline and every candidate (``change_pct`` = new vs
baseline, negative is less time) with its evidence, and the notes. Every float is rounded and
never ``-0.0``; a non-finite one is null.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fastverify.console import cell, say
from fastverify.errors import shown
from fastverify.registry import BackendName, backend_info
from fastverify.tune.candidates import MEASURED, PREDICTED, Figure, PredictedRanking, dedup, per_size_json
from fastverify.tune.ranking import us_text
from fastverify.tune.trial import Clock
from fastverify.tune.verify_time import change_pct, verify_reduction

TOP = 5
"""Ranked candidates the table shows without ``--explain`` (the baseline is shown in any case)."""
CHANGE_SAYS = "change = new vs baseline, - = less time"
USER_LABEL = "measured-by-user"


def header_line(workload, topo, version) -> str:
    """``# <workload>; topology <source>; NCCL <version>``: one line."""
    source = workload.source.replace(" (fastverify preset)", "")
    return f"# {source}; topology {topo.source}; NCCL {version or 'version unknown'}"


def candidate_cell(f) -> str:
    """The candidate column: a backend's name, an NCCL setting per line (each escaped to one
    line by :func:`fastverify.errors.shown`: a value may come from the environment), never cut."""
    if not f.ranked:
        return shown(
            f"{f.backend.value} ({'unknown at this size' if f.status == 'unknown at this size: measure with fastverify tune' else 'no published data'})"
        )
    lines = [shown(f"{k}={v}") for k, v in f.settings.items()]
    if f.backend is not BackendName.nccl:
        lines.insert(0, shown(f.backend.value))
    return "\n".join(lines) or "current environment"


def change_text(f, base: float | None) -> str:
    if f.is_baseline:
        return "baseline"
    if f.point_us is None or not base:
        return "-"
    return change_pct(100.0 * (f.point_us - base) / base)


def shown_candidates(pred, explain: bool) -> list:
    """The rows: every candidate with ``explain``; else the top :data:`TOP` ranked (one fewer for
    each unranked backend, at least 2, so the table keeps its height), the baseline where it is
    further down, and each unranked backend."""
    if explain:
        return list(pred.candidates)
    ranked = [f for f in pred.candidates if f.ranked]
    unranked = [f for f in pred.candidates if not f.ranked]
    top = max(2, TOP - len(unranked))
    rows = ranked[:top] + [f for f in ranked[top:] if f.is_baseline]
    return rows + unranked


def _verify_differs(pred) -> bool:
    """Whether a verify time says more than the all-reduce time (compute is known)."""
    return any(
        f.ranked
        and f.verify
        and f.verify.get("verify_ms") is not None
        and abs(f.verify["verify_ms"] - f.point_us / 1e3) > 5e-4
        for f in pred.candidates
    )


def table_title(workload) -> str:
    return f"all-reduce per verify step ({workload.allreduce_count} calls); {CHANGE_SAYS}"


def prediction_table(pred, *, explain: bool, tok_s: bool) -> Table:
    """The candidates' table (:func:`shown_candidates`); its title is :func:`table_title`, printed
    as a line of its own (a table title wraps at the table's width)."""
    base = pred.baseline.point_us
    verify_col = explain or _verify_differs(pred)
    tok_col = tok_s  # no tok/s without a cycle
    t = Table()
    t.add_column("#", justify="right")
    t.add_column("candidate", no_wrap=True)  # a setting is never cut: one per line
    t.add_column("label", no_wrap=True)
    t.add_column("µs / step", justify="right")
    if explain:
        t.add_column("range µs", justify="right")
    t.add_column("change", justify="right", no_wrap=True)
    if verify_col:
        t.add_column("verify ms", justify="right")
    if tok_col:
        t.add_column("tok/s", justify="right")
    for f in shown_candidates(pred, explain):
        i = pred.candidates.index(f) + 1
        v = f.verify or {}
        row = [
            cell(i) if f.ranked else "-",
            Text(candidate_cell(f)),
            cell(f.label) if f.ranked else "-",
            cell(us_text(f.point_us)),
        ]
        if explain:
            row.append(
                ("unknown" if f.ranked else "-")
                if f.range_us is None
                else cell(f"{us_text(f.range_us[0])} – {us_text(f.range_us[1])}")
            )
        row.append(cell(change_text(f, base)))
        if verify_col:
            row.append("-" if v.get("verify_ms") is None else f"{v['verify_ms']:.3f}")
        if tok_col:
            row.append("-" if v.get("tok_s") is None else f"{v['tok_s']:.1f}")
        t.add_row(*row)
    return t


def explain_lines(pred, held_notes=()) -> list[str]:
    """Each evidence line and note once, naming the candidates it belongs to; the backends ruled
    out; the prediction's own notes and ``held_notes`` (said before the prediction)."""
    said: dict[tuple[str, str], list[str]] = {}
    for i, f in enumerate(pred.candidates, 1):
        who = str(i) if f.ranked else f"{f.backend.value} (not ranked)"
        lines = [("evidence", e) for e in f.evidence] + [("note", n) for n in f.notes]
        if f.bounds:
            lines.append(
                (
                    "wait",
                    f"a faster kernel replaces the transfer, not the wait for a slower rank: wait kept "
                    f"{us_text(f.bounds['wait_kept_us'])} µs, wait shrinks {us_text(f.bounds['wait_shrinks_us'])} µs "
                    "per step",
                )
            )
        for key in lines:
            said.setdefault(key, []).append(who)
    out = [f"# {kind} (candidate {', '.join(who)}): {text}" for (kind, text), who in said.items()]
    out += [f"# not a candidate: {why}" for why in pred.not_candidates]
    out += [f"# note: {n}" for n in dict.fromkeys((*pred.notes, *held_notes))]
    return out


def _label_pair(a: str, b: str, la: str, lb: str) -> tuple[str, str]:
    """``a -> b (label)`` when both carry one label, else each its own."""
    if la == lb:
        return f"{a} -> {b}", f" ({la})"
    return f"{a} ({la}) -> {b} ({lb})", ""


def winner_lines(
    red: dict, *, best, base_label: str, best_label: str, user=None, tok_s_given: bool, keep: bool = False
) -> list[str]:
    """The winner's all-reduce and verify change (and tok/s when a rate was given), each figure
    labelled; "upper bound" where the figures make it one. ``keep``: the baseline won, one line."""
    if keep:
        return [
            f"winner: {best}, the baseline: keep the current settings (all-reduce "
            f"{us_text(red['allreduce_baseline_us'])} µs per verify step, {base_label})"
        ]
    upper = user is not None or "upper bound" in str(red.get("verify_baseline_basis", ""))
    bound = " (upper bound)" if user is not None else ""  # scalars: a faster kernel cannot shrink the wait
    ar_base, ar_best = red["allreduce_baseline_us"], red["allreduce_predicted_us"]
    pair, lab = _label_pair(f"{us_text(ar_base)} µs", f"{us_text(ar_best)} µs", base_label, best_label)
    ar_chg = change_pct(100.0 * (ar_best - ar_base) / ar_base) if ar_base else "0.0 %"
    lines = [f"winner: {best}: all-reduce per verify step {pair}, {ar_chg}{lab}{bound}"]
    basis = str(red.get("verify_baseline_basis", ""))
    v_label = user.label if user is not None else basis.split(" (")[0].split(":")[0] or "predicted"
    v_base, v_best = red["verify_baseline_us"], red["verify_predicted_us"]
    pair, lab = _label_pair(f"{v_base / 1e3:.3f} ms", f"{v_best / 1e3:.3f} ms", v_label, "predicted")
    v_chg = change_pct(100.0 * (v_best - v_base) / v_base) if v_base else "0.0 %"
    why = "" if not upper or user is not None else "; compute not measured, so an upper bound on the gain"
    lines.append(f"verify step: {pair}, {v_chg}{lab}{bound}{why}")
    if tok_s_given and red.get("tok_s_baseline") is not None:
        lines.append(
            f"tok/s per stream at accept length {red['accept_length']:g}: {red['tok_s_baseline']:.1f} "
            f"({USER_LABEL}) -> {red['tok_s_predicted']:.1f} (predicted{', upper bound' if bound else ''}; "
            "rest of the cycle held fixed)"
        )
    return lines


def next_command(args, workload, best, *, p2p_ok) -> str:
    """ONE next step: prove P2P where the winner needs it and it is not proven, else measure on
    the box and write the settings."""
    info = backend_info(best.backend)
    if info.needs_p2p and p2p_ok is not True:
        return (
            f"next: `fastverify p2p --output p2p.json` on the box ({best.backend.value} needs P2P, not "
            "proven), then add --p2p-check p2p.json"
        )
    if args.profile is not None:
        work = f"--profile {shlex.quote(str(args.profile))}"
        if args.hidden is not None:
            work += f" --hidden {args.hidden}"
    else:
        work = f"--model {shlex.quote(args.model or 'tiny')} --tp {workload.tp}"
    if args.draft_tokens is not None:
        work += f" --draft-tokens {args.draft_tokens}"
    if args.batch != 1:
        work += f" --batch {args.batch}"
    write = " --write-env" if workload.hidden or args.hidden else ""
    return f"next: measure on the box: `fastverify tune {work}{write}`"


def explain_count_line(pred, shown: int, n_lines: int) -> str:
    """What ``--explain`` adds, counted, in one line."""
    parts = []
    more = len(pred.candidates) - shown
    if more:
        parts.append(f"{more} more candidate{'s' if more != 1 else ''}")
    notes = n_lines - len(pred.not_candidates)
    parts.append(f"{notes} note{'s' if notes != 1 else ''} on the evidence")
    ruled = len(pred.not_candidates)
    if ruled:
        parts.append(f"{ruled} backend{'s' if ruled != 1 else ''} ruled out")
    said = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return f"# {said}: --explain shows them"


def print_prediction(
    args, console: Console, workload, topo, version, pred, red: dict, *, p2p_ok, user=None, held_notes=()
) -> None:
    """``tune --predict``'s words (the module docstring). Every line goes through
    :func:`fastverify.console.say`: escaped, one line whatever its length (the terminal wraps it)."""
    explain = bool(getattr(args, "explain", False))
    say(console, header_line(workload, topo, version))
    say(console, table_title(workload))
    console.print(prediction_table(pred, explain=explain, tok_s=args.tok_s is not None))
    best, base = pred.best, pred.baseline
    line = per_size_line(pred)
    if line:
        say(console, line)
    for line in pred.too_close.values():  # one line whatever its length, as the header's
        say(console, line)
    best_name = candidate_cell(best).replace("\n", ", ")
    for line in winner_lines(
        red,
        best=best_name,
        base_label=base.label,
        best_label=best.label,
        user=user,
        tok_s_given=args.tok_s is not None,
        keep=best.is_baseline,
    ):
        say(console, line)
    say(console, next_command(args, workload, best, p2p_ok=p2p_ok))
    lines = explain_lines(pred, held_notes)
    if explain:
        for line in per_size_table_lines(pred):
            say(console, line)
        for line in lines:
            say(console, line)
    else:
        say(console, explain_count_line(pred, len(shown_candidates(pred, False)), len(lines)))


def _kb(nbytes: int) -> str:
    return f"{nbytes / 1000:.0f} KB" if nbytes >= 1000 else f"{nbytes} B"


def per_size_line(pred) -> str:
    """One line: per message size the winner with its change against NCCL's point at that size,
    "too close to call", or unknown; then each backend's crossover (the size from which NCCL's
    point is at or below the backend's; "never" within the step's sizes). Empty when no backend
    has a figure at any size."""
    rows = [r for r in pred.per_size if len(r["entries"]) >= 2]
    if not rows:
        return ""
    parts = []
    for r in rows:
        nccl = next(e for e in r["entries"] if e["backend"] == BackendName.nccl.value)
        win = next((e for e in r["entries"] if e["name"] == r["winner"]), None)
        if win is None:
            if r["verdict"].startswith("too close"):
                parts.append(f"{_kb(r['msg_bytes'])} too close to call: measure")
            else:
                who = ", ".join(e["name"] for e in r["entries"] if e["range_us"] is None)
                parts.append(f"{_kb(r['msg_bytes'])} unknown at this size ({who}): measure")
        elif win is nccl:
            parts.append(f"{_kb(r['msg_bytes'])} NCCL")
        else:
            chg = change_pct(100.0 * (win["point_us"] - nccl["point_us"]) / nccl["point_us"])
            parts.append(f"{_kb(r['msg_bytes'])} {win['name']} ({chg})")
    cross = [
        f"crossover {n} {_kb(b) if b is not None else 'never'}"
        for n, b in pred.crossover_bytes.items()
        if any(e["name"] == n for r in rows for e in r["entries"])
    ]
    return "per size: " + ", ".join(parts + cross)


def per_size_table_lines(pred) -> list[str]:
    """``--explain``: one line per (size, figure): point and range per call (µs), and the verdict."""
    out = []
    for r in pred.per_size:
        figs = "; ".join(
            f"{e['name']} {us_text(e['point_us'])} µs ("
            + (
                "range unknown"
                if e["range_us"] is None
                else f"{us_text(e['range_us'][0])} – {us_text(e['range_us'][1])}"
            )
            + ")"
            for e in r["entries"]
        )
        out.append(f"# per size {r['msg_bytes']:,} B x {r['count']}: {figs}; verdict: {r['verdict']}")
    out += [
        f"# crossover {n}: NCCL at or below it from {b:,} B"
        if b is not None
        else f"# crossover {n}: none within the step's sizes"
        for n, b in pred.crossover_bytes.items()
    ]
    return out


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
