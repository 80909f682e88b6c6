"""Live GPU topology from NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

:func:`read_nvml_topology` asks the driver what ``nvidia-smi topo -m`` shows and more: GPU names,
PCI bus ids, each pair's common PCIe ancestor, NVLink counts, P2P read/write status, current and
maximum PCIe generation and width, NUMA placement. Without a driver it raises a one-line
:class:`~fastverify.errors.UserError` that points at the offline ``--nvidia-smi FILE`` route.

Constants checked against nvidia-ml-py 13.615 (``pynvml.py``): ``NVML_TOPOLOGY_INTERNAL/SINGLE/
MULTIPLE/HOSTBRIDGE/NODE/SYSTEM`` (0/10/20/30/40/50; ``NVML_TOPOLOGY_CPU`` aliases NODE),
``NVML_P2P_CAPS_INDEX_READ/WRITE``, ``NVML_P2P_STATUS_*``, ``NVML_NVLINK_MAX_LINKS``,
``NVML_NVLINK_DEVICE_TYPE_GPU/SWITCH``; that release's ``NVML_P2P_CAPS_INDEX_READ = 0,`` is the
tuple ``(0,)``, which ctypes cannot pass (:func:`_const_int` unwraps it). A query NVML refuses
(``NVML_ERROR_NOT_SUPPORTED``, ``NO_PERMISSION``, ...) loses only its own fact: a pair's link goes
to ``Topology.link_errors``, every refused query to ``Topology.unsupported``; only init, count and
handles fail the read. NUMA: ``nvmlDeviceGetNumaNodeId`` is the node of the GPU's own memory where
GPUs are NUMA nodes ("GPU NUMA ID"), not a PCIe GPU's CPU node ("NUMA Affinity"), which comes from
sysfs ``/sys/bus/pci/devices/<bdf>/numa_node``, else ``nvmlDeviceGetMemoryAffinity``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from fastverify.errors import UserError
from fastverify.topo.matrix import Gpu, Topology

NO_DRIVER = "no NVIDIA driver/GPU found (NVML: {reason}); for an offline diagnosis give --nvidia-smi FILE (`nvidia-smi topo -m` text) and/or --nccl-log FILE"

# NVML common-ancestor level -> nvidia-smi connection name. INTERNAL means both GPUs sit on one
# board (dual-GPU cards): behind that board's own PCIe switch, so PIX (my reading; nvidia-smi
# never shows a separate name for it).
_ANCESTOR_NAMES = (
    ("NVML_TOPOLOGY_INTERNAL", 0, "PIX"),
    ("NVML_TOPOLOGY_SINGLE", 10, "PIX"),
    ("NVML_TOPOLOGY_MULTIPLE", 20, "PXB"),
    ("NVML_TOPOLOGY_HOSTBRIDGE", 30, "PHB"),
    ("NVML_TOPOLOGY_NODE", 40, "NODE"),
    ("NVML_TOPOLOGY_SYSTEM", 50, "SYS"),
)
_P2P_STATUS_NAMES = (
    ("NVML_P2P_STATUS_OK", 0, "OK"),
    ("NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED", 1, "chipset not supported"),
    ("NVML_P2P_STATUS_GPU_NOT_SUPPORTED", 2, "GPU not supported"),
    ("NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED", 3, "IOH topology not supported"),
    ("NVML_P2P_STATUS_DISABLED_BY_REGKEY", 4, "disabled by regkey"),
    ("NVML_P2P_STATUS_NOT_SUPPORTED", 5, "not supported"),
    ("NVML_P2P_STATUS_UNKNOWN", 6, "unknown"),
)
_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.ASCII)
_CPU_WORDS = max(16, -(-(os.cpu_count() or 1) // 64))  # 64-bit words in the CPU bitmask NVML fills


def _const_int(nvml: Any, name: str, default: int) -> int:
    """Integer value of an NVML constant; tolerates a missing name and the ``(0,)`` tuple slip."""
    value = getattr(nvml, name, default)
    if isinstance(value, tuple):
        value = value[0] if value else default
    return int(value)


def nvml_text(value: Any) -> str:
    """An NVML string as text: pynvml returns ``bytes`` in some releases, ``str`` in others."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def ancestor_to_link(nvml: Any, level: int) -> str:
    """nvidia-smi connection name (PIX/PXB/PHB/NODE/SYS) for an NVML common-ancestor level."""
    for name, default, link in _ANCESTOR_NAMES:
        if _const_int(nvml, name, default) == level:
            return link
    raise ValueError(f"unknown NVML topology level {level!r}")


