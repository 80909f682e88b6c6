"""The short terminal table printed by ``fastverify profile``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fastverify.console import cell, say, stdout_console


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}"


def print_profile(profile: dict, console: Console | None = None) -> None:
    """Print the per-rank split, the per-step medians and the all-reduce sizes.

    ``profile`` is the record as plain dicts (:func:`fastverify.profile.build.as_builtins`)."""
    console = console or stdout_console()
    clock = profile["timing"]["clock"]
    say(console, f"# fastverify profile: {profile['source']['kind']}, {len(profile['ranks'])} rank(s), clock: {clock}")
    src = profile["source"]
    if src["kind"] == "live":
        line = (
            f"# live: {src['model']}, TP {src['tp']}, batch {src['batch']} x {src['draft_tokens']} draft tokens "
            f"= {src['tokens']} tokens x hidden {src['hidden']} {src['dtype']}, all-reduce backend "
            f"{src['backend']} on {src['device']}/{src['dist_backend']}"
        )
        if src.get("n_routed_experts"):
            line += (
                f"; {src['experts_allocated']} of {src['n_routed_experts']} routed experts allocated "
                "(all that the tokens' top-k can reach)"
            )
        say(console, line)
    if clock in ("cpu_wall_clock", "cpu_trace"):
        console.print("# [bold]CPU timings over gloo: these are NOT GPU timings[/bold]")
    t = Table(title="per TP rank (whole window)", title_justify="left")
    for col in (
        "rank",
        "window µs",
        "compute µs",
        "all-reduce µs",
        "#AR",
        "AR wait µs",
        "other comm µs",
        "memory µs",
        "idle µs",
        "exposed comm µs",
        "AR % of busy",
    ):
        t.add_column(col, justify="right", overflow="fold")
    for r in profile["ranks"]:
        share = 100.0 * r["allreduce_us"] / r["busy_us"] if r["busy_us"] else None
        t.add_row(
            cell(r["rank"]),
            _fmt(r["window_us"]),
            _fmt(r["compute_us"]),
            _fmt(r["allreduce_us"]),
            cell(r["allreduce_count"]),
            _fmt(r.get("allreduce_wait_us")),
            _fmt(r["other_comm_us"]),
            _fmt(r["memory_us"]),
            _fmt(r["idle_us"]),
            _fmt(r["exposed_comm_us"]),
            _fmt(share),
        )
    console.print(t)

    steps = [r for r in profile["ranks"] if r.get("step_median")]
    if steps:
        t = Table(title="per step (median over steps)", title_justify="left")
        for col in ("rank", "steps", "step µs", "compute µs", "all-reduce µs", "#AR", "exposed comm µs"):
            t.add_column(col, justify="right", overflow="fold")
        for r in steps:
            m = r["step_median"]
            t.add_row(
                cell(r["rank"]),
                cell(m["steps"]),
                _fmt(m["window_us"]),
                _fmt(m["compute_us"]),
                _fmt(m["allreduce_us"]),
                f"{m['allreduce_count']:g}",
                _fmt(m["exposed_comm_us"]),
            )
        console.print(t)

    sizes = profile["allreduce_by_msg_size"]
    if sizes:
        t = Table(title="all-reduce by message size (all ranks)", title_justify="left")
        for col in ("bytes", "count", "median µs", "p90 µs", "sum µs"):
            t.add_column(col, justify="right", overflow="fold")
        for s in sizes:
            t.add_row(
                "unknown" if s["msg_bytes"] is None else f"{s['msg_bytes']:,}",
                cell(s["count"]),
                _fmt(s["median_us"]),
                _fmt(s["p90_us"]),
                _fmt(s["sum_us"]),
            )
        console.print(t)
    positions = sorted(profile["allreduce_by_position"], key=lambda r: -r["median_us"])[:5]
    if positions:
        t = Table(
            title="slowest all-reduce positions in a step (layer view, median over steps and ranks)",
            title_justify="left",
        )
        for col in ("position", "label", "bytes", "count", "median µs", "p90 µs"):
            t.add_column(col, justify="right", overflow="fold")
        for r in positions:
            t.add_row(
                cell(r["position"]),
                cell(r["label"] or "-"),
                "-" if r["msg_bytes"] is None else f"{r['msg_bytes']:,}",
                cell(r["count"]),
                _fmt(r["median_us"]),
                _fmt(r["p90_us"]),
            )
        console.print(t)
    xr = profile["cross_rank"]
    if xr["matched"]:
        say(
            console,
            f"# {xr['matched']} collectives matched across ranks; straggler (most often last to "
            f"arrive): TP rank {xr['straggler_rank']}",
        )
    for w in profile["warnings"]:
        say(console, f"# warning: {w}", style="yellow")  # warnings quote the traces (file and kernel names)
