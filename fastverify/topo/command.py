"""``fastverify topo``: read the box's evidence (NVML, or ``nvidia-smi topo -m`` text, an NCCL_DEBUG
log, an ``all_reduce_perf`` table), evaluate ``--set`` NCCL settings strictly, and print the
diagnosis (:func:`fastverify.topo.diagnose.diagnose`) as text or JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS
from fastverify.errors import UserError, path_text


def add_arguments(p: argparse.ArgumentParser, bounded) -> None:
    """The ``topo`` subcommand's flags (``bounded`` is the CLI's int-range parser)."""
    p.add_argument("--topology", "--nvidia-smi", dest="topology", type=Path, metavar="FILE",
                      help="output of `nvidia-smi topo -m` (--nvidia-smi: the same flag)")
    p.add_argument("--nccl-log", type=Path, metavar="FILE",
                      help="NCCL_DEBUG=INFO log (NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV gives the most)")
    p.add_argument("--perf-table", type=Path, metavar="FILE",
                      help="output of nccl-tests all_reduce_perf on this box (measured NCCL times; MPI-prefixed is fine)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                      help="evaluate this NCCL setting as if it were in the environment (repeatable); "
                           "an unknown name or a value NCCL rejects is an error")
    p.add_argument("--hidden", type=bounded(1, 1 << 17), default=7168, help="model hidden size (verify message = tokens x hidden x 2 B)")
    p.add_argument("--draft-tokens", "--speculative-num-draft-tokens", type=bounded(1, MAX_DRAFT_TOKENS), default=4, help="draft tokens per request")
    p.add_argument("--batch", type=bounded(1, MAX_BATCH), nargs="+", default=[1, 2, 4, 8, 16, 32], help="verify batch sizes")
    from fastverify.topo.boxfacts import add_box_arguments

    add_box_arguments(p, bounded)
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def read_text(path: Path, kind: str = "text") -> str:
    from fastverify.inputs import read_text as read

    return read(path, kind=kind, errors="replace")


def run(args: argparse.Namespace) -> int:
    import os

    from fastverify.nccl.catalogue import Severity, validate_setting
    from fastverify.topo.diagnose import diagnose

    for item in args.set:  # the form first, before reading any input
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UserError(f"--set {item!r}: expected NAME=VALUE, e.g. NCCL_P2P_LEVEL=SYS")
        if value == "":  # refused as the env file refuses it (fastverify/tune/envfile.py)
            raise UserError(f"--set {item!r}: {name} has an empty value (leave the setting out instead)")
    topo = log = None
    if args.topology:
        from fastverify.topo.matrix import parse_nvidia_smi_topo

        topo = parse_nvidia_smi_topo(read_text(args.topology), source=path_text(args.topology))
    if args.nccl_log:
        from fastverify.nccl.logparse import parse_nccl_log

        text = read_text(args.nccl_log, "log")
        log = parse_nccl_log(text, source=path_text(args.nccl_log))
        cut = [p for p in log.problems if "cut off" in p]
        if cut:
            raise UserError(f"{args.nccl_log}: the log ends in the middle of a line (truncated?); "
                            "capture it again (or end it with a newline if it is complete)")
    perf = None
    if args.perf_table:
        from fastverify.nccl.perftable import parse_all_reduce_perf

        text = read_text(args.perf_table)
        perf = parse_all_reduce_perf(text, source=path_text(args.perf_table))
        if log is None and "NCCL INFO" in text:
            # NCCL_DEBUG=INFO shares all_reduce_perf's stdout: its lines are the run's NCCL log
            from fastverify.nccl.logparse import parse_nccl_log

            try:
                log = parse_nccl_log(text, source=path_text(args.perf_table))
            except UserError:
                log = None  # "NCCL INFO" only in a comment: the table stands alone
    if topo is None and log is None and perf is None:
        from fastverify.topo.nvml import read_nvml_topology

        topo = read_nvml_topology()  # UserError on a machine without GPUs names the offline options
    env = dict(os.environ)
    version = None
    if not (log and log.version):
        from fastverify.nccl.version import read_nccl_version

        found = read_nccl_version()
        version = str(found) if found else None
    for item in args.set:
        name, _, value = item.partition("=")
        from fastverify.nccl.version import NcclVersion

        finding = validate_setting(name, value, NcclVersion.parse(log.version if log and log.version else version)
                                   if (log and log.version) or version else None)
        if finding.severity is Severity.ERROR:
            raise UserError(f"--set {name}={value}: {finding.reason}" + (f" ({finding.fix})" if finding.fix else ""))
        env[name] = value
    if args.set:  # the --set values against each other and the environment (MIN over MAX channels, ...)
        from fastverify.nccl.catalogue import validate_settings

        given = {item.partition("=")[0] for item in args.set}
        ver = log.version if log and log.version else version
        for f in validate_settings({k: v for k, v in env.items() if k.startswith("NCCL_")},
                                   NcclVersion.parse(ver) if ver else None):
            if f.severity is Severity.ERROR and (f.name in given or any(g in f.reason for g in given)):
                raise UserError(f"--set {f.name}={f.value}: {f.reason}" + (f" ({f.fix})" if f.fix else ""))
    from fastverify.topo.boxfacts import resolve_args

    gpus = len(topo.gpus) if topo is not None else (log.n_ranks if log is not None else None)
    facts = resolve_args(args, topology_gpus=gpus)
    d = diagnose(topo, log, env, nccl_version=version, hidden=args.hidden, draft_tokens=args.draft_tokens,
                 batches=tuple(args.batch), pcie_gen=args.pcie_gen, sm=args.sm, perf=perf)
    if args.json:
        import orjson

        doc = {"box": facts.as_dict(), **d.as_dict()}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        from fastverify.topo.report import print_diagnosis

        print(facts.first_line())
        print_diagnosis(d)
    return 0
