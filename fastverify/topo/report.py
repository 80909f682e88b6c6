"""Terminal output of ``fastverify topo``."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from fastverify.topo.diagnose import Diagnosis


def print_diagnosis(d: Diagnosis, console: Console | None = None) -> None:
    """Print the diagnosis in words a user acts on: actions first, then the evidence."""
    c = console or Console(width=None if sys.stdout.isatty() else 130)
    c.print(f"# fastverify topo: {d.n_gpus} GPU(s); from {', '.join(d.sources)}; NCCL {d.nccl_version or 'version unknown'}",
            markup=False)
    c.print(f"# NCCL_P2P_LEVEL now: {d.p2p_level_now} ({d.p2p_level_now_source}); recommended: "
            f"{d.p2p_level_recommended or 'no change'}", markup=False)
    c.print("what to do:", style="bold")
    for a in d.actions:
        c.print(f"  - {a}", markup=False)

    if d.pairs:
        by: dict[tuple, list[str]] = {}
        for p in d.pairs:
            key = (p.link or "?", p.nccl_path or "?", p.transport_now, "seen in log" if p.seen else "predicted",
                   p.transport_recommended, {True: "yes", False: "no", None: "unknown"}[p.hw_p2p])
            by.setdefault(key, []).append(f"{p.a}-{p.b}")
        t = Table(title="GPU pairs", title_justify="left")
        for col in ("pairs", "nvidia-smi", "NCCL path", "transport now", "basis", "recommended", "driver P2P"):
            t.add_column(col, overflow="fold")
        for key, names in by.items():
            t.add_row(" ".join(names), *key)
        c.print(t)

    for name, info in (("FlashInfer PCIe IPC all-reduce", d.pcie_ipc_allreduce),
                       ("SGLang custom all-reduce", d.custom_allreduce)):
        verdict = {True: "can run", False: "cannot run", None: "unknown"}[info["possible"]]
        c.print(f"{name}: {verdict} - {info['reason']}", markup=False)

    for f in d.findings:
        c.print(f"setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}" + (f" -> {f.fix}" if f.fix else ""),
                markup=False, style="yellow" if f.severity.value == "warning" else "red")
    for n in d.log_notes:
        c.print(f"log: {n}", markup=False)

    if d.predictions:
        t = Table(title="verify all-reduce, PREDICTED (not measured)", title_justify="left")
        for col in ("tokens", "bytes", "now µs", "now algo", "recommended µs", "recommended algo"):
            t.add_column(col, justify="right", overflow="fold")
        for p in d.predictions:
            t.add_row(str(p.tokens), f"{p.msg_bytes:,}", f"{p.now_us:,.1f}", p.now_algo_proto,
                      f"{p.recommended_us:,.1f}", p.recommended_algo_proto)
        c.print(t)
        c.print(f"# {d.prediction_note}", markup=False)
