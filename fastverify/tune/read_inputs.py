"""What ``fastverify tune`` reads before it ranks anything: the workload (``--profile``, else a
model's shapes), the box (``--topology`` text, else NVML; GPU count, SM and PCIe generation), the
NCCL version, and the user's evidence files (``--p2p-check``, ``--perf-table``, ``--nccl-log``).
Each is read once; a bad one is refused with a one-line :class:`~fastverify.errors.UserError`
naming its flag. ``--p2p-check FILE`` is read whenever given; its per-pair results replace the
topology's P2P status in the ranking (:func:`fastverify.tune.predict.with_p2p_results`).
"""

from __future__ import annotations

import dataclasses

from fastverify.errors import UserError
from fastverify.inputs import read_text
from fastverify.live.config import load_model_config, preset_names
from fastverify.nccl.debuglog import parse_nccl_log
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.nccl.version import NcclVersion, read_nccl_version
from fastverify.topo.box import nvml_facts, p2p_file_facts, resolve_args
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.topo.nvml import read_nvml_topology
from fastverify.topo.p2p_proof import complete_gpus, read_check_file
from fastverify.tune import user_figures
from fastverify.tune.predict import with_p2p_results
from fastverify.tune.workload import workload_from_model, workload_from_profile


def read_workload(args, draft_tokens: int):
    """The verify step's all-reduces: from ``--profile`` (its TP must match ``--tp``), else from
    ``--model`` (default ``tiny``) at ``--tp`` (else :func:`_default_tp`), ``draft_tokens`` per
    request and ``--batch``, its source naming where an unasked TP came from."""
    if args.profile is not None:
        if args.model is not None:
            raise UserError("--profile and --model both describe the workload; give one")
        workload = workload_from_profile(args.profile)
        if args.tp is not None and args.tp != workload.tp:
            raise UserError(
                f"--tp {args.tp}: {args.profile} was measured at TP {workload.tp}; drop the flag or re-profile"
            )
        return workload
    name = args.model or "tiny"
    config = load_model_config(name)
    tp, tp_from = _default_tp(args)
    workload = workload_from_model(config, tp=tp, draft_tokens=draft_tokens, batch=args.batch)
    if tp_from:  # a TP nobody gave is said where the workload is named
        workload = dataclasses.replace(
            workload, source=workload.source.replace(f", tp {tp},", f", tp {tp} ({tp_from}),")
        )
    if name in preset_names():  # the package's own file: its absolute path says nothing portable
        workload = dataclasses.replace(
            workload, source=workload.source.replace(f" ({config.source})", " (fastverify preset)")
        )
    return workload


def with_hidden(args, workload):
    """``workload`` with ``--hidden`` where it records no hidden size (a trace profile), said once
    in its notes; ``--hidden`` contradicting a known hidden size is refused."""
    if args.hidden is not None and workload.hidden and args.hidden != workload.hidden:
        raise UserError(
            f"--hidden {args.hidden}: the workload ({workload.source}) has hidden size {workload.hidden}; --hidden is "
            "for a trace profile that records none (leave it out)"
        )
    if args.hidden is not None and not workload.hidden:
        # a trace profile records no hidden size: the user's --hidden is the one every stage reads
        # (the fused candidates, the sweep's norm, the deployment record), said once in the notes
        workload = dataclasses.replace(
            workload, hidden=args.hidden, notes=(*workload.notes, f"hidden size {args.hidden} from --hidden")
        )
    return workload


def _default_tp(args) -> tuple[int, str]:
    """``(tp, where it came from)`` of a model workload: ``--tp`` as given (``""``), else every GPU
    of the ``--topology`` text, else every GPU NVML sees here (2 or more), else 2."""
    if args.tp is not None:
        return args.tp, ""
    if args.topology is not None:
        gpus = len(topology_file(args).gpus)
        if gpus >= 2:
            return gpus, "every GPU of the topology; --tp-size for fewer"
    count = nvml_facts()[2]
    if count >= 2:
        return count, "every GPU NVML sees; --tp-size for fewer"
    return 2, "default; --tp-size for yours"


def topology_file(args):
    """The ``--topology`` text, read and parsed once per run (the TP default and the box both need it)."""
    parsed = getattr(args, "topology_parsed", None)
    if parsed is None:
        parsed = parse_nvidia_smi_topo(
            read_text(args.topology, kind="text", errors="replace"), source=str(args.topology)
        )
        args.topology_parsed = parsed
    return parsed


