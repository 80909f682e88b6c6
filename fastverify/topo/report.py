"""Terminal output of ``fastverify topo``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fastverify.console import cell, say, stdout_console
from fastverify.topo.advice_text import advice_lines, level_line
from fastverify.topo.diagnose import Diagnosis


def print_diagnosis(d: Diagnosis, console: Console | None = None) -> None:
    """Print the diagnosis in words a user acts on: the ranked options (:mod:`fastverify.topo.advice_text`)
    and the actions first, then the evidence. Every line and cell that can quote an input (file
    names, log lines, settings' values) goes through :func:`fastverify.console.say` / ``cell``."""
    c = console or stdout_console(130)
    gpus = f"{d.n_gpus} GPU(s)" if d.n_gpus else "GPU count unknown from this input"
    say(c, f"# fastverify topo: {gpus}; from {', '.join(d.sources)}; NCCL {d.nccl_version or 'version unknown'}")
    say(c, level_line(d))
    c.print("what to do:", style="bold")
    for line in advice_lines(d.advice, d.advice_notes):
        say(c, f"  {line}")
    for a in d.actions:
        say(c, f"  - {a}")
    for w in d.warnings:
        say(c, f"warning: {w}", style="yellow")

    if d.pairs:
        by: dict[tuple, list[str]] = {}
        for p in d.pairs:
            key = (p.link or "?", p.nccl_path or "?", p.transport_now,
                   p.basis or ("seen in log" if p.seen else "predicted"),
                   p.transport_recommended, {True: "yes", False: "no", None: "unknown"}[p.hw_p2p])
            by.setdefault(key, []).append(f"{p.a}-{p.b}")
        t = Table(title="GPU pairs", title_justify="left")
        for col in ("pairs", "nvidia-smi", "NCCL path", "transport now", "basis", "recommended", "driver P2P"):
            t.add_column(col, overflow="fold")
        for key, names in by.items():
            t.add_row(cell(" ".join(names)), *map(cell, key))
        c.print(t)

    for name, info in (("FlashInfer PCIe IPC all-reduce", d.pcie_ipc_allreduce),
                       ("SGLang custom all-reduce", d.custom_allreduce)):
        verdict = {True: "can run", False: "cannot run", None: "unknown"}[info["possible"]]
        say(c, f"{name}: {verdict} - {info['reason']}")

    for f in d.findings:
        say(c, f"setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}" + (f" -> {f.fix}" if f.fix else ""),
            style="yellow" if f.severity.value == "warning" else "red")
    for n in d.log_notes:
        say(c, f"log: {n}")

    if d.predictions:
        t = Table(title="verify all-reduce, PREDICTED (not measured)", title_justify="left")
        for col in ("tokens", "bytes", "now µs", "now algo", "recommended µs", "recommended algo"):
            t.add_column(col, justify="right", overflow="fold")
        for p in d.predictions:
            t.add_row(cell(p.tokens), f"{p.msg_bytes:,}", f"{p.now_us:,.1f}", cell(p.now_algo_proto),
                      f"{p.recommended_us:,.1f}", cell(p.recommended_algo_proto))
        c.print(t)
        say(c, f"# {d.prediction_note}")

    _print_evidence(d, c)


def _print_evidence(d: Diagnosis, c: Console) -> None:
    """The user's own measurements and NCCL's own TUNING lines, each naming its source."""
    if d.perf_table:
        p = d.perf_table
        ranks = f"{p['n_ranks']} ranks" if p["n_ranks"] else "ranks unknown"
        gpus = f" on {', '.join(p['devices'])}" if p["devices"] else ""
        avg = f", footer average busBw {p['avg_busbw_gbps']:g} GB/s" if p["avg_busbw_gbps"] is not None else ""
        say(c, f"all_reduce_perf {p['source']} (measured): {p['rows']} sizes {p['min_bytes']:,}-{p['max_bytes']:,} B, "
                f"{ranks}{gpus}, {'/'.join(p['dtypes'])} {'/'.join(p['redops'])}; {p['time_us_at_min']:g} µs at the "
                f"smallest, {p['time_us_at_max']:g} µs at the largest; peak busBw {p['peak_busbw_gbps']:g} GB/s at "
                f"{p['peak_busbw_bytes']:,} B{avg}")
    if d.measured:
        t = Table(title=cell(f"verify all-reduce, MEASURED by NCCL all_reduce_perf ({d.measured[0]['source']})"),
                  title_justify="left")
        for col in ("tokens", "bytes", "NCCL µs", "column", "basis"):
            t.add_column(col, justify="right", overflow="fold")
        for m in d.measured:
            t.add_row(cell(m["tokens"]), f"{m['msg_bytes']:,}", "-" if m["time_us"] is None else f"{m['time_us']:,.1f}",
                      cell(m.get("column") or "-"), cell(m["basis"]))
        c.print(t)
        say(c, "# the in-place column: SGLang's NCCL all-reduce writes into its input")
    tu = d.nccl_tuning
    if tu:
        if tu["model_table"]:
            cells = ", ".join(f"{r['algo']}/{r['proto']} {r['latency_us']:g} µs + size/{r['algbw_gbps']:g} GB/s"
                              for r in tu["model_table"])
            say(c, f"NCCL's model table (TUNING, AllReduce): {cells}")
            t = Table(title="NCCL's model table from the log (TUNING, AllReduce; NCCL's own numbers)",
                      title_justify="left")
            for col in ("algorithm", "protocol", "latency µs", "algBw GB/s"):
                t.add_column(col, justify="right")
            for r in tu["model_table"]:
                bw = f"{r['algbw_gbps']:g}" if r["algbw_gbps"] > 0 else "0 (never picked)"
                t.add_row(cell(r["algo"]), cell(r["proto"]), f"{r['latency_us']:g}", bw)
            c.print(t)
        if tu["verify_choice"]:
            t = Table(title="verify all-reduce, NCCL's own model table from the log, PREDICTED", title_justify="left")
            for col in ("tokens", "bytes", "NCCL picks", "model µs"):
                t.add_column(col, justify="right")
            for v in tu["verify_choice"]:
                t.add_row(cell(v["tokens"]), f"{v['msg_bytes']:,}", cell(v["algo_proto"]), f"{v['time_us']:,.1f}")
            c.print(t)
        if tu["launched"]:
            shown = tu["launched"][:12]
            more = f" (+{len(tu['launched']) - 12} more)" if len(tu["launched"]) > 12 else ""
            say(c, "NCCL's choice per launched all-reduce: " + ", ".join(
                f"{x['size_bytes']:,} B -> {x['algo']}/{x['proto']}" + (f" ({x['time_us']:g} µs model)"
                                                                        if x["time_us"] is not None else "")
                for x in shown) + more)
        say(c, f"# {tu['basis']}")
