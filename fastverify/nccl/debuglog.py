"""Read an ``NCCL_DEBUG=INFO`` log into an :class:`NcclLog`: the line forms, the records, the parser.

Any subsystems, any number of ranks and communicators; other program output mixed in is skipped.
Three parts, in order: the line forms of the log as regexes, each with the NCCL source that prints
it (also the small readers the nccl-tests reader shares, :func:`search_near_nccl`); one frozen
record per line form and :class:`NcclLog`, everything read from one log; and the parser
:func:`parse_nccl_log`.

Nothing here raises except :class:`~fastverify.errors.UserError`, in two cases: the text has no
NCCL line at all, or a line of a known form holds a number no NCCL prints, past fastverify's
plausibility bounds (:mod:`fastverify.bounds`): a channel index or count beyond NCCL's 64
(``MAXCHANNELS``), a bandwidth that is negative, nan, inf or over 1e6 GB/s, a time outside
[0, 1 hour], a message over 1 TiB, a rank or hop count over 1e9. Such a line is corrupt or
hand-edited, and every field is held to the same rule: the error names the file, the line, the
field and its value. Lines that start like a known form but do not parse (a line cut off) go to
``problems``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fastverify.bounds import (
    MAX_CHANNELS,
    MAX_COUNT,
    MAX_MSG_BYTES,
    implausible_bandwidth,
    implausible_count,
    implausible_time_us,
)
from fastverify.errors import UserError

# The line forms of an ``NCCL_DEBUG=INFO`` log, as regexes, with where NCCL prints each one
# (NVIDIA/nccl ``src/``), and the small readers the parser shares with the nccl-tests reader.
#
# Regexes match ASCII digits only: a Unicode digit must not reach ``int()``.

# NCCL_ALGO_* / NCCL_PROTO_* ids (src/include/device.h), for the 2.21–2.23 per-call lines.
ALGO_BY_ID = {0: "TREE", 1: "RING", 2: "COLLNET_DIRECT", 3: "COLLNET_CHAIN", 4: "NVLS", 5: "NVLS_TREE", 6: "PAT"}
PROTO_BY_ID = {0: "LL", 1: "LL128", 2: "SIMPLE"}

_A = re.ASCII
# Prefix (debug.cc): ``[%F %T] `` timestamp (optional; default on WARN only), ``host:pid:tid ``,
# then ``[cudaDev] NCCL INFO msg`` / ``[cudaDev] file:line [(func) ]NCCL WARN msg`` /
# ``[cudaDev] ms func:line NCCL TRACE msg``.
PREFIX = re.compile(
    r"(?P<host>[^\s:\[\]]{1,255}):(?P<pid>\d{1,12}):(?P<tid>\d{1,12}) \[(?P<dev>-?\d{1,9})\] "
    r"(?:[\d.]{1,30} )?(?:(?P<file>[^\s:]{1,255}):\d{1,9} (?:\([^)]{0,255}\) )?)?NCCL (?P<level>INFO|WARN|TRACE)",
    _A,
)
# NCCL_DEBUG=VERSION/WARN print the version line bare (debug.cc NCCL_LOG_VERSION),
# ``NCCL version 2.27.5+cuda12.9``; an MPI tag (``[1,0]<stdout>:``) may precede it.
BARE_VERSION = re.compile(r"^(?:\[[\d,]+\](?:<std\w+>)?:?\s*|\d+: )?\s*(NCCL version \d\S*)\s*$", _A)
# ``NCCL version 2.27.5+cuda12.9`` (init.cc).
VERSION = re.compile(r"^NCCL version (\d{1,4})\.(\d{1,4})\.(\d{1,4})(\S*?)(?:\+cuda(\d+\.\d+))?$", _A)
# ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (2.20+).
COMM_NEW = re.compile(
    r"^comm (0x[0-9a-fA-F]+|\S+) rank (\d{1,9}) nRanks (\d{1,9}) nNodes (\d{1,9}) localRanks (\d{1,9}) "
    r"localRank (\d{1,9})(?: MNNVL \d+)?$",
    _A,
)
# ``[func] comm %p rank %d nranks %d cudaDev %d [nvmlDev %d] busId %lx … - Init COMPLETE``.
COMM_INIT = re.compile(
    r"^(?:.*? )?comm (0x[0-9a-fA-F]+|\S+) rank (\d{1,9}) nranks (\d{1,9}) cudaDev (\d{1,9})(?: nvmlDev \d+)? "
    r"busId ([0-9a-fA-F]{1,16})\b.* - (?:Init (?:START|COMPLETE))$",
    _A,
)
# Transports (transport/p2p.cc, shm.cc, net.cc): ``Channel %02d/%01d : %d[%d] -> %d[%d] via
# P2P/direct pointer[/read]``, ``P2P/CUMEM|IPC|MNNVL[/read][/CE]``, ``P2P/indirect/%d[%d][/read]``,
# ``Channel %02d : … via SHM/direct/direct`` (<= 2.30.4; ``SHM/CE/…`` with memcpy) or ``SHM/direct``
# (2.30.7+), ``… [send] via NET/IB/0/GDRDMA``. In brackets: the NVML device index since 2.18, the
# PCI bus id in hex (``%lx``) before; before 2.14 there is no ``/connIndex``.
TRANSPORT = re.compile(
    r"^Channel (\d{1,30})(?:/(\d{1,30}))? : (\d{1,30})\[([0-9a-fA-F]{1,16})\] -> (\d{1,30})\[([0-9a-fA-F]{1,16})\]"
    r"(?: \[(send|receive)\])? via (.+?)\s*$",
    _A,
)
P2P_VIA = re.compile(
    r"^P2P/(?:direct pointer(?P<r1>/read)?|(?:IPC|CUMEM|MNNVL)(?P<r2>/read)?(?P<ce>/CE)?"
    r"|indirect/(?P<via>\d{1,9})\[[0-9a-fA-F]{1,16}\](?P<r3>/read)?)$",
    _A,
)
# ``direct shared memory``: what NCCL up to 2.8 printed for SHM (transport/shm.cc,
# ``Channel %02d : %d[%lx] -> %d[%lx] via direct shared memory``).
SHM_VIA = re.compile(r"^(?:SHM/(?:direct|CE)(?:/(?:direct|CE))?|direct shared memory)$", _A)
NET_VIA = re.compile(r"^NET/\S+/\d+\S*$", _A)
# Rings (graph/rings.cc, rank 0 only): ``Channel 00/02 :    0   1 …`` (``%3d``, <= 2.22) or
# ``Channel 00/02 : 0 1 …`` (``%*d``, 2.23+); ``Ring 00 : 7 -> 0 -> 1`` (GRAPH) per rank.
RING = re.compile(r"^Channel (\d{1,30})/(\d{1,30}) :((?: +-?\d{1,30})+)\s*$", _A)
RING_LINK = re.compile(r"^Ring (\d{1,30}) : (-?\d{1,30}) -> (-?\d{1,30}) -> (-?\d{1,30})$", _A)
# ``Trees [0] 5/-1/-1->4->3 [1] …`` = down0/down1/down2->rank->up per channel (init.cc).
TREES = re.compile(r"^Trees((?: \[\d{1,30}\] -?\d{1,30}/-?\d{1,30}/-?\d{1,30}->-?\d{1,30}->-?\d{1,30})*)\s*$", _A)
TREE_ITEM = re.compile(r"\[(\d{1,30})\] (-?\d{1,30})/(-?\d{1,30})/(-?\d{1,30})->(-?\d{1,30})->(-?\d{1,30})", _A)
# ``%d coll channels, [%d collnet channels, ][%d nvls channels, ]%d p2p channels, %d p2p channels
# per peer`` (collnet field 2.20+).
CHANNELS = re.compile(
    r"^(\d{1,30}) coll channels, (?:(\d{1,30}) collnet channels, )?(?:(\d{1,30}) nvls channels, )?"
    r"(\d{1,30}) p2p channels, (\d{1,30}) p2p channels per peer$",
    _A,
)
_NUM = r"[-+\w.]{1,40}"  # a number as NCCL prints it, or what a corrupt log put there (1e308, nan)
# Graph (graph/search.cc): ``Pattern %d, crossNic %d, nChannels %d, bw %f/%f, type %s/%s,
# sameChannels %d`` (``speed`` instead of ``bw`` <= 2.12; bw = intra/inter GB/s per channel), and
# ``Could not find a path for pattern %d, falling back to simple order``.
GRAPH = re.compile(
    rf"^Pattern (\d{{1,3}}), crossNic (\d{{1,3}}), nChannels (\d{{1,30}}), (?:bw|speed) ({_NUM})/({_NUM}), "
    r"type (\w{1,8})/(\w{1,8}), sameChannels (\d{1,3})$",
    _A,
)
FALLBACK = re.compile(r"^Could not find a path for pattern (\d{1,3}), falling back to simple order$", _A)
# Topology (graph/topo.cc, paths.cc): ``=== System : maxBw %2.1f totalBw %2.1f ===``, tree dump
# lines ``+ PCI[24.0] - GPU/0-cf000 (5)`` (GPU and its rank), and one line of paths per node
# ``GPU/0-ce000 :GPU/0-4e000 (5/10.0/SYS) …`` = (hops/bw GB/s/path type); <= 2.21 write the first
# node as ``GPU/CE000``.
SYSTEM = re.compile(rf"^=== System : maxBw ({_NUM}) totalBw ({_NUM}) ===$", _A)
_NODE = r"(?:GPU|PCI|NVS|CPU|NIC|NET|GIN|RMA|DEV|CXB)/[0-9a-fA-F]{1,16}(?:-[0-9a-fA-F]{1,16})?"
PATHS = re.compile(rf"^({_NODE}) :(.*)$", _A)
PATH_ITEM = re.compile(rf"({_NODE}) \((\d{{1,30}})/([-+\w.]{{1,40}})/([A-Z0-9]{{2,4}})\)\s*", _A)
TOPO_GPU = re.compile(r"^(?:\+ \w+\[[\d.]+\] - )?(GPU/[0-9a-fA-F]{1,16}-[0-9a-fA-F]{1,16}) \((\d{1,9})\)", _A)
# Per call (enqueue.cc, rank 0): 2.24+ ``AllReduce: 57344 Bytes -> Algo RING proto LL
# channel{Lo..Hi}={0..1}``; 2.21–2.23 ``[AllReduce: ]57344 Bytes -> Algo 1 proto 0 time 12.3`` (ids).
CALL = re.compile(
    r"^(?:(\w+): )?(\d{1,30}) Bytes -> Algo (\w+) proto (\w+)"
    r"(?: channel\{Lo\.\.Hi\}=\{(\d{1,30})\.\.(\d{1,30})\}| time ([-+\w.]{1,30}))$",
    _A,
)
# Settings: ``NCCL_X set by environment to V`` (``V.`` for integers, misc/param.cc);
# ``NCCL_P2P_LEVEL set by environment to SYS`` only when NCCL understood the value (paths.cc);
# ``Invalid value %s for %s, using default %lld.``
ENV = re.compile(r"^(NCCL_\w+) set by environment to (.*)$", _A)
ENV_INVALID = re.compile(r"^Invalid value (.*) for (NCCL_\w+), using default", _A)
P2P_FAIL = re.compile(
    r"^(?:Could not enable P2P|peer query failed) between dev (\d{1,6})\(=[0-9a-fA-F]+\) and dev (\d{1,6})", _A
)
# Tuner plugin (plugin/tuner*.cc): ``TUNER/Plugin: …``, ``Successfully loaded external tuner plugin %s``.
TUNER_NAME = re.compile(r"^(?:TUNER/Plugin: Using (.+) \(v\d+\)|Successfully loaded external tuner plugin (.+))$", _A)
# Model (graph/tuning.cc, rank 0): 2.18+ blocks of ``  Algorithm   |`` / ``  Protocol    |`` /
# `` Max NThreads |`` then ``    AllReduce |   lat/  bw |…`` (latency µs / algBw GB/s); <= 2.17 one
# table headed ``Latency/AlgBw |    Tree/    LL |…``.
TUNE_HEAD = re.compile(r"^(Algorithm|Protocol|Max NThreads|Latency/AlgBw)\s*\|(.*)$", _A)
TUNE_ROW = re.compile(r"^(\w{1,20}) \|((?:\s*[-\d.e+infa]+/\s*[-\d.e+infa]+ \|)+)\s*$", _A)
LATBW = re.compile(r"^\s*([-+\w.]{1,30})/\s*([-+\w.]{1,30})\s*$", _A)

MAX_LINE = 8192  # longer lines are skipped: NCCL's own are at most ~2 KiB (debug.cc buffer)

# tuning.cc names → the names of the per-call lines (collectives.cc ncclAlgoToString/ncclProtoToString)
TABLE_ALGO = {
    "Tree": "TREE",
    "Ring": "RING",
    "CollNetDirect": "COLLNET_DIRECT",
    "CollNetChain": "COLLNET_CHAIN",
    "NVLS": "NVLS",
    "NVLSTree": "NVLS_TREE",
    "PAT": "PAT",
}

# Message starts that promise a known form; if none of the parsers takes such a line it is reported.
KNOWN_STARTS = ("Channel ", "Trees", "Pattern ", "=== System", "NCCL version", "Ring ")


def search_near_nccl(line: str, pattern: re.Pattern[str]) -> re.Match[str] | None:
    """``pattern`` (a log prefix ending in ``NCCL <LEVEL>``) searched only just before each
    ``NCCL `` in ``line`` (at most 4), so that a long line costs linear time; anything before the
    prefix (MPI tags, timestamps, a table row it interrupts) is ignored."""
    i = line.find("NCCL ")
    for _ in range(4):
        if i < 0:
            return None
        m = pattern.search(line, max(0, i - 800), i + 10)
        if m is not None:
            return m
        i = line.find("NCCL ", i + 1)
    return None


def find_prefix(line: str) -> re.Match[str] | None:
    """The ``host:pid:tid [dev] … NCCL LEVEL`` prefix of a log line."""
    return search_near_nccl(line, PREFIX)


def float_or_none(s: str) -> float | None:
    """``float(s)``, or ``None`` where that raises ``ValueError``."""
    try:
        return float(s)
    except ValueError:
        return None


def norm_node(name: str) -> str:
    """``GPU/CE000`` (≤2.21) and ``GPU/0-ce000`` → ``GPU/0-ce000``."""
    kind, _, ident = name.partition("/")
    if "-" in ident:
        sys_id, _, local = ident.partition("-")
        return f"{kind}/{int(sys_id, 16):x}-{int(local, 16):x}"
    v = int(ident, 16)
    return f"{kind}/{v >> 56:x}-{v & ((1 << 56) - 1):x}"


# What an ``NCCL_DEBUG=INFO`` log says, as records: one frozen dataclass per line form
# (the line forms above) and :class:`NcclLog`, everything read from one
# log. Every record keeps the 1-based ``line`` it was read from.

Dev = int | str  # device index (NCCL >= 2.18) or PCI bus id as lower-case hex text (older)


@dataclass(frozen=True)
class CommInfo:
    """One communicator line of one rank; fields the line does not carry are ``None``."""

    comm: str
    rank: int
    n_ranks: int
    n_nodes: int | None = None
    local_ranks: int | None = None
    local_rank: int | None = None
    cuda_dev: int | None = None
    bus_id: str | None = None
    line: int = 0


@dataclass(frozen=True)
class Transport:
    """One ``Channel … : src -> dst via …`` connection. ``transport`` is the text after ``via``."""

    channel: int
    conn_index: int | None
    src_rank: int
    src_dev: Dev
    dst_rank: int
    dst_dev: Dev
    transport: str  # e.g. "P2P/direct pointer/read", "SHM/direct/direct", "NET/IB/0/GDRDMA"
    kind: str  # "P2P", "SHM" or "NET"
    read: bool = False
    ce: bool = False
    via_rank: int | None = None  # P2P/indirect: the intermediate rank
    direction: str | None = None  # NET: "send" or "receive"
    line: int = 0


@dataclass(frozen=True)
class Ring:
    """A ring of one channel as rank 0 prints it: ``ranks`` in ring order."""

    channel: int
    n_channels: int
    ranks: tuple[int, ...]
    line: int = 0


@dataclass(frozen=True)
class RingLink:
    """``Ring c : prev -> rank -> next``, one rank's neighbours on channel ``channel``."""

    channel: int
    prev: int
    rank: int
    next: int
    line: int = 0