def p2p_status_text(nvml: Any, status: int) -> str:
    """Words for an ``nvmlGpuP2PStatus_t`` value (``"OK"`` when P2P is allowed)."""
    for name, default, words in _P2P_STATUS_NAMES:
        if _const_int(nvml, name, default) == status:
            return words
    return f"status {status}"


def _bitmask_ranges(words: Any, bits_per_word: int = 64) -> str | None:
    """``"0-35,72-107"`` from an NVML bitmask (a sequence of 64-bit words); ``None`` when empty."""
    bits = [w * bits_per_word + b for w, word in enumerate(words) for b in range(bits_per_word) if (int(word) >> b) & 1]
    if not bits:
        return None
    ranges: list[str] = []
    start = prev = bits[0]
    for bit in bits[1:] + [None]:
        if bit is not None and bit == prev + 1:
            prev = bit
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if bit is not None:
            start = prev = bit
    return ",".join(ranges)


def sysfs_bdf(bus_id: str) -> str | None:
    """sysfs name of a PCI device from NVML's bus id: ``"00000000:18:00.0"`` -> ``"0000:18:00.0"``;
    ``None`` when ``bus_id`` is not a PCI address."""
    m = _BUS_ID.fullmatch(bus_id.strip().lower())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"


def _sysfs_numa_node(bus_id: str | None, sysfs_root: Path) -> int | None:
    bdf = sysfs_bdf(bus_id) if bus_id else None
    if bdf is None:
        return None
    try:
        value = int((sysfs_root / "bus/pci/devices" / bdf / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def nvml_error_name(nvml: Any, err: BaseException) -> str:
    """NVML's name for the return code of ``err``: ``"NVML_ERROR_NOT_SUPPORTED"`` for
    ``pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)`` (nvidia-ml-py keeps the code in
    ``.value`` and defines one ``NVML_ERROR_*`` constant per code); the exception's class name
    when the code has no constant."""
    value = getattr(err, "value", None)
    if isinstance(value, int):
        for name in dir(nvml):
            if name.startswith("NVML_ERROR_") and getattr(nvml, name, None) == value:
                return name
    return type(err).__name__


class _Queries:
    """Calls NVML queries whose failure loses one fact, not the topology: a refused query returns
    None and is recorded in :attr:`failed` as ``"fn(GPU i[, GPU j]): NVML_ERROR_..."``."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.failed: list[str] = []

    def record(self, fn_name: str, where: str, err: BaseException) -> str:
        name = nvml_error_name(self.nvml, err)
        self.failed.append(f"{fn_name}({where}): {name}")
        return name

    def maybe(self, fn_name: str, where: str, *args: Any) -> Any:
        """``nvml.<fn_name>(*args)``, or None when the binding lacks it or NVML refuses."""
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None  # an older nvidia-ml-py without it: nothing the driver said
        try:
            return fn(*args)
        except self.nvml.NVMLError as err:
            self.record(fn_name, where, err)
            return None


def _nvlink_peers(q: _Queries, handle: Any, index: int, bus_to_index: dict[str, int]) -> tuple[dict[int, int], int]:
    """Active NVLinks of one GPU: links per peer GPU index, and links to NVSwitches."""
    nvml = q.nvml
    per_peer: dict[int, int] = {}
    to_switch = 0
    gpu_type = _const_int(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", 0)
    switch_type = _const_int(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    not_supported = _const_int(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
    where = f"GPU {index}"
    for link in range(_const_int(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as err:
            if getattr(err, "value", None) != not_supported:
                q.record("nvmlDeviceGetNvLinkState", f"{where}, link {link}", err)
            continue  # NOT_SUPPORTED: no such link (every link, on a GPU without NVLink): not a gap
        if active != _const_int(nvml, "NVML_FEATURE_ENABLED", 1):
            continue
        kind = q.maybe("nvmlDeviceGetNvLinkRemoteDeviceType", f"{where}, link {link}", handle, link)
        if kind == switch_type:
            to_switch += 1
            continue
        remote = q.maybe("nvmlDeviceGetNvLinkRemotePciInfo", f"{where}, link {link}", handle, link)
        peer = bus_to_index.get(nvml_text(remote.busId).lower()) if remote is not None else None
        if peer is not None and kind in (None, gpu_type):
            per_peer[peer] = per_peer.get(peer, 0) + 1
    return per_peer, to_switch


def read_nvml_topology(nvml: ModuleType | Any | None = None, *, sysfs_root: str | os.PathLike = "/sys") -> Topology:
    """Read the topology of this box's GPUs from NVML.

    Parameters
    ----------
    nvml
        The NVML binding; ``None`` imports ``pynvml`` (nvidia-ml-py). Tests pass a stand-in object
        with the same functions, constants and ``NVMLError``.
    sysfs_root
        Root of sysfs, for ``bus/pci/devices/<bdf>/numa_node``.

    Returns
    -------
    Topology
        GPUs in NVML order (``nvidia-smi`` order, which is PCI bus order, not necessarily CUDA's);
        ``links`` from ``nvmlDeviceGetTopologyCommonAncestor`` (PIX/PXB/PHB/NODE/SYS), replaced by
        ``NV<n>`` where the pair has n active NVLinks (GPUs on NVSwitches get ``NV<min links>``);
        ``p2p_read``/``p2p_write`` from ``nvmlDeviceGetP2PStatus`` (``None`` where NVML errs), with
        the refusal in ``p2p_reason``. No NICs. A pair whose common ancestor NVML refuses to
        report (``NVML_ERROR_NOT_SUPPORTED`` and the like, per pair) is left out of ``links`` and
        put in ``link_errors`` with the error's name; every refused query (per GPU or per pair)
        is listed in ``unsupported``. The rest of the topology is read as usual.

    Raises
    ------
    UserError
        NVML cannot start (no driver, no library) or sees no GPU: one line,
        ``no NVIDIA driver/GPU found (NVML: <reason>); use --nvidia-smi FILE ...``; or NVML
        fails a query the whole topology needs (the GPU count, a GPU's handle).
    """
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional until a live box is asked about
        except ImportError as err:
            raise UserError(NO_DRIVER.format(reason=f"nvidia-ml-py is not installed: {_one_line(err)}")) from None
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error_type, OSError) as err:
        raise UserError(NO_DRIVER.format(reason=_one_line(err))) from None
    try:
        return _read(nvml, Path(sysfs_root))
    except error_type as err:
        raise UserError(f"NVML failed while reading the GPU topology: {_one_line(err)}") from None
    finally:
        try:
            nvml.nvmlShutdown()
        except error_type:
            pass


def _read(nvml: Any, sysfs_root: Path) -> Topology:
    count = nvml.nvmlDeviceGetCount()
    if count < 1:
        raise UserError(NO_DRIVER.format(reason="the driver reports 0 GPUs"))
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    q = _Queries(nvml)
    driver = q.maybe("nvmlSystemGetDriverVersion", "")

    gpus: list[Gpu] = []
    for i, h in enumerate(handles):
        at = f"GPU {i}"
        pci = q.maybe("nvmlDeviceGetPciInfo", at, h)
        bus_id = nvml_text(pci.busId) if pci is not None else None
        name = q.maybe("nvmlDeviceGetName", at, h)
        numa = _sysfs_numa_node(bus_id, sysfs_root)
        if numa is None:
            mask = q.maybe("nvmlDeviceGetMemoryAffinity", at, h, 1, _const_int(nvml, "NVML_AFFINITY_SCOPE_NODE", 0))
            nodes = _bitmask_ranges(mask) if mask is not None else None
            numa = int(nodes) if nodes is not None and nodes.isdigit() else None
        gpu_numa = q.maybe("nvmlDeviceGetNumaNodeId", at, h)
        cpus = q.maybe("nvmlDeviceGetCpuAffinity", at, h, _CPU_WORDS)
        gpus.append(
            Gpu(
                index=i,
                name=nvml_text(name) if name is not None else None,
                pci_bus_id=bus_id,
                numa_node=numa,
                cpu_affinity=_bitmask_ranges(cpus) if cpus is not None else None,
                pcie_gen=q.maybe("nvmlDeviceGetCurrPcieLinkGeneration", at, h),
                pcie_width=q.maybe("nvmlDeviceGetCurrPcieLinkWidth", at, h),
                pcie_max_gen=q.maybe("nvmlDeviceGetMaxPcieLinkGeneration", at, h),
                pcie_max_width=q.maybe("nvmlDeviceGetMaxPcieLinkWidth", at, h),
                gpu_numa_id=gpu_numa if isinstance(gpu_numa, int) and gpu_numa >= 0 else None,
            )
        )

    bus_to_index = {g.pci_bus_id.lower(): g.index for g in gpus if g.pci_bus_id}
    nvlinks = [_nvlink_peers(q, h, i, bus_to_index) for i, h in enumerate(handles)]
    read_idx = _const_int(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    write_idx = _const_int(nvml, "NVML_P2P_CAPS_INDEX_WRITE", 1)
    ok = _const_int(nvml, "NVML_P2P_STATUS_OK", 0)

    links: dict[tuple[int, int], str] = {}
    link_errors: dict[tuple[int, int], str] = {}
    p2p_read: dict[tuple[int, int], bool | None] = {}
    p2p_write: dict[tuple[int, int], bool | None] = {}
    p2p_reason: dict[tuple[int, int], str] = {}
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            pair = f"GPU {i}, GPU {j}"
            direct = nvlinks[i][0].get(j, 0)
            via_switch = min(nvlinks[i][1], nvlinks[j][1])
            if direct or via_switch:
                links[(i, j)] = f"NV{direct or via_switch}"
            else:
                try:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                except nvml.NVMLError as err:
                    # Per pair (NOT_SUPPORTED on some virtualised or MIG setups): this pair's link
                    # is unknown, the other pairs and the GPUs are still read.
                    link_errors[(i, j)] = q.record("nvmlDeviceGetTopologyCommonAncestor", pair, err)
                else:
                    try:
                        links[(i, j)] = ancestor_to_link(nvml, level)
                    except ValueError as err:
                        raise UserError(f"NVML: GPUs {i} and {j}: {err} (newer driver than fastverify knows)") from None
            refused = []
            for what, index, table in (("read", read_idx, p2p_read), ("write", write_idx, p2p_write)):
                status = q.maybe("nvmlDeviceGetP2PStatus", f"{pair}, {what}", handles[i], handles[j], index)
                table[(i, j)] = None if status is None else status == ok
                if status is not None and status != ok:
                    refused.append(f"{what}: {p2p_status_text(nvml, status)}")
            if refused:
                p2p_reason[(i, j)] = "; ".join(refused)
    source = f"NVML (driver {nvml_text(driver)})" if driver is not None else "NVML"
    return Topology(
        gpus=tuple(gpus),
        links=links,
        nics=(),
        p2p_read=p2p_read,
        p2p_write=p2p_write,
        source=source,
        p2p_reason=p2p_reason,
        link_errors=link_errors,
        unsupported=tuple(q.failed),
    )


def read_gpu_memory(
    nvml: ModuleType | Any | None = None, *, proc_root: str | os.PathLike = "/proc"
) -> list[dict] | None:
    """Each GPU's free memory and the processes that hold it, from NVML: no CUDA context, no torch.

    Parameters
    ----------
    nvml
        The NVML binding; ``None`` imports ``pynvml`` (nvidia-ml-py). Tests pass a stand-in.
    proc_root
        Root of procfs, for a holder's name (``<proc_root>/<pid>/comm``).

    Returns
    -------
    list[dict] | None
        One row per GPU in NVML order: ``{"index", "pci_bus_id", "uuid", "name"}`` (the fields
        :func:`fastverify.topo.gpu_identity.visible_gpus` maps to CUDA ordinals; None where NVML
        refuses), ``"total_bytes"`` and ``"free_bytes"`` (bytes, ``nvmlDeviceGetMemoryInfo``; None
        where NVML refuses, as on GPUs whose memory NVML does not report) and ``"holders"``:
        ``[{"pid", "name", "used_bytes"}, ...]`` from ``nvmlDeviceGetComputeRunningProcesses``
        (``[]`` where NVML refuses). ``pid`` is as NVML reports it, in the host's pid namespace;
        ``name`` is ``/proc/<pid>/comm`` where that is readable and this process shares the
        host's pid namespace (:func:`in_host_pid_namespace`; in a container's own namespace a host
        pid names another process or none), else None; ``used_bytes`` is None where the driver does
        not say. None when NVML cannot start (no driver, no ``pynvml``) or cannot count or open
        the GPUs.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # optional until a live box is asked about
        except ImportError:
            return None
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error, OSError):
        return None
    names = Path(proc_root) if in_host_pid_namespace(Path(proc_root)) else None
    try:
        return [
            _memory_row(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i), names) for i in range(nvml.nvmlDeviceGetCount())
        ]
    except error:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass


def _memory_row(nvml: Any, index: int, handle: Any, proc_root: Path | None) -> dict:
    """:func:`read_gpu_memory`'s row of GPU ``index``; a refused query loses its own fields only.
    Holders' names come from ``proc_root`` (None: no names)."""
    q = _Queries(nvml)
    at = f"GPU {index}"
    pci = q.maybe("nvmlDeviceGetPciInfo", at, handle)
    uuid = q.maybe("nvmlDeviceGetUUID", at, handle)
    name = q.maybe("nvmlDeviceGetName", at, handle)
    memory = q.maybe("nvmlDeviceGetMemoryInfo", at, handle)
    holders = []
    for proc in _compute_processes(q, at, handle):
        pid = int(proc.pid)
        used = getattr(proc, "usedGpuMemory", None)
        holders.append(
            {
                "pid": pid,
                "name": None if proc_root is None else _process_name(proc_root, pid),
                "used_bytes": int(used) if isinstance(used, int) else None,
            }
        )
    return {
        "index": index,
        "pci_bus_id": nvml_text(pci.busId) if pci is not None else None,
        "uuid": nvml_text(uuid) if uuid is not None else None,
        "name": nvml_text(name) if name is not None else None,
        "total_bytes": int(memory.total) if memory is not None else None,
        "free_bytes": int(memory.free) if memory is not None else None,
        "holders": holders,
    }


def _compute_processes(q: _Queries, at: str, handle: Any) -> list:
    """``nvmlDeviceGetComputeRunningProcesses`` (``[]`` where NVML refuses). nvidia-ml-py maps the
    unversioned name to ``_v3`` and raises ``NVMLLibraryMismatchError`` (not an ``NVMLError``)
    where the driver lacks it; the ``_v2`` call is asked then."""
    mismatch = getattr(q.nvml, "NVMLLibraryMismatchError", None)
    try:
        return q.maybe("nvmlDeviceGetComputeRunningProcesses", at, handle) or []
    except Exception as err:  # only the binding's mismatch error is handled, the rest re-raised
        if mismatch is None or not isinstance(err, mismatch):
            raise
    return q.maybe("nvmlDeviceGetComputeRunningProcesses_v2", at, handle) or []


def _process_name(proc_root: Path, pid: int) -> str | None:
    """``<proc_root>/<pid>/comm`` (the kernel's name of the process, at most 15 characters), None
    where it is not readable."""
    try:
        return (proc_root / str(pid) / "comm").read_text(errors="replace").strip() or None
    except OSError:
        return None


def in_host_pid_namespace(proc_root: Path) -> bool:
    """Whether this process's pids are the host's, as NVML reports them: the ``NSpid:`` line of
    ``<proc_root>/self/status`` lists one pid per nested pid namespace (Linux 4.1+, proc(5)), so a
    single entry means no container namespace. True where the line is missing (older kernels)."""
    try:
        for line in (proc_root / "self" / "status").read_text(errors="replace").splitlines():
            if line.startswith("NSpid:"):
                return len(line.split()) == 2
    except OSError:
        return False
    return True
