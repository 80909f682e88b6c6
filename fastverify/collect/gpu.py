"""The multi-GPU parts of ``fastverify collect``: the real P2P check, an NCCL debug log of the verify
all-reduces, and a ``fastverify tune`` sweep at the verify shapes. Each runs only with at least 2
CUDA GPUs (:func:`gpu_skip_reason`); everything that touches the GPUs runs in fresh processes
with a time limit (the tune trial machinery, :mod:`fastverify.tune.sweep`, or a child command)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import orjson

from fastverify.bundle import ARCNAMES
from fastverify.collect.core import Context, Outcome, failed, fastverify_argv, ok, run_child
from fastverify.errors import UserError
from fastverify.live.config import load_model_config
from fastverify.registry import BackendName
from fastverify.topo.p2p import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S
from fastverify.topo.p2p_proof import count_statuses, results_from_json
from fastverify.tune.sweep import run_trial
from fastverify.tune.trial import Op, TrialSpec

NO_CUDA = "no CUDA GPUs"
NO_CUDA_SWEEP = "no CUDA GPUs: a gloo sweep times the CPU, not this box's GPUs"
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,ENV,TUNING"}
NCCL_LOG_ITERS, NCCL_LOG_WARMUP = 5, 2
P2P_PARALLEL = 4  # pair children at once: fastverify.topo.p2p.check_p2p's max_parallel default
SWEEP_TRIAL_MAX_S = 120.0  # tune's own --timeout default
PRESET_HIDDEN = {"kimi-k2": 7168}


def gpu_skip_reason(ctx: Context, *, sweep: bool = False, needs_tp: bool = True) -> str | None:
    """Why a multi-GPU part cannot run here (None: it can): under 2 CUDA GPUs, or a TP size the box
    cannot hold, or TP 1 (no all-reduce)."""
    if ctx.gpus < 2:
        base = NO_CUDA_SWEEP if sweep else NO_CUDA
        return base if ctx.gpus == 0 else f"{base} beyond 1: a TP all-reduce needs at least 2"
    tp = ctx.shapes.tp
    if needs_tp and tp is not None and tp > ctx.gpus:
        return f"TP {tp} needs {tp} GPUs; this machine has {ctx.gpus}"
    if needs_tp and tp == 1:
        return "TP 1: a single rank runs no all-reduce"
    return None


def _tp(ctx: Context) -> int:
    return ctx.shapes.tp or ctx.gpus


def p2p_timeout_s(gpus: int, limit_s: float) -> float:
    """Seconds per pair child for ``gpus`` GPUs in ``limit_s``: the budget shared by the rounds of
    :data:`P2P_PARALLEL` pairs, at most the check's default, and never under
    :data:`fastverify.topo.p2p.MIN_TIMEOUT_S` (each side process needs time to import torch)."""
    rounds = max(1, math.ceil(gpus * (gpus - 1) // 2 / P2P_PARALLEL))
    return float(max(MIN_TIMEOUT_S, min(DEFAULT_TIMEOUT_S, math.floor((limit_s - 5.0) / rounds))))


def p2p_check(ctx: Context, limit_s: float) -> Outcome:
    """``python -m fastverify.topo.p2p check``: every GPU pair read and written for real (CUDA IPC),
    in children; a result cached for this box (``~/.cache/fastverify``) is reused (timeouts are
    not cached: retried). Meta: ``passed_directions``, ``failed_directions`` and
    ``timed_out_directions`` of the document printed (:mod:`fastverify.topo.p2p_proof`, version 2)."""
    pairs = ctx.gpus * (ctx.gpus - 1) // 2
    per_pair = p2p_timeout_s(ctx.gpus, limit_s)
    argv = [sys.executable, "-m", "fastverify.topo.p2p", "check", "--timeout", f"{per_pair:.0f}"]
    child = run_child(argv, timeout_s=limit_s, cwd=ctx.workdir)
    meta = {"pairs": pairs, "timeout_per_pair_s": round(per_pair), "cache": "reused when this box was checked before"}
    if child.rc not in (0, 1):  # 1: some direction failed or timed out, which the JSON says
        return failed(child.why("python -m fastverify.topo.p2p check", limit_s), **meta)
    try:
        doc = orjson.loads(child.stdout)
        results = results_from_json(doc.get("results") if isinstance(doc, dict) else None)
    except (orjson.JSONDecodeError, ValueError) as e:
        return failed(f"the P2P check printed no JSON with results ({' '.join(str(e).split())[:120]})", **meta)
    n = count_statuses(results.values())
    return ok(
        {ARCNAMES["p2p_check"]: child.stdout},
        passed_directions=n["passed"],
        failed_directions=n["failed"],
        timed_out_directions=n["timeout"],
        **meta,
    )


def nccl_log(ctx: Context, limit_s: float, *, device: str = "cuda", backend: str = BackendName.nccl.value) -> Outcome:
    """One NCCL all-reduce trial at the verify sizes (one tune trial, fresh rank processes) with
    ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV,TUNING`` and ``NCCL_DEBUG_FILE`` (NCCL
    writes each process's log to that file, ``%h`` host, ``%p`` pid; NCCL's environment-variable
    documentation), joined into one log that ``fastverify topo --nccl-log`` reads. ``device`` /
    ``backend``: ``"cpu"`` / ``"gloo"`` runs the same machinery without GPUs (tests; no log)."""

    logs = ctx.workdir / "nccl-logs"
    logs.mkdir(exist_ok=True)
    shapes = ctx.shapes
    numels = sorted({b * shapes.draft_tokens * shapes.hidden for b in shapes.batches})
    env = dict(NCCL_DEBUG_ENV, NCCL_DEBUG_FILE=str(logs / "nccl.%h.%p.log"))
    spec = TrialSpec(
        backend=backend,
        env=env,
        world_size=_tp(ctx),
        device=device,
        dtype="bfloat16",
        hidden=shapes.hidden,
        sizes=tuple((n, 1) for n in numels),
        warmup=NCCL_LOG_WARMUP,
        iters=NCCL_LOG_ITERS,
        op=Op.ALL_REDUCE,
        norm="torch",
        label="collect nccl_log",
    )
    result = run_trial(spec, timeout_s=0.2 * limit_s, startup_timeout_s=0.5 * limit_s, build_timeout_s=0.3 * limit_s)
    files = sorted(p for p in logs.glob("nccl.*.log") if p.is_file())
    text = b"".join(p.read_bytes() for p in files)
    meta = {
        **shapes.as_meta(),
        "trial": result.status.value,
        "trial_reason": result.reason or None,
        "log_files": len(files),
        "env": env,
    }
    if not text:
        return failed(
            f"no NCCL log written (trial {result.status.value}: {result.reason or 'no reason given'})", **meta
        )
    meta["median_us"] = {str(s.msg_bytes): s.median_us for s in result.sizes}
    return ok({ARCNAMES["nccl_log"]: text}, **meta)


def _sweep_model(ctx: Context) -> tuple[str, str]:
    """The ``--model`` for tune at ``ctx.shapes.hidden`` and what it is: the served model's own
    ``config.json`` when it is on this machine and has that hidden size, the kimi-k2 preset at
    7168, else the kimi-k2 preset's shapes with ``hidden_size`` replaced (a file in the workdir)."""

    hidden = ctx.shapes.hidden
    path = ctx.server.fact("model_path") if ctx.server is not None else None
    if isinstance(path, str) and (Path(path) / "config.json").is_file():
        try:
            if load_model_config(path).hidden_size == hidden:
                return path, "the served model's config.json"
        except UserError:
            pass
    if PRESET_HIDDEN["kimi-k2"] == hidden:
        return "kimi-k2", "the kimi-k2 preset (hidden 7168)"
    from importlib import resources

    doc = orjson.loads(resources.files("fastverify.live").joinpath("presets", "kimi-k2.json").read_bytes())
    doc["hidden_size"] = hidden
    doc["_source"] = f"fastverify collect: the kimi-k2 preset with hidden_size {hidden}"
    out = ctx.workdir / "sweep-model" / "config.json"
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(orjson.dumps(doc))
    return str(out), f"the kimi-k2 preset's shapes with hidden_size {hidden}"