@dataclass(frozen=True)
class Tree:
    """``[c] d0/d1/d2->rank->up``; -1 means none."""

    channel: int
    rank: int
    down: tuple[int, int, int]
    up: int
    line: int = 0


@dataclass(frozen=True)
class ChannelCounts:
    """The channel counts of one communicator; ``collnet`` / ``nvls`` are ``None`` where the line has no such field."""

    coll: int
    collnet: int | None
    nvls: int | None
    p2p: int
    p2p_per_peer: int
    line: int = 0


@dataclass(frozen=True)
class GraphInfo:
    """pattern 4 = ring, 1 = balanced tree, 3 = tree, 2 = split tree, 5 = NVLS."""

    pattern: int
    cross_nic: int
    n_channels: int
    bw_intra_gbps: float
    bw_inter_gbps: float
    type_intra: str
    type_inter: str
    same_channels: int
    line: int = 0


@dataclass(frozen=True)
class PathInfo:
    """One path of the topology dump: hop count, bandwidth in GB/s, NCCL's path type."""

    hops: int
    bw_gbps: float
    path_type: str  # LOC NVL NVB C2C PIX PXB P2C PXN PHB SYS NET DIS


@dataclass(frozen=True)
class CallChoice:
    """NCCL's choice for one launched collective (rank 0, TUNING subsystem)."""

    func: str | None
    size_bytes: int
    algo: str  # TREE, RING, … (ids of 2.21–2.23 mapped through ALGO_BY_ID)
    proto: str  # LL, LL128, SIMPLE
    channel_lo: int | None = None
    channel_hi: int | None = None
    time_us: float | None = None  # 2.21–2.23: the model's predicted time
    line: int = 0


