"""``fastverify topo``: read the box's evidence (NVML, or ``nvidia-smi topo -m`` text, an NCCL_DEBUG
log, an ``all_reduce_perf`` table), evaluate ``--set`` NCCL settings strictly, diagnose it
(:func:`fastverify.topo.diagnose.diagnose`), rank the box's options, and print the result as text or
JSON.

The recommendation ("what to do", JSON ``advice``) is the ranking ``tune --predict`` prints
(:func:`fastverify.tune.advice.rank_options`), for the workload of ``--model``/``--tp``/
``--draft-tokens``/``--batch`` (without ``--model``: one all-reduce of each verify size, counts per
step unknown), as JSON entries and as the lines of "what to do", each saying where its evidence
stops. Without a topology there is no ranking, and one line says so. This module sits above both
:mod:`fastverify.topo` and :mod:`fastverify.tune`: it is the one place that joins the diagnosis to
tune's ranking.

An entry's ``change_pct`` is new − old over old, in % of the all-reduce time (−: less time);
``allreduce_us`` is per verify step for a model workload, and one all-reduce of each verify size
where the counts per step are unknown (no ``--model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from rich.console import Console
from rich.table import Table

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS
from fastverify.console import cell, say, stdout_console
from fastverify.errors import UserError, path_text, shown
from fastverify.inputs import read_text as read
from fastverify.live.config import load_model_config, preset_names
from fastverify.nccl.checks import apply_sets, split_set
from fastverify.nccl.debuglog import parse_nccl_log
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.nccl.version import NcclVersion, read_nccl_version
from fastverify.outputs import path_arg
from fastverify.registry import BackendName, backend_info
from fastverify.topo.box import add_box_arguments, resolve_args
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.topo.nvml import read_nvml_topology
from fastverify.tune.advice import prediction_p2p, rank_options
from fastverify.tune.workload import DTYPE_BYTES, Workload, workload_from_model

if TYPE_CHECKING:
    from fastverify.topo.diagnose import Diagnosis
    from fastverify.topo.matrix import Topology


def add_arguments(p: argparse.ArgumentParser, bounded) -> None:
    """The ``topo`` subcommand's flags (``bounded`` is the CLI's int-range parser)."""
    p.add_argument(
        "--topology",
        "--nvidia-smi",
        dest="topology",
        type=path_arg,
        metavar="FILE",
        help="output of `nvidia-smi topo -m` (--nvidia-smi: the same flag)",
    )
    p.add_argument(
        "--nccl-log",
        type=path_arg,
        metavar="FILE",
        help="NCCL_DEBUG=INFO log (NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV gives the most)",
    )
    p.add_argument(
        "--perf-table",
        type=path_arg,
        metavar="FILE",
        help="output of nccl-tests all_reduce_perf on this box (measured NCCL times; MPI-prefixed is fine)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="evaluate this NCCL setting as if it were in the environment (repeatable); "
        "an unknown name or a value NCCL rejects is an error",
    )
    p.add_argument(
        "--hidden",
        type=bounded(1, 1 << 17),
        default=None,
        help="model hidden size (verify message = tokens x hidden x 2 B) [default: --model's, else 7168]",
    )
    p.add_argument(
        "--draft-tokens",
        "--speculative-num-draft-tokens",
        type=bounded(1, MAX_DRAFT_TOKENS),
        default=4,
        help="draft tokens per request",
    )
    p.add_argument(
        "--batch",
        type=bounded(1, MAX_BATCH),
        nargs="+",
        default=None,
        help="verify batch sizes [default: 1 2 4 8 16 32; with --model one batch, default 1]",
    )
    p.add_argument(
        "--model",
        default=None,
        help="preset (tiny, kimi-k2, kimi-k2.5, deepseek-v3) or config.json: the advice then ranks options per verify "
        "step of this model, as `fastverify tune --predict --model` does",
    )
    p.add_argument(
        "--tp",
        "--tp-size",
        type=bounded(2, 64),
        default=None,
        help="tensor-parallel world size; below the box's GPU count the whole output is about the TP group, "
        "GPUs 0..N-1 (SGLang's default --base-gpu-id 0) [default: the box's GPU count]",
    )
    add_box_arguments(p, bounded)
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def read_text(path: Path, kind: str = "text") -> str:
    return read(path, kind=kind, errors="replace")


def run(args: argparse.Namespace) -> int:
    from fastverify.topo.diagnose import DEFAULT_BATCHES, DEFAULT_HIDDEN, diagnose  # lazy: numpy

    for item in args.set:  # the form first, before reading any input
        split_set(item)
    config = _model_config(args)  # a bad --model or --batch/--hidden against it: refused before any input is read
    topo = log = None
    if args.topology:
        topo = parse_nvidia_smi_topo(read_text(args.topology), source=path_text(args.topology))
    if args.nccl_log:
        text = read_text(args.nccl_log, "log")
        log = parse_nccl_log(text, source=path_text(args.nccl_log))
        cut = [p for p in log.problems if "cut off" in p]
        if cut:
            raise UserError(
                f"{args.nccl_log}: the log ends in the middle of a line (truncated?); "
                "capture it again (or end it with a newline if it is complete)"
            )
    perf = None
    if args.perf_table:
        text = read_text(args.perf_table)
        perf = parse_all_reduce_perf(text, source=path_text(args.perf_table))
        if log is None and "NCCL INFO" in text:
            # NCCL_DEBUG=INFO shares all_reduce_perf's stdout: its lines are the run's NCCL log
            try:
                log = parse_nccl_log(text, source=path_text(args.perf_table))
            except UserError:
                log = None  # "NCCL INFO" only in a comment: the table stands alone
    if topo is None and log is None and perf is None:
        topo = read_nvml_topology()  # UserError on a machine without GPUs names the offline options
    env = dict(os.environ)
    version = None
    if not (log and log.version):
        found = read_nccl_version()
        version = str(found) if found else None
    ver = log.version if log and log.version else version
    env = apply_sets(args.set, env, NcclVersion.parse(ver) if ver else None)
    gpus = len(topo.gpus) if topo is not None else (log.n_ranks if log is not None else None)
    facts = resolve_args(args, topology_gpus=gpus, ranks_only=topo is None)
    if args.tp is not None and topo is not None and args.tp > len(topo.gpus):
        raise UserError(f"--tp {args.tp}: {topo.source} has {len(topo.gpus)} GPUs")
    box, scope = topo, None
    if args.tp is not None and topo is not None and args.tp < len(topo.gpus):
        topo, scope = tp_group(topo, args.tp)  # everything below is about the TP group's GPUs
    hidden = args.hidden or (config.hidden_size if config is not None else DEFAULT_HIDDEN)
    d = diagnose(
        topo,
        log,
        env,
        nccl_version=version,
        hidden=hidden,
        draft_tokens=args.draft_tokens,
        batches=tuple(args.batch or DEFAULT_BATCHES),
        pcie_gen=args.pcie_gen,
        sm=args.sm,
        perf=perf,
        box=box,
    )
    d = dataclasses.replace(d, scope=scope)
    d = _advise(args, d, config, topo, log, perf, env, log.version if log and log.version else version, hidden)
    if args.json:
        doc = {"box": facts.as_dict(), **d.as_dict()}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        print(shown(facts.first_line(), limit=None))
        print_diagnosis(d)
    return 0


def tp_group(topo: Topology, tp: int) -> tuple[Topology, str]:
    """The topology of the GPUs a TP group of ``tp`` ranks uses on the box ``topo``
    (:meth:`fastverify.topo.matrix.Topology.first_gpus`: GPUs 0..tp-1, SGLang's default
    ``--base-gpu-id 0``, ``--gpu-id-step 1``), and the one line saying so."""
    group = topo.first_gpus(tp)
    kept = list(group.gpu_indices)
    span = f"{kept[0]}-{kept[-1]}" if kept == list(range(kept[0], kept[0] + len(kept))) else ", ".join(map(str, kept))
    n = len(topo.gpus)
    return group, (
        f"--tp {tp}: the TP group is GPUs {span} of {n} (SGLang's default --base-gpu-id 0, --gpu-id-step 1, "
        f"no CUDA_VISIBLE_DEVICES); everything below is about them; pass --tp {n} for the whole box"
    )


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
        raise UserError(
            f"--batch {' '.join(map(str, args.batch))}: with --model the advice ranks one verify step; "
            "give one batch size (run topo once per batch)"
        )
    config = load_model_config(args.model)
    if args.hidden is not None and args.hidden != config.hidden_size:
        raise UserError(
            f"--hidden {args.hidden}: --model {args.model} has hidden size {config.hidden_size}; drop one of the two"
        )
    return config


def _workload(args, config, tp: int, hidden: int):
    """The workload the advice ranks options for: ``config``'s verify step at ``tp``
    (:func:`fastverify.tune.workload.workload_from_model`, as ``tune --model`` builds it), or
    without a model one all-reduce of each verify size ``batch × draft_tokens × hidden × 2`` B
    (bf16; counts per step unknown). Returns (workload, counts_known)."""
    from fastverify.topo.diagnose import DEFAULT_BATCHES  # lazy: numpy

    if config is not None:
        batch = args.batch[0] if args.batch else 1
        w = workload_from_model(config, tp=tp, draft_tokens=args.draft_tokens, batch=batch)
        if args.model in preset_names():  # the package's own file: its absolute path says nothing portable
            w = dataclasses.replace(w, source=w.source.replace(f" ({config.source})", " (fastverify preset)"))
        return dataclasses.replace(w, source=path_text(w.source)), True
    batches = sorted(set(args.batch or DEFAULT_BATCHES))
    sizes = tuple((b * args.draft_tokens * hidden * DTYPE_BYTES, 1) for b in batches)
    one = len(batches) == 1
    return Workload(
        msg_sizes=sizes,
        hidden=hidden,
        tp=tp,
        tokens=batches[0] * args.draft_tokens if one else None,
        draft_tokens=args.draft_tokens,
        batch=batches[0] if one else None,
        source=f"verify sizes of batch {', '.join(map(str, batches))} x {args.draft_tokens} draft tokens "
        f"x hidden {hidden}, tp {tp}, one all-reduce each",
    ), False


def _advise(args, d, config, topo, log, perf, env, version, hidden):
    """``d`` with the shared ranking as its recommendation (:func:`fastverify.topo.diagnose.with_advice`);
    without a topology, or with fewer than 2 GPUs, one line saying why there is none."""
    from fastverify.topo.diagnose import with_advice  # lazy: numpy

    tp = args.tp or (len(topo.gpus) if topo is not None else 0)
    if topo is not None and tp < 2:
        return with_advice(
            d,
            log,
            None,
            [f"no ranking of options: {topo.source} has {len(topo.gpus)} GPU(s); an all-reduce needs 2 or more"],
        )
    workload, counts_known = _workload(args, config, tp, hidden) if topo is not None else (None, False)
    nv = NcclVersion.parse(version) if version else None
    hint = ""
    if topo is not None:
        where = (
            (f"--topology {path_text(args.topology)}" if args.topology else "(NVML)")
            + (f" --nccl-log {path_text(args.nccl_log)}" if args.nccl_log else "")
            + (f" --perf-table {path_text(args.perf_table)}" if args.perf_table and perf is not None else "")
        )
        draft = f" --draft-tokens {args.draft_tokens}" if args.draft_tokens != 4 else ""
        if args.model:
            batch = f" --batch {args.batch[0]}" if args.batch else ""
            hint = (
                f"the same ranking, with ranges and tok/s: `fastverify tune --predict {where} --model {path_text(args.model)} "
                f"--tp {tp}{draft}{batch} --sm {args.sm} --pcie-gen {args.pcie_gen}`"
            )
        else:
            hint = (
                f"per verify step, with ranges and tok/s: `fastverify tune --predict {where} --model MODEL "
                f"--tp {tp}{draft} --batch N --sm {args.sm} --pcie-gen {args.pcie_gen}`"
            )
    entries, notes = build_advice(
        workload,
        topo,
        counts_known=counts_known,
        env=env,
        nccl_version=nv,
        sm=args.sm,
        pcie_gen=args.pcie_gen,
        perf=perf,
        log=log,
        tune_hint=hint,
        no_p2p_pairs=tuple(f"{p.a}-{p.b}" for p in d.pairs if p.hw_p2p is False),
    )
    return with_advice(d, log, entries, notes)


TOP = 3
"""Options listed in "what to do" (those predicted faster than the current settings, at most this many)."""
MODEL_ERROR_PCT = 10.0
"""Held-out error of the NCCL cost model (:data:`fastverify.topo.diagnose.CALIBRATION`): a smaller
predicted change of an NCCL setting is within it."""


def _title(backend: str | None) -> str:
    """The registry's words for a backend (empty for NCCL settings or an unknown name)."""
    try:
        return backend_info(BackendName(backend)).title
    except ValueError:
        return ""


