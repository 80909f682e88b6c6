"""``fastverify tune``: build the workload, rank NCCL settings with the cost model, measure the
candidates in isolated workers (unless ``--predict``), report, and write the env file / tuner CSV.

Two modes:

* ``--predict --topology FILE``: for a box described by ``nvidia-smi topo -m`` text, NCCL settings
  (cost model) and every tunable registry backend the box allows (published measurements) ranked
  together (:mod:`fastverify.tune.candidates`), the user's evidence first: ``--profile`` >
  ``--perf-table`` > ``--nccl-log`` > topology. Every number is labelled predicted (or measured where
  the user's files measured it), every figure names its evidence, and so does the env file's header;
  the winner may be a backend, written by registry name with gain basis ``predicted``.
* ``--predict --verify-ms V --allreduce-ms R [--tok-s S]``: the user's own figures are the
  baseline (``measured-by-user``), each candidate at R × its predicted ratio to the predicted
  baseline, every gain an upper bound; without ``--topology`` or NVML the box is assumed
  (:mod:`fastverify.tune.user_figures`).
* ``--json`` (both modes): one JSON document on stdout (:func:`fastverify.tune.candidates.prediction_document`
  / :func:`~fastverify.tune.candidates.measured_document`); the words go to stderr.
* measure (default): each candidate runs in a fresh set of worker processes
  (:mod:`fastverify.tune.sweep`): NCCL settings ranked by the model (top ``--top``) plus the current
  environment as the baseline, and on GPUs every tunable backend of the registry
  (:func:`fastverify.registry.names`) that SGLang can reach on this box
  (:func:`fastverify.registry.unreachable_reason`; :func:`backend_trials`). Without GPUs the same
  machinery runs on gloo, which ignores NCCL settings: the output says so and the timings are CPU
  wall clock.

``--write-env X.env`` writes the env file and the deployment record ``X.deploy.json`` beside it
(:mod:`fastverify.deploy`): the winner by registry name (never one SGLang cannot reach on the box,
:func:`choose_winner`), the shapes (``--max-batch`` × draft tokens × hidden, dtype), the P2P facts
and their source, the box fingerprint, the NCCL settings, the SGLang version and the gain with its
basis. The env file holds NCCL settings only: the winner's SGLang switch is never written there
(sourced without ``launch`` it would start that path unchecked); ``launch`` sets it from the
record after the P2P proof (:func:`fastverify.deploy.sglang_settings`). Both files or neither are
written.

Before any work (:func:`_check_outputs`): no output, nor the ``.bak`` it keeps of an existing file
(``X.env.bak``, ``X.deploy.json.bak``), replaces an input (``--topology``, ``--profile``,
``--p2p-check``, a ``--model`` file) or another output, every output's folder
exists or can be created, ``--png`` names a format matplotlib writes, ``--write-env`` names a
``.env`` file, ``--tok-s`` is finite and positive, ``--hidden`` agrees with a workload that knows
its hidden size. ``--p2p-check FILE`` is read whenever given; its per-pair results replace the
topology's P2P status in the ranking (:func:`fastverify.tune.predict.with_p2p_results`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_TIMEOUT_S
from fastverify.errors import UserError
from fastverify.registry import Role, backend_info
from fastverify.tune.advice import _p2p_facts, _prediction_p2p  # shared with topo's advice

DEFAULT_DRAFT_TOKENS = 4
"""``--draft-tokens`` of a model workload when not given: SGLang 0.5.23's automatic EAGLE choice for
DeepSeek-V3/Kimi-like models, ``(steps, topk, draft tokens) = (3, 1, 4)``
(``srt/arg_groups/speculative_hook.py::_auto_choose_speculative_params``)."""


def add_arguments(p: argparse.ArgumentParser, positive, bounded) -> None:
    """The ``tune`` subcommand's flags (``positive``/``bounded`` are the CLI's int parsers)."""
    w = p.add_argument_group("workload (a profile, or a model's shapes)")
    w.add_argument("--profile", type=Path, metavar="JSON", help="profile written by `fastverify profile`")
    w.add_argument("--model", default=None, help="preset (tiny, kimi-k2, kimi-k2.5, deepseek-v3) or config.json [default: tiny]")
    w.add_argument("--tp", "--tp-size", type=bounded(2, 64), default=None,
                   help="tensor-parallel world size [default: a profile's own; with --model every GPU of --topology (or NVML), "
                        "else 2]")
    w.add_argument("--draft-tokens", "--speculative-num-draft-tokens", type=bounded(1, MAX_DRAFT_TOKENS), default=None,
                   help="draft tokens per request (SGLang's --speculative-num-draft-tokens) [default: a profile's "
                        "own; 4 with --model]")
    w.add_argument("--batch", type=bounded(1, MAX_BATCH), default=1, help="requests per verify batch")
    w.add_argument("--max-batch", "--cuda-graph-max-bs-decode", type=bounded(1, MAX_BATCH), default=None,
                   help="largest batch the server captures/serves (SGLang's --cuda-graph-max-bs-decode), recorded "
                        "in the deployment record [default: the workload's batch]")
    w.add_argument("--hidden", type=bounded(1, MAX_HIDDEN), default=None,
                   help="hidden size, for a trace profile that does not record it (with a model or a live "
                        "profile it must equal theirs) [default: the workload's]")
    u = p.add_argument_group("your own figures (with --predict; fastverify.tune.user_figures)")
    u.add_argument("--verify-ms", type=float, default=None, metavar="MS",
                   help="your measured verify step, ms (with --allreduce-ms): the baseline, labelled measured-by-user")
    u.add_argument("--allreduce-ms", type=float, default=None, metavar="MS",
                   help="the all-reduce time of that verify step, ms (at most --verify-ms)")
    b = p.add_argument_group("box")
    b.add_argument("--topology", "--nvidia-smi", dest="topology", type=Path, metavar="FILE",
                   help="`nvidia-smi topo -m` text (else NVML on a GPU box)")
    b.add_argument("--nccl-version", default=None, help="NCCL version for the catalogue and model [default: the "
                                                        "library's own, else the newest known]")
    from fastverify.topo.boxfacts import add_box_arguments

    add_box_arguments(b, bounded)
    b.add_argument("--p2p-check", type=Path, metavar="FILE", default=None,
                   help="JSON of `fastverify p2p` [default: run it on a GPU box]")
    b.add_argument("--perf-table", type=Path, metavar="FILE", default=None,
                   help="nccl-tests all_reduce_perf output from this box: NCCL measured there replaces the "
                        "model's NCCL baseline (second only to a --profile's own times)")
    b.add_argument("--nccl-log", type=Path, metavar="FILE", default=None,
                   help="NCCL_DEBUG=INFO output of a run on this box: its TUNING table and transports come "
                        "before the topology in the NCCL baseline")
    m = p.add_argument_group("measurement")
    m.add_argument("--predict", action="store_true",
                   help="predict only: rank NCCL settings and the registry's backends from the cost model, "
                        "published measurements and your evidence; measure nothing")
    m.add_argument("--top", type=bounded(0, 20), default=3, help="NCCL candidates from the model to measure")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where trials run")
    m.add_argument("--iters", type=bounded(1, 10000), default=20, help="timed repetitions per size")
    m.add_argument("--warmup", type=bounded(0, 1000), default=3, help="untimed repetitions per size")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds a trial may measure before it counts as hung")
    m.add_argument("--journal", type=Path, default=None,
                   help="append-only record of finished trials [default: nccl_configs/<box>.journal.jsonl]")
    m.add_argument("--resume", action="store_true", help="skip trials the journal already holds")
    from fastverify.tune.draft_shape import add_arguments as add_draft_shape_arguments

    add_draft_shape_arguments(p.add_argument_group("draft shape (--draft-shape; fastverify.tune.draft_shape)"))
    o = p.add_argument_group("output")
    o.add_argument("--accept-length", type=float, default=None, help="tokens per cycle per stream [profile's, else 3.0]")
    o.add_argument("--tok-s", type=float, default=None, help="measured tok/s per stream now (fixes the rest of the cycle)")
    o.add_argument("--write-env", nargs="?", const="", default=None, metavar="PATH",
                   help="write the winning settings and the deployment record beside them (X.env, X.deploy.json) "
                        "[default path: nccl_configs/<box fingerprint>.env]")
    o.add_argument("--write-tuner-config", type=Path, metavar="PATH", help="per-size NCCL tuner-plugin CSV")
    o.add_argument("--png", type=Path, default=None, help="latency vs message size per candidate (measure mode)")
    o.add_argument("--json", action="store_true",
                   help="print one JSON document (label, baseline, candidates[]) on stdout; notes go to stderr")
    o.add_argument("--explain", action="store_true",
                   help="with --predict: every candidate with its range, and every evidence line, note and "
                        "ruled-out backend behind the figures [default: the top candidates and the decision]")


MIN_WIN_PCT = 2.0
"""A measured candidate must beat the baseline's verify-step all-reduce time by this much (and by
more than the baseline's own p90 spread) before its settings are written: smaller differences are
run-to-run noise, not a reason to change a server's settings."""


