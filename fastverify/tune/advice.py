"""One ranking of a box's options for the verify step's all-reduces: the NCCL settings of the cost
model (:func:`fastverify.tune.predict.rank_nccl_settings`) and every registry backend the box allows
(published measurements of comparable boxes, :func:`fastverify.tune.candidates.predict_candidates`)
ranked together, with verify time and tok/s (:func:`fastverify.tune.candidates.with_verify`).

``fastverify tune --predict`` prints this ranking and ``fastverify topo`` advises from it
(:mod:`fastverify.topo_command`), so the two commands never recommend different things for the
same box and workload. :func:`rank_options` is the one public function; the P2P and NVLink helpers
below are shared with ``tune``'s deployment record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from fastverify.deploy import GpuId, installed_sglang_version
from fastverify.errors import UserError
from fastverify.topo.box import p2p_from_results, p2p_from_topology
from fastverify.topo.gpu_identity import gpu_identities
from fastverify.topo.p2p import check_p2p
from fastverify.topo.p2p_proof import CheckFile, complete_gpus
from fastverify.tune import user_figures


def rank_options(
    workload,
    topology,
    *,
    env: Mapping[str, str],
    nccl_version=None,
    sm: int,
    pcie_gen: int,
    p2p_given=None,
    perf=None,
    log=None,
    accept_length: float | None = None,
    tok_s: float | None = None,
    user=None,
    user_notes: Sequence[str] = (),
    ranked: Sequence | None = None,
    p2p_check: str | None = None,
):
    """Every option of the box for ``workload``, fastest predicted first.

    Parameters
    ----------
    workload : fastverify.tune.workload.Workload
        The verify step's all-reduces (sizes in bytes, counts per step); ``workload.tp`` ranks run
        on the first ``tp`` GPUs of ``topology``.
    topology : fastverify.topo.matrix.Topology
        The box (``nvidia-smi topo -m`` text or NVML), with a P2P check's results already folded in
        (:func:`fastverify.tune.predict.with_p2p_results`) where one was given.
    env : mapping of str to str
        The NCCL settings now (the baseline, and what every NCCL candidate adds to).
    nccl_version : NcclVersion or None
        The NCCL the server loads; None: the newest rules the model and catalogue know.
    sm, pcie_gen : int
        Compute capability × 10 and PCIe generation of the box (resolved: flag, NVML or guess).
    p2p_given : P2PFacts or None
        A P2P check's facts (``--p2p-check``); else NVML's status in the topology, else a log line
        saying NCCL could not enable P2P, else unknown (:func:`prediction_p2p`).
    perf, log : PerfTable or None, NcclLog or None
        ``--perf-table`` (NCCL measured on the box; same world size as ``workload.tp``) and
        ``--nccl-log``; each replaces the cost model for the sizes it covers.
    accept_length, tok_s : float or None
        Tokens per cycle per stream, and the measured tok/s per stream now (fixes the rest of the
        cycle); without them tok/s figures are upper bounds.
    user, user_notes
        The user's own verify / all-reduce figures (:class:`fastverify.tune.user_figures.UserFigures`)
        and the lines that mode carries: every figure is then scaled to them.
    ranked : sequence of fastverify.tune.predict.Candidate or None
        The NCCL candidates when the caller ranked them already (with the same arguments); None:
        ranked here.
    p2p_check : str or None
        The P2P check file whose results are in ``topology`` (its notes then never ask for it again).

    Returns
    -------
    fastverify.tune.candidates.PredictedRanking
        ``candidates`` ranked by predicted all-reduce time per verify step (µs), the baseline among
        them; unranked backends (no comparable published data) last; ``not_candidates`` one line
        per backend the registry rules out on the box.

    Raises
    ------
    UserError
        From the NCCL ranking: ``workload.tp`` above the topology's GPU count or below 2, a version
        older than 2.9; from the verify figures: a ``tok_s`` the all-reduce time alone exceeds.
    """
    from fastverify.nccl.model import enabled_algos_protos  # lazy: numpy (off `topo --help`)
    from fastverify.tune.candidates import predict_candidates, with_verify  # lazy: numpy
    from fastverify.tune.predict import rank_nccl_settings  # lazy: numpy

    if ranked is None:
        ranked = rank_nccl_settings(
            workload, topology, env=env, nccl_version=nccl_version, pcie_gen=pcie_gen, sm=sm, p2p_check=p2p_check
        )
    p2p_ok, p2p_source = prediction_p2p(p2p_given, topology, log)
    en = enabled_algos_protos(env, nccl_version, sm)
    pred = predict_candidates(
        workload,
        ranked,
        sm=sm,
        pcie_gen=pcie_gen,
        p2p_ok=p2p_ok,
        p2p_source=p2p_source,
        nvlink_full=topology_nvlink_full(topology, workload.tp),
        perf=perf,
        log=log,
        enabled=(en.algos, en.protos if en.protos_set else None),
        sglang_version=installed_sglang_version(),
    )
    pred = replace(pred, notes=pred.notes + tuple(_evidence_notes(workload, env, perf, log)))
    if user is not None:
        pred = user_figures.scale_prediction(pred, user, tuple(user_notes))
    return with_verify(pred, workload, accept_length=accept_length, tok_s=tok_s, user=user)


def _evidence_notes(workload, env: Mapping[str, str], perf, log) -> list[str]:
    """What the evidence files say about themselves: NCCL settings the log ran with that this
    environment lacks, the log's first problems, verify sizes outside the perf table."""
    notes = []
    if log is not None:
        for k, v in sorted(log.env.items()):
            if k.startswith("NCCL_") and env.get(k) != v:
                notes.append(f"the NCCL log {log.source} ran with {k}={v} (set by environment there, not here)")
        for w in getattr(log, "problems", ())[:3]:
            notes.append(f"NCCL log {log.source}: {w}")
    if perf is not None and any(perf.time_us(b, in_place=True) is None for b, _ in workload.msg_sizes):
        notes.append(
            f"--perf-table {perf.source}: some verify sizes lie outside its measured sizes "
            f"({min(perf.sizes):,}..{max(perf.sizes):,} B): the next evidence is used for those"
        )
    return notes


