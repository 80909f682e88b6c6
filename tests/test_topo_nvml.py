"""NVML topology: the real no-driver failure on this CPU box, and the mapping logic with a stand-in
NVML module (same function names, constants and error class as nvidia-ml-py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastverify.errors import UserError
from fastverify.topo import nvml as topo_nvml
from fastverify.topo.nvml import read_nvml_topology, sysfs_bdf

pynvml = pytest.importorskip("pynvml")

# Names the code reads from the binding; they must exist in the installed nvidia-ml-py.
CONSTANTS = [
    "NVML_TOPOLOGY_INTERNAL",
    "NVML_TOPOLOGY_SINGLE",
    "NVML_TOPOLOGY_MULTIPLE",
    "NVML_TOPOLOGY_HOSTBRIDGE",
    "NVML_TOPOLOGY_NODE",
    "NVML_TOPOLOGY_SYSTEM",
    "NVML_P2P_CAPS_INDEX_READ",
    "NVML_P2P_CAPS_INDEX_WRITE",
    "NVML_P2P_STATUS_OK",
    "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED",
    "NVML_P2P_STATUS_GPU_NOT_SUPPORTED",
    "NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED",
    "NVML_P2P_STATUS_DISABLED_BY_REGKEY",
    "NVML_P2P_STATUS_NOT_SUPPORTED",
    "NVML_P2P_STATUS_UNKNOWN",
    "NVML_NVLINK_MAX_LINKS",
    "NVML_NVLINK_DEVICE_TYPE_GPU",
    "NVML_NVLINK_DEVICE_TYPE_SWITCH",
    "NVML_FEATURE_ENABLED",
    "NVML_AFFINITY_SCOPE_NODE",
]
FUNCTIONS = [
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetMemoryAffinity",
    "nvmlDeviceGetCpuAffinity",
    "nvmlSystemGetDriverVersion",
]


def test_names_exist_in_installed_pynvml():
    for name in CONSTANTS + FUNCTIONS + ["NVMLError"]:
        assert hasattr(pynvml, name), name
    # Values the fake below copies (and the stray-comma tuple of nvidia-ml-py 13.x, if present).
    assert [
        pynvml.NVML_TOPOLOGY_INTERNAL,
        pynvml.NVML_TOPOLOGY_SINGLE,
        pynvml.NVML_TOPOLOGY_MULTIPLE,
        pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
        pynvml.NVML_TOPOLOGY_NODE,
        pynvml.NVML_TOPOLOGY_SYSTEM,
    ] == [0, 10, 20, 30, 40, 50]
    assert pynvml.NVML_P2P_CAPS_INDEX_READ in (0, (0,)) and pynvml.NVML_P2P_CAPS_INDEX_WRITE == 1


def nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_no_driver_real_pynvml():
    if nvml_works():
        pytest.skip("NVML works here (GPU box)")
    with pytest.raises(UserError) as info:
        read_nvml_topology()
    text = str(info.value)
    assert text.startswith("no NVIDIA driver/GPU found (NVML: ")
    assert text.endswith(
        "); for an offline diagnosis give --nvidia-smi FILE (`nvidia-smi topo -m` text) and/or --nccl-log FILE"
    )
    assert "\n" not in text


# --- a stand-in NVML -----------------------------------------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int = 3, text: str = "Not Supported"):
        super().__init__(text)
        self.value = value


class FakeNvml:
    """Enough of pynvml for read_nvml_topology. Handles are ints; tables are per ordered pair."""

    NVMLError = FakeNVMLError

    def __init__(
        self,
        n,
        *,
        ancestors=None,
        p2p=None,
        nvlinks=None,
        switch_links=None,
        init_error=None,
        fail_count=False,
        bus_ids=None,
    ):
        for name in CONSTANTS:
            setattr(self, name, getattr(pynvml, name))
        self.NVML_P2P_CAPS_INDEX_READ = (0,)  # as nvidia-ml-py 13.615 defines it (stray comma)
        self.n = n
        self.ancestors = ancestors or {}
        self.p2p = p2p or {}  # (i, j, index) -> status, or an exception
        self.nvlinks = nvlinks or {}  # i -> list of peer indices, one per link
        self.switch_links = switch_links or {}  # i -> links to NVSwitches
        self.init_error = init_error
        self.fail_count = fail_count
        self.bus_ids = bus_ids or [f"00000000:{0x18 + 0x10 * k:02X}:00.0" for k in range(n)]
        self.shutdowns = 0
        self.p2p_indices = set()

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetCount(self):
        if self.fail_count:
            raise FakeNVMLError(15, "GPU is lost")
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA GeForce RTX 4090" if h % 2 == 0 else "NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus_ids[h])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestors[(min(a, b), max(a, b))]

    def _links(self, h):
        return [("gpu", p) for p in self.nvlinks.get(h, [])] + [("switch", None)] * self.switch_links.get(h, 0)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self._links(h)):
            raise FakeNVMLError()
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if self._links(h)[link][0] == "switch" else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        peer = self._links(h)[link][1]
        return SimpleNamespace(busId="00000000:FF:00.0" if peer is None else self.bus_ids[peer])

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert type(index) is int, index  # a tuple would break ctypes in the real binding
        self.p2p_indices.add(index)
        value = self.p2p.get((a, b, index), 0)
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 1 if h == 0 else 4  # GPU 0 idles at gen 1

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        raise FakeNVMLError()

    def nvmlDeviceGetNumaNodeId(self, h):
        raise FakeNVMLError()  # PCIe GPUs are not NUMA nodes

    def nvmlDeviceGetMemoryAffinity(self, h, node_words, scope):
        return [1 << (h % 2)]  # node 0 for even GPUs, node 1 for odd

    def nvmlDeviceGetCpuAffinity(self, h, words):
        assert words >= 1
        return [0xFF << (8 * h), 0] if h < 4 else [0, 0xF]


# Six GPUs; every NVML ancestor level appears among the pairs.
ANCESTORS = {
    (0, 1): 0,
    (0, 2): 10,
    (0, 3): 20,
    (0, 4): 30,
    (0, 5): 40,
    (1, 2): 50,
    (1, 3): 10,
    (1, 4): 20,
    (1, 5): 30,
    (2, 3): 40,
    (2, 4): 50,
    (2, 5): 10,
    (3, 4): 20,
    (3, 5): 30,
    (4, 5): 40,
}
EXPECTED_LINKS = {
    (0, 1): "PIX",
    (0, 2): "PIX",
    (0, 3): "PXB",
    (0, 4): "PHB",
    (0, 5): "NODE",
    (1, 2): "SYS",
    (1, 3): "PIX",
    (1, 4): "PXB",
    (1, 5): "PHB",
    (2, 3): "NODE",
    (2, 4): "SYS",
    (2, 5): "PIX",
    (3, 4): "PXB",
    (3, 5): "PHB",
    (4, 5): "NODE",
}


def test_ancestor_levels_map_to_nvidia_smi_names(tmp_path):
    fake = FakeNvml(6, ancestors=ANCESTORS)
    topo = read_nvml_topology(fake, sysfs_root=tmp_path)
    for (i, j), link in EXPECTED_LINKS.items():
        assert topo.links[(i, j)] == link and topo.links[(j, i)] == link
    assert len(topo.links) == 30
    assert fake.shutdowns == 1
    assert topo.source == "NVML (driver 550.54.15)"
    assert topo.nics == ()


def test_gpu_fields(tmp_path):
    (tmp_path / "bus/pci/devices/0000:28:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:28:00.0/numa_node").write_text("3\n")  # GPU 1 from sysfs
    (tmp_path / "bus/pci/devices/0000:18:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:18:00.0/numa_node").write_text("-1\n")  # GPU 0: sysfs says unknown
    topo = read_nvml_topology(FakeNvml(6, ancestors=ANCESTORS), sysfs_root=tmp_path)
    g = topo.gpus
    assert [x.index for x in g] == [0, 1, 2, 3, 4, 5]
    assert [x.name for x in g] == ["NVIDIA GeForce RTX 4090"] * 6  # bytes and str both decoded
    assert [x.pci_bus_id for x in g] == [
        "00000000:18:00.0",
        "00000000:28:00.0",
        "00000000:38:00.0",
        "00000000:48:00.0",
        "00000000:58:00.0",
        "00000000:68:00.0",
    ]
    # sysfs first (GPU 1 -> 3); else NVML memory affinity (even -> node 0, odd -> node 1).
    assert [x.numa_node for x in g] == [0, 3, 0, 1, 0, 1]
    assert [x.gpu_numa_id for x in g] == [None] * 6
    assert [x.cpu_affinity for x in g] == ["0-7", "8-15", "16-23", "24-31", "64-67", "64-67"]
    assert [(x.pcie_gen, x.pcie_width, x.pcie_max_gen, x.pcie_max_width) for x in g] == [(1, 16, 4, None)] + [
        (4, 16, 4, None)
    ] * 5


P2P_CASES = [  # status -> (allowed, reason)
    (0, True, None),
    (1, False, "chipset not supported"),
    (2, False, "GPU not supported"),
    (3, False, "IOH topology not supported"),
    (4, False, "disabled by regkey"),
    (5, False, "not supported"),
    (6, False, "unknown"),
]


@pytest.mark.parametrize("status,allowed,words", P2P_CASES)
def test_p2p_status_values(tmp_path, status, allowed, words):
    fake = FakeNvml(2, ancestors={(0, 1): 10}, p2p={(0, 1, 0): status, (0, 1, 1): status})
    topo = read_nvml_topology(fake, sysfs_root=tmp_path)
    assert topo.p2p_read[(0, 1)] is allowed and topo.p2p_write[(0, 1)] is allowed
    assert topo.p2p_read[(1, 0)] is True and topo.p2p_write[(1, 0)] is True
    assert fake.p2p_indices == {0, 1}  # READ passed as 0 although the binding holds (0,)
    if words is None:
        assert topo.p2p_reason == {}
    else:
        assert topo.p2p_reason == {(0, 1): f"read: {words}; write: {words}"}


def test_p2p_read_ok_write_refused_and_error_is_unknown(tmp_path):
    fake = FakeNvml(
        3,
        ancestors={(0, 1): 50, (0, 2): 50, (1, 2): 50},
        p2p={(0, 1, 1): 2, (0, 2, 0): FakeNVMLError(), (0, 2, 1): FakeNVMLError()},
    )
    topo = read_nvml_topology(fake, sysfs_root=tmp_path)
    assert (topo.p2p_read[(0, 1)], topo.p2p_write[(0, 1)]) == (True, False)
    assert topo.p2p_reason[(0, 1)] == "write: GPU not supported"
    assert (topo.p2p_read[(0, 2)], topo.p2p_write[(0, 2)]) == (None, None)
    assert (0, 2) not in topo.p2p_reason


def test_nvlink_direct_and_switch(tmp_path):
    # GPUs 0-1: 4 direct links; GPUs 2, 3: 18 links each to NVSwitches; the rest PCIe.
    ancestors = {(a, b): 40 for a in range(4) for b in range(a + 1, 4)}
    fake = FakeNvml(4, ancestors=ancestors, nvlinks={0: [1] * 4, 1: [0] * 4}, switch_links={2: 18, 3: 18})
    topo = read_nvml_topology(fake, sysfs_root=tmp_path)
    assert topo.links[(0, 1)] == topo.links[(1, 0)] == "NV4"
    assert topo.links[(2, 3)] == topo.links[(3, 2)] == "NV18"
    assert topo.links[(0, 2)] == topo.links[(1, 3)] == "NODE"
    assert topo.pairs_by_type(nccl=True) == {"NVL": ((0, 1), (2, 3)), "PHB": ((0, 2), (0, 3), (1, 2), (1, 3))}


def test_init_failure_is_one_line_user_error():
    fake = FakeNvml(2, init_error=FakeNVMLError(9, "Driver Not Loaded"))
    with pytest.raises(
        UserError,
        match=r"^no NVIDIA driver/GPU found \(NVML: Driver Not Loaded\); for an offline diagnosis give --nvidia-smi FILE",
    ):
        read_nvml_topology(fake)
    assert fake.shutdowns == 0  # never initialised


def test_shutdown_after_failure_and_zero_gpus():
    fake = FakeNvml(2, fail_count=True)
    with pytest.raises(UserError, match="^NVML failed while reading the GPU topology: GPU is lost$"):
        read_nvml_topology(fake)
    assert fake.shutdowns == 1
    fake = FakeNvml(0)
    with pytest.raises(UserError, match=r"NVML: the driver reports 0 GPUs"):
        read_nvml_topology(fake)
    assert fake.shutdowns == 1


def test_unknown_ancestor_level(tmp_path):
    fake = FakeNvml(2, ancestors={(0, 1): 35})
    with pytest.raises(UserError, match=r"GPUs 0 and 1: unknown NVML topology level 35"):
        read_nvml_topology(fake, sysfs_root=tmp_path)
    assert fake.shutdowns == 1


@pytest.mark.parametrize(
    "bus_id,bdf",
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0000:AF:00.1", "0000:af:00.1"),
        ("18:00.0", "0000:18:00.0"),
        ("00000001:3B:00.0", "0001:3b:00.0"),
        ("", None),
        ("../../etc", None),
        ("0000:18:00.8", None),
    ],
)
def test_sysfs_bdf(bus_id, bdf):
    assert sysfs_bdf(bus_id) == bdf


def test_an_nvml_constant_given_as_a_tuple_or_missing_is_read():
    """pynvml releases that spell a constant ``(0,)`` and ones that lack it read alike."""
    assert topo_nvml.p2p_status_text(SimpleNamespace(NVML_P2P_STATUS_OK=(7,)), 7) == "OK"
    assert topo_nvml.p2p_status_text(SimpleNamespace(), 0) == "OK"  # missing: NVML's own value
    assert topo_nvml.ancestor_to_link(SimpleNamespace(NVML_TOPOLOGY_SYSTEM=(99,)), 99) == "SYS"


# --- per-query NVML refusals (issue 9 item 10) -----------------------------------------------------


def _patch_real_pynvml(monkeypatch, fake: FakeNvml) -> None:
    """Point the installed pynvml's functions at ``fake``'s tables; errors stay pynvml's own."""
    for name in FUNCTIONS:
        monkeypatch.setattr(pynvml, name, getattr(fake, name))