def _check_flags(args) -> None:
    """Flag combinations and values that need no input read: refused first."""
    if not args.predict and args.write_tuner_config is not None:
        raise UserError("--write-tuner-config comes from the cost model's per-size choice: use it with --predict")
    if args.predict and args.png is not None:
        raise UserError("--png plots measured latencies: it does not apply with --predict")
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
    draft = args.draft_tokens or (DEFAULT_DRAFT_TOKENS if args.profile is None else None)
    if args.accept_length is not None and draft is not None and args.accept_length > draft:
        raise UserError(f"--accept-length {args.accept_length:g}: more than the {draft} draft tokens a verify step "
                        "checks per request (accepted tokens per cycle are at most the draft tokens)")


def _env_path(args, fp: str) -> Path | None:
    from fastverify.envfile import default_env_path

    if args.write_env is None:
        return None
    return Path(args.write_env) if args.write_env else default_env_path(fp)


def _journal_path(args, fp: str) -> Path:
    return args.journal or Path("nccl_configs") / f"{fp}.journal.jsonl"


def _check_outputs(args, fp: str) -> None:
    """Refuse unusable output paths before any work, so nothing is half-written afterwards: each
    output's folder must exist or be creatable (:func:`fastverify.tune.envfile.check_folder`),
    ``--png`` must name a format matplotlib writes, and no output may replace an input
    (``--topology``, ``--profile``, ``--p2p-check``, a ``--model`` config file) or another output
    (:func:`fastverify.procs.check_outputs`)."""
    from fastverify.deploy import record_path_for
    from fastverify.live.config import preset_names
    from fastverify.procs import check_outputs
    from fastverify.envfile import check_folder

    from fastverify.envfile import backup_path

    env_p = _env_path(args, fp)
    rec_p = record_path_for(env_p) if env_p is not None else None
    # atomic_write_text keeps an existing file as <name>.bak: the backups are outputs too, so an
    # input named X.env.bak (or X.deploy.json.bak) is never replaced by the old env file.
    outputs = {"--write-env": env_p,
               "--write-env (deployment record)": rec_p,
               "--write-tuner-config": args.write_tuner_config, "--png": args.png,
               "--journal": None if args.predict else _journal_path(args, fp),
               "--write-env (backup of the env file)": backup_path(env_p) if env_p is not None else None,
               "--write-env (backup of the deployment record)": backup_path(rec_p) if rec_p is not None else None,
               "--write-tuner-config (backup)": (backup_path(args.write_tuner_config)
                                                 if args.write_tuner_config is not None else None)}
    for flag, value in (("--write-env", args.write_env or None), ("--write-tuner-config", args.write_tuner_config),
                        ("--png", args.png), ("--journal", args.journal)):
        if value and str(value).endswith(os.sep):
            raise UserError(f"{flag} {value}: give a file path, not a folder")
    if env_p is not None and (not env_p.name.endswith(".env") or env_p.name == ".env"):
        stem = env_p.name.split(".")[0] or "box"
        raise UserError(f"--write-env {env_p}: name the env file <name>.env, e.g. {env_p.with_name(stem + '.env')} "
                        f"(its deployment record goes beside it as {stem}.deploy.json)")
    model = args.model if args.model is not None and args.model not in preset_names() else None
    inputs = {"--topology": args.topology, "--profile": args.profile, "--p2p-check": args.p2p_check,
              "--model": model, "--perf-table": args.perf_table, "--nccl-log": args.nccl_log}
    for flag, path in outputs.items():
        if path is not None:
            check_folder(path, flag.split(" ")[0])
    check_outputs(outputs, inputs)
    if args.png is not None:
        from fastverify.tune.report import plot_format

        plot_format(args.png)


