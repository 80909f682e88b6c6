"""``fastverify tune --predict``: every candidate (NCCL settings and the registry's backends the
box allows) ranked from the cost model, published measurements and the user's evidence
(``--profile`` > ``--perf-table`` > ``--nccl-log`` > topology; :mod:`fastverify.tune.candidates`),
printed as text (:mod:`fastverify.tune.printer`) or one JSON document, and written as an env file
and deployment record (``--write-env``, gain basis ``predicted``, the header naming the evidence)
or an NCCL tuner-plugin CSV (``--write-tuner-config``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from fastverify.console import say
from fastverify.deploy import BoxFingerprint, Gain
from fastverify.envfile import write_tuner_config
from fastverify.registry import BackendName, backend_info
from fastverify.tune import user_figures
from fastverify.tune.advice import p2p_facts, prediction_p2p, rank_options, topology_nvlink_full
from fastverify.tune.measure import env_path, write_env_and_record
from fastverify.tune.predict import tuner_choices
from fastverify.tune.printer import prediction_document, print_prediction
from fastverify.tune.user_figures import decorate, header_lines
from fastverify.tune.verify_time import change_pct
from fastverify.tune.workload import Workload


def predict(args, workload, topo, version, ranked, p2p_given, perf, log, user=None):
    """Every candidate, NCCL settings and backends ranked together, with verify time and tok/s:
    :func:`fastverify.tune.advice.rank_options` (the ranking ``topo`` advises from too) on this
    command's flags; with ``user`` (the user's own figures) scaled to them."""
    user_notes = ()
    if user is not None:
        user_notes = user_figures.notes(args, topo, user)
    return rank_options(
        workload,
        topo,
        env=os.environ,
        nccl_version=version,
        sm=args.sm,
        pcie_gen=args.pcie_gen,
        p2p_given=p2p_given,
        perf=perf,
        log=log,
        accept_length=args.accept_length,
        tok_s=args.tok_s,
        user=user,
        user_notes=user_notes,
        ranked=ranked,
    )


def box_doc(args, workload, topo, version, p2p_given, log) -> dict:
    """The ``box`` part of the JSON document: the topology, the resolved box facts, NCCL version,
    P2P and where it came from, and the evidence files."""
    p2p_ok, p2p_source = prediction_p2p(p2p_given, topo, log)
    return {
        "topology": topo.source if topo is not None else None,
        "gpus": len(topo.gpus) if topo is not None else None,
        "tp": workload.tp,
        "sm": args.sm,
        "pcie_gen": args.pcie_gen,
        "facts": args.box_facts.as_dict(),
        "nccl_version": str(version) if version else None,
        "p2p_ok": p2p_ok,
        "p2p_source": p2p_source,
        "perf_table": str(args.perf_table) if args.perf_table else None,
        "nccl_log": str(args.nccl_log) if args.nccl_log else None,
    }


def report_prediction(args, console, workload, topo, version, pred, shapes, p2p_given, fp, box_doc, user=None) -> int:
    """Print the prediction (``--json``: the document, decorated with the user's figures), then
    write ``--write-env`` and ``--write-tuner-config``; returns 0."""
    red = pred.best.verify["reduction"]
    if args.json:
        import json

        doc = prediction_document(pred, workload, box=box_doc)
        if user is not None:
            doc = decorate(doc, user, red, topo=topo)
        # not print(): it writes nothing to a closed stdout (None) and succeeds; None.write fails, and
        # print_guarded says so in one line
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    else:
        print_prediction(
            args,
            console,
            workload,
            topo,
            version,
            pred,
            red,
            p2p_ok=box_doc["p2p_ok"],
            user=user,
            held_notes=getattr(args, "held_notes", ()),
        )
    if args.write_env is not None:
        _write_env(args, console, workload, topo, version, pred, shapes, p2p_given, fp, user)
    if args.write_tuner_config is not None:
        _write_tuner_config(args, console, workload, pred)
    return 0


def _write_env(args, console, workload, topo, version, pred, shapes, p2p_given, fp, user) -> None:
    """The winner's env file and deployment record, the header saying PREDICTED and why."""
    base, best = pred.baseline, pred.best
    red = best.verify["reduction"]
    path = env_path(args, fp)
    header = prediction_header(
        workload,
        best,
        base,
        red,
        topology_source=topo.source,
        n_gpus=len(topo.gpus),
        pcie_gen=args.pcie_gen,
        sm=args.sm,
        user=user,
        box_facts=args.box_facts,
    )
    header += [f"not chosen: {line}" for line in pred.too_close.values()]
    box = predicted_box(args, workload, topo, version)
    p2p = p2p_facts(p2p_given, topo, cuda=False)
    # The winner by registry name: an NCCL setting, or a backend (with no NCCL setting changed).
    name = BackendName.nccl if best.nccl is not None else best.backend
    gain = Gain(baseline_us=base.point_us, best_us=best.point_us, basis="predicted")
    env_p, rec_p = write_env_and_record(
        args,
        path,
        name,
        dict(best.settings),
        header,
        version,
        shapes=shapes,
        box=box,
        p2p=p2p,
        gain=gain,
        source=f"tune --predict: {workload.source}",
        batch_known=workload.batch is not None,
    )
    say(
        console,
        f"wrote {env_p} (backend {name.value}, {len(best.settings)} NCCL setting(s); header says "
        f"PREDICTED) and {rec_p}",
    )
    if backend_info(name).needs_p2p and not p2p.proven:
        say(
            console,
            f"# note: {name.value} needs P2P proven before `fastverify launch` deploys it: run "
            "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json",
        )


def _write_tuner_config(args, console, workload, pred) -> None:
    """The best NCCL candidate's per-size choice as an NCCL tuner-plugin CSV."""
    nccl_best = pred.best_nccl.nccl
    write_tuner_config(
        args.write_tuner_config,
        tuner_choices(nccl_best),
        header_lines=[
            f"PREDICTED by fastverify tune --predict for {workload.source}",
            f"from the best NCCL candidate: {nccl_best.name}",
            "allreduce rows only; other collectives run on one channel under this plugin",
        ],
    )
    say(console, f"wrote {args.write_tuner_config}")


def predicted_box(args, workload, topo, version):
    """The fingerprint of the box ``--predict`` describes: GPU names from the topology (when it
    has them), compute capability from ``--sm``, GPU count from the topology, full NVLink over the
    first ``tp`` GPUs."""
    name = next((g.name for g in topo.gpus if g.name), None)
    return BoxFingerprint(
        gpu_name=name,
        sm=(args.sm // 10, args.sm % 10),
        gpu_count=len(topo.gpus),
        tp=workload.tp,
        driver=None,
        nccl_version=str(version) if version else None,
        nvlink_full=topology_nvlink_full(topo, workload.tp),
    )


def prediction_header(
    workload: Workload,
    best,
    baseline,
    reduction: Mapping,
    *,
    topology_source: str,
    n_gpus: int,
    pcie_gen: int,
    sm: int,
    user=None,
    box_facts=None,
) -> list[str]:
    """Comment lines for an env file written from a prediction: how the values were obtained, the
    box, the workload and the predicted numbers with their ranges and evidence (the writer adds
    date and NCCL version).

    Parameters
    ----------
    best, baseline : fastverify.tune.candidates.Figure
        The winner (an NCCL setting or a registry backend) and the current environment.
    reduction : mapping
        :func:`fastverify.tune.verify_time.verify_reduction` of the winner against the baseline.
    user : fastverify.tune.user_figures.UserFigures or None
        The user's own figures: the baseline is labelled with their label (``measured-by-user``),
        and their lines (:func:`fastverify.tune.user_figures.header_lines`) follow.
    """
    sizes = ", ".join(f"{c} x {b:,} B" for b, c in workload.msg_sizes)

    def tok(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    def rng(f) -> str:
        if f.range_us is None:
            return "range unknown at this size"
        lo, hi = f.range_us
        return f"range {lo:,.1f}..{hi:,.1f} us"

    lines = [
        "PREDICTED, not measured: NCCL cost model + PCIe correction fitted on one 8x RTX 4090 box "
        "(fastverify.topo.diagnose.CALIBRATION) and published all-reduce measurements of comparable boxes "
        "(fastverify/data/published_allreduce.json); measure with `fastverify tune` before relying on it",
        f"topology: {topology_source}; GPUs: {n_gpus} in the topology, tp {workload.tp}; "
        + (box_facts.first_line()[2:] if box_facts is not None else f"assumed PCIe Gen{pcie_gen} x16, sm_{sm}"),
        f"workload: {workload.source}; all-reduces per verify step: {sizes}",
        f"chosen: {best.name} (backend {best.backend.value}, {best.label})",
        f"all-reduce per verify step: {baseline.point_us:.1f} us (baseline"
        f"{', ' + user.label if user is not None else ''}, {rng(baseline)}) -> "
        f"{best.point_us:.1f} us ({rng(best)}), {change_pct(-reduction['allreduce_reduction_pct'])} ({best.label})",
        f"verify step: {reduction['verify_baseline_us'] / 1e3:.3f} ms -> {reduction['verify_predicted_us'] / 1e3:.3f} ms, "
        f"{change_pct(-reduction['verify_reduction_pct'])} (predicted; baseline {reduction['verify_baseline_basis']})",
        f"tok/s per stream at A = {reduction['accept_length']:g}: {tok(reduction['tok_s_baseline'])}"
        f"{' (' + user.label + ')' if user is not None else ''} -> "
        f"{tok(reduction['tok_s_predicted'])} (predicted; t_rest {reduction['t_rest_basis']})"
        if reduction["tok_s_baseline"] is not None
        else f"tok/s per stream: not computed (t_rest {reduction['t_rest_basis']})",
    ]
    if user is not None:
        lines += header_lines(user, reduction)
    lines += [f"evidence: {e}" for e in best.evidence]
    lines += [f"note: {n}" for n in best.notes]
    return lines