def build_advice(
    workload,
    topo,
    *,
    counts_known: bool,
    env,
    nccl_version,
    sm: int,
    pcie_gen: int,
    perf=None,
    log=None,
    tune_hint: str = "",
    no_p2p_pairs: tuple[str, ...] = (),
) -> tuple[list[dict] | None, list[str]]:
    """The ranking for ``workload`` on ``topo`` and the lines saying where its evidence stops.

    Parameters
    ----------
    workload : fastverify.tune.workload.Workload
    topo : Topology or None
        None: no ranking (the one note says why).
    counts_known : bool
        The workload counts its all-reduces per verify step (a model); else each size once.
    env, nccl_version, sm, pcie_gen, perf, log
        As :func:`fastverify.tune.advice.rank_options` takes them; a ``perf`` table of another
        world size than ``workload.tp`` is left out of the ranking (said in the notes).
    tune_hint : str
        The ``fastverify tune --predict`` command line that ranks the same options.
    no_p2p_pairs : tuple of str
        Pairs (``"a-b"``) the diagnosis finds without P2P (NCCL re-routed them, or fell back to SHM
        where the level allows P2P); the ranking's P2P facts do not hold them, so a note says so.

    Returns
    -------
    (entries, notes)
        ``entries`` (:func:`advice_entries`) or None where the ranking cannot run; ``notes``: the
        workload, the evidence and what is unknown, or the one line saying why there is no ranking.
        A UserError of the ranking (a topology it cannot use) becomes that line.
    """
    if topo is None:
        return None, [
            "no ranking of options: the box's topology is unknown from this input (an NCCL log or an "
            "all_reduce_perf table alone); add --topology FILE (`nvidia-smi topo -m`) to rank NCCL settings "
            "and all-reduce backends together"
        ]
    notes = []
    if perf is not None and perf.n_ranks is not None and perf.n_ranks != workload.tp:
        notes.append(f"{perf.source} ran on {perf.n_ranks} GPUs, the ranking on tp {workload.tp}: left out of it")
        perf = None
    try:
        pred = rank_options(
            workload, topo, env=env, nccl_version=nccl_version, sm=sm, pcie_gen=pcie_gen, perf=perf, log=log
        )
    except UserError as e:
        return None, [f"no ranking of options: {e}"]
    p2p_ok, p2p_source = prediction_p2p(None, topo, log)
    entries = advice_entries(pred, p2p_ok=p2p_ok, p2p_source=p2p_source, per_verify_step=counts_known)
    return entries, [
        *_workload_notes(workload, counts_known),
        *notes,
        *_limits(pred, entries, p2p_ok, p2p_source, no_p2p_pairs),
        *([tune_hint] if tune_hint else []),
    ]


