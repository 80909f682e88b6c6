"""Which GPUs: the identities (NVML index, PCI bus id, UUID) that bind a P2P check to a box.

NVML names each GPU without a CUDA context or torch (:func:`nvml_gpus`); the checking process
maps its CUDA ordinals onto those names (:func:`gpu_identities`), and a server's environment maps
them the other way (:func:`visible_gpus`). UUID first, PCI address else; never the index alone,
which every box has.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from fastverify.deploy import GpuId, _pci_key, _uuid_key
from fastverify.topo.nvml import nvml_text

_ROW_FIELDS = ("index", "pci_bus_id", "uuid", "name")


def nvml_gpus(nvml: Any | None = None) -> list[dict]:
    """This box's GPUs as NVML names them, in NVML order: ``[{"index", "pci_bus_id", "uuid",
    "name", "memory_bytes"}, ...]`` (a query NVML refuses leaves that field None;
    ``memory_bytes`` is ``nvmlDeviceGetMemoryInfo().total``). No CUDA context, no torch. ``[]``
    when NVML cannot start (no driver, no ``pynvml``)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            return []
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error, OSError):
        return []
    queries = (
        ("pci_bus_id", lambda h: nvml_text(nvml.nvmlDeviceGetPciInfo(h).busId)),
        ("uuid", lambda h: nvml_text(nvml.nvmlDeviceGetUUID(h))),
        ("name", lambda h: nvml_text(nvml.nvmlDeviceGetName(h))),
        ("memory_bytes", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total)),
    )
    gpus: list[dict] = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            row: dict[str, Any] = {"index": i, "pci_bus_id": None, "uuid": None, "name": None, "memory_bytes": None}
            for field, query in queries:  # a refused query loses its own field only
                try:
                    row[field] = query(handle)
                except (error, AttributeError, TypeError, ValueError):
                    pass
            gpus.append(row)
    except error:
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass
    return gpus


def gpu_id(row: dict) -> GpuId:
    """:class:`~fastverify.deploy.GpuId` of one :func:`nvml_gpus` row (ValueError when it has
    neither UUID nor PCI bus id)."""
    return GpuId(index=row.get("index"), pci_bus_id=row.get("pci_bus_id"), uuid=row.get("uuid"), name=row.get("name"))


def gpu_identities(nvml: Any | None = None, torch_mod: Any | None = None) -> list[dict]:
    """The checking process's CUDA devices as NVML names them, in CUDA ordinal order:
    ``[{"cuda": k, "index", "pci_bus_id", "uuid", "name"}, ...]``.

    Ordinal ``k`` is matched to NVML's GPU by UUID (``torch.cuda.get_device_properties(k).uuid``),
    else by PCI address (``pci_domain_id``/``pci_bus_id``/``pci_device_id``), the way ``doctor``
    matches them: CUDA's order and ``CUDA_VISIBLE_DEVICES`` are whatever this process runs under.
    A device NVML does not list keeps torch's own facts (``index`` None). Needs torch with CUDA."""
    if torch_mod is None:
        import torch as torch_mod  # noqa: PLC0415
    listed = nvml_gpus(nvml)
    return [_identity(k, torch_mod.cuda.get_device_properties(k), listed) for k in range(torch_mod.cuda.device_count())]