def topology_nvlink_full(topology, tp: int) -> bool | None:
    """Every pair of the first ``tp`` GPUs on NVLink (SGLang's full-NVLink test,
    ``custom_all_reduce_utils.py::is_full_nvlink``); None where a link is unknown."""
    first = sorted(topology.gpu_indices)[:tp]
    links = [topology.link(a, b) for i, a in enumerate(first) for b in first[i + 1 :]]
    return None if any(link is None for link in links) else all(link.startswith("NV") for link in links)


def p2p_facts(given, topo, *, cuda: bool):
    """P2P facts for the record: those of ``--p2p-check FILE`` (``given``, proof), else on a GPU
    box the real check (:func:`fastverify.topo.p2p.check_p2p`, cached per box), else NVML's
    status (not proof)."""
    if given is not None:
        return given
    if cuda:
        import msgspec

        try:
            gpus = gpu_identities()
            results = check_p2p(gpus=gpus)
        except UserError:
            pass
        else:
            named = {}
            for g in gpus:
                try:
                    named[g["cuda"]] = GpuId(
                        index=g["index"], pci_bus_id=g["pci_bus_id"], uuid=g["uuid"], name=g["name"]
                    )
                except (ValueError, TypeError):
                    named = None
                    break
            proof = complete_gpus(CheckFile(path="", results=results, gpus=named))
            return msgspec.structs.replace(p2p_from_results(results), gpus=proof)
    return p2p_from_topology(topo)


def prediction_p2p(p2p_given, topo, log):
    """(ok, source) of P2P between every pair for the prediction: the P2P check, else NVML's status
    in the topology, else a log line "Could not enable P2P between dev a and dev b" (refuted),
    else unknown."""
    facts = p2p_facts(p2p_given, topo, cuda=False)
    if facts.ok is None and log is not None and log.p2p_unavailable:
        a, b = log.p2p_unavailable[0]
        return False, f"NCCL log {log.source}: could not enable P2P between dev {a} and dev {b}"
    if facts.ok is None:
        return None, f"{facts.source}: {facts.note}" if facts.note else facts.source
    return facts.ok, facts.source