@dataclass(frozen=True)
class WarnLine:
    """A ``NCCL WARN`` line: the message, the source file NCCL names (or ``None``), the CUDA device."""

    message: str
    file: str | None
    dev: int
    line: int = 0


@dataclass(frozen=True)
class NcclLog:
    """Everything read from one log. Dict fields map names as printed; see the module docstring."""

    source: str
    version: str | None = None  # "2.27.5"
    cuda_version: str | None = None  # "12.9"
    comms: tuple[CommInfo, ...] = ()
    transports: tuple[Transport, ...] = ()
    rings: tuple[Ring, ...] = ()
    ring_links: tuple[RingLink, ...] = ()
    trees: tuple[Tree, ...] = ()
    channel_counts: tuple[ChannelCounts, ...] = ()
    graphs: tuple[GraphInfo, ...] = ()
    graph_fallbacks: tuple[int, ...] = ()  # pattern of each "Could not find a path … simple order"
    paths: dict[str, dict[str, PathInfo]] = field(default_factory=dict)  # "GPU/0-ce000" -> node -> path
    gpu_ranks: dict[str, int] = field(default_factory=dict)  # "GPU/0-cf000" -> rank, from the topology dump
    max_bw_gbps: float | None = None
    total_bw_gbps: float | None = None
    tuning: dict[str, dict[tuple[str, str], tuple[float, float]]] = field(default_factory=dict)
    max_nthreads: dict[tuple[str, str], int] = field(default_factory=dict)
    calls: tuple[CallChoice, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    env_invalid: dict[str, str] = field(default_factory=dict)  # "Invalid value V for NCCL_X, using default"
    p2p_unavailable: tuple[tuple[int, int], ...] = ()  # "Could not enable P2P between dev a and dev b"
    tuner_plugin: str | None = None
    tuner_lines: tuple[str, ...] = ()
    warnings: tuple[WarnLine, ...] = ()
    n_nccl_lines: int = 0
    problems: tuple[str, ...] = ()
    devices: tuple[int, ...] = ()  # CUDA devices (``[dev]`` of the prefix) that printed a line, sorted

    @property
    def version_tuple(self) -> tuple[int, int, int] | None:
        if self.version is None:
            return None
        a, b, c = (int(x) for x in self.version.split("."))
        return a, b, c

    @property
    def n_ranks(self) -> int | None:
        """nRanks of the comm lines, else the length of a ring, else ``None``."""
        if self.comms:
            return max(c.n_ranks for c in self.comms)
        if self.rings:
            return max(len(r.ranks) for r in self.rings)
        return None

    def transports_by_pair(self) -> dict[tuple[Dev, Dev], set[str]]:
        """(src device, dst device) → the transports seen for that direction."""
        out: dict[tuple[Dev, Dev], set[str]] = {}
        for t in self.transports:
            out.setdefault((t.src_dev, t.dst_dev), set()).add(t.transport)
        return out

    def ring_order(self, channel: int = 0) -> tuple[int, ...] | None:
        for r in self.rings:
            if r.channel == channel:
                return r.ranks
        return None

    def gpu_paths(self) -> dict[tuple[str, str], PathInfo]:
        """GPU → other GPU paths only, keyed by the two normalised node names."""
        return {
            (s, d): p
            for s, row in self.paths.items()
            if s.startswith("GPU/")
            for d, p in row.items()
            if d.startswith("GPU/") and d != s
        }

    def transport_kinds(self) -> dict[tuple[int, int], str]:
        """(a, b) with a < b (device indices) → ``"P2P"``, ``"SHM"`` or ``"NET"`` as the log's
        ``via`` lines show, either direction; SHM wins where a pair shows both (the ring runs at
        its slowest hop). Pairs named by PCI bus id (NCCL < 2.18) are left out."""
        out: dict[tuple[int, int], str] = {}
        for t in self.transports:
            if not (isinstance(t.src_dev, int) and isinstance(t.dst_dev, int)) or t.src_dev == t.dst_dev:
                continue
            key = (min(t.src_dev, t.dst_dev), max(t.src_dev, t.dst_dev))
            if out.get(key) != "SHM":
                out[key] = t.kind
        return out

    @property
    def p2p_disabled_by_env(self) -> str | None:
        """The setting NCCL read that turns P2P off for every pair, as ``NAME=VALUE``, else ``None``:
        ``NCCL_P2P_DISABLE=1``, or ``NCCL_P2P_LEVEL`` LOC / 0 (``src/graph/paths.cc``: a path type
        must be <= the level, and LOC is below every path between two GPUs), so every pair is on
        SHM (or NET). ``NCCL_P2P_LEVEL set by environment to …`` is printed only for a value NCCL
        understood (paths.cc)."""
        if self.env.get("NCCL_P2P_DISABLE", "").strip() == "1":
            return "NCCL_P2P_DISABLE=1"
        level = self.env.get("NCCL_P2P_LEVEL", "").strip()
        if level in ("LOC", "0"):
            return f"NCCL_P2P_LEVEL={level}"
        return None

    def tuning_rows(self, func: str = "AllReduce") -> list[tuple[str, str, float, float]]:
        """The TUNING model table of ``func`` as ``(algo, proto, latency µs, algBw GB/s)`` rows, in
        table order, without the (0, 0) cells NCCL prints for a disabled or unsupported pair."""
        return [(a, p, lat, bw) for (a, p), (lat, bw) in self.tuning.get(func, {}).items() if (lat, bw) != (0.0, 0.0)]

    @property
    def uses_shm(self) -> bool:
        return any(t.kind == "SHM" for t in self.transports)

    @property
    def uses_p2p(self) -> bool:
        return any(t.kind == "P2P" for t in self.transports)

    @property
    def uses_net(self) -> bool:
        return any(t.kind == "NET" for t in self.transports)


class _State:
    """Mutable accumulator; frozen into an :class:`NcclLog` at the end."""

    def __init__(self, source: str = "<text>") -> None:
        self.source = source
        self.lists: dict[str, list] = {
            k: []
            for k in (
                "comms",
                "transports",
                "rings",
                "ring_links",
                "trees",
                "channel_counts",
                "graphs",
                "graph_fallbacks",
                "calls",
                "p2p_unavailable",
                "tuner_lines",
                "warnings",
                "problems",
            )
        }
        self.versions: list[tuple[str, str | None, int]] = []
        self.paths: dict[str, dict[str, PathInfo]] = {}
        self.gpu_ranks: dict[str, int] = {}
        self.system: tuple[float, float] | None = None
        self.tuning: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
        self.max_nthreads: dict[tuple[str, str], int] = {}
        self.env: dict[str, str] = {}
        self.env_invalid: dict[str, str] = {}
        self.tuner: str | None = None
        self.tables: dict[tuple[str, str], dict] = {}  # per (pid, tid): TUNING table columns
        self.comm_seen: set[tuple] = set()
        self.old_busid = False  # NCCL < 2.18 prints bus ids in transport brackets
        self.devices: set[int] = set()

    def problem(self, lineno: int, what: str, text: str) -> None:
        """Note a line that started like a known form but was not read (``NcclLog.problems``)."""
        t = " ".join(text.split())
        self.lists["problems"].append(f"line {lineno}: {what}: {t[:100]}")

    def refuse(self, lineno: int, what: str, why: str | None) -> None:
        """Raise the one-line error for a number past fastverify's bounds (``why``, from
        :mod:`fastverify.bounds`); nothing when ``why`` is None."""
        if why:
            raise UserError(
                f"{self.source}: line {lineno}: {what} {why}: no NCCL prints that "
                "(a corrupt or hand-edited log; fastverify's plausibility bounds)"
            )

    def channel(self, lineno: int, what: str, value: int | None, *, index: bool = False) -> None:
        """A channel count (<= NCCL's MAXCHANNELS) or a channel index (< MAXCHANNELS)."""
        if value is not None:
            top = MAX_CHANNELS - 1 if index else MAX_CHANNELS
            self.refuse(
                lineno,
                what,
                implausible_count(value, upper=top, what=what)
                and f"{value} is outside [0, {top}] (NCCL has at most {MAX_CHANNELS} channels, MAXCHANNELS)",
            )

    def bandwidth(self, lineno: int, what: str, value: float) -> None:
        """A bandwidth in GB/s: finite, >= 0, at most 1e6 (:func:`fastverify.bounds.implausible_bandwidth`)."""
        self.refuse(lineno, what, implausible_bandwidth(value))

    def count(self, lineno: int, what: str, value: int, *, lowest: int = 0) -> None:
        """A rank, a rank count or a hop count: in [lowest, 1e9]; -1 (none) allowed with ``lowest=-1``."""
        if not lowest <= value <= MAX_COUNT:
            self.refuse(lineno, what, f"{value} is outside [{lowest}, {MAX_COUNT:g}]")


def _dev(s: str, st: _State) -> Dev:
    """A transport bracket: a device index (NCCL >= 2.18), else the PCI bus id as lower-case hex."""
    if st.old_busid or not s.isdigit() or len(s) >= 4:
        return s.lower()
    return int(s)


def _msg(st: _State, lineno: int, key: tuple[str, str], dev: int, level: str, file: str | None, msg: str) -> None:
    """One message (the text after the prefix) to the first handler that takes it."""
    if level == "WARN":
        st.lists["warnings"].append(WarnLine(msg.strip(), file, dev, lineno))
        return
    s = msg.strip()
    if _tuning_line(st, key, s, lineno):
        return
    for handler in _HANDLERS:
        if handler(st, lineno, s):
            return
    if s.startswith(KNOWN_STARTS) and not _is_other_channel_line(s):
        st.problem(lineno, "line not understood (cut off?)", s)


def _is_other_channel_line(s: str) -> bool:
    # ``Channel 00/0 : 0[0] -> 1[1] [receive] via COLLNET…`` and NVLS/CollNet set-up lines start alike.
    return " via " in s and ("COLLNET" in s or "NVLS" in s)


def _h_version(st: _State, lineno: int, s: str) -> bool:
    m = VERSION.match(s)
    if not m:
        return False
    ver = f"{int(m.group(1))}.{int(m.group(2))}.{int(m.group(3))}"
    st.versions.append((ver, m.group(5), lineno))
    if (int(m.group(1)), int(m.group(2))) < (2, 18):
        st.old_busid = True
    return True


def _h_comm(st: _State, lineno: int, s: str) -> bool:
    m = COMM_NEW.match(s)
    if m:
        info = CommInfo(
            m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), int(m.group(6)), line=lineno
        )
    elif "Init " in s and (m := COMM_INIT.match(s)) is not None:
        info = CommInfo(
            m.group(1),
            int(m.group(2)),
            int(m.group(3)),
            cuda_dev=int(m.group(4)),
            bus_id=m.group(5).lower(),
            line=lineno,
        )
    else:
        return False
    seen = (info.comm, info.rank, info.n_ranks, info.n_nodes, info.cuda_dev, info.bus_id)
    if seen not in st.comm_seen:  # "Init START" and "Init COMPLETE" say the same
        st.comm_seen.add(seen)
        st.lists["comms"].append(info)
    return True