def _workload(args):
    from fastverify.tune.workload import workload_from_model, workload_from_profile

    if args.profile is not None:
        if args.model is not None:
            raise UserError("--profile and --model both describe the workload; give one")
        workload = workload_from_profile(args.profile)
        if args.tp is not None and args.tp != workload.tp:
            raise UserError(f"--tp {args.tp}: {args.profile} was measured at TP {workload.tp}; drop the flag or "
                            "re-profile")
        return workload
    from fastverify.live.config import load_model_config, preset_names

    name = args.model or "tiny"
    config = load_model_config(name)
    tp, tp_from = _default_tp(args)
    workload = workload_from_model(config, tp=tp, draft_tokens=args.draft_tokens or DEFAULT_DRAFT_TOKENS,
                                   batch=args.batch)
    if tp_from:  # a TP nobody gave is said where the workload is named
        workload = dataclasses.replace(workload, source=workload.source.replace(f", tp {tp},", f", tp {tp} ({tp_from}),"))
    if name in preset_names():  # the package's own file: its absolute path says nothing portable
        workload = dataclasses.replace(workload, source=workload.source.replace(f" ({config.source})",
                                                                                " (fastverify preset)"))
    return workload


def _default_tp(args) -> tuple[int, str]:
    """``(tp, where it came from)`` of a model workload: ``--tp`` as given (``""``), else every GPU
    of the ``--topology`` text, else every GPU NVML sees here (2 or more), else 2."""
    if args.tp is not None:
        return args.tp, ""
    if args.topology is not None:
        gpus = len(_topology_file(args).gpus)
        if gpus >= 2:
            return gpus, "every GPU of the topology; --tp-size for fewer"
    from fastverify.topo.boxfacts import nvml_facts

    count = nvml_facts()[2]
    if count >= 2:
        return count, "every GPU NVML sees; --tp-size for fewer"
    return 2, "default; --tp-size for yours"


def _topology_file(args):
    """The ``--topology`` text, read and parsed once per run (the TP default and the box both need it)."""
    parsed = getattr(args, "topology_parsed", None)
    if parsed is None:
        from fastverify.inputs import read_text
        from fastverify.topo.matrix import parse_nvidia_smi_topo

        parsed = parse_nvidia_smi_topo(read_text(args.topology, kind="text", errors="replace"),
                                       source=str(args.topology))
        args.topology_parsed = parsed
    return parsed


def _topology(args, tp: int, assume=None):
    if args.topology is not None:
        return _topology_file(args)
    from fastverify.topo.nvml import read_nvml_topology

    try:
        return read_nvml_topology()
    except UserError:
        if assume is not None:  # the user's own figures: an assumed box, said in every output
            return assume()
        if args.predict:
            raise UserError("--predict needs the box's topology: give --topology FILE (`nvidia-smi topo -m` text)") from None
        return None


def _version(args):
    from fastverify.nccl.version import NcclVersion, read_nccl_version

    if args.nccl_version:
        return NcclVersion.parse(args.nccl_version)
    return read_nccl_version()


def _fingerprint(workload, topo, version) -> str:
    gpus = topo.gpus if topo else ()
    name = next((g.name for g in gpus if g.name), None) or (Path(topo.source).stem if topo else "unknown-box")
    return f"{name}-tp{workload.tp}-nccl{version or 'unknown'}"


