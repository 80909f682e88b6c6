"""``fastverify tune``: the flags, and one run: build the workload, read the box and the user's
evidence (below), check every output path (:mod:`fastverify.tune.measure`),
rank NCCL settings with the cost model (:func:`fastverify.tune.predict.rank_nccl_settings`), then

* ``--predict``: rank every candidate and write the winner (:mod:`fastverify.tune.predict_mode`);
  with ``--verify-ms V --allreduce-ms R [--tok-s S]`` the user's own figures are the baseline
  (``measured-by-user``; :mod:`fastverify.tune.user_figures`);
* else measure the candidates in isolated workers and write the winner (:mod:`fastverify.tune.measure`);
* ``--draft-shape``: the EAGLE draft shape instead (:mod:`fastverify.tune.draft_shape`).

``--json`` prints one JSON document on stdout; the words go to stderr. The mode modules load in
:func:`run`: the CLI imports this module at every start, to build its parser.

What ``fastverify tune`` reads before it ranks anything: the workload (``--profile``, else a
model's shapes), the box (``--topology`` text, else NVML; GPU count, SM and PCIe generation), the
NCCL version, and the user's evidence files (``--p2p-check``, ``--perf-table``, ``--nccl-log``).
Each is read once; a bad one is refused with a one-line :class:`~fastverify.errors.UserError`
naming its flag. ``--p2p-check FILE`` is read whenever given; its per-pair results replace the
topology's P2P status in the ranking (:func:`fastverify.tune.predict.with_p2p_results`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_TIMEOUT_S
from fastverify.console import say
from fastverify.errors import UserError
from fastverify.inputs import read_text
from fastverify.live.config import load_model_config, preset_names
from fastverify.nccl.checks import Severity, apply_sets, split_set, validate_env
from fastverify.nccl.debuglog import parse_nccl_log
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.nccl.version import NcclVersion, read_nccl_version
from fastverify.outputs import or_default, output_arg, path_arg
from fastverify.proof.run import baseline_of
from fastverify.topo.box import add_box_arguments, nvml_facts, p2p_file_facts, resolve_args
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.topo.nvml import read_nvml_topology
from fastverify.topo.p2p_proof import complete_gpus, read_check_file
from fastverify.tune import predict_mode, user_figures
from fastverify.tune.draft_shape import add_arguments as add_draft_shape_arguments, run as run_draft_shape
from fastverify.tune.measure import box_fingerprint, check_outputs, measure, verify_shapes
from fastverify.tune.predict import priced, rank_nccl_settings, with_p2p_results
from fastverify.tune.verify_time import accept_length_in_force, verify_reduction
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


DEFAULT_DRAFT_TOKENS = 4
"""``--draft-tokens`` of a model workload when not given: SGLang 0.5.23's automatic EAGLE choice for
DeepSeek-V3/Kimi-like models, ``(steps, topk, draft tokens) = (3, 1, 4)``
(``srt/arg_groups/speculative_hook.py::_auto_choose_speculative_params``)."""


def _server_words(text: str) -> list[str]:
    """``--server-args``: the words of one shell-quoted string (``shlex``), at most 64 KiB of it."""
    if len(text) > 65536:
        raise argparse.ArgumentTypeError(f"expected at most 65536 characters, got {len(text)}")
    try:
        return shlex.split(text)
    except ValueError as err:  # "No closing quotation", "No escaped character"
        raise argparse.ArgumentTypeError(f"{err} in {text[:60]!r}") from None


def add_arguments(p: argparse.ArgumentParser, positive, bounded) -> None:
    """The ``tune`` subcommand's flags (``positive``/``bounded`` are the CLI's int parsers)."""
    w = p.add_argument_group("workload (a profile, or a model's shapes)")
    w.add_argument("--profile", type=path_arg, metavar="JSON", help="profile written by `fastverify profile`")
    w.add_argument(
        "--model", default=None, help="preset (tiny, kimi-k2, kimi-k2.5, deepseek-v3) or config.json [default: tiny]"
    )
    w.add_argument(
        "--tp",
        "--tp-size",
        type=bounded(2, 64),
        default=None,
        help="tensor-parallel world size [default: a profile's own; with --model every GPU of --topology (or NVML), "
        "else 2]",
    )
    w.add_argument(
        "--draft-tokens",
        "--speculative-num-draft-tokens",
        type=bounded(1, MAX_DRAFT_TOKENS),
        default=None,
        help="draft tokens per request (SGLang's --speculative-num-draft-tokens) [default: a profile's "
        "own; 4 with --model]",
    )
    w.add_argument("--batch", type=bounded(1, MAX_BATCH), default=1, help="requests per verify batch")
    w.add_argument(
        "--max-batch",
        "--cuda-graph-max-bs-decode",
        type=bounded(1, MAX_BATCH),
        default=None,
        help="largest batch the server captures/serves (SGLang's --cuda-graph-max-bs-decode), recorded "
        "in the deployment record [default: the workload's batch]",
    )
    w.add_argument(
        "--hidden",
        type=bounded(1, MAX_HIDDEN),
        default=None,
        help="hidden size, for a trace profile that does not record it (with a model or a live "
        "profile it must equal theirs) [default: the workload's]",
    )
    u = p.add_argument_group("your own figures (with --predict; fastverify.tune.user_figures)")
    u.add_argument(
        "--verify-ms",
        type=float,
        default=None,
        metavar="MS",
        help="your measured verify step, ms (with --allreduce-ms): the baseline, labelled measured-by-user",
    )
    u.add_argument(
        "--allreduce-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the all-reduce time of that verify step, ms (at most --verify-ms)",
    )
    b = p.add_argument_group("box")
    b.add_argument(
        "--topology",
        "--nvidia-smi",
        dest="topology",
        type=path_arg,
        metavar="FILE",
        help="`nvidia-smi topo -m` text (else NVML on a GPU box)",
    )
    b.add_argument(
        "--nccl-version",
        default=None,
        help="NCCL version for the catalogue and model [default: the library's own, else the newest known]",
    )
    add_box_arguments(b, bounded)
    b.add_argument(
        "--p2p-check",
        type=path_arg,
        metavar="FILE",
        default=None,
        help="JSON of `fastverify p2p` [default: run it on a GPU box]",
    )
    b.add_argument(
        "--perf-table",
        type=path_arg,
        metavar="FILE",
        default=None,
        help="nccl-tests all_reduce_perf output from this box: NCCL measured there replaces the "
        "model's NCCL baseline (second only to a --profile's own times)",
    )
    b.add_argument(
        "--nccl-log",
        type=path_arg,
        metavar="FILE",
        default=None,
        help="NCCL_DEBUG=INFO output of a run on this box: its TUNING table and transports come "
        "before the topology in the NCCL baseline",
    )
    m = p.add_argument_group("measurement")
    m.add_argument(
        "--predict",
        action="store_true",
        help="predict only: rank NCCL settings and the registry's backends from the cost model, "
        "published measurements and your evidence; measure nothing",
    )
    m.add_argument("--top", type=bounded(0, 20), default=3, help="NCCL candidates from the model to measure")
    m.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more NCCL candidate, this setting over the current environment (repeatable: one candidate "
        "each); measured even where the cost model cannot price it (then 'measured only, not predicted', "
        "and refused with --predict); an unknown name or a value NCCL rejects is an error",
    )
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where trials run")
    m.add_argument("--iters", type=bounded(1, 10000), default=20, help="timed repetitions per size")
    m.add_argument("--warmup", type=bounded(0, 1000), default=3, help="untimed repetitions per size")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds a trial may measure before it counts as hung")
    m.add_argument(
        "--journal",
        type=output_arg,
        default=None,
        help="append-only record of finished trials [default: nccl_configs/<box>.journal.jsonl]",
    )
    m.add_argument("--resume", action="store_true", help="skip trials the journal already holds")
    m.add_argument(
        "--server-args",
        default=None,
        metavar="'FLAGS'",
        type=_server_words,
        help="the SGLang server's command or flags, one quoted string: every trial runs in the "
        "environment its start-up sets (SGLang's own _set_envs_and_config where it imports) "
        "[default: a plain server of --tp GPUs]",
    )
    add_draft_shape_arguments(p.add_argument_group("draft shape (--draft-shape; fastverify.tune.draft_shape)"))
    o = p.add_argument_group("output")
    o.add_argument(
        "--accept-length", type=float, default=None, help="tokens per cycle per stream [profile's, else 3.0]"
    )
    o.add_argument(
        "--tok-s", type=float, default=None, help="measured tok/s per stream now (fixes the rest of the cycle)"
    )
    o.add_argument(
        "--write-env",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        type=or_default(output_arg),
        help="write the winning settings and the deployment record beside them (X.env, X.deploy.json) "
        "[default path: nccl_configs/<box fingerprint>.env]",
    )
    o.add_argument(
        "--baseline",
        type=path_arg,
        metavar="DIR",
        default=None,
        help="with --write-env: the answers of a `launch --load` run without the swap, kept in the "
        "deployment record; `launch --env` asks them again of the patched server before it serves",
    )
    o.add_argument("--write-tuner-config", type=output_arg, metavar="PATH", help="per-size NCCL tuner-plugin CSV")
    o.add_argument(
        "--force",
        action="store_true",
        help="replace existing output files (the old env file, record and tuner CSV kept as <name>.bak), "
        "and start the --journal over without --resume",
    )
    o.add_argument("--png", type=output_arg, default=None, help="latency vs message size per candidate (measure mode)")
    o.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (label, baseline, candidates[]) on stdout; notes go to stderr",
    )
    o.add_argument(
        "--explain",
        action="store_true",
        help="with --predict: every candidate with its range, and every evidence line, note and "
        "ruled-out backend behind the figures [default: the top candidates and the decision]",
    )


def _check_flags(args) -> None:
    """Flag combinations and values that need no input read: refused first."""
    if not args.predict and args.write_tuner_config is not None:
        raise UserError("--write-tuner-config comes from the cost model's per-size choice: use it with --predict")
    if args.predict and args.png is not None:
        raise UserError("--png plots measured latencies: it does not apply with --predict")
    if args.predict and (args.journal is not None or args.resume):
        raise UserError(
            f"{'--journal' if args.journal is not None else '--resume'} records measured trials: "
            "it does not apply with --predict"
        )
    if args.accept_length is not None and not (1.0 <= args.accept_length <= 64):
        raise UserError(f"--accept-length {args.accept_length:g}: expected tokens per cycle in [1, 64]")
    if args.tok_s is not None and not (math.isfinite(args.tok_s) and args.tok_s > 0):
        # one message for nan, inf, 0 and negatives
        raise UserError(f"--tok-s {args.tok_s:g}: expected a finite positive number (tokens/s per stream)")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UserError(f"--timeout {args.timeout:g}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    if args.explain and not args.predict:
        raise UserError("--explain prints the evidence of a prediction: use it with --predict")
    if args.explain and args.json:
        raise UserError("--explain adds the evidence to the text; --json holds all of it already (drop one)")
    if args.max_batch is not None and args.batch > args.max_batch:
        raise UserError(f"--batch {args.batch}: larger than --max-batch {args.max_batch} (the largest batch served)")


def _draft_tokens_in_force(args, workload):
    """``workload`` with the draft tokens per request in force: the profile's or the model's; for
    a profile that records none, ``--draft-tokens`` (said in its notes). The accept length is then
    checked against them in one place (:func:`fastverify.tune.verify_time.accept_length_in_force`).

    Raises
    ------
    UserError
        ``--draft-tokens`` contradicting the profile's; ``--accept-length`` with a profile that
        records no draft tokens and no ``--draft-tokens`` (nothing to check it against).
    """
    have, given = workload.draft_tokens, args.draft_tokens
    if have is not None:
        if given is not None and given != have:
            raise UserError(
                f"--draft-tokens {given}: the workload ({workload.source}) has {have} draft tokens per "
                "request; drop the flag or re-profile"
            )
        return workload
    if given is None:
        if args.accept_length is not None:
            raise UserError(
                f"--accept-length {args.accept_length:g}: {args.profile} does not record the draft tokens "
                "per request, the most an accept length can be; give --draft-tokens N too (SGLang's "
                "--speculative-num-draft-tokens)"
            )
        return workload
    if workload.batch is not None and workload.tokens is not None and given * workload.batch != workload.tokens:
        raise UserError(
            f"--draft-tokens {given}: the workload ({workload.source}) has {workload.tokens} tokens at "
            f"batch {workload.batch} per verify step, not {given} x {workload.batch}"
        )
    return dataclasses.replace(
        workload, draft_tokens=given, notes=(*workload.notes, f"{given} draft tokens per request from --draft-tokens")
    )


def run(args) -> int:
    """``fastverify tune`` with the parsed flags: returns 0; a bad flag, input or output path raises
    :class:`~fastverify.errors.UserError` before anything is written."""
    import sys

    from rich.console import Console

    # --json: stdout holds the one document; everything said in words goes to stderr (stderr=True:
    # rich writes to sys.stderr, or nowhere where it is closed; file=None would mean stdout)
    console = Console(stderr=True, width=130) if args.json else Console(width=None if sys.stdout.isatty() else 130)
    if args.draft_shape:
        return _run_draft_shape(args, console)
    given = _given(args, "--accept-histogram", "--verify-log", "--bundle", "--draft-step-ms", "--draft-extend-ms")
    if given:
        raise UserError(f"{given[0]} applies to --draft-shape only (add --draft-shape, or leave it out)")
    _check_flags(args)
    for item in args.set:  # the form first, before reading any input
        split_set(item)
    if args.baseline is not None:  # read before any work: the record carries its answers
        if args.write_env is None:
            raise UserError("--baseline goes into the deployment record: use it with --write-env")
        args.answer_baseline = baseline_of(args.baseline)
    user = user_figures.from_args(args)
    workload = with_hidden(args, read_workload(args, args.draft_tokens or DEFAULT_DRAFT_TOKENS))
    workload = _draft_tokens_in_force(args, workload)
    accept_length_in_force(workload, args.accept_length)  # refused before any work, whichever way it came
    user, user_said = user_figures.reconcile(user, workload, args.profile)
    if args.tok_s is not None:  # a measured verify time bounds tok/s already (the rest needs the baseline)
        verify_reduction(workload, 0.0, 0.0, accept_length=args.accept_length, tok_s=args.tok_s, user=user)
    # the P2P check is read and validated whenever given, whatever else is asked; its notes and the
    # perf table's warnings are said after the box line, which comes first
    p2p_results, p2p_given, late_notes = read_p2p_check(args)
    (perf, perf_warnings), log = read_perf(args, workload.tp), read_log(args)
    late_notes += perf_warnings
    version = nccl_version(args, log)
    args.nccl_sets = _nccl_sets(args, version)
    topo = box_topology(args, workload, user, p2p_results)
    fp = box_fingerprint(workload, topo, version)
    check_outputs(args, fp)
    shapes = verify_shapes(args, workload) if args.write_env is not None else None  # refused before any work
    ranked = (
        rank_nccl_settings(
            workload,
            topo,
            env=os.environ,
            nccl_version=version,
            pcie_gen=args.pcie_gen,
            sm=args.sm,
            p2p_check=str(args.p2p_check) if p2p_results is not None else None,
            given=[s.settings for s in args.nccl_sets if s.priced],
        )
        if topo is not None
        else []
    )
    pred = box_doc = None
    if args.predict:  # the whole prediction before any output: a bad --tok-s prints nothing
        pred = predict_mode.predict(args, workload, topo, version, ranked, p2p_given, perf, log, user)
        box_doc = predict_mode.box_doc(args, workload, topo, version, p2p_given, log)
    _print_preamble(args, console, late_notes, version, (*user_said, *_baseline_notes(ranked)))
    if args.predict:
        return predict_mode.report_prediction(
            args, console, workload, topo, version, pred, shapes, p2p_given, fp, box_doc, user
        )
    return measure(args, console, workload, topo, version, ranked, shapes, p2p_given, fp)


@dataclasses.dataclass(frozen=True)
class NcclSet:
    """One ``--set NAME=VALUE`` candidate: its settings, and whether the cost model can price it
    (:func:`fastverify.tune.predict.priced`)."""

    settings: dict
    priced: bool


def _nccl_sets(args, version) -> list[NcclSet]:
    """The ``--set`` candidates, each checked over the current environment as NCCL ``version`` reads
    it (:func:`fastverify.nccl.checks.apply_sets`, as ``topo --set``); with ``--predict`` one the cost
    model cannot price is refused."""
    out = []
    for i, item in enumerate(args.set):
        if item in args.set[:i]:
            raise UserError(f"--set {item}: given twice (one candidate each)")
        apply_sets([item], os.environ, version)
        name, value = split_set(item)
        can = priced(name, value, version)
        if args.predict and not can:
            raise UserError(
                f"--set {name}={value}: the cost model cannot price it, so --predict cannot rank it; "
                "measure it (drop --predict)"
            )
        out.append(NcclSet({name: value}, can))
    return out


def _given(args, *flags: str) -> list[str]:
    """The ``flags`` (``--tok-s``: attribute ``tok_s``) the user gave: a value other than the
    parser's unset ``None``, ``False`` or ``[]``."""
    return [f for f in flags if getattr(args, f[2:].replace("-", "_")) not in (None, False, [])]