def sweep(ctx: Context, limit_s: float) -> Outcome:
    """``fastverify tune --json`` (measure mode) at the verify shapes, in a child: NCCL settings
    and the backends the box allows, each in fresh worker processes. tune times one batch per run:
    the largest of the verify batches (its message is the largest verify all-reduce)."""
    shapes = ctx.shapes
    batch = max(shapes.batches)
    try:
        model, model_what = _sweep_model(ctx)
    except (OSError, UserError) as e:
        return failed(f"no model shapes for the sweep: {e}")
    trial_s = max(10.0, min(SWEEP_TRIAL_MAX_S, limit_s / 10))
    argv = fastverify_argv(
        "tune",
        "--json",
        "--model",
        model,
        "--tp",
        str(_tp(ctx)),
        "--draft-tokens",
        str(shapes.draft_tokens),
        "--batch",
        str(batch),
        "--device",
        "cuda",
        "--timeout",
        f"{trial_s:.0f}",
        "--journal",
        str(ctx.workdir / "tune.journal.jsonl"),
    )
    child = run_child(argv, timeout_s=limit_s, cwd=ctx.workdir)
    meta = {
        **shapes.as_meta(),
        "batch": batch,
        "swept_msg_bytes": batch * shapes.draft_tokens * shapes.hidden * 2,
        "batches_not_swept": [b for b in shapes.batches if b != batch],
        "model": model_what,
        "trial_timeout_s": round(trial_s),
        "server_running": ctx.server is not None,
    }
    if child.rc != 0:
        return failed(child.why("fastverify tune --json", limit_s), **meta)
    try:
        orjson.loads(child.stdout)
    except orjson.JSONDecodeError as e:
        return failed(f"tune --json printed no JSON ({e})", **meta)
    return ok({ARCNAMES["sweep"]: child.stdout}, **meta)