def advice_entries(pred, *, p2p_ok: bool | None, p2p_source: str, per_verify_step: bool = True) -> list[dict]:
    """One dict per candidate of ``pred`` (:class:`fastverify.tune.candidates.PredictedRanking`), in rank
    order: ``rank`` (None: not ranked, no published data), ``candidate`` (name), ``backend``,
    ``settings``, ``is_baseline``, ``label``, ``allreduce_us`` / ``allreduce_us_range`` /
    ``baseline_us`` (µs), ``change_pct`` (new − old, %), ``evidence``, ``notes``, ``needs_p2p`` and
    ``p2p`` (``proven`` / ``reported by NVML`` / ``unproven`` / ``refuted``, None for NCCL),
    ``per_verify_step`` (False: the times are one all-reduce of each size, counts unknown), ``too_close``
    (:attr:`fastverify.tune.candidates.PredictedRanking.too_close`'s line, None when its lead is decided)."""
    base = pred.baseline.point_us
    p2p = (
        "unproven"
        if p2p_ok is None
        else "refuted"
        if p2p_ok is False
        else "reported by NVML, not proven"
        if p2p_source == "nvml"
        else "proven"
    )
    out = []
    for i, f in enumerate(pred.candidates, 1):
        needs = backend_info(f.backend).needs_p2p
        change = None if f.point_us is None or not base else round(100.0 * (f.point_us - base) / base, 2)
        out.append(
            {
                "rank": i if f.ranked else None,
                "candidate": f.name,
                "backend": f.backend.value,
                "settings": dict(f.settings),
                "is_baseline": f.is_baseline,
                "label": f.label,
                "allreduce_us": None if f.point_us is None else round(f.point_us, 3),
                "allreduce_us_range": None if f.range_us is None else [round(x, 3) for x in f.range_us],
                "baseline_us": None if base is None else round(base, 3),
                "change_pct": change,
                "evidence": list(f.evidence),
                "notes": list(f.notes),
                "needs_p2p": needs,
                "p2p": p2p if needs else None,
                "per_verify_step": per_verify_step,
                "status": f.status,
                "too_close": pred.too_close.get(f.name),
            }
        )
    return out