def _h_transport(st: _State, lineno: int, s: str) -> bool:
    m = TRANSPORT.match(s)
    if not m:
        return False
    via = m.group(8)
    kw: dict = {}
    if (p := P2P_VIA.match(via)) is not None:
        kind = "P2P"
        kw["read"] = bool(p.group("r1") or p.group("r2") or p.group("r3"))
        kw["ce"] = bool(p.group("ce"))
        if p.group("via") is not None:
            kw["via_rank"] = int(p.group("via"))
    elif SHM_VIA.match(via):
        kind = "SHM"
        kw["ce"] = "CE" in via
    elif NET_VIA.match(via):
        kind = "NET"
    else:
        if not _is_other_channel_line(s):
            st.problem(lineno, "unknown transport", s)
        return True
    channel, src, dst = int(m.group(1)), int(m.group(3)), int(m.group(5))
    st.channel(lineno, "transport channel", channel, index=True)
    st.count(lineno, "transport source rank", src)
    st.count(lineno, "transport destination rank", dst)
    if "via_rank" in kw:
        st.count(lineno, "transport intermediate rank", kw["via_rank"])
    st.lists["transports"].append(
        Transport(
            channel,
            int(m.group(2)) if m.group(2) is not None else None,
            src,
            _dev(m.group(4), st),
            dst,
            _dev(m.group(6), st),
            via,
            kind,
            direction=m.group(7),
            line=lineno,
            **kw,
        )
    )
    return True