def test_common_ancestor_not_supported_for_one_pair_keeps_the_rest(monkeypatch, tmp_path):
    """The real ``pynvml.NVMLError_NotSupported`` from ``nvmlDeviceGetTopologyCommonAncestor``
    for GPUs 0 and 2 only: before the fix the whole read failed with a UserError; now that pair
    is unknown with the error's name and every other pair and GPU is read."""
    ancestors = {(0, 1): 10, (1, 2): 30}  # (0, 2) refused below
    fake = FakeNvml(3, ancestors=ancestors)
    fake.NVMLError = pynvml.NVMLError
    real_ancestor = fake.nvmlDeviceGetTopologyCommonAncestor

    def ancestor(a, b):
        if {a, b} == {0, 2}:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return real_ancestor(a, b)

    fake.nvmlDeviceGetTopologyCommonAncestor = ancestor
    fake.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    fake.nvmlDeviceGetNumaNodeId = lambda h: -1
    fake.nvmlDeviceGetNvLinkState = lambda h, link: (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    )  # no NVLink: not a gap worth reporting
    _patch_real_pynvml(monkeypatch, fake)
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED), pynvml.NVMLError_NotSupported)

    topo = read_nvml_topology(sysfs_root=tmp_path)  # imports the (patched) real pynvml

    assert topo.links == {(0, 1): "PIX", (1, 0): "PIX", (1, 2): "PHB", (2, 1): "PHB"}
    assert topo.link_errors == {(0, 2): "NVML_ERROR_NOT_SUPPORTED", (2, 0): "NVML_ERROR_NOT_SUPPORTED"}
    assert topo.link(0, 2) is None and topo.link(0, 1) == "PIX" and topo.link(2, 2) == "X"
    assert topo.unsupported == (
        "nvmlDeviceGetTopologyCommonAncestor(GPU 0, GPU 2): NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetTopologyCommonAncestor(GPU 2, GPU 0): NVML_ERROR_NOT_SUPPORTED",
    )
    assert [g.pci_bus_id for g in topo.gpus] == ["00000000:18:00.0", "00000000:28:00.0", "00000000:38:00.0"]
    assert topo.p2p_read[(0, 2)] is True and topo.p2p_write[(2, 0)] is True  # P2P still read for that pair
    assert topo.pairs_by_type() == {"PIX": ((0, 1),), "PHB": ((1, 2),)}
    doc = topo.as_dict()
    assert doc["link_errors"] == {"0-2": "NVML_ERROR_NOT_SUPPORTED", "2-0": "NVML_ERROR_NOT_SUPPORTED"}
    assert doc["unsupported"] == list(topo.unsupported)