def _run_draft_shape(args, console) -> int:
    """``tune --draft-shape`` (:func:`fastverify.tune.draft_shape.run`), which takes none of the
    workload flags."""
    given = _given(
        args,
        "--predict",
        "--write-env",
        "--profile",
        "--model",
        "--tok-s",
        "--accept-length",
        "--verify-ms",
        "--allreduce-ms",
        "--topology",
        "--describe-box",
        "--p2p-check",
        "--perf-table",
        "--nccl-log",
        "--set",
        "--journal",
        "--resume",
        "--server-args",
        "--baseline",
        "--write-tuner-config",
        "--png",
        "--explain",
    )
    if given:  # read by nothing here: refused rather than silently ignored
        raise UserError(
            f"--draft-shape reads accept lengths and verify costs only; {', '.join(given)} "
            f"{'does' if len(given) == 1 else 'do'} not apply to it"
        )
    return run_draft_shape(args, console)


def _baseline_notes(ranked) -> tuple[str, ...]:
    """The NCCL baseline's notes (version unknown, settings skipped, ...), said before the ranking."""
    return tuple(ranked[0].notes) if ranked and ranked[0].is_baseline else ()


def _print_preamble(args, console, late_notes, version, early) -> None:
    """The lines before the ranking: the box and where each fact came from (first), the P2P check's
    and perf table's notes, the current environment's NCCL settings that are not OK, and the
    ``early`` notes, which plain ``--predict`` holds back for ``--explain`` (``args.held_notes``)."""
    say(console, args.box_facts.first_line())  # first: the box, and from where
    for note in late_notes:
        say(console, note)
    for f in validate_env(os.environ, version):
        if f.severity is not Severity.OK:
            say(
                console,
                f"# setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}" + (f" -> {f.fix}" if f.fix else ""),
            )
    args.held_notes = early if args.predict and not args.json and not args.explain else ()
    for note in () if args.held_notes else early:  # held: counted in the --explain line instead
        say(console, f"# note: {note}")