def _h_ring(st: _State, lineno: int, s: str) -> bool:
    m = RING.match(s)
    if m:
        c, n = int(m.group(1)), int(m.group(2))
        st.channel(lineno, "ring channel", c, index=True)
        st.channel(lineno, "ring channel count", n)
        ranks = tuple(int(x) for x in m.group(3).split())
        for r in ranks:
            st.count(lineno, "ring rank", r)
        st.lists["rings"].append(Ring(c, n, ranks, lineno))
        return True
    m = RING_LINK.match(s)
    if m:
        c, *ranks = (int(g) for g in m.groups())
        st.channel(lineno, "ring channel", c, index=True)
        for r in ranks:
            st.count(lineno, "ring rank", r, lowest=-1)
        st.lists["ring_links"].append(RingLink(c, *ranks, line=lineno))
        return True
    return False


def _h_trees(st: _State, lineno: int, s: str) -> bool:
    if not s.startswith("Trees"):
        return False
    m = TREES.match(s)
    if not m:
        # NCCL cuts the line at 1023 characters; keep the whole entries
        st.problem(lineno, "Trees line cut off", s)
    for t in TREE_ITEM.finditer(s if m is None else m.group(1)):
        c, d0, d1, d2, r, up = (int(g) for g in t.groups())
        st.channel(lineno, "tree channel", c, index=True)
        for v in (d0, d1, d2, r, up):
            st.count(lineno, "tree rank", v, lowest=-1)
        st.lists["trees"].append(Tree(c, r, (d0, d1, d2), up, lineno))
    return True