def _read_perf(args, tp: int):
    """``--perf-table FILE`` parsed (:func:`fastverify.nccl.perftable.parse_all_reduce_perf`) and
    the warnings to print (``# warning: …`` lines), or ``(None, [])``. A table that ran across
    several nodes (:meth:`~fastverify.nccl.perftable.PerfTable.several_nodes`, against the
    topology's GPU count, else ``tp``) is warned about and not used; one of another world size is
    refused: its times are not this workload's."""
    if args.perf_table is None:
        return None, []
    from fastverify.nccl.perftable import parse_all_reduce_perf

    from fastverify.inputs import read_text

    text = read_text(args.perf_table, kind="text", flag="--perf-table", errors="replace")
    table = parse_all_reduce_perf(text, source=str(args.perf_table))
    warnings = [f"# warning: {w}" for w in (table.dropped_warning(),) if w]
    gpus = len(_topology(args, tp).gpus) if args.topology is not None else tp
    if (several := table.several_nodes(gpus)) is not None:
        return None, [f"# warning: {several}; tune does not use them", *warnings]
    if table.n_ranks is not None and table.n_ranks != tp:
        raise UserError(f"--perf-table {args.perf_table}: all_reduce_perf ran on {table.n_ranks} GPUs, the workload "
                        f"on tp {tp}: run it with -g {tp} (or under mpirun -np {tp})")
    return table, warnings


def _read_log(args):
    """``--nccl-log FILE`` parsed (:func:`fastverify.nccl.logparse.parse_nccl_log`), or None."""
    if args.nccl_log is None:
        return None
    from fastverify.nccl.logparse import parse_nccl_log

    from fastverify.inputs import read_text

    text = read_text(args.nccl_log, kind="log", flag="--nccl-log", errors="replace")
    return parse_nccl_log(text, source=str(args.nccl_log))


def run(args) -> int:
    import sys

    from rich.console import Console

    from fastverify.tune.predict import rank_nccl_settings, verify_reduction

    # --json: stdout holds the one document; everything said in words goes to stderr
    console = (Console(file=sys.stderr, width=130) if args.json
               else Console(width=None if sys.stdout.isatty() else 130))
    if args.draft_shape:
        from fastverify.tune.draft_shape import run as run_draft_shape

        if args.predict or args.write_env is not None or args.profile is not None:
            raise UserError("--draft-shape reads accept lengths and verify costs only; --predict, --write-env and "
                            "--profile do not apply to it")

        return run_draft_shape(args, console)
    given = [flag for flag, v in (("--accept-histogram", args.accept_histogram), ("--verify-log", args.verify_log),
                                  ("--bundle", args.bundle), ("--draft-step-ms", args.draft_step_ms),
                                  ("--draft-extend-ms", args.draft_extend_ms)) if v is not None]
    if given:
        raise UserError(f"{given[0]} applies to --draft-shape only (add --draft-shape, or leave it out)")
    _check_flags(args)
    from fastverify.tune import user_figures as uf

    user = uf.from_args(args)
    workload = _workload(args)
    if args.hidden is not None and workload.hidden and args.hidden != workload.hidden:
        raise UserError(f"--hidden {args.hidden}: the workload ({workload.source}) has hidden size {workload.hidden}; --hidden is "
                        "for a trace profile that records none (leave it out)")
    if args.hidden is not None and not workload.hidden:
        # a trace profile records no hidden size: the user's --hidden is the one every stage reads
        # (the fused candidates, the sweep's norm, the deployment record), said once in the notes
        import dataclasses

        workload = dataclasses.replace(workload, hidden=args.hidden,
                                       notes=(*workload.notes, f"hidden size {args.hidden} from --hidden"))
    user, user_said = uf.reconcile(user, workload, args.profile)
    if args.tok_s is not None:  # a measured verify time bounds tok/s already (the rest needs the baseline)
        verify_reduction(workload, 0.0, 0.0, accept_length=args.accept_length, tok_s=args.tok_s, user=user)
    p2p_results = p2p_given = None
    late_notes: list[str] = []  # said after the box line, which comes first
    if args.p2p_check is not None:  # read and validated whenever given, whatever else is asked
        import msgspec

        from fastverify.topo.box import p2p_file_facts
        from fastverify.topo.p2p import complete_gpus, read_check_file

        check = read_check_file(args.p2p_check)
        p2p_results = check.results
        # the record keeps the GPUs the check tested (every ordered pair among them passed): launch
        # accepts the record's proof only for a TP group of those GPUs
        p2p_given = msgspec.structs.replace(p2p_file_facts(args.p2p_check, p2p_results), gpus=complete_gpus(check))
        if check.gpus is None:
            late_notes.append(f"# note: --p2p-check {args.p2p_check} names no GPU (a check from before it recorded "
                              "which GPUs it tested): it ranks the candidates, but `fastverify launch` takes a "
                              "record made from it as proof only once the check is rerun on the box")
    (perf, perf_warnings), log = _read_perf(args, workload.tp), _read_log(args)
    late_notes += perf_warnings
    version = _version(args)
    if version is None and log is not None and log.version:
        from fastverify.nccl.version import NcclVersion

        version = NcclVersion.parse(log.version)
    topo = _topology(args, workload.tp,
                     assume=None if user is None else lambda: uf.assumed_topology(workload.tp, p2p_results))
    uf.check_outputs(args, topo)
    from fastverify.topo.boxfacts import resolve_args

    args.box_facts = resolve_args(args, topology_gpus=None if topo is None or uf.is_assumed(topo) else len(topo.gpus),
                                  tp=workload.tp)
    if topo is not None and len(topo.gpus) < workload.tp:
        raise UserError(f"{topo.source}: {len(topo.gpus)} GPUs, fewer than --tp {workload.tp}")
    if topo is not None and p2p_results is not None:
        from fastverify.tune.predict import with_p2p_results

        topo = with_p2p_results(topo, p2p_results, source=str(args.p2p_check))
    fp = _fingerprint(workload, topo, version)
    _check_outputs(args, fp)
    shapes = _shapes(args, workload) if args.write_env is not None else None  # refused before any work

    from fastverify.nccl.catalogue import Severity, validate_env

    ranked = rank_nccl_settings(workload, topo, env=os.environ, nccl_version=version, pcie_gen=args.pcie_gen,
                                sm=args.sm, p2p_check=str(args.p2p_check) if p2p_results is not None else None) \
        if topo is not None else []
    pred = box_doc = None
    if args.predict:  # the whole prediction before any output: a bad --tok-s prints nothing
        pred = _predict(args, workload, topo, version, ranked, p2p_given, perf, log, user)
        box_doc = _box_doc(args, workload, topo, version, p2p_given, log)
    console.print(args.box_facts.first_line(), markup=False, soft_wrap=True)  # first: the box, and from where
    for note in late_notes:
        console.print(note, markup=False)
    for f in validate_env(os.environ, version):
        if f.severity is not Severity.OK:
            console.print(f"# setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}"
                          + (f" -> {f.fix}" if f.fix else ""), markup=False)
    early = (*user_said, *(ranked[0].notes if ranked and ranked[0].is_baseline else ()))
    args.held_notes = early if args.predict and not args.json and not args.explain else ()
    for note in () if args.held_notes else early:  # held: counted in the --explain line instead
        console.print(f"# note: {note}", markup=False)
    if args.predict:
        return _report_prediction(args, console, workload, topo, version, pred, shapes, p2p_given, fp, box_doc,
                                  user)
    return _measure(args, console, workload, topo, version, ranked, verify_reduction, shapes, p2p_given, fp)


