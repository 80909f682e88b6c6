"""Which GPUs: the identities (NVML index, PCI bus id, UUID) that bind a P2P check to a box.

NVML names each GPU without a CUDA context or torch (:func:`nvml_gpus`); the checking process
maps its CUDA ordinals onto those names (:func:`gpu_identities`), and a server's environment maps
them the other way (:func:`visible_gpus`). UUID first, PCI address else; never the index alone,
which every box has.
"""

from __future__ import annotations

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
    queries = (("pci_bus_id", lambda h: nvml_text(nvml.nvmlDeviceGetPciInfo(h).busId)),
               ("uuid", lambda h: nvml_text(nvml.nvmlDeviceGetUUID(h))),
               ("name", lambda h: nvml_text(nvml.nvmlDeviceGetName(h))),
               ("memory_bytes", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total)))
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
    bus = (f"{int(parts[0]):08x}:{int(parts[1]):02x}:{int(parts[2]):02x}.0" if None not in parts else None)
    match = next((g for g in listed if _uuid_key(uuid) is not None and _uuid_key(g["uuid"]) == _uuid_key(uuid)),
                 None) or next((g for g in listed if bus is not None and _pci_key(g["pci_bus_id"]) == _pci_key(bus)),
                               None)
    if match is not None:
        return {"cuda": k, **{f: match[f] for f in _ROW_FIELDS}}
    return {"cuda": k, "index": None, "pci_bus_id": bus,
            "uuid": (uuid if uuid is None or uuid.upper().startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"),
            "name": getattr(props, "name", None)}


def visible_gpus(listed: Sequence[dict], environ: Any) -> tuple[list[dict] | None, str]:
    """The GPUs (:func:`nvml_gpus` rows) a process started with ``environ`` gets as CUDA ordinals
    0, 1, ...; ``(None, why)`` where that cannot be told.

    ``CUDA_VISIBLE_DEVICES`` entries are NVML indices or (prefixes of) UUIDs: torch's own NVML
    device count (``torch.cuda._device_count_nvml``) and SGLang 0.5.23's custom all-reduce
    (``custom_all_reduce_utils.py``: ``device_ids[device.index]`` handed to
    ``nvmlDeviceGetHandleByIndex``) read them so; unset, the ordinals are NVML's order. That is
    CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; under CUDA's default (fastest first) it
    is the same for GPUs of one model, and not known for a mixed box, which gives ``None``.
    """
    if not listed:
        return None, "NVML lists no GPU here"
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({g.get("name") for g in listed}) > 1:
        return None, ("GPUs of several models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA orders them fastest "
                      "first, not as NVML does")
    if text is None:
        return list(listed), ""
    chosen: list[dict] = []
    for entry in (e.strip() for e in text.split(",")):
        if entry.isdigit():
            hit = [g for g in listed if g["index"] == int(entry)]
        elif entry.upper().startswith("GPU-"):
            hit = [g for g in listed if (g.get("uuid") or "").lower().startswith(entry.lower())]
        else:
            hit = []
        if len(hit) != 1:
            break  # CUDA stops at the first entry it cannot use
        if hit[0] in chosen:
            return None, f"CUDA_VISIBLE_DEVICES={text} names a GPU twice"
        chosen.append(hit[0])
    return chosen, ""