def _workload_notes(workload, counts_known: bool) -> list[str]:
    if counts_known:
        return [f"for {workload.source}: {workload.allreduce_count} all-reduces per verify step"]
    n = len(workload.msg_sizes)
    each = "the one verify size" if n == 1 else f"one all-reduce of each of the {n} verify sizes"
    return [
        f"counts per verify step are unknown without --model: the times are {each} "
        f"({', '.join(f'{b:,}' for b, _ in workload.msg_sizes)} B), not a verify step; give --model "
        "(and --tp) for per-step figures"
    ]


def _limits(pred, entries: list[dict], p2p_ok, p2p_source: str, no_p2p_pairs=()) -> list[str]:
    """Where the evidence of the listed options stops, and what this input cannot tell."""
    listed = _listed(entries) + [e for e in entries if e["is_baseline"]]
    out = []
    if no_p2p_pairs and p2p_ok is not False and any(e["needs_p2p"] for e in listed):
        shown = ", ".join(no_p2p_pairs[:6]) + (" ..." if len(no_p2p_pairs) > 6 else "")
        out.append(
            f"caution: this input shows {len(no_p2p_pairs)} pair(s) without P2P ({shown}; see the pairs "
            "below), which the ranking's P2P facts do not hold: an option that needs P2P between every pair "
            "will likely not run; prove it with `fastverify p2p` first"
        )
    kinds = []
    if any(e["label"] == "measured" or any(x.startswith("measured") for x in e["evidence"]) for e in listed):
        kinds.append("measured on this box (your files)")
    if any(any(x.startswith("published") for x in e["evidence"]) for e in listed):
        kinds.append("published measurements of other, comparable boxes")
    if any(any("cost model" in x or "TUNING" in x for x in e["evidence"]) for e in listed):
        kinds.append("NCCL's cost model (PCIe correction fitted on one 8x RTX 4090 box)")
    out.append(f"evidence: {'; '.join(kinds) or 'none'}; nothing here was measured by fastverify on this box")
    unknown = []
    if p2p_ok is None:
        unknown.append(f"driver P2P ({p2p_source})")
    unknown += [
        "ACS/IOMMU (can make P2P slow or hang; no input here shows it)",
        "the rest of the verify step (compute not measured: the % are of all-reduce time)",
    ]
    out.append("unknown from this input: " + "; ".join(unknown))
    ruled = [r.split(";")[0] for r in pred.not_candidates]
    if ruled:
        out.append("ruled out on this box: " + "; ".join(ruled))
    unranked = [f"{e['backend']} ({(e['status'] or 'no figure').split(':')[0]})" for e in entries if e["rank"] is None]
    if unranked:
        out.append(f"not ranked: {', '.join(unranked)}: measure each with `fastverify tune` on the box")
    return out


