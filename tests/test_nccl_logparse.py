"""NCCL_DEBUG=INFO log parser: the two real excerpts in ``../shared/inputs`` (values read off the files
by eye and typed in below) and hand-written lines of every other form, built from NCCL's format
strings (file named next to each)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.nccl.debuglog import CallChoice, ChannelCounts, GraphInfo, PathInfo, Ring, RingLink, parse_nccl_log

INPUTS = Path(__file__).resolve().parents[2] / "shared" / "inputs"
F1027 = "nccldebug-nccl-1027.txt"
F307 = "nccldebug-nccl-tests-307.txt"
P = "host0:13313:13988 [0] NCCL INFO "  # a rank-0 INFO prefix


def _read(name: str) -> str:
    path = INPUTS / name
    if not path.is_file():
        pytest.skip(f"{path} not found (../shared/inputs beside the repo)")
    return path.read_text()


def _log(*msgs: str, prefix: str = P) -> str:
    return "".join(prefix + m + "\n" for m in msgs)


# --------------------------------------------------------------------------------------------
# nccl#1027: 8 GPUs, one process; ring mixes P2P read (NVLink pair), P2P (PCIe) and SHM

# (src dev, dst dev) → transports, every transport line of the excerpt
T1027 = {
    (0, 1): {"P2P/direct pointer/read"},
    (1, 2): {"P2P/direct pointer"},
    (2, 3): {"P2P/direct pointer/read"},
    (3, 4): {"SHM/direct/direct"},
    (5, 6): {"P2P/direct pointer"},
    (6, 7): {"P2P/direct pointer/read"},
}
# (channel, src rank, dst rank, transport, line of the file)
T1027_LINES = [
    (0, 5, 6, "P2P/direct pointer", 10),
    (0, 2, 3, "P2P/direct pointer/read", 11),
    (0, 1, 2, "P2P/direct pointer", 12),
    (0, 0, 1, "P2P/direct pointer/read", 13),
    (0, 3, 4, "SHM/direct/direct", 14),
    (1, 5, 6, "P2P/direct pointer", 15),
    (0, 6, 7, "P2P/direct pointer/read", 16),
]


@pytest.fixture(scope="module")
def log1027():
    return parse_nccl_log(_read(F1027), source=F1027)


def test_1027_transports(log1027):
    assert log1027.transports_by_pair() == T1027
    assert [(t.channel, t.src_rank, t.dst_rank, t.transport, t.line) for t in log1027.transports] == T1027_LINES
    shm = [t for t in log1027.transports if t.kind == "SHM"]
    assert [(t.src_dev, t.dst_dev, t.conn_index) for t in shm] == [(3, 4, None)]  # "Channel 00 :" has no /conn
    assert {(t.src_dev, t.dst_dev) for t in log1027.transports if t.read} == {(0, 1), (2, 3), (6, 7)}
    assert log1027.uses_shm and log1027.uses_p2p and not log1027.uses_net


def test_1027_rings_trees(log1027):
    assert log1027.rings == (Ring(0, 2, (0, 1, 2, 3, 4, 5, 6, 7), 5), Ring(1, 2, (0, 1, 2, 3, 4, 5, 6, 7), 6))
    assert log1027.ring_order(1) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert log1027.ring_order(2) is None
    # (channel, rank, down, up)
    assert [(t.channel, t.rank, t.down, t.up) for t in log1027.trees] == [
        (0, 4, (5, -1, -1), 3),
        (1, 4, (5, -1, -1), 3),
        (0, 0, (1, -1, -1), -1),
        (1, 0, (1, -1, -1), -1),
    ]
    assert log1027.n_ranks == 8  # no comm line in the excerpt: from the ring
    assert log1027.version is None and log1027.problems == ()
    assert log1027.n_nccl_lines == 15  # every line but the "# source" one


# --------------------------------------------------------------------------------------------
# nccl-tests#307: 8× RTX 4090, two PCIe switches of 4 GPUs, no P2P; paths and system bandwidth

A_SIDE = ("GPU/0-4e000", "GPU/0-4f000", "GPU/0-50000", "GPU/0-51000")
B_SIDE = ("GPU/0-ce000", "GPU/0-cf000", "GPU/0-d0000", "GPU/0-d1000")
PHB24, SYS10, LOC = PathInfo(4, 24.0, "PHB"), PathInfo(5, 10.0, "SYS"), PathInfo(0, 5000.0, "LOC")


@pytest.fixture(scope="module")
def log307():
    return parse_nccl_log(_read(F307), source=F307)


def test_307_paths_per_gpu_pair(log307):
    # the excerpt has path lines for GPUs CE000, CF000, D0000, D1000 and 50000
    assert sorted(log307.paths) == ["GPU/0-50000", "GPU/0-ce000", "GPU/0-cf000", "GPU/0-d0000", "GPU/0-d1000"]
    for src, row in log307.paths.items():
        same = B_SIDE if src in B_SIDE else A_SIDE
        for dst in A_SIDE + B_SIDE:
            want = LOC if dst == src else PHB24 if dst in same else SYS10
            assert row[dst] == want, (src, dst)
    # literal spot checks, as printed
    assert log307.paths["GPU/0-ce000"]["GPU/0-4e000"] == PathInfo(5, 10.0, "SYS")
    assert log307.paths["GPU/0-cf000"]["GPU/0-d1000"] == PathInfo(4, 24.0, "PHB")
    assert log307.paths["GPU/0-50000"]["GPU/0-51000"] == PathInfo(4, 24.0, "PHB")
    assert log307.paths["GPU/0-ce000"]["CPU/0-0"] == PathInfo(3, 10.0, "SYS")
    assert log307.paths["GPU/0-ce000"]["CPU/0-1"] == PathInfo(2, 24.0, "PHB")
    assert log307.paths["GPU/0-50000"]["CPU/0-0"] == PathInfo(2, 24.0, "PHB")
    assert log307.paths["GPU/0-50000"]["CPU/0-1"] == PathInfo(3, 10.0, "SYS")
    pairs = log307.gpu_paths()
    assert len(pairs) == 5 * 7
    assert sum(p.path_type == "SYS" for p in pairs.values()) == 5 * 4
    assert sum(p.path_type == "PHB" for p in pairs.values()) == 5 * 3


def test_307_system_and_topology(log307):
    assert (log307.max_bw_gbps, log307.total_bw_gbps) == (24.0, 24.0)
    assert log307.gpu_ranks == {"GPU/0-ce000": 4, "GPU/0-cf000": 5, "GPU/0-d0000": 6, "GPU/0-d1000": 7}
    assert log307.transports == () and not log307.uses_shm and not log307.uses_p2p
    assert log307.problems == ()


# --------------------------------------------------------------------------------------------
# Hand-written lines


@pytest.mark.parametrize(
    "line, version, cuda",
    [
        (P + "NCCL version 2.27.5+cuda12.9", "2.27.5", "12.9"),
        ("NCCL version 2.21.5+cuda12.4", "2.21.5", "12.4"),  # NCCL_DEBUG=VERSION: bare
        ("[1,0]<stdout>:NCCL version 2.18.3+cuda12.2", "2.18.3", "12.2"),
        ("[2025-02-07 10:00:00] " + P + "NCCL version 2.30.7+cuda13.0", "2.30.7", "13.0"),
        (P + "NCCL version 2.12.12+cuda11.7", "2.12.12", "11.7"),
    ],
)
def test_version_lines(line, version, cuda):
    log = parse_nccl_log(line + "\n")
    assert (log.version, log.cuda_version) == (version, cuda)
    assert log.version_tuple == tuple(int(x) for x in version.split("."))


def test_two_versions_is_a_problem():
    log = parse_nccl_log(_log("NCCL version 2.27.5+cuda12.9", "NCCL version 2.26.2+cuda12.2"))
    assert log.version == "2.27.5"
    assert any("several NCCL versions" in p for p in log.problems)


def test_comm_lines():
    log = parse_nccl_log(
        _log(
            "comm 0x55d1c0a0 rank 3 nRanks 8 nNodes 1 localRanks 8 localRank 3 MNNVL 0",
            "ncclCommInitRankConfig comm 0x55d1c0a0 rank 3 nranks 8 cudaDev 3 nvmlDev 3 busId 61000 commId 0x1234 - Init START",
            "ncclCommInitRankConfig comm 0x55d1c0a0 rank 3 nranks 8 cudaDev 3 nvmlDev 3 busId 61000 commId 0x1234 - Init COMPLETE",
            "comm 0x7f00 rank 0 nranks 2 cudaDev 0 busId 1a000 - Init COMPLETE",
        )
    )
    c = log.comms
    assert len(c) == 3
    assert (c[0].rank, c[0].n_ranks, c[0].n_nodes, c[0].local_ranks, c[0].local_rank) == (3, 8, 1, 8, 3)
    assert (c[1].rank, c[1].n_ranks, c[1].cuda_dev, c[1].bus_id) == (3, 8, 3, "61000")
    assert (c[2].rank, c[2].n_ranks, c[2].bus_id) == (0, 2, "1a000")
    assert log.n_ranks == 8


@pytest.mark.parametrize(
    "msg, kind, transport, read, ce, via",
    [
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", "P2P", "P2P/IPC", False, False, None),
        ("Channel 01/1 : 0[0] -> 1[1] via P2P/IPC/read/CE", "P2P", "P2P/IPC/read/CE", True, True, None),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", "P2P", "P2P/CUMEM", False, False, None),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read", "P2P", "P2P/CUMEM/read", True, False, None),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/CE", "P2P", "P2P/CUMEM/CE", False, True, None),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer", "P2P", "P2P/direct pointer", False, False, None),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/indirect/2[2]/read", "P2P", "P2P/indirect/2[2]/read", True, False, 2),
        ("Channel 00 : 0[0] -> 1[1] via SHM/direct/direct", "SHM", "SHM/direct/direct", False, False, None),
        ("Channel 00 : 0[0] -> 1[1] via SHM/CE/direct", "SHM", "SHM/CE/direct", False, True, None),
        ("Channel 00 : 0[0] -> 1[1] via SHM/direct", "SHM", "SHM/direct", False, False, None),
        ("Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA", "NET", "NET/IB/0/GDRDMA", False, False, None),
    ],
)
def test_transport_forms(msg, kind, transport, read, ce, via):
    (t,) = parse_nccl_log(_log(msg)).transports
    assert (t.src_rank, t.src_dev, t.dst_rank, t.dst_dev) == (0, 0, 1, 1)
    assert (t.kind, t.transport, t.read, t.ce, t.via_rank) == (kind, transport, read, ce, via)


def test_net_receive_direction_and_old_bus_ids():
    log = parse_nccl_log(
        _log(
            "NCCL version 2.12.12+cuda11.7",
            "Channel 00 : 0[1a000] -> 1[1b000] via P2P/IPC",
            "Channel 01/0 : 8[1a000] -> 0[1a000] [receive] via NET/Socket/0",
        )
    )
    a, b = log.transports
    assert (a.src_dev, a.dst_dev) == ("1a000", "1b000")  # bus ids before 2.18
    assert (b.direction, b.kind, b.channel, b.conn_index) == ("receive", "NET", 1, 0)
    assert log.uses_net


def test_rings_both_spacings_and_ring_links():
    log = parse_nccl_log(
        _log(
            "Channel 00/02 :    0   1   2   3   4   5   6   7",  # ≤2.22: %3d
            "Channel 01/02 : 0 1 2 3 4 5 6 7",  # ≥2.23: %*d, width = digits of nRanks-1
            "Channel 00/04 :  0  9 10 11  1  2  3  4  5  6  7  8",
            "Ring 00 : 7 -> 0 -> 1",
        )
    )
    assert [(r.channel, r.n_channels, r.ranks) for r in log.rings] == [
        (0, 2, (0, 1, 2, 3, 4, 5, 6, 7)),
        (1, 2, (0, 1, 2, 3, 4, 5, 6, 7)),
        (0, 4, (0, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 8)),
    ]
    assert log.ring_links == (RingLink(0, 7, 0, 1, 4),)


def test_channel_counts_both_forms():
    log = parse_nccl_log(
        _log(
            "2 coll channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer",  # 2.18–2.19
            "4 coll channels, 4 collnet channels, 0 nvls channels, 8 p2p channels, 1 p2p channels per peer",  # 2.20+
        )
    )
    assert log.channel_counts == (ChannelCounts(2, None, 0, 2, 2, 1), ChannelCounts(4, 4, 0, 8, 1, 2))


def test_graph_lines_and_fallback():
    log = parse_nccl_log(
        _log(
            "Pattern 4, crossNic 0, nChannels 2, bw 12.000000/12.000000, type PHB/PIX, sameChannels 1",
            " 0 : GPU/0 GPU/1 GPU/2 GPU/3",
            "Could not find a path for pattern 3, falling back to simple order",
            "Pattern 3, crossNic 0, nChannels 1, bw 0.100000/0.000000, type SYS/DIS, sameChannels 1",
            "Pattern 4, crossNic 0, nChannels 1, speed 6.000000/6.000000, type SYS/PIX, sameChannels 1",  # ≤2.12
        )
    )
    assert log.graphs == (
        GraphInfo(4, 0, 2, 12.0, 12.0, "PHB", "PIX", 1, 1),
        GraphInfo(3, 0, 1, 0.1, 0.0, "SYS", "DIS", 1, 4),
        GraphInfo(4, 0, 1, 6.0, 6.0, "SYS", "PIX", 1, 5),
    )
    assert log.graph_fallbacks == (3,)


def _tuning_block(algos, threads, rows):
    """Lines as graph/tuning.cc (2.18+) prints one block of 3 algorithms."""
    protos = ("LL", "LL128", "Simple")
    out = ["  Algorithm   |" + "".join(" %14s   %14s   %14s |" % ("", a, "") for a in algos)]
    out.append("  Protocol    |" + "".join(" %14s |" % p for _ in range(3) for p in protos))
    out.append(" Max NThreads |" + "".join(" %14d |" % n for n in threads))
    for func, cells in rows:
        out.append("%13s |" % func + "".join("%8.1f/%6.1f |" % c for c in cells))
    return out


def test_tuning_table_new_form():
    block1 = _tuning_block(
        ("Tree", "Ring", "CollNetDirect"),
        (512, 640, 512, 512, 640, 256, 0, 0, 640),
        [
            ("Broadcast", [(0.0, 0.0)] * 3 + [(6.3, 4.8), (8.4, 21.0), (14.0, 24.0)] + [(0.0, 0.0)] * 3),
            (
                "AllReduce",
                [(10.8, 2.2), (13.9, 9.6), (46.0, 14.4), (20.6, 1.9), (27.1, 8.4), (43.5, 12.0)] + [(0.0, 0.0)] * 3,
            ),
        ],
    )
    block2 = _tuning_block(("CollNetChain", "NVLS", "NVLSTree"), (0,) * 9, [("AllReduce", [(0.0, 0.0)] * 9)])
    log = parse_nccl_log(_log(*block1, *block2, prefix="host0:1:2 [0] NCCL INFO "))
    ar = log.tuning["AllReduce"]
    assert ar[("TREE", "LL")] == (10.8, 2.2)
    assert ar[("TREE", "SIMPLE")] == (46.0, 14.4)
    assert ar[("RING", "LL")] == (20.6, 1.9)
    assert ar[("RING", "LL128")] == (27.1, 8.4)
    assert ar[("RING", "SIMPLE")] == (43.5, 12.0)
    assert ar[("NVLS", "SIMPLE")] == (0.0, 0.0)
    assert log.tuning["Broadcast"][("RING", "SIMPLE")] == (14.0, 24.0)
    assert log.max_nthreads[("RING", "LL")] == 512
    assert log.max_nthreads[("RING", "SIMPLE")] == 256
    assert len(ar) == 18 and log.problems == ()


def test_tuning_table_old_single_form():
    # ≤2.17: "Latency/AlgBw |" with " %7s/%6s |" per (algo, proto)
    cols = [
        ("Tree", "LL"),
        ("Tree", "LL128"),
        ("Tree", "Simple"),
        ("Ring", "LL"),
        ("Ring", "LL128"),
        ("Ring", "Simple"),
    ]
    head = "Latency/AlgBw |" + "".join(" %7s/%6s |" % c for c in cols)
    threads = " Max NThreads |" + "".join(" %14d |" % n for n in (512, 640, 512, 512, 640, 512))
    row = "%13s |" % "AllReduce" + "".join(
        "%8.1f/%6.1f |" % c for c in [(6.8, 0.6), (8.1, 0.8), (56.0, 2.4), (6.6, 4.0), (8.4, 5.0), (29.0, 12.0)]
    )
    log = parse_nccl_log(_log(head, threads, row))
    assert log.tuning == {
        "AllReduce": {
            ("TREE", "LL"): (6.8, 0.6),
            ("TREE", "LL128"): (8.1, 0.8),
            ("TREE", "SIMPLE"): (56.0, 2.4),
            ("RING", "LL"): (6.6, 4.0),
            ("RING", "LL128"): (8.4, 5.0),
            ("RING", "SIMPLE"): (29.0, 12.0),
        }
    }


def test_per_call_lines_both_versions():
    log = parse_nccl_log(
        _log(
            "AllReduce: 57344 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}",  # ≥2.24
            "AllReduce: 4194304 Bytes -> Algo TREE proto SIMPLE channel{Lo..Hi}={0..3}",
            "AllReduce: 8192 Bytes -> Algo 1 proto 0 time 21.496000",  # 2.23: ids and the model's time
            "8 Bytes -> Algo 0 proto 2 time 56.300000",  # 2.21: no function name
        )
    )
    assert log.calls == (
        CallChoice("AllReduce", 57344, "RING", "LL", 0, 1, None, 1),
        CallChoice("AllReduce", 4194304, "TREE", "SIMPLE", 0, 3, None, 2),
        CallChoice("AllReduce", 8192, "RING", "LL", None, None, 21.496, 3),
        CallChoice(None, 8, "TREE", "SIMPLE", None, None, 56.3, 4),
    )


def test_env_lines():
    log = parse_nccl_log(
        _log(
            "NCCL_P2P_LEVEL set by environment to SYS",
            "NCCL_P2P_DISABLE set by environment to 1",
            "NCCL_BUFFSIZE set by environment to 8388608.",  # misc/param.cc: "%lld."
            "NCCL_ALGO set by environment to Ring",
            "NCCL_SOCKET_IFNAME set by environment to eth0",
            "Invalid value abc for NCCL_NTHREADS, using default 512.",
            "Could not enable P2P between dev 3(=61000) and dev 4(=81000)",
        )
    )
    assert log.env == {
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_ALGO": "Ring",
        "NCCL_SOCKET_IFNAME": "eth0",
    }
    assert log.env_invalid == {"NCCL_NTHREADS": "abc"}
    assert log.p2p_unavailable == ((3, 4),)


def test_tuner_plugin_lines():
    log = parse_nccl_log(
        _log(
            "NCCL_TUNER_PLUGIN set by environment to libnccl-tuner-example.so",
            "TUNER/Plugin: Using Example (v4)",
            "Successfully loaded external tuner plugin libnccl-tuner-example.so",
        )
    )
    assert log.tuner_plugin == "libnccl-tuner-example.so"
    assert log.tuner_lines[0] == "TUNER/Plugin: Using Example (v4)"
    assert log.env["NCCL_TUNER_PLUGIN"] == "libnccl-tuner-example.so"


def test_warn_lines_with_timestamp_file_and_function():
    text = (
        "[2025-02-07 10:00:00] host0:13313:13991 [3] transport/p2p.cc:275 NCCL WARN Cuda failure 'peer access is not supported'\n"
        "host0:13313:13991 [3] enqueue.cc:1540 (ncclLaunchKernel) NCCL WARN Cuda failure 700\n"
    )
    w1, w2 = parse_nccl_log(text).warnings
    assert (w1.dev, w1.file, w1.message) == (3, "transport/p2p.cc", "Cuda failure 'peer access is not supported'")
    assert (w2.file, w2.message) == ("enqueue.cc", "Cuda failure 700")


def test_mpi_prefixes_and_other_output_are_skipped():
    text = (
        "Starting server…\n"
        "[1,0]<stdout>:host0:100:101 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "[1,1]<stdout>:host0:200:201 [1] NCCL INFO Channel 00 : 1[1] -> 0[0] via SHM/direct/direct\n"
        "[0] host0:100:101 [0] NCCL INFO NCCL_P2P_LEVEL set by environment to PHB\n"
        "some unrelated | table | 1.0/2.0 |\n"
    )
    log = parse_nccl_log(text)
    assert log.transports_by_pair() == {(0, 1): {"P2P/CUMEM/read"}, (1, 0): {"SHM/direct/direct"}}
    assert log.env == {"NCCL_P2P_LEVEL": "PHB"} and log.n_nccl_lines == 3


def test_truncated_text_keeps_what_parsed():
    full = _log(
        "NCCL version 2.27.5+cuda12.9",
        "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM",
        "Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-1->0->-1",
    )
    text = full + P + "Channel 00/0 : 1[1] -> 2[2] via P2P/CU"
    log = parse_nccl_log(text, source="cut.log")
    assert log.version == "2.27.5" and len(log.transports) == 1 and len(log.trees) == 2
    assert any(p.startswith("line 4: unknown transport") for p in log.problems)
    assert any(p.startswith("line 4: text ends without a newline") for p in log.problems)


def test_cut_trees_and_paths_lines_are_reported():
    log = parse_nccl_log(
        _log(
            "Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-",
            "GPU/0-ce000 :GPU/0-4e000 (5/10.0/SYS) GPU/0-4f000 (5/10.",
        )
    )
    assert [(t.channel, t.rank) for t in log.trees] == [(0, 0)]
    assert log.paths == {"GPU/0-ce000": {"GPU/0-4e000": PathInfo(5, 10.0, "SYS")}}
    assert [p.split(":")[0] for p in log.problems] == ["line 1", "line 2"]


@pytest.mark.parametrize("text", ["", "\n\n", "hello world\n", "NCCL is great\nversion 2.27\n"])
def test_no_nccl_line_is_a_user_error(text):
    with pytest.raises(UserError) as ei:
        parse_nccl_log(text, source="app.log")
    msg = str(ei.value)
    assert msg.startswith("app.log: no NCCL log line found") and "\n" not in msg


# --------------------------------------------------------------------------------------------
# Never anything but UserError


def _returns_or_user_error(text: str) -> None:
    try:
        log = parse_nccl_log(text, source="fuzz")
    except UserError as e:
        assert "\n" not in str(e)
    else:
        assert log.n_nccl_lines > 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_arbitrary_text(text):
    _returns_or_user_error(text)


_PIECES = [
    P,
    "host0:1:2 [0] NCCL WARN ",
    "NCCL version ",
    "2.27.5+cuda12.9",
    "Channel ",
    "00/02 :",
    " 0 1 2",
    " : 0[0] -> 1[1]",
    " via ",
    "P2P/direct pointer",
    "/read",
    "SHM/direct/direct",
    "NET/IB/0",
    "Trees",
    " [0] 1/-1/-1->0->-1",
    "Pattern 4, crossNic 0, nChannels 2, bw ",
    "12.0/1.2.3",
    ", type PHB/PIX, sameChannels 1",
    "GPU/CE000 :",
    "GPU/0-4e000 (5/10.0/SYS) ",
    "=== System : maxBw 24.0 totalBw ",
    " ===",
    "  Algorithm   |",
    "   Tree |",
    "  Protocol    |",
    "  LL |",
    " Max NThreads |",
    " 512 |",
    "    AllReduce |",
    "   6.8/   0.6 |",
    "Latency/AlgBw |",
    "AllReduce: ",
    "99999999999999999999999 Bytes -> Algo ",
    "RING proto LL",
    " channel{Lo..Hi}={0..1}",
    " time nan",
    "NCCL_P2P_LEVEL set by environment to ",
    "\n",
    " ",
    "9" * 5000,
    "٣",
    "ÿ",
    "\x00",
    "\r",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_PIECES), max_size=60).map("".join))
def test_fuzz_nccl_like_text(text):
    _returns_or_user_error(text)


@pytest.mark.parametrize("name", [F1027, F307])
def test_every_truncation_of_real_files(name):
    text = _read(name)
    for n in range(0, len(text) + 1, 3):
        _returns_or_user_error(text[:n])


@pytest.mark.parametrize(
    "line",
    [
        "NCCL " + "a" * 1_000_000,
        P + "comm " + "a " * 300_000 + " - Init COMPLETE",
        P + "NCCL_ALGO set by environment to" + " " * 8000 + "x",
        P + "Channel 00/02 :" + " 1" * 400_000 + "x",
        "x" * 300_000 + " NCCL INFO " + "y:" * 100_000,
    ],
)
def test_long_lines_stay_fast(line):
    import time

    t0 = time.perf_counter()
    _returns_or_user_error(line + "\n")
    assert time.perf_counter() - t0 < 2.0


# --------------------------------------------------------------------------------------------
# Issue 11: what topo and tune read off a log (devices, pair kinds, P2P off by env, TUNING rows)


def test_devices_and_pair_kinds_of_nccl_1027():
    log = parse_nccl_log(_read("nccldebug-nccl-1027.txt"))
    # every [dev] that printed a line in the excerpt: 0..7
    assert log.devices == (0, 1, 2, 3, 4, 5, 6, 7)
    # read off the file: 0->1, 2->3, 6->7 P2P/direct pointer/read; 1->2, 5->6 P2P/direct pointer; 3->4 SHM
    assert log.transport_kinds() == {
        (0, 1): "P2P",
        (1, 2): "P2P",
        (2, 3): "P2P",
        (3, 4): "SHM",
        (5, 6): "P2P",
        (6, 7): "P2P",
    }
    assert log.p2p_disabled_by_env is None


def test_pair_kind_shm_wins_over_p2p():
    log = parse_nccl_log(
        _log("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", "Channel 01 : 1[1] -> 0[0] via SHM/direct/direct")
    )
    assert log.transport_kinds() == {(0, 1): "SHM"}


@pytest.mark.parametrize(
    "line, want",
    [
        ("NCCL_P2P_LEVEL set by environment to LOC", "NCCL_P2P_LEVEL=LOC"),
        ("NCCL_P2P_LEVEL set by environment to 0.", "NCCL_P2P_LEVEL=0"),
        ("NCCL_P2P_DISABLE set by environment to 1.", "NCCL_P2P_DISABLE=1"),
        ("NCCL_P2P_LEVEL set by environment to PIX", None),
        ("NCCL_P2P_DISABLE set by environment to 0.", None),
    ],
)
def test_p2p_disabled_by_env(line, want):
    log = parse_nccl_log(_log(line))
    assert log.p2p_disabled_by_env == want
    assert log.transports == () and log.devices == (0,)


def test_tuning_rows_leave_out_disabled_cells():
    # one 2.18+ block as graph/tuning.cc prints it; NVLS/CollNet cells 0/0 (no such hardware)
    head = [
        "  Algorithm   |" + "".join(" %14s   %14s   %14s |" % ("", a, "") for a in ("Tree", "Ring", "CollNetDirect")),
        "  Protocol    |" + "".join(" %14s |" % p for _ in range(3) for p in ("LL", "LL128", "Simple")),
        " Max NThreads |" + "".join(" %14d |" % n for n in (512, 640, 512, 512, 640, 256, 0, 0, 640)),
    ]
    row = "%13s |" % "AllReduce" + "".join(
        "%8.1f/%6.1f |" % c
        for c in [(10.8, 2.2), (0.0, 0.0), (46.0, 14.4), (20.6, 1.9), (0.0, 0.0), (43.5, 12.0)] + [(0.0, 0.0)] * 3
    )
    log = parse_nccl_log(_log(*head, row))
    assert log.tuning_rows() == [
        ("TREE", "LL", 10.8, 2.2),
        ("TREE", "SIMPLE", 46.0, 14.4),
        ("RING", "LL", 20.6, 1.9),
        ("RING", "SIMPLE", 43.5, 12.0),
    ]
    assert log.tuning_rows("Broadcast") == []
