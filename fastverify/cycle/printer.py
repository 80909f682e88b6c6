"""The text of ``fastverify report``: the cycle split per mode, the flags with their evidence, and
the answer table (removable by a faster all-reduce vs not). Reads the report document
(:func:`fastverify.cycle.command.document`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fastverify.console import cell, say, stdout_console

_ORDER = ("draft", "verify", "draft_extend", "extend", "decode", "other", "outside")


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _modes_table(doc: dict) -> Table:
    split = doc["cycles"]
    t = Table(title=cell(f"per cycle, mean over {len(split['ranks'])} TP rank(s), ms (cycle starts at each "
                         f"{split['anchor']}; clock: {split['clock']})"), title_justify="left")
    idle = "GPU idle" if split["clock"] == "trace" else "idle"
    for col in ("mode", "forwards", "compute", "#AR", "AR transfer", "AR wait", "last to arrive", "AR unmatched",
                "other comm", "memory", idle):
        t.add_column(col, justify="right")
    means = doc["modes_mean_us"]
    for mode in sorted(means, key=_ORDER.index):
        m = means[mode]
        s = split.get("straggler_by_mode", {}).get(mode)
        last = cell(f"TP {s['rank']}: {s['last']}/{s['waited']}") if s else "-"
        t.add_row(cell(mode), f"{m['forwards']:g}", _ms(m["compute_us"]), f"{m['allreduce_count']:g}",
                  _ms(m["transfer_us"]), _ms(m["wait_us"]), last, _ms(m["unmatched_us"]), _ms(m["other_comm_us"]),
                  _ms(m["memory_us"]), _ms(m["idle_us"]))
    between = sum(r["between_idle_us"] for r in split["ranks"]) / max(len(split["ranks"]), 1)
    t.add_row("between forwards", "", "", "", "", "", "", "", "", "", _ms(between))
    return t


def print_report(doc: dict, console: Console | None = None) -> None:
    """Print the report document ``doc`` (plain dicts). Every line that quotes the bundle (its
    name, host, flags' evidence, notes) goes through :func:`fastverify.console.say`."""
    console = console or stdout_console()
    host = doc.get("host") or {}
    say(console, f"# fastverify report: {doc['bundle']} (collected {doc['collected_utc']} on "
                 f"{host.get('hostname', '?')})")
    if doc["cycles"]:
        split = doc["cycles"]
        if split["clock"] != "trace":
            console.print("# [bold]CPU timings (a CPU server's trace): these are NOT GPU timings[/bold]")
        cyc = [r["cycle_mean_us"] for r in split["ranks"]]
        say(console, f"# {split['ranks'][0]['cycles']} complete cycles per rank; cycle {_ms(sum(cyc) / len(cyc))} ms "
                     f"(mean over ranks); {split['matched']} all-reduces matched across ranks")
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
    from fastverify.cycle.draft_section import print_draft_section

    print_draft_section(doc.get("draft_shape"), console)