def _predict(args, workload, topo, version, ranked, p2p_given, perf, log, user=None):
    """Every candidate, NCCL settings and backends ranked together, with verify time and tok/s:
    :func:`fastverify.tune.advice.rank_options` (the ranking ``topo`` advises from too) on this
    command's flags; with ``user`` (the user's own figures) scaled to them."""
    from fastverify.tune.advice import rank_options

    user_notes = ()
    if user is not None:
        from fastverify.tune import user_figures as uf

        user_notes = uf.notes(args, topo, user)
    return rank_options(workload, topo, env=os.environ, nccl_version=version, sm=args.sm, pcie_gen=args.pcie_gen,
                        p2p_given=p2p_given, perf=perf, log=log, accept_length=args.accept_length,
                        tok_s=args.tok_s, user=user, user_notes=user_notes, ranked=ranked)


def _box_doc(args, workload, topo, version, p2p_given, log) -> dict:
    p2p_ok, p2p_source = _prediction_p2p(p2p_given, topo, log)
    return {"topology": topo.source if topo is not None else None, "gpus": len(topo.gpus) if topo is not None else None,
            "tp": workload.tp, "sm": args.sm, "pcie_gen": args.pcie_gen, "facts": args.box_facts.as_dict(),
            "nccl_version": str(version) if version else None, "p2p_ok": p2p_ok, "p2p_source": p2p_source,
            "perf_table": str(args.perf_table) if args.perf_table else None,
            "nccl_log": str(args.nccl_log) if args.nccl_log else None}


def _report_prediction(args, console, workload, topo, version, pred, shapes, p2p_given, fp, box_doc,
                       user=None) -> int:
    from fastverify.registry import BackendName
    from fastverify.tune.candidates import prediction_document
    from fastverify.envfile import write_tuner_config
    from fastverify.tune.predict import prediction_header, tuner_choices

    base, best = pred.baseline, pred.best
    red = best.verify["reduction"]
    if args.json:
        import json

        doc = prediction_document(pred, workload, box=box_doc)
        if user is not None:
            from fastverify.tune.user_figures import decorate

            doc = decorate(doc, user, red, topo=topo)
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        from fastverify.tune.printer import print_prediction

        print_prediction(args, console, workload, topo, version, pred, red, p2p_ok=box_doc["p2p_ok"], user=user,
                         held_notes=getattr(args, "held_notes", ()))
    if args.write_env is not None:
        from fastverify.deploy import Gain

        path = _env_path(args, fp)
        header = prediction_header(workload, best, base, red, topology_source=topo.source, n_gpus=len(topo.gpus),
                                   pcie_gen=args.pcie_gen, sm=args.sm, user=user,
                                   box_facts=args.box_facts)
        box = _predicted_box(args, workload, topo, version)
        p2p = _p2p_facts(p2p_given, topo, cuda=False)
        # The winner by registry name: an NCCL setting, or a backend (with no NCCL setting changed).
        name = BackendName.nccl if best.nccl is not None else best.backend
        gain = Gain(baseline_us=base.point_us, best_us=best.point_us, basis="predicted")
        env_p, rec_p = _write_deployment(args, path, name, dict(best.settings), header, version,
                                         shapes=shapes, box=box, p2p=p2p, gain=gain,
                                         source=f"tune --predict: {workload.source}", batch_known=workload.batch is not None)
        console.print(f"wrote {env_p} (backend {name.value}, {len(best.settings)} NCCL setting(s); header says "
                      f"PREDICTED) and {rec_p}", markup=False)
        if backend_info(name).needs_p2p and not p2p.proven:
            console.print(f"# note: {name.value} needs P2P proven before `fastverify launch` deploys it: run "
                          "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json", markup=False)
    if args.write_tuner_config is not None:
        nccl_best = pred.best_nccl.nccl
        write_tuner_config(args.write_tuner_config, tuner_choices(nccl_best),
                           header_lines=[f"PREDICTED by fastverify tune --predict for {workload.source}",
                                         f"from the best NCCL candidate: {nccl_best.name}",
                                         "allreduce rows only; other collectives run on one channel under this plugin"])
        console.print(f"wrote {args.write_tuner_config}", markup=False)
    return 0


