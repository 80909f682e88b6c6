"""The names, constants and version rules of NCCL's all-reduce cost model on one node (NVIDIA/nccl
``src/graph/tuning.cc`` ``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``, read at commit
5067397c = 2.30.7; the release codes below mark where older releases differ). Latencies in µs,
bandwidths in GB/s.
"""

from __future__ import annotations

from enum import Enum


class Algo(str, Enum):
    """All-reduce algorithms usable on one PCIe node (NCCL_ALGO names)."""

    TREE = "Tree"
    RING = "Ring"


class Proto(str, Enum):
    """NCCL protocols (NCCL_PROTO names)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


class LinkType(str, Enum):
    """Hardware row of NCCL's per-hop latency table (``NCCL_HW_NVLINK`` / ``NCCL_HW_PCI``)."""

    NVLINK = "NVLINK"
    PCI = "PCI"


# NCCL version code, X*10000 + Y*100 + Z for releases >= 2.9 (2.30.7 -> 23007), as ncclGetVersion returns.
DEFAULT_NCCL_VERSION = 23007  # the source read for the constants below (commit 5067397c)
_V2_19 = 21900  # Tree/Simple latency: base 0, 28 µs/hop (2.19 .. 2.22)
V2_21 = 22100  # Ring/LL busBw factor 1/4 -> 1/2
_V2_23 = 22300  # Tree/Simple latency: base 8.4, 4.0 µs/hop
_V2_25 = 22500  # LL128 default whitelist gains sm100/sm120
_V2_27 = 22700  # LL128 default: any sm >= 70 (whitelist dropped)


def is_version_code(code: object) -> bool:
    """``code`` is an int NCCL's ``NCCL_VERSION`` macro gives a 2.x release: 2000..2899
    (``X*1000+Y*100+Z``, releases up to 2.8, whose patch numbers stayed below 10: 2.7.8, 2.8.4)
    or 20900..29999 (``X*10000+Y*100+Z``, 2.9 on). 2234 is neither (it would be "2.2.34")."""
    if isinstance(code, bool) or not isinstance(code, int):
        return False
    return (2000 <= code <= 2899 and code % 100 < 10) or 20900 <= code <= 29999


def compcap_index(sm: int) -> int:
    """The column of the per-compute-capability caps for ``sm`` (compute capability x 10)."""
    # tuning.cc ncclTopoTuneModel: >=100 Blackwell, >=90 Hopper, >=80 Ampere, else Volta.
    return 3 if sm >= 100 else 2 if sm >= 90 else 1 if sm >= 80 else 0


def default_protos(link: LinkType, sm: int, version: int = DEFAULT_NCCL_VERSION) -> frozenset[Proto]:
    """Protocols NCCL enables for all-reduce when ``NCCL_PROTO`` is unset.

    LL and Simple always; LL128 only on an NVLink graph (``typeIntra <= PATH_NVB``), with sm >= 70
    from 2.27 and, before that, only for sm 70/80/90 (+100/120 from 2.25) (tuning.cc, the
    ``pEnable == 2`` block). Listing LL128 in ``NCCL_PROTO`` enables it anywhere, unchecked.
    """
    protos = {Proto.LL, Proto.SIMPLE}
    if LinkType(link) is LinkType.NVLINK:
        if version >= _V2_27:
            ok = sm >= 70
        else:
            ok = sm in (70, 80, 90) or (version >= _V2_25 and sm in (100, 120))
        if ok:
            protos.add(Proto.LL128)
    return frozenset(protos)


_A, _P = Algo, Proto

# ncclTunerConstantsDefaults (2.30.7, identical in the 2.32.3 binary for these rows).
# baseLatencies[algo][proto]; Tree/Simple was 0 before 2.23 (see base_and_hop_latency).
BASE_LAT_US = {
    (_A.TREE, _P.LL): 6.8, (_A.TREE, _P.LL128): 14.0, (_A.TREE, _P.SIMPLE): 8.4,
    (_A.RING, _P.LL): 6.6, (_A.RING, _P.LL128): 14.0, (_A.RING, _P.SIMPLE): 8.4,
}  # fmt: skip

# hwLatencies[hw][algo][proto], per hop. Unchanged since <= 2.18 except Tree/Simple.
HW_LAT_US = {
    LinkType.NVLINK: {
        (_A.TREE, _P.LL): 0.6, (_A.TREE, _P.LL128): 1.25, (_A.TREE, _P.SIMPLE): 4.0,
        (_A.RING, _P.LL): 0.6, (_A.RING, _P.LL128): 1.9, (_A.RING, _P.SIMPLE): 3.4,
    },
    LinkType.PCI: {
        (_A.TREE, _P.LL): 1.0, (_A.TREE, _P.LL128): 1.9, (_A.TREE, _P.SIMPLE): 4.0,
        (_A.RING, _P.LL): 1.0, (_A.RING, _P.LL128): 2.5, (_A.RING, _P.SIMPLE): 5.7,
    },
}  # fmt: skip

# Single-node (N1) column of the per-compute-capability caps; index Volta=0 (<sm80), Ampere=1
# (sm80-89, Ada included), Hopper=2 (sm90), Blackwell=3 (>=sm100). 2.30.7 values: unchanged since
# 2.18 for Volta/Ampere/Ada; for Hopper and Blackwell some older releases differ.
LL_MAX_BW = (39.0, 87.7, 141.0, 282.0)  # llMaxBws[cc][0]
PER_CH_MAX_RING_LL128_BW = (20.0, 20.0, 36.7, 40.0)  # perChMaxRingLL128Bws[cc][0]
PER_CH_MAX_TREE_LL128_BW = (20.0, 20.0, 36.7, 55.6)  # perChMaxTreeLL128Bws[cc][0]
PER_CH_MAX_TREE_BW = (26.5, 24.0, 38.7, 70.0)  # perChMaxTreeBws[cc][0]

# treeCorrectionFactor[proto][log2(nBytes >> 6)], applied for 0 <= index < 23 (ncclTopoGetAlgoTime).
TREE_CORRECTION = {
    _P.LL: (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    _P.LL128: (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    _P.SIMPLE: (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}  # fmt: skip


def base_and_hop_latency(algo: Algo, proto: Proto, link: LinkType, version: int) -> tuple[float, float]:
    """(base latency, latency per hop) in µs of ``algo``/``proto`` on ``link`` for the NCCL
    version code ``version``."""
    base, hop = BASE_LAT_US[(algo, proto)], HW_LAT_US[link][(algo, proto)]
    if algo is Algo.TREE and proto is Proto.SIMPLE:
        if version < _V2_19:  # v2.18.x: base 0, PCI 6 / NVLink 4 µs per hop
            base, hop = 0.0, (6.0 if link is LinkType.PCI else 4.0)
        elif version < _V2_23:  # v2.19 .. v2.22: base 0, 28 µs per hop on both rows
            base, hop = 0.0, 28.0
    return base, hop
