"""``fastverify topo``: read the box's evidence (NVML, or ``nvidia-smi topo -m`` text, an NCCL_DEBUG
log, an ``all_reduce_perf`` table), evaluate ``--set`` NCCL settings strictly, and print the
diagnosis (:func:`fastverify.topo.diagnose.diagnose`) as text or JSON.

Its recommendation ("what to do", JSON ``advice``) is the ranking ``tune --predict`` prints
(:func:`fastverify.tune.advice.rank_options`, rendered by :mod:`fastverify.topo.advice_text`), for
the workload of ``--model``/``--tp``/``--draft-tokens``/``--batch`` (without ``--model``: one
all-reduce of each verify size, counts per step unknown). Without a topology there is no ranking,
and one line says so."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS
from fastverify.errors import UserError, path_text, shown
from fastverify.output_paths import path_arg


def add_arguments(p: argparse.ArgumentParser, bounded) -> None:
    """The ``topo`` subcommand's flags (``bounded`` is the CLI's int-range parser)."""
    p.add_argument("--topology", "--nvidia-smi", dest="topology", type=path_arg, metavar="FILE",
                      help="output of `nvidia-smi topo -m` (--nvidia-smi: the same flag)")
    p.add_argument("--nccl-log", type=path_arg, metavar="FILE",
                      help="NCCL_DEBUG=INFO log (NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV gives the most)")
    p.add_argument("--perf-table", type=path_arg, metavar="FILE",
                      help="output of nccl-tests all_reduce_perf on this box (measured NCCL times; MPI-prefixed is fine)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                      help="evaluate this NCCL setting as if it were in the environment (repeatable); "
                           "an unknown name or a value NCCL rejects is an error")
    p.add_argument("--hidden", type=bounded(1, 1 << 17), default=None,
                   help="model hidden size (verify message = tokens x hidden x 2 B) [default: --model's, else 7168]")
    p.add_argument("--draft-tokens", "--speculative-num-draft-tokens", type=bounded(1, MAX_DRAFT_TOKENS), default=4, help="draft tokens per request")
    p.add_argument("--batch", type=bounded(1, MAX_BATCH), nargs="+", default=None,
                   help="verify batch sizes [default: 1 2 4 8 16 32; with --model one batch, default 1]")
    p.add_argument("--model", default=None,
                   help="preset (tiny, kimi-k2, kimi-k2.5, deepseek-v3) or config.json: the advice then ranks options per verify "
                        "step of this model, as `fastverify tune --predict --model` does")
    p.add_argument("--tp", "--tp-size", type=bounded(2, 64), default=None,
                   help="tensor-parallel world size of the advice's workload [default: the box's GPU count]")
    from fastverify.topo.boxfacts import add_box_arguments

    add_box_arguments(p, bounded)
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def read_text(path: Path, kind: str = "text") -> str:
    from fastverify.inputs import read_text as read

    return read(path, kind=kind, errors="replace")


def run(args: argparse.Namespace) -> int:
    import os

    from fastverify.topo.diagnose import diagnose

    for item in args.set:  # the form first, before reading any input
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise UserError(f"--set {item!r}: expected NAME=VALUE, e.g. NCCL_P2P_LEVEL=SYS")
        if value == "":  # refused as the env file refuses it (fastverify/tune/envfile.py)
            raise UserError(f"--set {item!r}: {name} has an empty value (leave the setting out instead)")
    config = _model_config(args)  # a bad --model or --batch/--hidden against it: refused before any input is read
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
    _apply_sets(args, env, log, version)
    from fastverify.topo.boxfacts import resolve_args

    gpus = len(topo.gpus) if topo is not None else (log.n_ranks if log is not None else None)
    facts = resolve_args(args, topology_gpus=gpus)
    if args.tp is not None and topo is not None and args.tp > len(topo.gpus):
        raise UserError(f"--tp {args.tp}: {topo.source} has {len(topo.gpus)} GPUs")
    from fastverify.topo.diagnose import DEFAULT_BATCHES, DEFAULT_HIDDEN

    hidden = args.hidden or (config.hidden_size if config is not None else DEFAULT_HIDDEN)
    d = diagnose(topo, log, env, nccl_version=version, hidden=hidden, draft_tokens=args.draft_tokens,
                 batches=tuple(args.batch or DEFAULT_BATCHES), pcie_gen=args.pcie_gen, sm=args.sm, perf=perf)
    d = _advise(args, d, config, topo, log, perf, env, log.version if log and log.version else version, hidden)
    if args.json:
        import orjson

        doc = {"box": facts.as_dict(), **d.as_dict()}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        from fastverify.topo.report import print_diagnosis

        print(shown(facts.first_line(), limit=None))
        print_diagnosis(d)
    return 0


def _model_config(args):
    """``--model``'s shapes (:func:`fastverify.live.config.load_model_config`), or None without it.

    Raises
    ------
    UserError
        A model that cannot be read; several ``--batch`` sizes with ``--model`` (its workload is one
        verify step); ``--hidden`` other than the model's.
    """
    if args.model is None:
        return None
    if args.batch is not None and len(args.batch) > 1:
        raise UserError(f"--batch {' '.join(map(str, args.batch))}: with --model the advice ranks one verify step; "
                        "give one batch size (run topo once per batch)")
    from fastverify.live.config import load_model_config

    config = load_model_config(args.model)
    if args.hidden is not None and args.hidden != config.hidden_size:
        raise UserError(f"--hidden {args.hidden}: --model {args.model} has hidden size {config.hidden_size}; "
                        "drop one of the two")
    return config


def _workload(args, config, tp: int, hidden: int):
    """The workload the advice ranks options for: ``config``'s verify step at ``tp``
    (:func:`fastverify.tune.workload.workload_from_model`, as ``tune --model`` builds it), or
    without a model one all-reduce of each verify size ``batch × draft_tokens × hidden × 2`` B
    (bf16; counts per step unknown). Returns (workload, counts_known)."""
    import dataclasses

    from fastverify.live.config import preset_names
    from fastverify.topo.diagnose import DEFAULT_BATCHES
    from fastverify.tune.workload import DTYPE_BYTES, Workload, workload_from_model

    if config is not None:
        batch = args.batch[0] if args.batch else 1
        w = workload_from_model(config, tp=tp, draft_tokens=args.draft_tokens, batch=batch)
        if args.model in preset_names():  # the package's own file: its absolute path says nothing portable
            w = dataclasses.replace(w, source=w.source.replace(f" ({config.source})", " (fastverify preset)"))
        return dataclasses.replace(w, source=path_text(w.source)), True
    batches = sorted(set(args.batch or DEFAULT_BATCHES))
    sizes = tuple((b * args.draft_tokens * hidden * DTYPE_BYTES, 1) for b in batches)
    one = len(batches) == 1
    return Workload(msg_sizes=sizes, hidden=hidden, tp=tp, tokens=batches[0] * args.draft_tokens if one else None,
                    draft_tokens=args.draft_tokens, batch=batches[0] if one else None,
                    source=f"verify sizes of batch {', '.join(map(str, batches))} x {args.draft_tokens} draft tokens "
                           f"x hidden {hidden}, tp {tp}, one all-reduce each"), False


def _advise(args, d, config, topo, log, perf, env, version, hidden):
    """``d`` with the shared ranking as its recommendation (:func:`fastverify.topo.diagnose.with_advice`);
    without a topology, or with fewer than 2 GPUs, one line saying why there is none."""
    from fastverify.topo.advice_text import build_advice
    from fastverify.topo.diagnose import with_advice

    tp = args.tp or (len(topo.gpus) if topo is not None else 0)
    if topo is not None and tp < 2:
        return with_advice(d, log, None, [f"no ranking of options: {topo.source} has {len(topo.gpus)} GPU(s); "
                                          "an all-reduce needs 2 or more"])
    workload, counts_known = _workload(args, config, tp, hidden) if topo is not None else (None, False)
    from fastverify.nccl.version import NcclVersion

    nv = NcclVersion.parse(version) if version else None
    hint = ""
    if topo is not None:
        where = (f"--topology {path_text(args.topology)}" if args.topology else "(NVML)") + \
            (f" --nccl-log {path_text(args.nccl_log)}" if args.nccl_log else "") + \
            (f" --perf-table {path_text(args.perf_table)}" if args.perf_table and perf is not None else "")
        draft = f" --draft-tokens {args.draft_tokens}" if args.draft_tokens != 4 else ""
        if args.model:
            batch = f" --batch {args.batch[0]}" if args.batch else ""
            hint = (f"the same ranking, with ranges and tok/s: `fastverify tune --predict {where} --model {path_text(args.model)} "
                    f"--tp {tp}{draft}{batch} --sm {args.sm} --pcie-gen {args.pcie_gen}`")
        else:
            hint = (f"per verify step, with ranges and tok/s: `fastverify tune --predict {where} --model MODEL "
                    f"--tp {tp}{draft} --batch N --sm {args.sm} --pcie-gen {args.pcie_gen}`")
    entries, notes = build_advice(workload, topo, counts_known=counts_known, env=env, nccl_version=nv, sm=args.sm,
                                  pcie_gen=args.pcie_gen, perf=perf, log=log, tune_hint=hint,
                                  no_p2p_pairs=tuple(f"{p.a}-{p.b}" for p in d.pairs if p.hw_p2p is False))
    return with_advice(d, log, entries, notes)


def _apply_sets(args, env: dict, log, version: str | None) -> None:
    """The ``--set`` values into ``env``, each checked strictly, then against each other and the
    environment (MIN over MAX channels, ...). Raises UserError for a value NCCL rejects."""
    from fastverify.nccl.catalogue import Severity, validate_setting

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