def _h_channels(st: _State, lineno: int, s: str) -> bool:
    m = CHANNELS.match(s)
    if not m:
        return False
    g = [None if x is None else int(x) for x in m.groups()]
    for what, v in zip(
        ("coll channels", "collnet channels", "nvls channels", "p2p channels", "p2p channels per peer"), g
    ):
        st.channel(lineno, what, v)
    st.lists["channel_counts"].append(ChannelCounts(g[0], g[1], g[2], g[3], g[4], lineno))
    return True


def _h_graph(st: _State, lineno: int, s: str) -> bool:
    m = GRAPH.match(s)
    if m:
        bw = _bandwidth_pair(st, lineno, s, m.group(4, 5), "bad graph bandwidth")
        if bw is None:
            return True
        bi, be = bw
        st.channel(lineno, "graph nChannels", int(m.group(3)))
        st.bandwidth(lineno, "graph intra bandwidth", bi)
        st.bandwidth(lineno, "graph inter bandwidth", be)
        st.lists["graphs"].append(
            GraphInfo(
                int(m.group(1)),
                int(m.group(2)),
                int(m.group(3)),
                bi,
                be,
                m.group(6),
                m.group(7),
                int(m.group(8)),
                lineno,
            )
        )
        return True
    m = FALLBACK.match(s)
    if m:
        st.lists["graph_fallbacks"].append(int(m.group(1)))
        return True
    return False