def _listed(entries: list[dict]) -> list[dict]:
    """The options predicted faster than the current settings, at most :data:`TOP`."""
    out = []
    for e in entries:
        if e["is_baseline"] or e["rank"] is None:
            break
        out.append(e)
    return out[:TOP]


def _pct(v: float) -> str:
    from fastverify.tune.verify_time import change_pct  # lazy: numpy

    return change_pct(v)


def _amount(us: float, counts_known: bool) -> str:
    return f"{us / 1e3:.3f} ms" if counts_known else f"{us:,.1f} µs"


def advice_lines(entries: list[dict] | None, notes: list[str]) -> list[str]:
    """The lines of "what to do" from the ranking: the listed options in rank order with their
    change and evidence, then the current settings, then the notes; without a ranking, its note."""
    if entries is None:
        return list(notes)
    listed = _listed(entries)
    base = next(e for e in entries if e["is_baseline"])
    counts_known = base["per_verify_step"]
    unit = "per verify step" if counts_known else "of the all-reduce time"
    lines = []
    for e in listed:
        title = _title(e["backend"])
        name = f"{e['candidate']} ({title})" if title and not e["settings"] else e["candidate"]
        line = (
            f"{e['rank']}. {name}: {_pct(e['change_pct'])} {unit} ({_amount(e['allreduce_us'], counts_known)} "
            f"vs {_amount(e['baseline_us'], counts_known)} now), {_basis(e)}"
        )
        if e.get("too_close"):
            why = e["too_close"].removeprefix(f"{e['candidate']}: ")
            line = f"{e['rank']}. {name}: {why}; at its point {_pct(e['change_pct'])}, {_basis(e)}"
        if e["needs_p2p"]:
            line += f"; needs P2P: {e['p2p']}"
            if e["p2p"] != "proven":
                line += (
                    ", run `fastverify p2p --output p2p.json` (and `fastverify launch --p2p-check p2p.json` deploys it)"
                )
        lines.append(line)
    if not listed:
        lines.append("keep the current settings: no option is predicted faster")
    per = " per verify step" if counts_known else ""
    lines.append(f"then: {base['candidate']}: {_amount(base['allreduce_us'], counts_known)}{per}, {_basis(base)}")
    return lines + notes


