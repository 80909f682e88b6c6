"""``fastverify report BUNDLE``: read a bundle of ``fastverify collect`` anywhere (no GPU) and say
where each speculative cycle's time goes, what is anomalous (with the evidence) and how much a
faster all-reduce can remove. Text (default), ``--json`` (one document), ``--png`` (the split).

The text (:func:`print_report`): the cycle split per mode, the flags with their evidence, and the
answer table (removable by a faster all-reduce vs not), read from the report document
(:func:`document`). The PNG (:func:`plot_cycle`): one stacked bar per forward mode (compute,
all-reduce transfer, all-reduce wait, other, GPU idle), ms per cycle, mean over TP ranks.

The draft-shape section of ``fastverify report``: when the bundle's verify-log part carries
``accepted`` (per request accepted draft tokens, :mod:`fastverify.patch.verify`), the accept
length by chain depth (derived: ``E[min(A, k)] + 1``, exact for topk 1) and the recommended depth
of :mod:`fastverify.tune.draft_shape` (verify cost from the records, draft cost from the trace).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import msgspec
import orjson
from rich.console import Console
from rich.table import Table

from fastverify.bundle import open_bundle
from fastverify.console import cell, say, stdout_console
from fastverify.cycle.bundle_evidence import evidence
from fastverify.cycle.flags import Answer, Evidence, Flag, answer, flags, mode_means
from fastverify.cycle.split import CycleSplit
from fastverify.errors import UserError, printable
from fastverify.outputs import check_outputs, claim_output, output_arg, path_arg
from fastverify.tune import draft_shape
from fastverify.tune.draft_model import DraftCost, DraftShapeReport, recommend
from fastverify.tune.draft_shape import from_bundle


def draft_section(bundle_path: str | Path, split=None) -> dict | None:
    """The section as plain dicts (:class:`fastverify.tune.draft_model.DraftShapeReport`), or
    None when the bundle has no verify records with ``accepted``; ``{"error": one line}`` when
    they cannot be read (the rest of the report stands). ``split``: the report's cycle split
    (:class:`fastverify.cycle.split.CycleSplit`), so the trace is not read twice."""
    try:
        hist, curve, draft, notes = from_bundle(bundle_path, split)  # a path or an opened Bundle
    except UserError as e:
        return None if "no verify-log part" in str(e) else {"error": str(e)}
    if hist is None or not curve.points:
        return None
    draft = draft or DraftCost(draft_step_ms=0.0, draft_extend_ms=0.0, label="assumed", source="none in the trace")
    return msgspec.to_builtins(recommend(hist, curve, draft, sources=[curve.source, draft.source], notes=notes))


def print_draft_section(section: dict | None, console) -> None:
    """Print the section under the report (nothing when it is None)."""
    if section is None:
        return
    if "error" in section:
        say(console, f"# draft shape: not read ({section['error']})")
        return
    console.print("[bold]draft shape[/bold] (accept length by depth: derived from the verify records' accepted)")
    draft_shape.print_report(msgspec.convert(section, DraftShapeReport), console)


SCHEMA = "fastverify.cycle_report"
SCHEMA_VERSION = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=path_arg, metavar="BUNDLE", help="the .tar.gz written by `fastverify collect`")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the text")
    p.add_argument(
        "--png", type=output_arg, default=None, metavar="PATH", help="also draw the cycle split per mode (a new file)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing --png file")


def document(bundle, ev: Evidence, found: list[Flag], ans: Answer | None, notes: list[str]) -> dict:
    """The report as one JSON-ready dict."""
    split: CycleSplit | None = ev.split
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "bundle": str(bundle.path),
        "collected_utc": bundle.manifest.created_utc,
        "host": bundle.manifest.host,
        "clock": split.clock if split else None,
        "world_size": ev.world_size,
        "verify_msg_bytes": ev.msg_bytes,
        "cycles": msgspec.to_builtins(split) if split else None,
        "modes_mean_us": mode_means(split) if split else None,
        "flags": [msgspec.to_builtins(f) for f in found],
        "answer": msgspec.to_builtins(ans) if ans else None,
        "sources": ev.sources,
        "notes": notes,
    }


def run(args: argparse.Namespace) -> int:
    if args.force and args.png is None:
        raise UserError("--force replaces an existing --png file; it does not apply without --png")
    if args.png is not None:
        check_outputs({"--png": args.png}, {"BUNDLE": args.bundle})
        claim_output(args.png, "--png", force=args.force)  # an existing file only with --force
    with open_bundle(args.bundle) as bundle:  # one pass over the archive; its copies removed after
        ev, notes = evidence(bundle)
        if args.png is not None and ev.split is None:
            raise UserError(f"--png {args.png}: the bundle has no cycles to draw ({notes[0] if notes else 'no trace'})")
        found = flags(ev)
        ans = answer(ev, found)
        doc = document(bundle, ev, found, ans, notes)
        doc["draft_shape"] = draft_section(bundle, ev.split)  # the opened bundle: not read again
    if args.png is not None:  # drawn before anything is printed: a failure leaves no half output
        plot_cycle(doc, args.png)
    if args.json:
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        print_report(doc)
        if args.png is not None:
            sys.stdout.write(f"wrote {printable(args.png)}\n")
    return 0


# --- the text -------------------------------------------------------------------------------------------

_ORDER = ("draft", "verify", "draft_extend", "extend", "decode", "other", "outside")


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _modes_table(doc: dict) -> Table:
    split = doc["cycles"]
    t = Table(
        title=cell(
            f"per cycle, mean over {len(split['ranks'])} TP rank(s), ms (cycle starts at each "
            f"{split['anchor']}; clock: {split['clock']})"
        ),
        title_justify="left",
    )
    idle = "GPU idle" if split["clock"] == "trace" else "idle"
    for col in (
        "mode",
        "forwards",
        "compute",
        "#AR",
        "AR transfer",
        "AR wait",
        "last to arrive",
        "AR unmatched",
        "other comm",
        "memory",
        idle,
    ):
        t.add_column(col, justify="right")
    means = doc["modes_mean_us"]
    for mode in sorted(means, key=_ORDER.index):
        m = means[mode]
        s = split.get("straggler_by_mode", {}).get(mode)
        last = cell(f"TP {s['rank']}: {s['last']}/{s['waited']}") if s else "-"
        t.add_row(
            cell(mode),
            f"{m['forwards']:g}",
            _ms(m["compute_us"]),
            f"{m['allreduce_count']:g}",
            _ms(m["transfer_us"]),
            _ms(m["wait_us"]),
            last,
            _ms(m["unmatched_us"]),
            _ms(m["other_comm_us"]),
            _ms(m["memory_us"]),
            _ms(m["idle_us"]),
        )
    between = sum(r["between_idle_us"] for r in split["ranks"]) / max(len(split["ranks"]), 1)
    t.add_row("between forwards", "", "", "", "", "", "", "", "", "", _ms(between))
    return t


def print_report(doc: dict, console: Console | None = None) -> None:
    """Print the report document ``doc`` (plain dicts). Every line that quotes the bundle (its
    name, host, flags' evidence, notes) goes through :func:`fastverify.console.say`."""
    console = console or stdout_console()
    host = doc.get("host") or {}
    say(
        console,
        f"# fastverify report: {doc['bundle']} (collected {doc['collected_utc']} on {host.get('hostname', '?')})",
    )
    if doc["cycles"]:
        split = doc["cycles"]
        if split["clock"] != "trace":
            console.print("# [bold]CPU timings (a CPU server's trace): these are NOT GPU timings[/bold]")
        cyc = [r["cycle_mean_us"] for r in split["ranks"]]
        say(
            console,
            f"# {split['ranks'][0]['cycles']} complete cycles per rank; cycle {_ms(sum(cyc) / len(cyc))} ms "
            f"(mean over ranks); {split['matched']} all-reduces matched across ranks",
        )
        console.print(_modes_table(doc))
    console.print("[bold]flags[/bold]" if doc["flags"] else "flags: none")
    for f in doc["flags"]:
        say(console, f"- [{f['kind']}] {f['finding']}")
        for e in f["evidence"]:  # evidence quotes the bundle (device names, file names, P2P reasons)
            say(console, f"    evidence: {e}")
        say(console, f"    fix: {f['fix']}")
    ans = doc["answer"]
    if ans:
        t = Table(title="the answer, per cycle (ms)", title_justify="left")
        t.add_column("", justify="left")
        t.add_column("ms", justify="right")
        t.add_row("cycle", f"{ans['cycle_ms']:.3f}")
        t.add_row("removable by a faster all-reduce (transfer)", f"{ans['removable_ms']:.3f}")
        for k, v in ans["not_removable_ms"].items():
            t.add_row(cell(f"not removable by it: {k}"), f"{v:.3f}")
        console.print(t)
        say(console, f"next: {ans['next_action']}")
        for a in ans["actions"]:
            say(console, f"  - {a}")
        say(console, f"# {ans['basis']}")
    for n in doc["notes"]:
        say(console, f"# note: {n}")
    print_draft_section(doc.get("draft_shape"), console)


# --- the PNG --------------------------------------------------------------------------------------------

_PARTS = (
    ("compute_us", "compute", "#4C72B0"),
    ("transfer_us", "all-reduce transfer", "#DD8452"),
    ("wait_us", "all-reduce wait", "#C44E52"),
    ("unmatched_us", "all-reduce (unmatched)", "#937860"),
    ("other_comm_us", "other comm", "#8172B3"),
    ("memory_us", "memory", "#64B5CD"),
    ("idle_us", "GPU idle", "#BBBBBB"),
)


def plot_cycle(doc: dict, path: Path) -> None:
    """Draw the report document's mode split to ``path`` (atomic: a temporary file, then rename).

    Raises
    ------
    UserError
        The file cannot be written.
    """
    from fastverify.profile.plot import Figure, FigureCanvasAgg  # lazy: matplotlib

    means = doc["modes_mean_us"]
    modes = list(means) + ["between forwards"]
    between = sum(r["between_idle_us"] for r in doc["cycles"]["ranks"]) / max(len(doc["cycles"]["ranks"]), 1)
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(modes)
    for key, label, color in _PARTS:
        vals = [means[m][key] / 1000 for m in modes[:-1]] + [between / 1000 if key == "idle_us" else 0.0]
        ax.bar(modes, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per cycle")
    ans = doc.get("answer") or {}
    ax.set_title(
        f"speculative cycle {ans.get('cycle_ms', 0):.3f} ms: removable by a faster all-reduce "
        f"{ans.get('removable_ms', 0):.3f} ms (clock: {doc['cycles']['clock']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.png", dir=path.parent)
        os.close(fd)
        try:
            fig.savefig(tmp, format="png", dpi=110)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        raise UserError(f"{path}: cannot write the PNG ({e.strerror or e})") from None
