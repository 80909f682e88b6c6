"""``fastverify tune`` without ``--predict``: measure the candidates, each in a fresh set of worker
processes (:mod:`fastverify.tune.sweep`), rank them (:mod:`fastverify.tune.ranking`) and write the
winner.

The trials: the current environment as the baseline, the cost model's top ``--top`` NCCL settings,
each over the environment the SGLang server's start-up imposes (:mod:`fastverify.tune.server_env`),
and on GPUs every tunable registry backend (:func:`fastverify.registry.names`) that SGLang can
reach on this box (:func:`fastverify.registry.unreachable_reason`; :func:`backend_trials`).
Without GPUs the same machinery runs on gloo, which ignores NCCL settings: the output says so and
the timings are CPU wall clock. ``--write-env`` writes the winner by registry name, never one
SGLang cannot reach on the box (:func:`choose_winner`), and only when it beats the baseline by
more than the noise (:data:`MIN_WIN_PCT`).

Where ``fastverify tune`` writes, checked before any work, and the env file and deployment
record it writes.

``--write-env X.env`` writes the env file and the deployment record ``X.deploy.json`` beside it
(:mod:`fastverify.deploy`), both or neither: the record names the winner by registry name, the
shapes (``--max-batch`` x draft tokens x hidden, dtype), the P2P facts and their source, the box
fingerprint, the NCCL settings, the SGLang version and the gain with its basis. The env file holds
NCCL settings only: the winner's SGLang switch is never written there (sourced without ``launch``
it would start that path unchecked); ``launch`` sets it from the record after the P2P proof
(:func:`fastverify.deploy.sglang_settings`).
"""

from __future__ import annotations

import os
from pathlib import Path

from fastverify.console import say
from fastverify.deploy import (
    DeploymentRecord,
    Gain,
    VerifyShapes,
    installed_sglang_version,
    record_path_for,
    sglang_settings,
    write_deployment,
)
from fastverify.envfile import default_env_path
from fastverify.errors import UserError
from fastverify.live.config import preset_names
from fastverify.outputs import (
    backup_path,
    check_folder,
    check_outputs as check_no_clobber,
    claim_output,
    refuse_symlink,
    shown,
)
from fastverify.patch.server_cmd import server_args_of
from fastverify.registry import BackendName, Role, backend_info, names, unreachable_reason
from fastverify.topo.box import read_box
from fastverify.tune.advice import p2p_facts
from fastverify.tune.predict import MEASURED_ONLY
from fastverify.tune.printer import measured_document, winner_lines
from fastverify.tune.ranking import plot_format, plot_latency, print_report, rank_candidates
from fastverify.tune.server_env import server_environment, tp_of
from fastverify.tune.sweep import run_sweep
from fastverify.tune.trial import DTYPE_BYTES, Op, TrialSpec
from fastverify.tune.verify_time import change_pct, verify_reduction


def env_path(args, fp: str) -> Path | None:
    """``--write-env``'s path (default ``nccl_configs/<box fingerprint>.env``), or None."""
    if args.write_env is None:
        return None
    return Path(args.write_env) if args.write_env else default_env_path(fp)


def journal_path(args, fp: str) -> Path:
    """``--journal``, default ``nccl_configs/<box fingerprint>.journal.jsonl``."""
    return args.journal or Path("nccl_configs") / f"{fp}.journal.jsonl"