def _basis(e: dict) -> str:
    """Where one option's figure comes from, in words."""
    ev = e["evidence"]
    if e["label"] == "measured":
        return f"measured ({ev[0].removeprefix('measured: ')})" if ev else "measured"
    if any(x.startswith("P2P kernel model") for x in ev):
        m = re.search(r"misses on (\d+) published boxes", " ".join(ev))
        return "predicted by the P2P kernel model" + (f" (its misses on {m.group(1)} published boxes)" if m else "")
    published = next((x for x in ev if x.startswith("published")), None)
    if published is not None:
        m = re.search(r"(\d+) comparable box", published)
        boxes = (
            f"{m.group(1)} comparable published box{'es' if m.group(1) != '1' else ''}"
            if m
            else "published measurements of other boxes"
        )
        return f"predicted from {boxes}"
    words = "predicted by NCCL's cost model"
    if any(x.startswith("measured") for x in ev):
        words += ", against your measured baseline"
    if not e["is_baseline"] and e["change_pct"] is not None and abs(e["change_pct"]) < MODEL_ERROR_PCT:
        words += f", within the model's error (~{MODEL_ERROR_PCT:.0f} %): measure it"
    return words


def level_line(d) -> str:
    """The ``# NCCL_P2P_LEVEL now: …`` line of :class:`fastverify.topo.diagnose.Diagnosis` ``d``: the
    widest level P2P can use, placed in the ranking where there is one."""
    head = f"# NCCL_P2P_LEVEL now: {d.p2p_level_now} ({d.p2p_level_now_source}); "
    rec = d.p2p_level_recommended
    if rec is None:
        return head + "recommended: no change"
    entry = next((e for e in d.advice or () if e["settings"] == {"NCCL_P2P_LEVEL": rec}), None)
    if entry is None:
        return head + f"recommended: {rec}"
    base_rank = next(e["rank"] for e in d.advice if e["is_baseline"])
    if entry["rank"] is not None and entry["rank"] < base_rank:
        return head + f"best level: {rec} (option {entry['rank']} of the ranking below, {_pct(entry['change_pct'])})"
    return head + f"{rec} would give P2P to more pairs but is predicted slower ({_pct(entry['change_pct'])}): no change"