def _bandwidth_pair(st: _State, lineno: int, s: str, texts: tuple[str, str], what: str) -> tuple[float, float] | None:
    """The two GB/s figures of a GRAPH or System line; ``None``, and a ``problems`` entry ``what``,
    when one of them is not a number."""
    a, b = float_or_none(texts[0]), float_or_none(texts[1])
    if a is None or b is None:
        st.problem(lineno, what, s)
        return None
    return a, b


def _h_system(st: _State, lineno: int, s: str) -> bool:
    m = SYSTEM.match(s)
    if not m:
        return False
    bw = _bandwidth_pair(st, lineno, s, m.group(1, 2), "bad system bandwidth")
    if bw is None:
        return True
    st.bandwidth(lineno, "system maxBw", bw[0])
    st.bandwidth(lineno, "system totalBw", bw[1])
    if st.system is None:
        st.system = bw
    return True


def _h_paths(st: _State, lineno: int, s: str) -> bool:
    """One node's line of paths: every ``node (hops/bw/type)`` entry up to the first that does not parse."""
    m = PATHS.match(s)
    if m and "(" in m.group(2):
        rest = m.group(2)
        src = norm_node(m.group(1))
        row = st.paths.setdefault(src, {})
        pos = 0
        rest_s = rest.lstrip()
        offset = len(rest) - len(rest_s)
        for it in PATH_ITEM.finditer(rest_s):
            if it.start() != pos:
                break
            bw = float_or_none(it.group(3))
            if bw is None:
                break
            st.count(lineno, "path hops", int(it.group(2)))
            st.bandwidth(lineno, f"path bandwidth to {it.group(1)}", bw)
            row[norm_node(it.group(1))] = PathInfo(int(it.group(2)), bw, it.group(4))
            pos = it.end()
        if pos != len(rest_s):
            st.problem(lineno, f"paths line cut at column {offset + pos}", s)
        return True
    return False


def _h_topo_gpu(st: _State, lineno: int, s: str) -> bool:
    m = TOPO_GPU.match(s)
    if m:
        st.count(lineno, "topology GPU rank", int(m.group(2)))
        st.gpu_ranks[norm_node(m.group(1))] = int(m.group(2))
        return True
    return False


def _h_call(st: _State, lineno: int, s: str) -> bool:
    m = CALL.match(s)
    if not m:
        return False
    func, size, algo, proto, lo, hi, t = m.groups()
    if algo.isdigit():
        algo = ALGO_BY_ID.get(int(algo), algo)
    if proto.isdigit():
        proto = PROTO_BY_ID.get(int(proto), proto)
    size_b, lo_c, hi_c = int(size), int(lo) if lo is not None else None, int(hi) if hi is not None else None
    time_us = float_or_none(t) if t is not None else None
    st.refuse(
        lineno,
        "call size",
        implausible_count(size_b, upper=MAX_MSG_BYTES, what="size") and f"{size_b} bytes is over 1 TiB",
    )
    st.channel(lineno, "call channel", lo_c, index=True)
    st.channel(lineno, "call channel", hi_c, index=True)
    if time_us is not None:
        st.refuse(lineno, "call time", implausible_time_us(time_us))
    st.lists["calls"].append(CallChoice(func, size_b, algo.upper(), proto.upper(), lo_c, hi_c, time_us, lineno))
    return True


def _h_env(st: _State, lineno: int, s: str) -> bool:
    m = ENV.match(s)
    if m:
        v = m.group(2).strip()
        if re.fullmatch(r"-?\d+\.", v, re.ASCII):  # misc/param.cc prints "%lld."
            v = v[:-1]
        st.env[m.group(1)] = v
        return True
    m = ENV_INVALID.match(s)
    if m:
        st.env_invalid[m.group(2)] = m.group(1)
        return True
    m = P2P_FAIL.match(s)
    if m:
        st.lists["p2p_unavailable"].append((int(m.group(1)), int(m.group(2))))
        return True
    return False


def _h_tuner(st: _State, lineno: int, s: str) -> bool:
    if not (s.startswith("TUNER/Plugin") or "tuner plugin" in s.lower()):
        return False
    st.lists["tuner_lines"].append(s)
    m = TUNER_NAME.match(s)
    if m:
        st.tuner = (m.group(1) or m.group(2)).strip()
    return True


# In this order: the first handler that takes a message reads it.
_HANDLERS = (
    _h_version,
    _h_transport,
    _h_ring,
    _h_trees,
    _h_comm,
    _h_channels,
    _h_graph,
    _h_system,
    _h_paths,
    _h_topo_gpu,
    _h_call,
    _h_env,
    _h_tuner,
)