def _identity(k: int, props: Any, listed: list[dict]) -> dict:
    """CUDA ordinal ``k`` (torch device properties ``props``) as the NVML row it matches
    (:func:`fastverify.deploy._uuid_key`, ``_pci_key``: the one comparison rule), else torch's facts."""
    uuid = getattr(props, "uuid", None)
    uuid = str(uuid) if uuid is not None and str(uuid) else None
    parts = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    bus = f"{int(parts[0]):08x}:{int(parts[1]):02x}:{int(parts[2]):02x}.0" if None not in parts else None
    match = next(
        (g for g in listed if _uuid_key(uuid) is not None and _uuid_key(g["uuid"]) == _uuid_key(uuid)), None
    ) or next((g for g in listed if bus is not None and _pci_key(g["pci_bus_id"]) == _pci_key(bus)), None)
    if match is not None:
        return {"cuda": k, **{f: match[f] for f in _ROW_FIELDS}}
    return {
        "cuda": k,
        "index": None,
        "pci_bus_id": bus,
        "uuid": (uuid if uuid is None or uuid.upper().startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"),
        "name": getattr(props, "name", None),
    }


def visible_gpus(listed: Sequence[dict], environ: Any) -> tuple[list[dict] | None, str]:
    """The GPUs (:func:`nvml_gpus` rows) a process started with ``environ`` gets as CUDA ordinals
    0, 1, ...; ``(None, why)`` where that cannot be told. The second item is ``""`` or one line
    for the caller to print: why the GPUs are not known, or which entry of
    ``CUDA_VISIBLE_DEVICES`` CUDA stopped at (never dropped silently).

    ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it (CUDA C Programming Guide, "CUDA Environment
    Variables": GPU indices or UUIDs, a unique UUID prefix allowed; "if one of the indices is
    invalid, only the devices whose index precedes the invalid index are visible", so ``0,2,-1,1``
    shows GPUs 0 and 2), the way torch's own NVML device count parses it
    (``torch/cuda/__init__.py``: ``_parse_visible_devices``, ``_transform_uuid_to_ordinals``):

    - a list that starts with ``GPU-`` is a list of UUIDs (prefixes); it stops at the first entry
      that is not one, or that matches no GPU or several;
    - otherwise each entry is read like ``strtoul`` (its leading digits, so ``1gpu2`` is 1); it
      stops at the first entry with none, or an index NVML does not list;
    - a GPU named twice shows no GPU at all;
    - ``MIG-...`` names a MIG instance: a slice of a GPU, not a whole GPU, and MIG instances have
      no GPU-to-GPU P2P (NVIDIA MIG User Guide: every profile ``nvidia-smi mig -lgip`` lists says
      P2P "No"), so no P2P check binds to it: a list starting with one gives ``None``; one later
      in an index list stops it like any entry CUDA cannot use there.

    Unset, the ordinals are NVML's order. That is CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
    under CUDA's default (fastest first) it is the same for GPUs of one model, and not known for a
    mixed box, which gives ``None``. SGLang 0.5.23's custom all-reduce maps ordinals the same way
    (``custom_all_reduce_utils.py``: ``device_ids[device.index]`` to ``nvmlDeviceGetHandleByIndex``).
    """
    if not listed:
        return None, "NVML lists no GPU here"
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({g.get("name") for g in listed}) > 1:
        return None, (
            "GPUs of several models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA orders them fastest "
            "first, not as NVML does"
        )
    if text is None:
        return list(listed), ""
    shown = _shown(text)
    if text.strip().upper().startswith("MIG-"):
        return None, (
            f"CUDA_VISIBLE_DEVICES={shown} names MIG instances: CUDA's devices are then slices of a GPU, "
            "not whole GPUs, and MIG instances have no GPU-to-GPU P2P (NVIDIA MIG User Guide)"
        )
    uuids = text.strip().upper().startswith("GPU-")
    chosen: list[dict] = []
    for k, entry in enumerate(e.strip() for e in text.split(",")):
        hit, why = _visible_entry(listed, entry, uuids)
        if why:
            seen = ", ".join(f"GPU {g['index']}" for g in chosen) or "no GPU"
            return chosen, (
                f"CUDA_VISIBLE_DEVICES={shown}: entry {k + 1} ({_shown(entry)!r}) {why}; CUDA stops at the first "
                f"entry it cannot use, so the command sees {seen} (CUDA C Programming Guide, CUDA "
                "environment variables)"
            )
        if hit in chosen:
            return None, f"CUDA_VISIBLE_DEVICES={shown} names a GPU twice: CUDA then shows no GPU"
        chosen.append(hit)
    return chosen, ""


def _shown(value: str, most: int = 80) -> str:
    """``value`` as a line may show it: at most ``most`` characters, the length said when cut."""
    return value if len(value) <= most else f"{value[: most - 20]}... ({len(value)} characters)"


def _visible_entry(listed: Sequence[dict], entry: str, uuids: bool) -> tuple[dict | None, str]:
    """The NVML row one ``CUDA_VISIBLE_DEVICES`` entry names, or ``(None, why CUDA stops there)``
    (:func:`visible_gpus`: ``uuids`` when the list is one of UUIDs)."""
    if entry.upper().startswith("MIG-"):
        return None, "is a MIG instance, not a whole GPU"
    if uuids:
        if not entry.upper().startswith("GPU-"):
            return None, "is not a GPU UUID, in a list of UUIDs"
        hits = [g for g in listed if (g.get("uuid") or "").lower().startswith(entry.lower())]
        what = "GPU UUID"
    else:
        digits = re.match(r"[0-9]+", entry)  # ASCII digits only, as strtoul reads them
        if digits is None:
            return None, "is not a GPU index"
        d = digits.group().lstrip("0") or "0"
        index = int(d) if len(d) <= 18 else -1  # strtoul saturates: no GPU has such an index
        hits = [g for g in listed if g["index"] == index]
        what = f"GPU index {_shown(digits.group(), 24)}"
    if len(hits) != 1:
        return None, (
            f"matches {len(hits)} GPUs ({what} prefix is ambiguous)"
            if hits
            else f"names no GPU NVML lists here ({what})"
        )
    return hits[0], ""