def print_diagnosis(d: Diagnosis, console: Console | None = None) -> None:
    """Print the diagnosis in words a user acts on: the ranked options (the ranking above)
    and the actions first, then the evidence. Every line and cell that can quote an input (file
    names, log lines, settings' values) goes through :func:`fastverify.console.say` / ``cell``."""
    c = console or stdout_console(130)
    gpus = f"{d.n_gpus} GPU(s)" if d.n_gpus else "GPU count unknown from this input"
    say(c, f"# fastverify topo: {gpus}; from {', '.join(d.sources)}; NCCL {d.nccl_version or 'version unknown'}")
    if d.scope:
        say(c, f"# {d.scope}")
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
            key = (
                p.link or "?",
                p.nccl_path or "?",
                p.transport_now,
                p.basis or ("seen in log" if p.seen else "predicted"),
                p.transport_recommended,
                {True: "yes", False: "no", None: "unknown"}[p.hw_p2p],
            )
            by.setdefault(key, []).append(f"{p.a}-{p.b}")
        t = Table(title="GPU pairs", title_justify="left")
        for col in ("pairs", "nvidia-smi", "NCCL path", "transport now", "basis", "recommended", "driver P2P"):
            t.add_column(col, overflow="fold")
        for key, names in by.items():
            t.add_row(cell(" ".join(names)), *map(cell, key))
        c.print(t)

    for name, info in (
        ("FlashInfer PCIe IPC all-reduce", d.pcie_ipc_allreduce),
        ("SGLang custom all-reduce", d.custom_allreduce),
    ):
        verdict = {True: "can run", False: "cannot run", None: "unknown"}[info["possible"]]
        say(c, f"{name}: {verdict} - {info['reason']}")

    for f in d.findings:
        say(
            c,
            f"setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}" + (f" -> {f.fix}" if f.fix else ""),
            style="yellow" if f.severity.value == "warning" else "red",
        )
    for n in d.log_notes:
        say(c, f"log: {n}")

    if d.predictions:
        t = Table(title="verify all-reduce, PREDICTED (not measured)", title_justify="left")
        for col in ("tokens", "bytes", "now µs", "now algo", "recommended µs", "recommended algo"):
            t.add_column(col, justify="right", overflow="fold")
        for p in d.predictions:
            t.add_row(
                cell(p.tokens),
                f"{p.msg_bytes:,}",
                f"{p.now_us:,.1f}",
                cell(p.now_algo_proto),
                f"{p.recommended_us:,.1f}",
                cell(p.recommended_algo_proto),
            )
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
        say(
            c,
            f"all_reduce_perf {p['source']} (measured): {p['rows']} sizes {p['min_bytes']:,}-{p['max_bytes']:,} B, "
            f"{ranks}{gpus}, {'/'.join(p['dtypes'])} {'/'.join(p['redops'])}; {p['time_us_at_min']:g} µs at the "
            f"smallest, {p['time_us_at_max']:g} µs at the largest; peak busBw {p['peak_busbw_gbps']:g} GB/s at "
            f"{p['peak_busbw_bytes']:,} B{avg}",
        )
    if d.measured:
        t = Table(
            title=cell(f"verify all-reduce, MEASURED by NCCL all_reduce_perf ({d.measured[0]['source']})"),
            title_justify="left",
        )
        for col in ("tokens", "bytes", "NCCL µs", "column", "basis"):
            t.add_column(col, justify="right", overflow="fold")
        for m in d.measured:
            t.add_row(
                cell(m["tokens"]),
                f"{m['msg_bytes']:,}",
                "-" if m["time_us"] is None else f"{m['time_us']:,.1f}",
                cell(m.get("column") or "-"),
                cell(m["basis"]),
            )
        c.print(t)
        say(c, "# the in-place column: SGLang's NCCL all-reduce writes into its input")
    tu = d.nccl_tuning
    if tu:
        if tu["model_table"]:
            cells = ", ".join(
                f"{r['algo']}/{r['proto']} {r['latency_us']:g} µs + size/{r['algbw_gbps']:g} GB/s"
                for r in tu["model_table"]
            )
            say(c, f"NCCL's model table (TUNING, AllReduce): {cells}")
            t = Table(
                title="NCCL's model table from the log (TUNING, AllReduce; NCCL's own numbers)", title_justify="left"
            )
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
            say(
                c,
                "NCCL's choice per launched all-reduce: "
                + ", ".join(
                    f"{x['size_bytes']:,} B -> {x['algo']}/{x['proto']}"
                    + (f" ({x['time_us']:g} µs model)" if x["time_us"] is not None else "")
                    for x in shown
                )
                + more,
            )
        say(c, f"# {tu['basis']}")