def _print_reduction(console, red: dict, *, best: str, tok_s_given: bool, keep: bool = False) -> None:
    """The measured winner's lines (:func:`fastverify.tune.printer.winner_lines`)."""
    from fastverify.tune.printer import winner_lines

    for line in winner_lines(red, best=best, base_label="measured", best_label="measured", tok_s_given=tok_s_given,
                             keep=keep):
        console.print(line, markup=False, highlight=False)


def _measure(args, console, workload, topo, version, ranked, verify_reduction, shapes, p2p_given, fp) -> int:
    from fastverify.deploy import Gain, installed_sglang_version
    from fastverify.registry import BackendName
    from fastverify.tune.report import plot_latency, print_report, rank_candidates
    from fastverify.tune.sweep import run_sweep
    from fastverify.tune.trial import DTYPE_BYTES, Op, TrialSpec

    import torch  # the measure mode needs torch for its workers anyway

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                     and torch.cuda.device_count() >= workload.tp)
    if args.device == "cuda" and not cuda:
        raise UserError(f"--device cuda: needs {workload.tp} GPUs, found "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    device = "cuda" if cuda else "cpu"
    if not cuda and args.write_env is not None:
        raise UserError("--write-env: without GPUs the sweep runs on gloo, which ignores NCCL settings, so it "
                        "measures nothing to write; use --predict --topology FILE, or run on the GPU box")
    elem = DTYPE_BYTES[workload.dtype]
    bad = [b for b, _ in workload.msg_sizes if b <= 0 or b % elem]
    if bad:
        raise UserError(f"{workload.source}: all-reduce sizes {bad} B are not whole {workload.dtype} tensors")
    sizes = tuple((b // elem, c) for b, c in workload.msg_sizes)
    # all-reduce + residual + RMSNorm (like for like with the fused kernels) needs the hidden size;
    # a trace profile has none, so its sizes are timed as plain all-reduces.
    fused_ok = bool(workload.hidden) and all(n % workload.hidden == 0 for n, _ in sizes)
    op = Op.ALL_REDUCE_RESIDUAL_RMSNORM if fused_ok else Op.ALL_REDUCE
    common = dict(world_size=workload.tp, device=device, dtype=workload.dtype, hidden=workload.hidden or 1,
                  sizes=sizes, warmup=args.warmup, iters=args.iters, op=op)
    if not fused_ok:
        console.print("# the workload has no hidden size (a trace profile): timing plain all-reduces; the fused "
                      "all-reduce + RMSNorm backend is left out", markup=False)
    base_backend = (BackendName.nccl if cuda else BackendName.gloo).value
    trials = [TrialSpec(backend=base_backend, env={}, label="current environment", baseline=True, **common)]
    for c in [c for c in ranked if not c.is_baseline][: args.top]:
        trials.append(TrialSpec(backend=base_backend, env=dict(c.settings), label=c.name, **common))
    if not ranked and not cuda:
        console.print("# no topology (--topology FILE or NVML): only the current environment is measured", markup=False)
    box = p2p = None
    sglang_version = installed_sglang_version()
    if cuda:
        from fastverify.topo.box import read_box

        box = read_box(workload.tp, nccl_version=str(version) if version else None)
        p2p = _p2p_facts(p2p_given, topo, cuda=True)
        max_numel = max([n for n, _ in sizes] + ([shapes.max_numel] if shapes else []))
        extra, skipped = backend_trials(common, box=box, p2p=p2p, fused_ok=fused_ok, max_numel=max_numel,
                                        sglang_version=sglang_version)
        trials += extra
        for why in skipped:
            console.print(f"# not measured: {why}", markup=False)
    journal = _journal_path(args, fp)
    console.print(f"# fastverify tune: {len(trials)} trial(s), {workload.allreduce_count} all-reduces per verify step, "
                  f"{device}; journal {journal}", markup=False)
    if not cuda:
        console.print("# no GPUs: trials run on gloo over CPU, which ignores NCCL settings; timings are CPU wall "
                      "clock, NOT GPU timings; this checks the machinery, it does not tune", markup=False)
    try:
        results = run_sweep(trials, journal_path=journal, timeout_s=args.timeout, resume=args.resume, progress=True,
                            config={"workload": workload.source, "fingerprint": fp})
    except OSError as e:
        raise UserError(f"{journal}: cannot write the journal ({e.strerror or e})") from None
    ranking = rank_candidates(trials, results)
    red = None
    if ranking.best is not None and ranking.baseline is not None:  # a bad --tok-s: before the report
        red = verify_reduction(workload, ranking.baseline.step_us, ranking.best.step_us,
                               accept_length=args.accept_length, tok_s=args.tok_s)
    print_report(ranking, console)
    if args.png:
        written = plot_latency(ranking, args.png)
        console.print(f"wrote {written}", markup=False)
    if red is None:
        raise UserError("no trial finished with a correct result (see the reasons above); nothing to write")
    if args.json:
        import json

        from fastverify.tune.candidates import measured_document

        doc = measured_document(ranking, workload, accept_length=args.accept_length, tok_s=args.tok_s,
                                box={"device": device, "tp": workload.tp, "nccl_version": str(version) if version else None,
                                     "topology": topo.source if topo is not None else None,
                                     "gpu_name": box.gpu_name if box is not None else None})
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    if cuda:
        _print_reduction(console, red, best=ranking.best.spec.name, tok_s_given=args.tok_s is not None,
                         keep=ranking.best is ranking.baseline)
    if args.write_env is not None:
        path = _env_path(args, fp)
        chosen, why_not = choose_winner(ranking, box=box, p2p=p2p, world_size=workload.tp,
                                        sglang_version=sglang_version, dtype=workload.dtype)
        for why in why_not:
            console.print(f"# not recommended: {why}", markup=False)
        best = chosen.spec
        gain_pct = 100.0 * (ranking.baseline.step_us - chosen.step_us) / ranking.baseline.step_us
        spread_pct = _spread_pct(ranking.baseline.result)
        if best is not ranking.baseline.spec and gain_pct < max(MIN_WIN_PCT, spread_pct):
            console.print(f"# the best candidate is {gain_pct:.1f} % faster than the baseline, within the noise "
                          f"(needs > {max(MIN_WIN_PCT, spread_pct):.1f} %): keeping the current settings", markup=False)
            chosen, best = ranking.baseline, ranking.baseline.spec
        info = backend_info(best.backend)
        name = BackendName.nccl if info.role is Role.baseline else info.name
        header = ["MEASURED by fastverify tune (GPU, CUDA events)", f"workload: {workload.source}",
                  f"winner: {best.label or best.backend}: {chosen.step_us:.1f} us per verify step vs "
                  f"{ranking.baseline.step_us:.1f} us baseline"]
        gain = Gain(baseline_us=ranking.baseline.step_us, best_us=chosen.step_us, basis="measured",
                    clock=chosen.result.clock.value if chosen.result.clock else None)
        env_p, rec_p = _write_deployment(args, path, name, dict(best.env), header, version, shapes=shapes, box=box,
                                         p2p=p2p, gain=gain, source=f"tune (measured): {workload.source}",
                                         batch_known=workload.batch is not None)
        from fastverify.tune.predict import change_pct

        change = change_pct(100.0 * (chosen.step_us - ranking.baseline.step_us) / ranking.baseline.step_us)
        console.print(f"wrote {env_p} and {rec_p} (backend {name.value}, all-reduce per verify step {change}, "
                      "measured)", markup=False)
        if info.needs_p2p and not p2p.proven:
            console.print(f"# note: {name.value} needs P2P proven before `fastverify launch` deploys it: run "
                          "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json", markup=False)
    return 0


def _spread_pct(result) -> float:
    """The baseline's own p90-over-median spread (%, worst size): differences below it are noise."""
    spreads = [100.0 * (z.p90_us - z.median_us) / z.median_us for z in result.sizes
               if z.median_us and z.p90_us is not None]
    return max(spreads, default=0.0)


def _shapes(args, workload):
    """The verify shapes the deployment record carries (:class:`fastverify.deploy.VerifyShapes`),
    read from the workload as its source recorded them: draft tokens and batch of a live profile
    or model workload; ``--draft-tokens`` only where the source does not say (a trace profile).
    ``max_batch`` is ``--max-batch`` (the server's largest captured batch), default the workload's
    batch.

    Raises
    ------
    UserError
        No hidden size (a trace profile without ``--hidden``); no draft-token count (a trace profile
        without ``--draft-tokens``); ``--draft-tokens`` contradicting the profile's; ``--max-batch``
        below the workload's batch.
    """
    from fastverify.deploy import VerifyShapes

    hidden = args.hidden or workload.hidden
    if not hidden:
        raise UserError(f"--write-env: {workload.source} has no hidden size (a trace profile); give --hidden N "
                        "(the model's hidden_size) or use --model")
    draft = workload.draft_tokens
    if draft is None:
        draft = args.draft_tokens
        if draft is None:
            raise UserError(f"--write-env: {workload.source} does not record the draft tokens per request (a trace "
                            "profile); give --draft-tokens N (SGLang's --speculative-num-draft-tokens)")
    elif args.draft_tokens is not None and args.draft_tokens != draft:
        raise UserError(f"--draft-tokens {args.draft_tokens}: the workload was measured with {draft} draft tokens "
                        "per request; drop the flag or re-profile")
    batch = workload.batch
    if batch is None:
        batch = workload.tokens // draft if workload.tokens else 1
        if workload.tokens and workload.tokens % draft:
            raise UserError(f"--draft-tokens {draft}: does not divide the profile's {workload.tokens} tokens per step")
    max_batch = args.max_batch or batch
    if max_batch < batch:
        raise UserError(f"--max-batch {max_batch}: smaller than the workload's batch {batch}")
    return VerifyShapes(max_batch=max_batch, draft_tokens=draft, hidden=hidden, dtype=workload.dtype)


def _predicted_box(args, workload, topo, version):
    """The fingerprint of the box ``--predict`` describes: GPU names from the topology (when it
    has them), compute capability from ``--sm``, GPU count from the topology."""
    from fastverify.deploy import BoxFingerprint

    name = next((g.name for g in topo.gpus if g.name), None)
    first = sorted(topo.gpu_indices)[: workload.tp]
    links = [topo.link(a, b) for i, a in enumerate(first) for b in first[i + 1:]]
    # SGLang's full-NVLink test (custom_all_reduce_utils.py::is_full_nvlink) over the first tp GPUs
    nvlink = None if any(link is None for link in links) else all(link.startswith("NV") for link in links)
    return BoxFingerprint(gpu_name=name, sm=(args.sm // 10, args.sm % 10), gpu_count=len(topo.gpus), tp=workload.tp,
                          driver=None, nccl_version=str(version) if version else None, nvlink_full=nvlink)


def backend_trials(common: dict, *, box, p2p, fused_ok: bool, max_numel: int,
                   sglang_version: str | None) -> tuple[list, list[str]]:
    """One trial per tunable registry backend that SGLang can reach on ``box``.

    Parameters
    ----------
    common : dict
        The :class:`~fastverify.tune.trial.TrialSpec` fields shared by every trial (world size,
        device, dtype, hidden, sizes, op, ...).
    box : BoxFingerprint
    p2p : P2PFacts
        NVML's report is enough to *measure* (a hang is killed at the trial's timeout); ``launch``
        later insists on proof.
    fused_ok : bool
        The workload has a hidden size, so all-reduce + residual + RMSNorm backends can be timed.
    max_numel : int
        Workspace bound (elements) for backends that take one.

    Returns
    -------
    (trials, skipped)
        The trials, and one line per backend left out, saying why
        (:func:`fastverify.registry.unreachable_reason`).
    """
    from fastverify.registry import Role, backend_info, names, unreachable_reason
    from fastverify.tune.trial import TrialSpec

    trials, skipped = [], []
    for name in names(tunable=True):
        info = backend_info(name)
        if info.role is Role.fused_norm and not fused_ok:
            skipped.append(f"{name.value}: the workload has no hidden size (a trace profile)")
            continue
        reason = unreachable_reason(info, sm=tuple(box.sm) if box.sm else None, world_size=common["world_size"],
                                    p2p_ok=p2p.ok, p2p_source=p2p.source, sglang_version=sglang_version,
                                    nvlink_full=box.nvlink_full, dtype=common["dtype"])
        if reason is not None:
            skipped.append(reason)
            continue
        trials.append(TrialSpec(backend=name.value, env={}, label=name.value, options={"max_numel": max_numel},
                                probe_facts={"p2p_ok": p2p.ok}, **common))
    return trials, skipped


def choose_winner(ranking, *, box, p2p, world_size: int, sglang_version: str | None, dtype: str | None = None):
    """The fastest candidate SGLang can reach on ``box`` (a baseline always qualifies).

    A candidate the registry says SGLang cannot reach there (``fused`` on SM89/SM120: SGLang 0.5.23
    calls it only on SM90/SM100) is never recommended, however fast it measured.

    Returns
    -------
    (Candidate, list[str])
        The winner, and one line per faster candidate passed over.
    """
    from fastverify.registry import Role, backend_info, unreachable_reason

    passed = []
    for c in ranking.candidates:
        info = backend_info(c.spec.backend)
        if info.role is Role.baseline:
            return c, passed
        reason = unreachable_reason(info, sm=tuple(box.sm) if box is not None and box.sm else None,
                                    world_size=world_size, p2p_ok=p2p.ok if p2p is not None else None,
                                    p2p_source=p2p.source if p2p is not None else "", sglang_version=sglang_version,
                                    nvlink_full=box.nvlink_full if box is not None else None, dtype=dtype)
        if reason is None:
            return c, passed
        passed.append(reason)
    return ranking.baseline, passed


def _write_deployment(args, path, backend, settings, header, version, *, shapes, box, p2p, gain, source,
                      batch_known=True):
    """The env file (NCCL settings only: never the backend's SGLang switch, which an env file
    sourced without launch would turn on with no P2P check) and the deployment record beside it,
    which alone names the backend; both or neither (:func:`fastverify.deploy.write_deployment`)."""
    from fastverify.deploy import DeploymentRecord, installed_sglang_version, sglang_settings, write_deployment

    env = dict(settings)
    record = DeploymentRecord(backend=backend, shapes=shapes, p2p=p2p, box=box,
                              nccl_settings={k: v for k, v in settings.items() if k.startswith("NCCL_")},
                              sglang_version=installed_sglang_version(), gain=gain, source=source)
    lines = [*header, f"backend: {backend.value}; shapes: max batch {shapes.max_batch} x {shapes.draft_tokens} draft "
             f"tokens x hidden {shapes.hidden} {shapes.dtype}; P2P: {p2p.source} ({'proven' if p2p.proven else 'not proven'})"]
    if sglang_settings(backend):
        lines.append(f"no SGLang switch here: the backend ({backend.value}) is in the deployment record; `fastverify "
                     "launch --env FILE` switches SGLang to it after proving P2P (this file alone, sourced by docker "
                     "or systemd, runs NCCL)")
    if args.max_batch is None:
        what = (f"the profiled batch {shapes.max_batch}" if batch_known else
                f"{shapes.max_batch}: the profile records no batch (a trace profile)")
        lines.append(f"max batch = {what} (no --max-batch given); `fastverify launch` reads the server's own "
                     "captured batch sizes from its command")
    inputs = (args.profile, args.topology, args.p2p_check, args.journal, args.perf_table, args.nccl_log)
    # (checked in full, backups included, by _check_outputs)
    return write_deployment(path, env, record, header_lines=lines, nccl_version=version, inputs=inputs)