def read_topology(args, tp: int, assume=None):
    """``--topology``, else NVML's; where neither: ``assume()`` (the user's own figures), a refusal
    (``--predict``), or None (measure mode)."""
    if args.topology is not None:
        return topology_file(args)
    try:
        return read_nvml_topology()
    except UserError:
        if assume is not None:  # the user's own figures: an assumed box, said in every output
            return assume()
        if args.predict:
            raise UserError(
                "--predict needs the box's topology: give --topology FILE (`nvidia-smi topo -m` text)"
            ) from None
        return None


def nccl_version(args, log):
    """``--nccl-version``, else the library's own, else the version the NCCL log names, else None."""
    version = NcclVersion.parse(args.nccl_version) if args.nccl_version else read_nccl_version()
    if version is None and log is not None and log.version:
        version = NcclVersion.parse(log.version)
    return version


def read_p2p_check(args):
    """``(per-pair results, P2P facts, notes)`` of ``--p2p-check FILE``, or ``(None, None, [])``.
    The facts keep the GPUs the check tested (every ordered pair among them passed): ``launch``
    accepts the record's proof only for a TP group of those GPUs."""
    if args.p2p_check is None:
        return None, None, []
    import msgspec

    check = read_check_file(args.p2p_check)
    p2p_given = msgspec.structs.replace(p2p_file_facts(args.p2p_check, check.results), gpus=complete_gpus(check))
    notes = []
    if check.gpus is None:
        notes.append(
            f"# note: --p2p-check {args.p2p_check} names no GPU (a check from before it recorded "
            "which GPUs it tested): it ranks the candidates, but `fastverify launch` takes a "
            "record made from it as proof only once the check is rerun on the box"
        )
    return check.results, p2p_given, notes


def read_perf(args, tp: int):
    """``--perf-table FILE`` parsed (:func:`fastverify.nccl.perftable.parse_all_reduce_perf`) and
    the warnings to print (``# warning: …`` lines), or ``(None, [])``. A table that ran across
    several nodes (:meth:`~fastverify.nccl.perftable.PerfTable.several_nodes`, against the
    topology's GPU count, else ``tp``) is warned about and not used; one of another world size is
    refused: its times are not this workload's."""
    if args.perf_table is None:
        return None, []
    text = read_text(args.perf_table, kind="text", flag="--perf-table", errors="replace")
    table = parse_all_reduce_perf(text, source=str(args.perf_table))
    warnings = [f"# warning: {w}" for w in (table.dropped_warning(),) if w]
    gpus = len(read_topology(args, tp).gpus) if args.topology is not None else tp
    if (several := table.several_nodes(gpus)) is not None:
        return None, [f"# warning: {several}; tune does not use them", *warnings]
    if table.n_ranks is not None and table.n_ranks != tp:
        raise UserError(
            f"--perf-table {args.perf_table}: all_reduce_perf ran on {table.n_ranks} GPUs, the workload "
            f"on tp {tp}: run it with -g {tp} (or under mpirun -np {tp})"
        )
    return table, warnings


def read_log(args):
    """``--nccl-log FILE`` parsed (:func:`fastverify.nccl.debuglog.parse_nccl_log`), or None."""
    if args.nccl_log is None:
        return None
    text = read_text(args.nccl_log, kind="log", flag="--nccl-log", errors="replace")
    return parse_nccl_log(text, source=str(args.nccl_log))


def box_topology(args, workload, user, p2p_results):
    """The box's topology with the P2P check's results folded in (None in measure mode without
    one), after the output checks of the user's-figures mode; sets ``args.box_facts`` (SM, PCIe
    generation, GPU count and where each came from)."""
    topo = read_topology(
        args,
        workload.tp,
        assume=None if user is None else lambda: user_figures.assumed_topology(workload.tp, p2p_results),
    )
    user_figures.check_outputs(args, topo)
    args.box_facts = resolve_args(
        args, topology_gpus=None if topo is None or user_figures.is_assumed(topo) else len(topo.gpus), tp=workload.tp
    )
    if topo is not None and len(topo.gpus) < workload.tp:
        raise UserError(f"{topo.source}: {len(topo.gpus)} GPUs, fewer than --tp {workload.tp}")
    if topo is not None and p2p_results is not None:
        topo = with_p2p_results(topo, p2p_results, source=str(args.p2p_check))
    return topo
