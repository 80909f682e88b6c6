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
"""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fastverify.console import cell, say
from fastverify.errors import shown
from fastverify.registry import BackendName, backend_info
from fastverify.tune.ranking import us_text
from fastverify.tune.verify_time import change_pct

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