def check_outputs(args, fp: str) -> None:
    """Refuse unusable output paths before any work, so nothing is half-written afterwards: each
    output's folder must exist or be creatable (:func:`fastverify.outputs.check_folder`),
    ``--png`` must name a format matplotlib writes, and no output may replace an input
    (``--topology``, ``--profile``, ``--p2p-check``, a ``--model`` config file) or another output
    (:func:`fastverify.outputs.check_outputs`)."""
    env_p = env_path(args, fp)
    rec_p = record_path_for(env_p) if env_p is not None else None
    # atomic_write_text keeps an existing file as <name>.bak: the backups are outputs too, so an
    # input named X.env.bak (or X.deploy.json.bak) is never replaced by the old env file.
    outputs = {
        "--write-env": env_p,
        "--write-env (deployment record)": rec_p,
        "--write-tuner-config": args.write_tuner_config,
        "--png": args.png,
        "--journal": None if args.predict else journal_path(args, fp),
        "--write-env (backup of the env file)": backup_path(env_p) if env_p is not None else None,
        "--write-env (backup of the deployment record)": backup_path(rec_p) if rec_p is not None else None,
        "--write-tuner-config (backup)": (
            backup_path(args.write_tuner_config) if args.write_tuner_config is not None else None
        ),
    }
    for flag, value in (
        ("--write-env", args.write_env or None),
        ("--write-tuner-config", args.write_tuner_config),
        ("--png", args.png),
        ("--journal", args.journal),
    ):
        if value and str(value).endswith(os.sep):
            raise UserError(f"{flag} {value}: give a file path, not a folder")
    if env_p is not None and (not env_p.name.endswith(".env") or env_p.name == ".env"):
        stem = env_p.name.split(".")[0] or "box"
        raise UserError(
            f"--write-env {env_p}: name the env file <name>.env, e.g. {env_p.with_name(stem + '.env')} "
            f"(its deployment record goes beside it as {stem}.deploy.json)"
        )
    model = args.model if args.model is not None and args.model not in preset_names() else None
    inputs = {
        "--topology": args.topology,
        "--profile": args.profile,
        "--p2p-check": args.p2p_check,
        "--model": model,
        "--perf-table": args.perf_table,
        "--nccl-log": args.nccl_log,
    }
    if outputs["--journal"] is not None:  # appended in place, not renamed over: never through a link
        refuse_symlink(outputs["--journal"], "--journal")
    for flag, path in outputs.items():
        if path is not None:
            check_folder(path, flag.split(" ")[0])
    check_no_clobber(outputs, inputs)
    _claim(args, outputs)
    if args.png is not None:
        plot_format(args.png)


def _claim(args, outputs: dict) -> None:
    """An existing output file is replaced only with ``--force`` (then kept as ``<name>.bak``),
    and the journal of an earlier sweep is started over only with ``--force`` (``--resume``
    continues it); every new name is taken by an exclusive create
    (:func:`fastverify.outputs.claim_output`)."""
    force = getattr(args, "force", False)
    journal = outputs.get("--journal")
    if (
        journal is not None
        and not args.resume
        and not force
        and os.path.isfile(journal)
        and os.path.getsize(journal) > 0
    ):
        raise UserError(
            f"--journal {shown(journal)}: holds an earlier sweep; --resume to continue it, or --force "
            "to start over (it is kept as .bak)"
        )
    for flag in ("--write-env", "--write-env (deployment record)", "--write-tuner-config", "--png"):
        claim_output(outputs.get(flag), flag, force=force)


def box_fingerprint(workload, topo, version) -> str:
    """The box's name in default output paths: first GPU name (else the topology file's stem),
    TP and NCCL version."""
    gpus = topo.gpus if topo else ()
    name = next((g.name for g in gpus if g.name), None) or (Path(topo.source).stem if topo else "unknown-box")
    return f"{name}-tp{workload.tp}-nccl{version or 'unknown'}"


def verify_shapes(args, workload):
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
    hidden = args.hidden or workload.hidden
    if not hidden:
        raise UserError(
            f"--write-env: {workload.source} has no hidden size (a trace profile); give --hidden N "
            "(the model's hidden_size) or use --model"
        )
    draft = workload.draft_tokens
    if draft is None:
        draft = args.draft_tokens
        if draft is None:
            raise UserError(
                f"--write-env: {workload.source} does not record the draft tokens per request (a trace "
                "profile); give --draft-tokens N (SGLang's --speculative-num-draft-tokens)"
            )
    elif args.draft_tokens is not None and args.draft_tokens != draft:
        raise UserError(
            f"--draft-tokens {args.draft_tokens}: the workload was measured with {draft} draft tokens "
            "per request; drop the flag or re-profile"
        )
    batch = workload.batch
    if batch is None:
        batch = workload.tokens // draft if workload.tokens else 1
        if workload.tokens and workload.tokens % draft:
            raise UserError(f"--draft-tokens {draft}: does not divide the profile's {workload.tokens} tokens per step")
    max_batch = args.max_batch or batch
    if max_batch < batch:
        raise UserError(f"--max-batch {max_batch}: smaller than the workload's batch {batch}")
    return VerifyShapes(max_batch=max_batch, draft_tokens=draft, hidden=hidden, dtype=workload.dtype)


