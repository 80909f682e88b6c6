"""The per-box cache of real P2P check results, ``<cache>/p2p-<fingerprint>.json``.

The fingerprint covers GPU names, PCI bus ids, the driver version (NVML's, and the loaded kernel
module's from ``/proc/driver/nvidia/version``), the kernel command line (``/proc/cmdline``: IOMMU
and ACS switches decide whether peer traffic works), ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` (both change what CUDA ordinal ``i`` means); the key itself is repeated
inside the file, so a fingerprint collision or a file from another box is never read as ours.
Passes and failures are cached; timeouts never are (written or read: an older file may hold
them), so a direction that timed out is tested again on the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from fastverify.errors import UserError
from fastverify.topo import nvml as topo_nvml
from fastverify.topo.p2p_results import P2PResult, results_from_json, results_to_json, write_json_atomic

SCHEMA_VERSION = 1  # of the cache file (its own "schema_version")
CMDLINE_PATH = "/proc/cmdline"
"""The kernel command line (Linux ``proc(5)``): ``intel_iommu=``, ``amd_iommu=``, ``iommu=``,
``pci=`` (ACS overrides) change whether P2P works without any GPU or driver change."""
NVIDIA_VERSION_PATH = "/proc/driver/nvidia/version"
"""The loaded NVIDIA kernel module's version line (its first line, ``NVRM version: ...``); it can
differ from NVML's user-space library after an upgrade without a reboot."""


def default_cache_dir() -> Path:
    """``$FASTVERIFY_CACHE_DIR``, else ``~/.cache/fastverify``."""
    env = os.environ.get("FASTVERIFY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fastverify"


def _first_line(path: str) -> str | None:
    """The file's first line, stripped; None where it cannot be read (no such file, not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return None


def box_key(nvml: Any | None = None) -> dict:
    """What identifies this box for the P2P cache: GPU names and PCI bus ids (NVML order), the
    driver version (NVML's, and the kernel module's :data:`NVIDIA_VERSION_PATH`), the kernel command
    line (:data:`CMDLINE_PATH`), ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. Without NVML
    the GPU list comes from torch and NVML's driver is ``None``; an unreadable file is ``None``."""
    key: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "kernel_cmdline": _first_line(CMDLINE_PATH),
        "driver_module": _first_line(NVIDIA_VERSION_PATH),
    }
    try:
        topo = topo_nvml.read_nvml_topology(nvml)
        key["gpus"] = [[g.name, g.pci_bus_id] for g in topo.gpus]
        key["driver"] = topo.source
    except UserError:
        import torch  # noqa: PLC0415 - optional, only where NVML cannot start

        key["gpus"] = [[torch.cuda.get_device_name(k), None] for k in range(torch.cuda.device_count())]
        key["driver"] = None
    return key


def fingerprint_of(key: dict) -> str:
    """16 hex digits of the SHA-256 of ``key`` as canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/p2p-<fingerprint>.json``; ``cache_dir`` defaults to :func:`default_cache_dir`."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"p2p-{fingerprint_of(key)}.json"


def read_cache(path: Path, key: dict) -> dict[tuple[int, int], P2PResult]:
    """Cached results in ``path`` when the file is ours and was written for ``key``, less any
    timeout (retried, module docstring); else ``{}``."""
    try:
        doc = json.loads(path.read_text())
        if (not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION
                or doc.get("fingerprint") != fingerprint_of(key) or doc.get("box") != key):
            return {}
        return {p: r for p, r in results_from_json(doc.get("results")).items() if not r.timed_out}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def write_cache(path: Path, key: dict, results: dict[tuple[int, int], P2PResult],
                gpus: Sequence[dict] | None = None) -> None:
    """Write ``results`` less their timeouts (module docstring) atomically (temporary file in the
    same folder, then rename); with
    ``gpus`` (:func:`fastverify.topo.gpu_identity.gpu_identities`) the file names the GPUs too,
    and proves like the check's own output (:func:`fastverify.topo.p2p_proof.read_check_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema_version": SCHEMA_VERSION, "fingerprint": fingerprint_of(key), "box": key,
           "written_unix_s": round(time.time(), 3),
           "results": results_to_json({p: r for p, r in results.items() if not r.timed_out})}
    if gpus is not None:
        doc.update(cuda_visible_devices=key.get("cuda_visible_devices"),
                   cuda_device_order=key.get("cuda_device_order"), gpus=list(gpus))
    write_json_atomic(path, doc)
