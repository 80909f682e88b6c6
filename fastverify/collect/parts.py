"""The host parts of ``fastverify collect``: doctor, ``nvidia-smi topo -m``, NVML, the host's IOMMU
and ACS settings, and the verify records of ``fastverify launch --profile-verify``. Each takes the
run's :class:`~fastverify.collect.core.Context` and its time limit (s) and returns an
:class:`~fastverify.collect.core.Outcome`; none raises for what the box lacks."""

from __future__ import annotations

import os
import re
import shutil
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
from fastverify.progress import say
from fastverify.topo.nvml import read_nvml_topology

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