def write_env_and_record(
    args, path, backend, settings, header, version, *, shapes, box, p2p, gain, source, batch_known=True
):
    """The env file (NCCL settings only: never the backend's SGLang switch, which an env file
    sourced without launch would turn on with no P2P check) and the deployment record beside it,
    which alone names the backend and carries the baseline's answers (``tune --baseline``); both or
    neither (:func:`fastverify.deploy.write_deployment`)."""
    env = dict(settings)
    record = DeploymentRecord(
        backend=backend,
        shapes=shapes,
        p2p=p2p,
        box=box,
        nccl_settings={k: v for k, v in settings.items() if k.startswith("NCCL_")},
        sglang_version=installed_sglang_version(),
        gain=gain,
        source=source,
        baseline=getattr(args, "answer_baseline", None),
    )
    lines = [
        *header,
        f"backend: {backend.value}; shapes: max batch {shapes.max_batch} x {shapes.draft_tokens} draft "
        f"tokens x hidden {shapes.hidden} {shapes.dtype}; P2P: {p2p.source} ({'proven' if p2p.proven else 'not proven'})",
    ]
    if sglang_settings(backend):
        lines.append(
            f"no SGLang switch here: the backend ({backend.value}) is in the deployment record; `fastverify "
            "launch --env FILE` switches SGLang to it after proving P2P (this file alone, sourced by docker "
            "or systemd, runs NCCL)"
        )
    if args.max_batch is None:
        what = (
            f"the profiled batch {shapes.max_batch}"
            if batch_known
            else f"{shapes.max_batch}: the profile records no batch (a trace profile)"
        )
        lines.append(
            f"max batch = {what} (no --max-batch given); `fastverify launch` reads the server's own "
            "captured batch sizes from its command"
        )
    inputs = (args.profile, args.topology, args.p2p_check, args.journal, args.perf_table, args.nccl_log)
    # (checked in full, backups included, by check_outputs)
    return write_deployment(path, env, record, header_lines=lines, nccl_version=version, inputs=inputs)


MIN_WIN_PCT = 2.0
"""A measured candidate must beat the baseline's verify-step all-reduce time by this much (and by
more than the baseline's own p90 spread) before its settings are written: smaller differences are
run-to-run noise, not a reason to change a server's settings."""