def _tuning_line(st: _State, key: tuple[str, str], s: str, lineno: int = 0) -> bool:
    """The model table; its column layout lives in the thread's state between lines."""
    m = TUNE_HEAD.match(s)
    tab = st.tables.setdefault(key, {"algos": [], "cols": []})
    if m:
        head, cells = m.group(1), [c.strip() for c in m.group(2).split("|")]
        cells = [c for c in cells if c]
        if head == "Algorithm":
            tab["algos"], tab["cols"] = [TABLE_ALGO.get(c, c.upper()) for c in cells], []
        elif head == "Protocol":
            n = cells.index(cells[0], 1) if cells and cells[0] in cells[1:] else len(cells)
            tab["cols"] = [
                (tab["algos"][i // n], p.upper()) for i, p in enumerate(cells) if n and i // n < len(tab["algos"])
            ]
        elif head == "Latency/AlgBw":  # ≤2.17: one table, cells "Tree/LL"
            pairs = [[x.strip() for x in c.split("/", 1)] for c in cells if "/" in c]
            tab["cols"] = [(TABLE_ALGO.get(a, a.upper()), p.upper()) for a, p in pairs]
        elif head == "Max NThreads":
            for col, c in zip(tab["cols"], cells):
                if c.isascii() and c.isdigit() and len(c) <= 30:
                    st.count(lineno, f"TUNING Max NThreads {'/'.join(col)}", int(c))
                    st.max_nthreads.setdefault(col, int(c))
        return True
    if not tab["cols"]:
        return False
    m = TUNE_ROW.match(s)
    if not m:
        return False
    func = m.group(1)
    cells = [c for c in m.group(2).split("|") if c.strip()]
    row = st.tuning.setdefault(func, {})
    for col, c in zip(tab["cols"], cells):
        lb = LATBW.match(c)
        lat, bw = (float_or_none(lb.group(1)), float_or_none(lb.group(2))) if lb else (None, None)
        if lat is not None and bw is not None:
            st.refuse(lineno, f"TUNING {func} {'/'.join(col)} latency", implausible_time_us(lat))
            st.bandwidth(lineno, f"TUNING {func} {'/'.join(col)} bandwidth", bw)
            row.setdefault(col, (lat, bw))  # first communicator's table wins
    return True


def parse_nccl_log(text: str, *, source: str = "<text>") -> NcclLog:
    """Parse ``NCCL_DEBUG=INFO`` output (any subsystems, any number of ranks and communicators).

    Parameters
    ----------
    text
        The log as text; other program output may be mixed in and is skipped.
    source
        Name of the input used in messages (a file path).

    Returns
    -------
    NcclLog
        Records in file order, each with its 1-based ``line``. A text that does not end in a newline
        gets a ``problems`` entry (its last line may be cut off), as does any line that starts like a
        known form but does not parse.

    Raises
    ------
    UserError
        One line naming ``source`` when the text holds no NCCL line at all, or naming ``source``,
        the line, the field and its value when a number is past fastverify's plausibility bounds
        (see the module docstring: channels over 64, bandwidths over 1e6 GB/s or negative, times
        outside [0, 1 hour], sizes over 1 TiB, ranks over 1e9; nan and inf included).
    """
    if not isinstance(text, str):
        raise UserError(f"{source}: expected an NCCL log as text, got {type(text).__name__}")
    st = _State(source)
    lines = text.splitlines()
    n_nccl = _read_lines(st, lines)
    if n_nccl == 0:
        raise UserError(
            f"{source}: no NCCL log line found (expected lines like "
            f"'host:pid:tid [0] NCCL INFO …'; run with NCCL_DEBUG=INFO)"
        )
    if lines and not text.endswith(("\n", "\r")):
        st.problem(len(lines), "text ends without a newline; the last line may be cut off", lines[-1])
    return _freeze(st, n_nccl)


def _read_lines(st: _State, lines: list[str]) -> int:
    """Every NCCL line of ``lines`` read into ``st``; returns how many NCCL lines there were."""
    n_nccl = 0
    for lineno, raw in enumerate(lines, start=1):
        if "NCCL " not in raw:
            continue
        m = find_prefix(raw)
        if m is not None and len(raw) > MAX_LINE:
            # NCCL's own lines are at most ~2 KiB (debug.cc buffer); keeps the regexes linear
            n_nccl += 1
            st.problem(lineno, f"line longer than {MAX_LINE} characters skipped", raw[:100])
            continue
        if m is None:
            b = BARE_VERSION.search(raw)
            if b is None:
                continue
            n_nccl += 1
            _h_version(st, lineno, b.group(1))
            continue
        n_nccl += 1
        if int(m.group("dev")) >= 0:
            st.devices.add(int(m.group("dev")))
        key = (m.group("pid"), m.group("tid"))
        msg = raw[m.end() :]
        msg = msg[1:] if msg[:1] == " " else msg
        _msg(st, lineno, key, int(m.group("dev")), m.group("level"), m.group("file"), msg)
    return n_nccl


def _freeze(st: _State, n_nccl: int) -> NcclLog:
    """The records of ``st`` as an :class:`NcclLog`; the first version line wins, others are a problem."""
    version = cuda = None
    if st.versions:
        version, cuda, _ = st.versions[0]
        others = sorted({v for v, _, _ in st.versions} - {version})
        if others:
            st.problem(st.versions[0][2], f"several NCCL versions in one log: {[version, *others]}", "")
    L = st.lists
    return NcclLog(
        source=st.source,
        version=version,
        cuda_version=cuda,
        comms=tuple(L["comms"]),
        transports=tuple(L["transports"]),
        rings=tuple(L["rings"]),
        ring_links=tuple(L["ring_links"]),
        trees=tuple(L["trees"]),
        channel_counts=tuple(L["channel_counts"]),
        graphs=tuple(L["graphs"]),
        graph_fallbacks=tuple(L["graph_fallbacks"]),
        paths=st.paths,
        gpu_ranks=st.gpu_ranks,
        max_bw_gbps=st.system[0] if st.system else None,
        total_bw_gbps=st.system[1] if st.system else None,
        tuning=st.tuning,
        max_nthreads=st.max_nthreads,
        calls=tuple(L["calls"]),
        env=st.env,
        env_invalid=st.env_invalid,
        p2p_unavailable=tuple(L["p2p_unavailable"]),
        tuner_plugin=st.tuner,
        tuner_lines=tuple(L["tuner_lines"]),
        warnings=tuple(L["warnings"]),
        n_nccl_lines=n_nccl,
        problems=tuple(L["problems"]),
        devices=tuple(sorted(st.devices)),
    )