def test_refused_per_gpu_and_p2p_queries_are_listed(tmp_path):
    """Per-GPU and per-pair P2P refusals lose only their fact, and each is named."""
    fake = FakeNvml(2, ancestors={(0, 1): 20}, p2p={(0, 1, 1): pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)})
    fake.NVMLError = pynvml.NVMLError
    for name in dir(pynvml):  # the error-code names the report uses
        if name.startswith("NVML_ERROR_"):
            setattr(fake, name, getattr(pynvml, name))
    fake.nvmlDeviceGetMaxPcieLinkWidth = lambda h: (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    )
    fake.nvmlDeviceGetNumaNodeId = lambda h: (_ for _ in ()).throw(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
    fake.nvmlDeviceGetNvLinkState = lambda h, link: (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    )
    topo = read_nvml_topology(fake, sysfs_root=tmp_path)
    assert topo.links[(0, 1)] == "PXB" and topo.link_errors == {}
    assert topo.p2p_write[(0, 1)] is None and topo.p2p_read[(0, 1)] is True
    assert topo.unsupported == (
        "nvmlDeviceGetNumaNodeId(GPU 0): NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetMaxPcieLinkWidth(GPU 0): NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetNumaNodeId(GPU 1): NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetMaxPcieLinkWidth(GPU 1): NVML_ERROR_NOT_SUPPORTED",
        "nvmlDeviceGetP2PStatus(GPU 0, GPU 1, write): NVML_ERROR_NO_PERMISSION",
    )


def test_nvml_error_name():
    assert (
        topo_nvml.nvml_error_name(pynvml, pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
        == "NVML_ERROR_NOT_SUPPORTED"
    )
    assert (
        topo_nvml.nvml_error_name(pynvml, pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "NVML_ERROR_GPU_IS_LOST"
    )
    assert topo_nvml.nvml_error_name(pynvml, RuntimeError("x")) == "RuntimeError"


# --- free memory and its holders (read_gpu_memory) ------------------------------------------------


class MemoryNvml(FakeNvml):
    """FakeNvml plus memory, UUIDs and compute processes, as pynvml's own structures."""

    def __init__(self, n, *, free, holders, refuse=(), **kw):
        super().__init__(n, **kw)
        self.free, self.holders, self.refuse = free, holders, set(refuse)

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h):
        if ("memory", h) in self.refuse:
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlMemory_t(total=24 << 30, free=self.free[h], used=(24 << 30) - self.free[h])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if ("procs", h) in self.refuse:
            raise FakeNVMLError(pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions")
        return [
            pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v3_t(pid=pid, usedGpuMemory=used))
            for pid, used in self.holders.get(h, [])
        ]


def _procfs(root, nspid: str, comms: dict[int, str]):
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text(f"Name:\tpython3\nPid:\t7053\nNSpid:\t{nspid}\nVmPeak:\t1 kB\n")
    for pid, comm in comms.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(comm + "\n")
    return root


def test_memory_names_exist_in_installed_pynvml():
    for name in (
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetUUID",
        "c_nvmlMemory_t",
        "c_nvmlProcessInfo_v3_t",
        "nvmlStructToFriendlyObject",
    ):
        assert hasattr(pynvml, name), name


def test_read_gpu_memory_free_bytes_and_named_holders(tmp_path):
    proc = _procfs(tmp_path, "7053", {4242: "sglang::schedul"})
    fake = MemoryNvml(2, free=[1 << 29, 20 << 30], holders={0: [(4242, 23 << 30), (5151, 1 << 28)]})
    rows = topo_nvml.read_gpu_memory(fake, proc_root=proc)
    assert rows == [
        {
            "index": 0,
            "pci_bus_id": "00000000:18:00.0",
            "uuid": "GPU-0",
            "name": "NVIDIA GeForce RTX 4090",
            "total_bytes": 24 << 30,
            "free_bytes": 1 << 29,
            "holders": [
                {"pid": 4242, "name": "sglang::schedul", "used_bytes": 23 << 30},
                {"pid": 5151, "name": None, "used_bytes": 1 << 28},
            ],
        },  # /proc/5151 absent: no name
        {
            "index": 1,
            "pci_bus_id": "00000000:28:00.0",
            "uuid": "GPU-1",
            "name": "NVIDIA GeForce RTX 4090",
            "total_bytes": 24 << 30,
            "free_bytes": 20 << 30,
            "holders": [],
        },
    ]
    assert fake.shutdowns == 1


def test_read_gpu_memory_in_a_container_names_no_holder(tmp_path):
    """NSpid lists two pids: this process is in a nested pid namespace, where the host pid NVML
    reports names another process (here a stale /proc/4242): no name is taken."""
    proc = _procfs(tmp_path, "7053\t12", {4242: "bash"})
    fake = MemoryNvml(1, free=[1 << 29], holders={0: [(4242, 23 << 30)]})
    (row,) = topo_nvml.read_gpu_memory(fake, proc_root=proc)
    assert row["holders"] == [{"pid": 4242, "name": None, "used_bytes": 23 << 30}]


def test_read_gpu_memory_refusals_lose_their_own_field_and_no_driver_is_none(tmp_path):
    proc = _procfs(tmp_path, "7053", {})
    fake = MemoryNvml(2, free=[1 << 29, 1 << 30], holders={1: [(9, 1 << 20)]}, refuse={("memory", 0), ("procs", 1)})
    rows = topo_nvml.read_gpu_memory(fake, proc_root=proc)
    assert [(r["total_bytes"], r["free_bytes"], r["holders"]) for r in rows] == [
        (None, None, []),
        (24 << 30, 1 << 30, []),
    ]
    assert (
        topo_nvml.read_gpu_memory(
            MemoryNvml(1, free=[0], holders={}, init_error=FakeNVMLError(9, "Driver Not Loaded")), proc_root=proc
        )
        is None
    )
    assert topo_nvml.read_gpu_memory(MemoryNvml(1, free=[0], holders={}, fail_count=True), proc_root=proc) is None


def test_read_gpu_memory_on_a_driver_without_the_v3_process_query(tmp_path):
    """nvidia-ml-py's unversioned process query is ``_v3``; on an older driver it raises
    ``NVMLLibraryMismatchError``, which is not an ``NVMLError``: the ``_v2`` query answers instead."""
    proc = _procfs(tmp_path, "7053", {})
    fake = MemoryNvml(1, free=[1 << 29], holders={0: [(77, 1 << 30)]})
    fake.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    v3 = fake.nvmlDeviceGetComputeRunningProcesses

    def unversioned(h):
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")

    fake.nvmlDeviceGetComputeRunningProcesses = unversioned
    fake.nvmlDeviceGetComputeRunningProcesses_v2 = v3
    (row,) = topo_nvml.read_gpu_memory(fake, proc_root=proc)
    assert row["holders"] == [{"pid": 77, "name": None, "used_bytes": 1 << 30}]