def measure(args, console, workload, topo, version, ranked, shapes, p2p_given, fp) -> int:
    """Build the trials, run the sweep, print the ranking (``--json``: the document) and the
    winner's verify change, and write ``--write-env``; returns 0.

    Raises
    ------
    UserError
        ``--device cuda`` without enough GPUs, ``--write-env`` without GPUs, sizes that are not
        whole tensors, an unwritable journal, or no trial that finished with a correct result.
    """
    import torch  # the measure mode needs torch for its workers anyway

    cuda = args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= workload.tp
    )
    if args.device == "cuda" and not cuda:
        raise UserError(
            f"--device cuda: needs {workload.tp} GPUs, found "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    device = "cuda" if cuda else "cpu"
    if not cuda and args.write_env is not None:
        raise UserError(
            "--write-env: without GPUs the sweep runs on gloo, which ignores NCCL settings, so it "
            "measures nothing to write; use --predict --topology FILE, or run on the GPU box"
        )
    trials, box, p2p, sglang_version = _trials(
        args, console, workload, topo, version, ranked, shapes, p2p_given, device
    )
    ranking = _run(args, console, workload, trials, device, fp)
    red = None
    if ranking.best is not None and ranking.baseline is not None:  # a bad --tok-s: before the report
        red = verify_reduction(
            workload, ranking.baseline.step_us, ranking.best.step_us, accept_length=args.accept_length, tok_s=args.tok_s
        )
    _report(args, console, workload, topo, version, ranking, red, device, box)
    if args.write_env is not None:
        _write_env(args, console, workload, version, ranking, shapes, box, p2p, sglang_version, fp)
    return 0


def _trials(args, console, workload, topo, version, ranked, shapes, p2p_given, device):
    """``(trials, box, P2P facts, SGLang version)``: the baseline and NCCL trials, and on GPUs the
    backends' (box and P2P then read here, else None); what is left out is said."""
    cuda = device == "cuda"
    elem = DTYPE_BYTES[workload.dtype]
    bad = [b for b, _ in workload.msg_sizes if b <= 0 or b % elem]
    if bad:
        raise UserError(f"{workload.source}: all-reduce sizes {bad} B are not whole {workload.dtype} tensors")
    sizes = tuple((b // elem, c) for b, c in workload.msg_sizes)
    # all-reduce + residual + RMSNorm (like for like with the fused kernels) needs the hidden size;
    # a trace profile has none, so its sizes are timed as plain all-reduces.
    fused_ok = bool(workload.hidden) and all(n % workload.hidden == 0 for n, _ in sizes)
    op = Op.ALL_REDUCE_RESIDUAL_RMSNORM if fused_ok else Op.ALL_REDUCE
    common = dict(
        world_size=workload.tp,
        device=device,
        dtype=workload.dtype,
        hidden=workload.hidden or 1,
        sizes=sizes,
        warmup=args.warmup,
        iters=args.iters,
        op=op,
    )
    if not fused_ok:
        console.print(
            "# the workload has no hidden size (a trace profile): timing plain all-reduces; the fused "
            "all-reduce + RMSNorm backend is left out",
            markup=False,
        )
    base_backend = (BackendName.nccl if cuda else BackendName.gloo).value
    nccl = nccl_trials(ranked, args.top, getattr(args, "nccl_sets", ()))
    server = _server_env(args, console, workload.tp, [{}] + [settings for settings, _ in nccl])
    trials = [
        TrialSpec(
            backend=base_backend,
            env={},
            server_env=server.envs[0],
            label="current environment",
            baseline=True,
            **common,
        )
    ]
    for (settings, label), senv in zip(nccl, server.envs[1:]):
        trials.append(TrialSpec(backend=base_backend, env=settings, server_env=senv, label=label, **common))
    common["server_env"] = server.envs[0]  # the backends' trials carry no settings of their own
    if not ranked and not cuda and not nccl:
        console.print("# no topology (--topology FILE or NVML): only the current environment is measured", markup=False)
    box = p2p = None
    sglang_version = installed_sglang_version()
    if cuda:
        box = read_box(workload.tp, nccl_version=str(version) if version else None)
        p2p = p2p_facts(p2p_given, topo, cuda=True)
        max_numel = max([n for n, _ in sizes] + ([shapes.max_numel] if shapes else []))
        extra, skipped = backend_trials(
            common, box=box, p2p=p2p, fused_ok=fused_ok, max_numel=max_numel, sglang_version=sglang_version
        )
        trials += extra
        for why in skipped:
            say(console, f"# not measured: {why}")
    return trials, box, p2p, sglang_version


def nccl_trials(ranked, top: int, asked) -> list[tuple[dict, str]]:
    """``(settings, label)`` of each NCCL trial: the cost model's ``top`` candidates, then each
    ``tune --set`` candidate (``asked``, :class:`fastverify.tune.command.NcclSet`), named as the model
    ranked it, or ``... (measured only, not predicted)`` where it could not."""
    predicted = {tuple(sorted(c.settings.items())): c.name for c in ranked if c.given}
    out = [(dict(c.settings), c.name) for c in ranked if not c.is_baseline and not c.given][:top]
    for s in asked:
        name = predicted.get(tuple(sorted(s.settings.items())))
        text = " ".join(f"{k}={v}" for k, v in sorted(s.settings.items()))
        out.append((dict(s.settings), name or f"{text} ({MEASURED_ONLY})"))
    return out


def _server_env(args, console, tp: int, overlays: list[dict]):
    """What SGLang's start-up sets over the shell plus each overlay (:mod:`fastverify.tune.server_env`),
    for the server of ``--server-args`` (else a plain ``tp``-way one); said in one line."""
    flags = None
    if args.server_args:
        words = args.server_args  # shell words (tune.command's parser)
        flags = server_args_of(words) or words  # a whole `python -m sglang.launch_server ...`, or its flags
        if tp_of(flags) not in (None, tp):
            raise UserError(
                f"--server-args names --tp-size {tp_of(flags)} but --tp is {tp}: the trials must run "
                "on the server's GPUs; give the same size"
            )
    server = server_environment(flags, overlays, tp=tp)
    base = " ".join(f"{k}={v}" for k, v in server.envs[0].items()) or "nothing"
    say(
        console,
        f"# trials run in the server's environment: SGLang's start-up sets {base} ({server.source}"
        + (f"; {server.note}" if server.note else "")
        + ")",
    )
    return server


def _run(args, console, workload, trials, device, fp):
    """The sweep over ``trials`` (journaled, resumable), ranked."""
    journal = journal_path(args, fp)
    say(
        console,
        f"# fastverify tune: {len(trials)} trial(s), {workload.allreduce_count} all-reduces per verify step, "
        f"{device}; journal {journal}",
    )
    if device != "cuda":
        console.print(
            "# no GPUs: trials run on gloo over CPU, which ignores NCCL settings; timings are CPU wall "
            "clock, NOT GPU timings; this checks the machinery, it does not tune",
            markup=False,
        )
    try:
        results = run_sweep(
            trials,
            journal_path=journal,
            timeout_s=args.timeout,
            resume=args.resume,
            progress=True,
            config={"workload": workload.source, "fingerprint": fp},
        )
    except OSError as e:
        raise UserError(f"{journal}: cannot write the journal ({e.strerror or e})") from None
    return rank_candidates(trials, results)


def _report(args, console, workload, topo, version, ranking, red, device, box) -> None:
    """The ranking table, ``--png``, ``--json``'s document and the winner's lines (GPU only)."""
    print_report(ranking, console)
    if args.png:
        written = plot_latency(ranking, args.png)
        say(console, f"wrote {written}")
    if red is None:
        raise UserError("no trial finished with a correct result (see the reasons above); nothing to write")
    if args.json:
        import json
        import sys

        doc = measured_document(
            ranking,
            workload,
            accept_length=args.accept_length,
            tok_s=args.tok_s,
            box={
                "device": device,
                "tp": workload.tp,
                "nccl_version": str(version) if version else None,
                "topology": topo.source if topo is not None else None,
                "gpu_name": box.gpu_name if box is not None else None,
            },
        )
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")  # print() skips a closed stdout
    if device == "cuda":
        for line in winner_lines(
            red,
            best=ranking.best.spec.name,
            base_label="measured",
            best_label="measured",
            tok_s_given=args.tok_s is not None,
            keep=ranking.best is ranking.baseline,
        ):
            say(console, line)


def _write_env(args, console, workload, version, ranking, shapes, box, p2p, sglang_version, fp) -> None:
    """The env file and deployment record of the fastest candidate SGLang can reach, or of the
    baseline where the winner is within the noise."""
    chosen, why_not = choose_winner(
        ranking, box=box, p2p=p2p, world_size=workload.tp, sglang_version=sglang_version, dtype=workload.dtype
    )
    for why in why_not:
        say(console, f"# not recommended: {why}")
    best = chosen.spec
    gain_pct = 100.0 * (ranking.baseline.step_us - chosen.step_us) / ranking.baseline.step_us
    spread_pct = _spread_pct(ranking.baseline.result)
    if best is not ranking.baseline.spec and gain_pct < max(MIN_WIN_PCT, spread_pct):
        console.print(
            f"# the best candidate is {gain_pct:.1f} % faster than the baseline, within the noise "
            f"(needs > {max(MIN_WIN_PCT, spread_pct):.1f} %): keeping the current settings",
            markup=False,
        )
        chosen, best = ranking.baseline, ranking.baseline.spec
    info = backend_info(best.backend)
    name = BackendName.nccl if info.role is Role.baseline else info.name
    header = [
        "MEASURED by fastverify tune (GPU, CUDA events)",
        f"workload: {workload.source}",
        f"winner: {best.label or best.backend}: {chosen.step_us:.1f} us per verify step vs "
        f"{ranking.baseline.step_us:.1f} us baseline",
    ]
    gain = Gain(
        baseline_us=ranking.baseline.step_us,
        best_us=chosen.step_us,
        basis="measured",
        clock=chosen.result.clock.value if chosen.result.clock else None,
    )
    env_p, rec_p = write_env_and_record(
        args,
        env_path(args, fp),
        name,
        dict(best.env),
        header,
        version,
        shapes=shapes,
        box=box,
        p2p=p2p,
        gain=gain,
        source=f"tune (measured): {workload.source}",
        batch_known=workload.batch is not None,
    )
    change = change_pct(100.0 * (chosen.step_us - ranking.baseline.step_us) / ranking.baseline.step_us)
    say(console, f"wrote {env_p} and {rec_p} (backend {name.value}, all-reduce per verify step {change}, measured)")
    if info.needs_p2p and not p2p.proven:
        say(
            console,
            f"# note: {name.value} needs P2P proven before `fastverify launch` deploys it: run "
            "`fastverify p2p --output p2p.json` and pass --p2p-check p2p.json",
        )


def _spread_pct(result) -> float:
    """The baseline's own p90-over-median spread (%, worst size): differences below it are noise."""
    spreads = [
        100.0 * (z.p90_us - z.median_us) / z.median_us for z in result.sizes if z.median_us and z.p90_us is not None
    ]
    return max(spreads, default=0.0)


def backend_trials(
    common: dict, *, box, p2p, fused_ok: bool, max_numel: int, sglang_version: str | None
) -> tuple[list, list[str]]:
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
    trials, skipped = [], []
    for name in names(tunable=True):
        info = backend_info(name)
        if info.role is Role.fused_norm and not fused_ok:
            skipped.append(f"{name.value}: the workload has no hidden size (a trace profile)")
            continue
        reason = unreachable_reason(
            info,
            sm=tuple(box.sm) if box.sm else None,
            world_size=common["world_size"],
            p2p_ok=p2p.ok,
            p2p_source=p2p.source,
            sglang_version=sglang_version,
            nvlink_full=box.nvlink_full,
            dtype=common["dtype"],
        )
        if reason is not None:
            skipped.append(reason)
            continue
        trials.append(
            TrialSpec(
                backend=name.value,
                env={},
                label=name.value,
                options={"max_numel": max_numel},
                probe_facts={"p2p_ok": p2p.ok},
                **common,
            )
        )
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
    passed = []
    for c in ranking.candidates:
        info = backend_info(c.spec.backend)
        if info.role is Role.baseline:
            return c, passed
        reason = unreachable_reason(
            info,
            sm=tuple(box.sm) if box is not None and box.sm else None,
            world_size=world_size,
            p2p_ok=p2p.ok if p2p is not None else None,
            p2p_source=p2p.source if p2p is not None else "",
            sglang_version=sglang_version,
            nvlink_full=box.nvlink_full if box is not None else None,
            dtype=dtype,
        )
        if reason is None:
            return c, passed
        passed.append(reason)
    return ranking.baseline, passed
