"""What an ``NCCL_DEBUG=INFO`` log says, as records: one frozen dataclass per line form
(:mod:`fastverify.nccl.loglines` names the forms) and :class:`NcclLog`, everything read from one
log. Every record keeps the 1-based ``line`` it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        return {(s, d): p for s, row in self.paths.items() if s.startswith("GPU/")
                for d, p in row.items() if d.startswith("GPU/") and d != s}

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
