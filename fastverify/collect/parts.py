"""The host parts of ``fastverify collect``: doctor, ``nvidia-smi topo -m``, NVML, the host's IOMMU
and ACS settings, and the verify records of ``fastverify launch --profile-verify``. Each takes the
run's :class:`~fastverify.collect.core.Context` and its time limit (s) and returns an
:class:`~fastverify.collect.core.Outcome`; none raises for what the box lacks.

The multi-GPU parts of ``fastverify collect``: the real P2P check, an NCCL debug log of the verify
all-reduces, and a ``fastverify tune`` sweep at the verify shapes. Each runs only with at least 2
CUDA GPUs (:func:`gpu_skip_reason`); everything that touches the GPUs runs in fresh processes
with a time limit (the tune trial machinery, :mod:`fastverify.tune.sweep`, or a child command).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from pathlib import Path

import orjson

from fastverify.bundle import ARCNAMES
from fastverify.collect.core import (
    LEFT_OUT_KEYS,
    NOT_REGULAR,
    Context,
    Outcome,
    failed,
    fastverify_argv,
    left_out_text,
    ok,
    run_child,
    scan_folder,
    skipped,
    take_regular,
    unfit_name,
)
from fastverify.errors import UserError, path_text, shown
from fastverify.live.config import load_model_config
from fastverify.progress import say
from fastverify.registry import BackendName
from fastverify.topo.nvml import read_nvml_topology
from fastverify.topo.p2p import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S
from fastverify.topo.p2p_proof import count_statuses, results_from_json
from fastverify.tune.sweep import run_trial
from fastverify.tune.trial import Op, TrialSpec

JSON_OPTS = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
NO_NVIDIA_SMI = "nvidia-smi not found (no NVIDIA driver on this machine)"
NVIDIA_SMI_LIMIT_S = 30.0
LSPCI_LIMIT_S = 30.0
IOMMU_KEYS = ("iommu", "intel_iommu", "amd_iommu")
"""Kernel command-line parameters that set the IOMMU (``Documentation/admin-guide/
kernel-parameters.txt``), plus every ``iommu.*`` one (``iommu.passthrough=``, ``iommu.strict=``)."""
VERIFY_RECORDS = "verify-rank*.jsonl"
TRACE_PATTERNS = ("*.trace.json", "*.trace.json.gz")


def doctor(ctx: Context, limit_s: float) -> Outcome:
    """``fastverify doctor --json --quick`` in a child: versions, libraries, CUDA and NVML presence
    (the quick checks: seconds, no GPU work; the full doctor JIT-builds and runs trials, minutes)."""
    child = run_child(fastverify_argv("doctor", "--json", "--quick"), timeout_s=limit_s, cwd=ctx.workdir)
    if child.rc not in (0, 1):  # 1: a check failed, which the JSON says
        return failed(child.why("doctor --json --quick", limit_s), mode="quick")
    try:
        doc = orjson.loads(child.stdout)
    except orjson.JSONDecodeError as e:
        return failed(f"doctor --json printed no JSON ({e})", mode="quick")
    if not isinstance(doc, dict) or "verdict" not in doc:
        return failed("doctor --json printed JSON without a verdict", mode="quick")
    return ok({ARCNAMES["doctor"]: child.stdout}, mode="quick", verdict=doc["verdict"], counts=doc.get("counts"))


def nvidia_smi_topo(ctx: Context, limit_s: float) -> Outcome:
    """The text of ``nvidia-smi topo -m`` (``fastverify topo --nvidia-smi`` reads it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return skipped(NO_NVIDIA_SMI)
    limit = min(limit_s, NVIDIA_SMI_LIMIT_S)
    child = run_child([exe, "topo", "-m"], timeout_s=limit, env=dict(os.environ), cwd=ctx.workdir)
    if child.rc != 0:
        return failed(child.why("nvidia-smi topo -m", limit))
    return ok({ARCNAMES["nvidia_smi_topo"]: child.stdout}, lines=child.stdout.count(b"\n"))


def nvml(ctx: Context, limit_s: float) -> Outcome:
    """GPU names, PCI bus ids, links and P2P status per pair from NVML
    (:func:`fastverify.topo.nvml.read_nvml_topology`, as ``Topology.as_dict``)."""
    try:
        topo = read_nvml_topology()
    except UserError as e:
        text = str(e).split("; for an offline diagnosis", 1)[0]  # that advice is for `topo`, not here
        return (skipped if text.startswith("no NVIDIA driver") else failed)(text)
    doc = topo.as_dict()
    return ok(
        {ARCNAMES["nvml"]: orjson.dumps(doc, option=JSON_OPTS)},
        gpus=len(topo.gpus),
        names=sorted({g.name for g in topo.gpus if g.name}),
        source=topo.source,
    )


# ---- host IOMMU / ACS -----------------------------------------------------------------------------

_LSPCI_DEVICE = re.compile(r"^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\s+(.*)$", re.ASCII)
_ACSCTL = re.compile(r"^\s+ACSCtl:\s*(.*)$")


def _cmdline_tokens(text: str) -> list[str]:
    return [t for t in text.split() if t.split("=", 1)[0] in IOMMU_KEYS or t.startswith("iommu.")]


def _iommu_groups(root: Path) -> int | None:
    try:
        return sum(1 for _ in (root / "kernel" / "iommu_groups").iterdir())
    except OSError:
        return None


def parse_lspci_acs(text: str) -> tuple[list[dict], bool]:
    """From ``lspci -D -vvv`` text: one ``{"device", "description", "acsctl"}`` per device that
    shows an ``ACSCtl:`` line, and whether any capability list read ``<access denied>`` (lspci as
    a non-root user)."""
    out: list[dict] = []
    device = description = None
    for line in text.splitlines():
        m = _LSPCI_DEVICE.match(line)
        if m:
            device, description = m.groups()
            continue
        a = _ACSCTL.match(line)
        if a and device is not None:
            out.append({"device": device, "description": description, "acsctl": a.group(1).strip()})
    return out, "<access denied>" in text


def host_iommu(
    ctx: Context, limit_s: float, *, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")
) -> Outcome:
    """IOMMU tokens of ``/proc/cmdline``, the count of ``/sys/kernel/iommu_groups`` entries and the
    ACS control bits per PCI device from ``lspci -D -vvv`` (ACS redirects peer-to-peer PCIe
    traffic through the root complex, which slows or breaks GPU P2P). Works without GPUs."""
    notes: list[str] = []
    try:
        tokens = _cmdline_tokens((proc_root / "cmdline").read_text(errors="replace"))
    except OSError as e:
        tokens = []
        notes.append(f"cannot read {proc_root / 'cmdline'} ({e.strerror or e})")
    if not tokens:
        notes.append(
            "no iommu= / intel_iommu= / amd_iommu= / iommu.* on the kernel command line "
            "(the kernel's and firmware's defaults apply)"
        )
    groups = _iommu_groups(sys_root)
    if not groups:
        notes.append(f"no IOMMU groups in {sys_root}/kernel/iommu_groups: the IOMMU is off or not exposed here")
    acs: list[dict] = []
    exe = shutil.which("lspci")
    if exe is None:
        notes.append("lspci not found (install pciutils): ACS settings not recorded")
    else:
        limit = min(limit_s, LSPCI_LIMIT_S)
        child = run_child([exe, "-D", "-vvv"], timeout_s=limit, env=dict(os.environ), cwd=ctx.workdir)
        if child.rc != 0:
            notes.append(child.why("lspci -D -vvv", limit))
        else:
            acs, denied = parse_lspci_acs(child.stdout.decode(errors="replace"))
            if denied:
                notes.append(
                    "lspci could not read some PCI capabilities as a non-root user: run collect "
                    "with sudo to record every ACSCtl line"
                )
            elif not acs:
                notes.append("no PCI device reports ACSCtl (no ACS capability, or none exposed here)")
    doc = {"cmdline_iommu_tokens": tokens, "iommu_groups": groups, "acs": acs, "notes": notes}
    return ok(
        {ARCNAMES["host_iommu"]: orjson.dumps(doc, option=JSON_OPTS)},
        iommu_groups=groups,
        acs_devices=len(acs),
        cmdline_iommu_tokens=tokens,
    )


# ---- verify records -------------------------------------------------------------------------------


def verify_log_files(folder: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """The verify records (``verify-rank*.jsonl``) and traces (``*.trace.json[.gz]``) of a
    ``fastverify launch --profile-verify`` folder, regular files only (``lstat``: a symbolic link
    is never followed), sorted by name; and, by reason (:func:`~fastverify.collect.core.unfit_name`:
    not UTF-8, holds control characters; :data:`~fastverify.collect.core.NOT_REGULAR`), the names
    (escaped) of those left out: a bundle's member names are UTF-8 text a terminal shows as it
    is, and such a name is no record the timer writes."""
    regular, other = scan_folder(folder, (VERIFY_RECORDS, *TRACE_PATTERNS))
    left_out: dict[str, list[str]] = {NOT_REGULAR: [shown(n) for n in other]} if other else {}
    for name in regular:
        why = unfit_name(name)
        if why is not None:
            left_out.setdefault(why, []).append(shown(name))
    return [folder / n for n in regular if unfit_name(n) is None], left_out


def check_verify_log(folder: Path) -> None:
    """Refuse, before any work, a ``--verify-log`` that is not a folder holding verify records
    with fit names (UTF-8, no control characters); say on stderr, one line per reason, which
    files will be left out for their name.

    Raises
    ------
    UserError
        Not a folder, or no verify record with a fit name in it."""
    where = f"--verify-log {path_text(folder)}"
    if not folder.is_dir():
        raise UserError(f"{where}: not a folder (give the DIR of `fastverify launch --profile-verify DIR`)")
    files, left_out = verify_log_files(folder)
    if not [p for p in files if p.match(VERIFY_RECORDS)]:
        names = [n for names in left_out.values() for n in names]
        why = (
            f" that is a regular file with a UTF-8 name free of control characters (left out: {', '.join(names[:3])})"
            if names
            else ""
        )
        raise UserError(
            f"{where}: no {VERIFY_RECORDS}{why} in it (the records of `fastverify launch --profile-verify DIR`)"
        )
    for why, names in left_out.items():
        say(
            f"collect: {where}: leaving out {len(names)} file(s) {'that' if why == NOT_REGULAR else 'whose name'} "
            f"{why}: {', '.join(names[:3])}"
            f"{' ...' if len(names) > 3 else ''}"
        )


def verify_log(ctx: Context, limit_s: float) -> Outcome:
    """Copy the verify records and traces of ``--verify-log DIR`` under ``verify-log/``; files
    whose name is not UTF-8 or holds control characters are left out and listed, escaped, in the
    meta (``left_out_not_utf8``, ``left_out_control_chars``)."""
    folder = ctx.verify_log
    files, left_out = verify_log_files(folder)
    records = [p for p in files if p.match(VERIFY_RECORDS)]
    if not records:  # checked before the run; gone since
        return failed(f"{path_text(folder)}: no {VERIFY_RECORDS} left in it")
    meta = {LEFT_OUT_KEYS[why]: names for why, names in left_out.items()}
    copies = ctx.workdir / "verify-log-copies"
    copies.mkdir(mode=0o700)
    out, swapped = {}, []
    for p in files:  # copied through a descriptor that never follows a link swapped in since
        if take_regular(folder, p.name, copies / p.name, move=False):
            out[ARCNAMES["verify_log"] + p.name] = copies / p.name
        else:
            swapped.append(shown(p.name))
    if swapped:
        meta.setdefault(LEFT_OUT_KEYS[NOT_REGULAR], []).extend(swapped)
    kept = [p for p in records if ARCNAMES["verify_log"] + p.name in out]
    if not kept:
        return failed(f"{path_text(folder)}: no {VERIFY_RECORDS} could be read: {left_out_text(meta)}", **meta)
    return ok(out, folder=path_text(folder), records=len(kept), traces=len(out) - len(kept), **meta)


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
