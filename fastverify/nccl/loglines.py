"""The line forms of an ``NCCL_DEBUG=INFO`` log, as regexes, with where NCCL prints each one
(NVIDIA/nccl ``src/``), and the small readers the parser shares with the nccl-tests reader.

Regexes match ASCII digits only: a Unicode digit must not reach ``int()``.
"""

from __future__ import annotations

import re

# NCCL_ALGO_* / NCCL_PROTO_* ids (src/include/device.h), for the 2.21–2.23 per-call lines.
ALGO_BY_ID = {0: "TREE", 1: "RING", 2: "COLLNET_DIRECT", 3: "COLLNET_CHAIN", 4: "NVLS", 5: "NVLS_TREE", 6: "PAT"}
PROTO_BY_ID = {0: "LL", 1: "LL128", 2: "SIMPLE"}

_A = re.ASCII
# Prefix (debug.cc): ``[%F %T] `` timestamp (optional; default on WARN only), ``host:pid:tid ``,
# then ``[cudaDev] NCCL INFO msg`` / ``[cudaDev] file:line [(func) ]NCCL WARN msg`` /
# ``[cudaDev] ms func:line NCCL TRACE msg``.
PREFIX = re.compile(
    r"(?P<host>[^\s:\[\]]{1,255}):(?P<pid>\d{1,12}):(?P<tid>\d{1,12}) \[(?P<dev>-?\d{1,9})\] "
    r"(?:[\d.]{1,30} )?(?:(?P<file>[^\s:]{1,255}):\d{1,9} (?:\([^)]{0,255}\) )?)?NCCL (?P<level>INFO|WARN|TRACE)", _A)
# NCCL_DEBUG=VERSION/WARN print the version line bare (debug.cc NCCL_LOG_VERSION),
# ``NCCL version 2.27.5+cuda12.9``; an MPI tag (``[1,0]<stdout>:``) may precede it.
BARE_VERSION = re.compile(r"^(?:\[[\d,]+\](?:<std\w+>)?:?\s*|\d+: )?\s*(NCCL version \d\S*)\s*$", _A)
# ``NCCL version 2.27.5+cuda12.9`` (init.cc).
VERSION = re.compile(r"^NCCL version (\d{1,4})\.(\d{1,4})\.(\d{1,4})(\S*?)(?:\+cuda(\d+\.\d+))?$", _A)
# ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (2.20+).
COMM_NEW = re.compile(
    r"^comm (0x[0-9a-fA-F]+|\S+) rank (\d{1,9}) nRanks (\d{1,9}) nNodes (\d{1,9}) localRanks (\d{1,9}) "
    r"localRank (\d{1,9})(?: MNNVL \d+)?$", _A)
# ``[func] comm %p rank %d nranks %d cudaDev %d [nvmlDev %d] busId %lx … - Init COMPLETE``.
COMM_INIT = re.compile(
    r"^(?:.*? )?comm (0x[0-9a-fA-F]+|\S+) rank (\d{1,9}) nranks (\d{1,9}) cudaDev (\d{1,9})(?: nvmlDev \d+)? "
    r"busId ([0-9a-fA-F]{1,16})\b.* - (?:Init (?:START|COMPLETE))$", _A)
# Transports (transport/p2p.cc, shm.cc, net.cc): ``Channel %02d/%01d : %d[%d] -> %d[%d] via
# P2P/direct pointer[/read]``, ``P2P/CUMEM|IPC|MNNVL[/read][/CE]``, ``P2P/indirect/%d[%d][/read]``,
# ``Channel %02d : … via SHM/direct/direct`` (<= 2.30.4; ``SHM/CE/…`` with memcpy) or ``SHM/direct``
# (2.30.7+), ``… [send] via NET/IB/0/GDRDMA``. In brackets: the NVML device index since 2.18, the
# PCI bus id in hex (``%lx``) before; before 2.14 there is no ``/connIndex``.
TRANSPORT = re.compile(
    r"^Channel (\d{1,30})(?:/(\d{1,30}))? : (\d{1,30})\[([0-9a-fA-F]{1,16})\] -> (\d{1,30})\[([0-9a-fA-F]{1,16})\]"
    r"(?: \[(send|receive)\])? via (.+?)\s*$", _A)
P2P_VIA = re.compile(
    r"^P2P/(?:direct pointer(?P<r1>/read)?|(?:IPC|CUMEM|MNNVL)(?P<r2>/read)?(?P<ce>/CE)?"
    r"|indirect/(?P<via>\d{1,9})\[[0-9a-fA-F]{1,16}\](?P<r3>/read)?)$", _A)
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
    r"(\d{1,30}) p2p channels, (\d{1,30}) p2p channels per peer$", _A)
_NUM = r"[-+\w.]{1,40}"  # a number as NCCL prints it, or what a corrupt log put there (1e308, nan)
# Graph (graph/search.cc): ``Pattern %d, crossNic %d, nChannels %d, bw %f/%f, type %s/%s,
# sameChannels %d`` (``speed`` instead of ``bw`` <= 2.12; bw = intra/inter GB/s per channel), and
# ``Could not find a path for pattern %d, falling back to simple order``.
GRAPH = re.compile(
    rf"^Pattern (\d{{1,3}}), crossNic (\d{{1,3}}), nChannels (\d{{1,30}}), (?:bw|speed) ({_NUM})/({_NUM}), "
    r"type (\w{1,8})/(\w{1,8}), sameChannels (\d{1,3})$", _A)
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
    r"(?: channel\{Lo\.\.Hi\}=\{(\d{1,30})\.\.(\d{1,30})\}| time ([-+\w.]{1,30}))$", _A)
# Settings: ``NCCL_X set by environment to V`` (``V.`` for integers, misc/param.cc);
# ``NCCL_P2P_LEVEL set by environment to SYS`` only when NCCL understood the value (paths.cc);
# ``Invalid value %s for %s, using default %lld.``
ENV = re.compile(r"^(NCCL_\w+) set by environment to (.*)$", _A)
ENV_INVALID = re.compile(r"^Invalid value (.*) for (NCCL_\w+), using default", _A)
P2P_FAIL = re.compile(
    r"^(?:Could not enable P2P|peer query failed) between dev (\d{1,6})\(=[0-9a-fA-F]+\) and dev (\d{1,6})", _A)
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
TABLE_ALGO = {"Tree": "TREE", "Ring": "RING", "CollNetDirect": "COLLNET_DIRECT", "CollNetChain": "COLLNET_CHAIN",
              "NVLS": "NVLS", "NVLSTree": "NVLS_TREE", "PAT": "PAT"}

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
