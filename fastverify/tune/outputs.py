"""Where ``fastverify tune`` writes, checked before any work, and the env file and deployment
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

from fastverify.deploy import (
    DeploymentRecord,
    VerifyShapes,
    installed_sglang_version,
    record_path_for,
    sglang_settings,
    write_deployment,
)
from fastverify.envfile import default_env_path
from fastverify.errors import UserError
from fastverify.live.config import preset_names
from fastverify.output_paths import backup_path, check_folder, check_outputs as check_no_clobber, shown
from fastverify.outputs import claim_output
from fastverify.tune.ranking import plot_format


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
    output's folder must exist or be creatable (:func:`fastverify.output_paths.check_folder`),
    ``--png`` must name a format matplotlib writes, and no output may replace an input
    (``--topology``, ``--profile``, ``--p2p-check``, a ``--model`` config file) or another output
    (:func:`fastverify.output_paths.check_outputs`)."""
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
