"""NCCL's own all-reduce cost model for one node, a fitted correction for PCIe boxes, and which
algorithms and protocols an environment leaves enabled.

Every number this module returns is a prediction: :class:`Prediction` always carries
``predicted=True`` and ``label="predicted"``.

NCCL's model is what NCCL itself computes to pick algorithm and protocol (NVIDIA/nccl
``src/graph/tuning.cc`` ``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``; ``src/enqueue.cc``
``updateCollCostTable``, ``topoGetAlgoInfo``; its constants are the first part below). Its graph
values (``bwIntra``, ``nChannels``) come from NCCL's topology search: read them from the GRAPH line
``Pattern 4, crossNic 0, nChannels N, bw X/Y, type …`` of an ``NCCL_DEBUG=INFO
NCCL_DEBUG_SUBSYS=INIT,GRAPH`` log, or let :func:`inputs_for_pcie_box` derive plausible ones
(:func:`ring_graph`). :class:`CorrectedModel` (:func:`fit`, on the grid of :func:`grid_search`)
keeps NCCL's structure and choice and corrects its PCIe latency and bandwidths.
:func:`enabled_algos_protos` is the one answer ``fastverify topo`` and ``fastverify tune`` both
ask: which of the model's algorithms and protocols ``NCCL_ALGO`` / ``NCCL_PROTO`` leave on;
:func:`inputs_for_env` is the one way both turn an environment into the model's inputs.

In this order below: NCCL's names, constants and version rules; the ring search; the fit's grid
search; the model and its correction; the enabled algorithms and protocols.

Not modelled: ``numPipeOps`` > 1 (aggregated groups), the ring "plateau" factor (multi-node only),
channel reduction for small messages (``topoGetAlgoInfo`` changes the channels *used*, not the cost
table), NVLS/CollNet/PAT (not usable for all-reduce on one PCIe node).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Protocol

import numpy as np

from fastverify.errors import UserError
from fastverify.nccl.checks import parse_algo_proto, validate_setting
from fastverify.nccl.findings import Ctx, Severity
from fastverify.nccl.version import NcclVersion

# The names, constants and version rules of NCCL's all-reduce cost model on one node (NVIDIA/nccl
# ``src/graph/tuning.cc`` ``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``, read at commit
# 5067397c = 2.30.7; the release codes below mark where older releases differ). Latencies in µs,
# bandwidths in GB/s.


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


# An approximation of NCCL's ring search on a symmetric PCIe box: the graph
# (``bwIntra`` GB/s per channel, ``nChannels``) that NCCL's topology search (NVIDIA/nccl
# ``src/graph/search.cc`` ``ncclTopoCompute``) would find, for when no GRAPH log line is at hand.

# Topology search (src/graph/search.cc speedArrayIntra / sm90SpeedArrayIntra / sm100SpeedArrayIntra),
# per-channel GB/s tried from fast to slow.
SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SPEEDS_INTRA_SM90 = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
SPEEDS_INTRA_SM100 = (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)
# PCIe lane rate in units of 100 Mbps (src/graph/topo.cc kvDictPciGen); link GB/s = width*rate/80.
PCI_GEN_RATE = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
MAX_GRAPH_CHANNELS = 32  # MAXCHANNELS/2: the ring search's default maxChannels


def ring_graph(max_bw: float, total_bw: float, sm: int) -> tuple[float, int]:
    """Approximate NCCL's ring search (search.cc ncclTopoCompute) on a symmetric PCIe box.

    Start at the fastest ladder speed <= ``max_bw``; at each speed take as many channels as the GPU's
    own link carries (``n·speed <= total_bw``); keep the best ``n·speed``; stop once it reaches
    ``total_bw`` or the next speed is below 0.49× the best; then (pass 2) raise the speed with the
    same channel count while it fits; finally ncclTopoDupChannels (bw >= 25: twice the channels, half
    the bw). Shared CPU/switch links and search time-outs are ignored.
    """
    ladder = SPEEDS_INTRA_SM100 if sm >= 100 else SPEEDS_INTRA_SM90 if sm >= 90 else SPEEDS_INTRA
    i = 0
    while i < len(ladder) - 1 and (ladder[i] > max_bw or ladder[i] > total_bw):
        i += 1
    best_n, best_speed = 0, 0.0
    while True:
        speed = ladder[i]
        n = min(MAX_GRAPH_CHANNELS, max(1, int(total_bw / speed + 1e-9)))
        if n * speed > best_n * best_speed:
            best_n, best_speed = n, speed
        if best_n * best_speed >= total_bw or i == len(ladder) - 1 or ladder[i + 1] / best_speed <= 0.49:
            break
        i += 1
    j = ladder.index(best_speed)
    while j > 0 and ladder[j - 1] <= max_bw and best_n * ladder[j - 1] <= total_bw:
        j -= 1
    bw, n = ladder[j], best_n
    if bw >= 25.0 and not (sm > 80 and bw < 50.0 and n > 4):  # ncclTopoDupChannels
        dup = min(2 * n, MAX_GRAPH_CHANNELS)
        bw, n = bw / math.ceil(dup / n), dup
    return bw, n


# The least-squares search behind :func:`fit`: one per-hop latency δ (µs)
# and one bandwidth factor β per protocol, minimising the sum of squared log errors of the
# predicted times, on a deterministic coarse-to-fine grid (numpy only). For a fixed δ the loss
# separates per protocol, so each β is a 1-D search.


def grid_search(
    lat: np.ndarray,
    hops: np.ndarray,
    xfer: np.ndarray,
    log_t: np.ndarray,
    groups: Mapping[Hashable, np.ndarray],
    fitted: set,
) -> tuple[float, float, dict]:
    """``(loss, δ, {group: log β})`` minimising ``Σ (log(lat + δ·hops + xfer/β_g) − log_t)²``.

    Per row: ``lat`` the model latency (µs), ``hops`` its hop count, ``xfer`` the transfer time at
    β = 1 (µs), ``log_t`` the log of the measured time. ``groups`` maps each protocol to the mask
    of its rows; a group outside ``fitted`` keeps log β = 0 (β = 1). δ stays above
    −0.95·min(lat/hops) (every latency positive) and −5, at most 50; β in [0.01, 20].
    """
    # δ lower bound keeps every latency positive.
    d_lo, d_hi = max(-0.95 * float(np.min(lat / hops)), -5.0), 50.0
    b_lo, b_hi = math.log(0.01), math.log(20.0)  # log β range
    d_grid = np.linspace(d_lo, d_hi, 201)
    best: tuple[float, float, dict] | None = None
    b_span = {p: (b_lo, b_hi) if p in fitted else (0.0, 0.0) for p in groups}
    for _level in range(5):  # coarse to fine; each level zooms on the best point
        lb = {p: np.linspace(*b_span[p], 161 if p in fitted else 1) for p in groups}
        total = np.zeros(len(d_grid))
        arg_b: dict = {}
        for p, m in groups.items():
            # pred[d, k, i] = lat_i + d·hops_i + xfer_i / β_k
            fixed = (lat[m] + d_grid[:, None] * hops[m])[:, None, :]  # [d, 1, i]
            pred = fixed + xfer[m][None, None, :] / np.exp(lb[p])[None, :, None]  # [d, k, i]
            with np.errstate(invalid="ignore", divide="ignore"):
                err = np.where(pred > 0, np.log(np.maximum(pred, 1e-300)) - log_t[m], np.inf)
            loss = np.sum(err**2, axis=2)  # [d, k]
            k = np.argmin(loss, axis=1)
            arg_b[p] = lb[p][k]
            total += loss[np.arange(len(d_grid)), k]
        j = int(np.argmin(total))
        best = (float(total[j]), float(d_grid[j]), {p: float(arg_b[p][j]) for p in groups})
        d_step = d_grid[1] - d_grid[0]
        d_grid = np.linspace(max(d_lo, best[1] - 2 * d_step), min(d_hi, best[1] + 2 * d_step), 41)
        for p in fitted:
            step = lb[p][1] - lb[p][0]
            b_span[p] = (max(b_lo, best[2][p] - 2 * step), min(b_hi, best[2][p] + 2 * step))
    assert best is not None
    return best


class Transport(str, Enum):
    """How peers exchange data. Recorded only: NCCL's model does not look at it."""

    P2P = "P2P"
    SHM = "SHM"


# The calibration window: rows of 8 B to 4 MiB only.
CALIBRATION_MIN_BYTES = 8
CALIBRATION_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ModelInputs:
    """What NCCL's all-reduce cost model needs, for one node.

    Parameters
    ----------
    n_ranks
        GPUs in the communicator (all on this node).
    sm
        Smallest compute capability × 10 (89 for an RTX 4090); gives the compcap index of the caps.
    bw_intra_gbps, n_channels
        The ring graph: ``bw X/…`` (GB/s per channel) and ``nChannels N`` of the ``Pattern 4`` GRAPH
        line (graph channels, not the doubled communicator channels).
    link
        ``PCI`` unless the graph's ``typeIntra`` is NVLink.
    nccl_version
        Integer code as ``ncclGetVersion`` returns it (NCCL ``nccl.h.in`` ``NCCL_VERSION``):
        ``X*1000 + Y*100 + Z`` up to 2.8 (2.8.3 -> 2803), ``X*10000 + Y*100 + Z`` from 2.9
        (2.23.4 -> 22304). Every old code is below every new one, so the version gates compare
        the integers directly; a release before 2.18 gets the 2.18 constants (the oldest read).
    algos, protos
        What is left after ``NCCL_ALGO``/``NCCL_PROTO`` (and LL128's default rule, see
        :func:`default_protos`); ``protos=None`` means NCCL's default for ``link`` and ``sm``.
    tree_bw_intra_gbps, tree_n_channels
        The tree graph (``Pattern 1`` or ``3``); ``None`` = same as the ring graph.
    tree_plain_pattern
        The tree graph fell back to the plain TREE pattern (sm90+): Tree bandwidth ×0.85.
    transport
        P2P or SHM, recorded for the correction's bookkeeping; NCCL's model ignores it.
    """

    n_ranks: int
    sm: int
    bw_intra_gbps: float
    n_channels: int
    link: LinkType = LinkType.PCI
    nccl_version: int = DEFAULT_NCCL_VERSION
    algos: frozenset[Algo] = frozenset({Algo.RING, Algo.TREE})
    protos: frozenset[Proto] | None = None
    tree_bw_intra_gbps: float | None = None
    tree_n_channels: int | None = None
    tree_plain_pattern: bool = False
    transport: Transport | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> ValueError:
            return ValueError(f"ModelInputs.{name}={value!r}: expected {want}")

        if isinstance(self.n_ranks, bool) or not isinstance(self.n_ranks, int) or self.n_ranks < 1:
            raise bad("n_ranks", self.n_ranks, "an int >= 1")
        if isinstance(self.sm, bool) or not isinstance(self.sm, int) or not 30 <= self.sm <= 300:
            raise bad("sm", self.sm, "compute capability x10 as an int, e.g. 89 for sm_89")
        for name in ("bw_intra_gbps", "tree_bw_intra_gbps"):
            v = getattr(self, name)
            if v is None and name == "tree_bw_intra_gbps":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(name, v, "a finite GB/s > 0 (read it from the GRAPH line 'bw X/Y')")
        for name in ("n_channels", "tree_n_channels"):
            v = getattr(self, name)
            if v is None and name == "tree_n_channels":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
                raise bad(name, v, "an int in 1..64 (graph channels, 'nChannels N' of the GRAPH line)")
        if not is_version_code(self.nccl_version):
            raise bad(
                "nccl_version",
                self.nccl_version,
                "an NCCL version code as ncclGetVersion returns it: "
                "X*1000+Y*100+Z up to 2.8 (2803 = 2.8.3), X*10000+Y*100+Z from 2.9 (22304 = 2.23.4)",
            )
        try:
            object.__setattr__(self, "link", LinkType(self.link))
            object.__setattr__(self, "algos", frozenset(Algo(a) for a in self.algos))
            protos = self.protos if self.protos is not None else default_protos(self.link, self.sm, self.nccl_version)
            object.__setattr__(self, "protos", frozenset(Proto(p) for p in protos))
            if self.transport is not None:
                object.__setattr__(self, "transport", Transport(self.transport))
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"ModelInputs: {exc}; algos are {[a.value for a in Algo]}, "
                f"protos {[p.value for p in Proto]}, links {[k.value for k in LinkType]}"
            ) from None
        if not self.algos or not self.protos:
            raise ValueError(
                "ModelInputs: no algorithm/protocol left (NCCL fails at the first collective with "
                "'No algorithm/protocol available'); enable at least one of Ring/Tree and LL/LL128/Simple"
            )

    @property
    def compcap_index(self) -> int:
        """0 Volta (<sm80), 1 Ampere/Ada (sm80-89), 2 Hopper (sm90), 3 Blackwell (>=sm100)."""
        return compcap_index(self.sm)

    def graph(self, algo: Algo) -> tuple[float, int]:
        """(bwIntra GB/s per channel, nChannels) of the graph NCCL uses for ``algo``."""
        if Algo(algo) is Algo.TREE:
            return (self.tree_bw_intra_gbps or self.bw_intra_gbps, self.tree_n_channels or self.n_channels)
        return self.bw_intra_gbps, self.n_channels


def inputs_for_pcie_box(
    n_ranks: int,
    *,
    gen: int,
    width: int = 16,
    sm: int,
    p2p: bool,
    version: int = DEFAULT_NCCL_VERSION,
    cpu_link_bw_gbps: float | None = None,
    graph_bw_intra_gbps: float | None = None,
    graph_n_channels: int | None = None,
    algos: Iterable[Algo] = (Algo.RING, Algo.TREE),
    protos: Iterable[Proto] | None = None,
) -> ModelInputs:
    """:class:`ModelInputs` for ``n_ranks`` GPUs on one PCIe node without NVLink.

    The graph (``bwIntra``, ``nChannels``) should be read from NCCL's log: the line
    ``Pattern 4, crossNic 0, nChannels N, bw X/Y, type …`` (``NCCL_DEBUG=INFO
    NCCL_DEBUG_SUBSYS=INIT,GRAPH``). Pass it as ``graph_bw_intra_gbps=X, graph_n_channels=N`` and it
    is used as is. Without it the graph is *derived*, which is only plausible:

    1. GPU link bandwidth ``width × rate/80`` GB/s (topo.cc ``kvDictPciGen``: Gen3 x16 = 12,
       Gen4 x16 = 24, Gen5 x16 = 48); this is the search's ``totalBw``.
    2. ``maxBw`` (best path from a GPU) = the link bandwidth, or ``min(link, cpu_link_bw_gbps)`` when
       every pair crosses a CPU-to-CPU link (one GPU per NUMA node; AMD 16, Intel SKL 10, SPR 22 GB/s).
    3. NCCL's speed ladder for the sm (search.cc) walked as in
       :func:`ring_graph`. Gen4 x16 gives
       2 channels × 12 GB/s (and so does Gen4 with ``cpu_link_bw_gbps=16``); Gen5 x16 on sm120
       gives 2 × 24.

    ``p2p`` only records the transport: NCCL's model is transport-blind, and on a box without PCIe
    switches both transports' paths cross the same links, so the derived graph is the same.
    """
    if gen not in PCI_GEN_RATE:
        raise ValueError(f"gen={gen!r}: expected a PCIe generation in {sorted(PCI_GEN_RATE)}")
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width={width!r}: expected a PCIe link width in (1, 2, 4, 8, 16)")
    if cpu_link_bw_gbps is not None and not (math.isfinite(cpu_link_bw_gbps) and cpu_link_bw_gbps > 0):
        raise ValueError(f"cpu_link_bw_gbps={cpu_link_bw_gbps!r}: expected GB/s > 0 or None")
    if (graph_bw_intra_gbps is None) != (graph_n_channels is None):
        raise ValueError(
            "graph_bw_intra_gbps and graph_n_channels come together from the GRAPH line "
            "'nChannels N, bw X/Y'; pass both or neither"
        )
    if graph_bw_intra_gbps is None:
        link_bw = width * PCI_GEN_RATE[gen] / 80.0
        max_bw = link_bw if cpu_link_bw_gbps is None else min(link_bw, cpu_link_bw_gbps)
        graph_bw_intra_gbps, graph_n_channels = ring_graph(max_bw, link_bw, sm)
    return ModelInputs(
        n_ranks=n_ranks,
        sm=sm,
        bw_intra_gbps=float(graph_bw_intra_gbps),
        n_channels=graph_n_channels,
        link=LinkType.PCI,
        nccl_version=version,
        algos=frozenset(algos),
        protos=None if protos is None else frozenset(protos),
        transport=Transport.P2P if p2p else Transport.SHM,
    )


def _hops(algo: Algo, n_ranks: int) -> int:
    # Ring: nsteps = 2(n-1) for all-reduce; Tree, one node: 2*(nRanks/nNodes - 1).
    return 2 * (n_ranks - 1)


def latency_us(algo: Algo, proto: Proto, inputs: ModelInputs) -> float:
    """NCCL's latency term for one all-reduce (µs, predicted): ``base[a][p] + hops · hw[link][a][p]``.

    ``hops = 2(n−1)`` for Ring (``nsteps``) and for Tree (``2·(nRanks/nNodes − 1)``); ``link`` is
    NVLINK when the graph's ``typeIntra`` is NVLink, else PCI. NCCL does not tell SHM from P2P.
    """
    algo, proto = Algo(algo), Proto(proto)
    base, hop = base_and_hop_latency(algo, proto, inputs.link, inputs.nccl_version)
    return base + _hops(algo, inputs.n_ranks) * hop


def algbw_gbps(algo: Algo, proto: Proto, inputs: ModelInputs) -> float:
    """NCCL's algorithm bandwidth (GB/s, predicted) before the Tree size correction; 0 if disabled.

    ``busBw = nChannels × bwIntra`` of the graph, then Ring/LL ``min(llMaxBw, ½·busBw)`` (¼ before
    2.21), Ring/LL128 ``min(0.92·busBw, nCh·perChMaxRingLL128Bw)``; Tree first ``min(0.92·busBw,
    nCh·perChMaxTreeBw)``, then Tree/LL ``min(busBw/3.8, llMaxBw)``, Tree/LL128 ``min(7/9·busBw,
    nCh·perChMaxTreeLL128Bw)``, ×0.85 for a plain TREE pattern. ``algBw = busBw · n/(2(n−1))`` for
    Ring and ``busBw/2`` for Tree.
    """
    algo, proto = Algo(algo), Proto(proto)
    if algo not in inputs.algos or proto not in inputs.protos:
        return 0.0
    cc, n = inputs.compcap_index, inputs.n_ranks
    bw, nch = inputs.graph(algo)
    bus = nch * bw
    if algo is Algo.RING:
        if proto is Proto.LL:
            bus = min(LL_MAX_BW[cc], bus * (0.5 if inputs.nccl_version >= V2_21 else 0.25))
        elif proto is Proto.LL128:
            bus = min(bus * 0.92, nch * PER_CH_MAX_RING_LL128_BW[cc])
        return bus * n / (2 * (n - 1))  # busBw -> algBw, nsteps = 2(n-1)
    bus = min(bus * 0.92, nch * PER_CH_MAX_TREE_BW[cc])
    if proto is Proto.LL:
        bus = min(bus / 3.8, LL_MAX_BW[cc])
    elif proto is Proto.LL128:
        bus = min(bus * 7.0 / 9.0, nch * PER_CH_MAX_TREE_LL128_BW[cc])
    if inputs.tree_plain_pattern:
        bus *= 0.85
    return bus * 0.5


def tree_correction_factor(proto: Proto, nbytes: int) -> float:
    """``treeCorrectionFactor[proto][log2i(nBytes >> 6)]`` for 0 <= index < 23, else 1."""
    k = int(nbytes >> 6).bit_length() - 1  # log2i: floor(log2), -1 for 0
    return TREE_CORRECTION[Proto(proto)][k] if 0 <= k < 23 else 1.0


@dataclass(frozen=True)
class Prediction:
    """A predicted all-reduce time; never a measurement.

    ``algo``/``proto`` is the pair NCCL runs (the minimum of NCCL's *own* cost table); ``time_us``
    is that pair's time under the model named by ``basis``; ``times_us`` maps every enabled
    ``(algo, proto)`` to its predicted time (what forcing that pair would give).
    """

    nbytes: int
    time_us: float
    algo: Algo
    proto: Proto
    times_us: Mapping[tuple[Algo, Proto], float] = field(hash=False)
    basis: str = "NCCL cost model (tuning.cc)"
    predicted: bool = True
    label: str = "predicted"

    def __post_init__(self) -> None:
        if self.predicted is not True or self.label != "predicted":
            raise ValueError("Prediction is always labelled predicted (predicted=True, label='predicted')")
        object.__setattr__(self, "times_us", MappingProxyType(dict(self.times_us)))

    def __str__(self) -> str:
        return f"{self.time_us:.1f} us predicted ({self.algo.value}/{self.proto.value}, {self.basis})"


def _check_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: expected the all-reduce buffer size in bytes, an int >= 0")
    return int(nbytes)


def _nccl_table(nbytes: int, inputs: ModelInputs) -> dict[tuple[Algo, Proto], float]:
    """ncclTopoGetAlgoTime for every enabled pair (numPipeOps = 1)."""
    if inputs.n_ranks == 1:  # updateCollCostTable: a 1-rank communicator is a copy, Ring/Simple 0
        return {(Algo.RING, Proto.SIMPLE): 0.0}
    table = {}
    for algo in (Algo.TREE, Algo.RING):  # NCCL's index order; ties go to the first pair
        for proto in (Proto.LL, Proto.LL128, Proto.SIMPLE):
            bw = algbw_gbps(algo, proto, inputs)
            if bw <= 0:
                continue
            if algo is Algo.TREE:
                bw *= tree_correction_factor(proto, nbytes)
            table[(algo, proto)] = latency_us(algo, proto, inputs) + nbytes / (1000.0 * bw)
    return table


def _pick(table: Mapping[tuple[Algo, Proto], float]) -> tuple[Algo, Proto]:
    # topoGetAlgoInfo: strict '<' over algo-major, proto-minor order.
    return min(table, key=lambda k: (table[k], list(Algo).index(k[0]), list(Proto).index(k[1])))


def predict(nbytes: int, inputs: ModelInputs) -> Prediction:
    """NCCL's own predicted time of one all-reduce of ``nbytes`` bytes (µs) and the pair it picks.

    ``time_us = lat + nBytes / (1000 · algBw)``, Tree's ``algBw`` × ``treeCorrectionFactor[p][log2(nBytes/64)]``;
    disabled pairs (``algBw = 0``) are skipped and NCCL runs the pair with the smallest time. LL128
    is off by default on PCIe (it needs an NVLink graph), so only LL and Simple compete there.
    """
    nbytes = _check_nbytes(nbytes)
    table = _nccl_table(nbytes, inputs)
    algo, proto = _pick(table)
    return Prediction(nbytes=nbytes, time_us=table[(algo, proto)], algo=algo, proto=proto, times_us=table)


class _Row(Protocol):
    size_bytes: int
    oop_time_us: float


@dataclass(frozen=True)
class CorrectedModel:
    """NCCL's model with a fitted per-hop latency and per-protocol bandwidth scale.

    ``lat' = lat + extra_hop_latency_us · hops`` (δ, one value for all protocols: the hardware
    round trip of one ring step, which an LL line's flag and a Simple chunk's flag both pay);
    ``algBw' = bw_scale[p] · algBw`` (β per protocol: LL moves 8-byte flag+data words with stores,
    Simple bulk chunks). LL128 (off on PCIe, no data) uses Simple's β. The pair run is still the one
    NCCL's own model picks. ``fitted_on`` is the transport of the fit data; the same parameters are
    applied unchanged to the other transport.

    Why: on a public 8× RTX 4090 box (2× EPYC 7542, one GPU per NUMA node, every pair SYS; its
    nccl-tests tables with P2P disabled and unlocked) NCCL's model predicts 20.6 µs for a tiny
    all-reduce where 38.8 µs are measured, and its LL and Simple bandwidths are ≈1.3–1.8× too high:
    its PCI per-hop latencies (1.0 µs LL, 5.7 µs Simple) are one value for every PCIe path, while
    every ring step there crosses two root ports and the Infinity Fabric (and, with SHM, host memory).

    Across transports: on an all-SYS box SHM and P2P put every byte and flag through the same links
    (floors 38.8 vs 38.8 µs at 8 B); where the data lands (host DRAM or peer HBM) changes only the
    large-message bandwidth (peak busBw 15.0 vs 20.6 GB/s), which is not modelled. Fitted on one
    table and judged on the other, the median error is 4.7 % / 6.6 % (worst rows 25 % / 23 %; NCCL's
    raw model 50.6 % / 46.9 %, always too fast), but one table's measured times already predict the
    other to 4.4 % / 4.2 %: the fit captures the curve's shape, it is no evidence for another box.
    Predicted, not measured: with the fitted bandwidths Simple beats LL from ≈450 KB, below the
    LL→Simple switch NCCL makes near 927 KB.
    """

    extra_hop_latency_us: float
    bw_scale: Mapping[Proto, float] = field(hash=False)
    fitted_on: Transport | None = None
    fitted_protos: frozenset[Proto] = frozenset()
    n_rows: int = 0
    fit_rms_log_error: float = float("nan")

    def __post_init__(self) -> None:
        scale = {p: float(self.bw_scale.get(p, 1.0)) for p in (Proto.LL, Proto.SIMPLE)}
        scale[Proto.LL128] = float(self.bw_scale.get(Proto.LL128, scale[Proto.SIMPLE]))  # no data: Simple's
        if not all(math.isfinite(v) and v > 0 for v in scale.values()):
            raise ValueError(f"CorrectedModel.bw_scale={dict(self.bw_scale)!r}: expected finite factors > 0")
        if not math.isfinite(self.extra_hop_latency_us):
            raise ValueError(f"CorrectedModel.extra_hop_latency_us={self.extra_hop_latency_us!r}: expected a finite µs")
        object.__setattr__(self, "bw_scale", MappingProxyType(scale))

    def times_us(self, nbytes: int, inputs: ModelInputs) -> dict[tuple[Algo, Proto], float]:
        """Corrected time of every enabled pair (µs, predicted)."""
        nbytes = _check_nbytes(nbytes)
        if inputs.n_ranks == 1:
            return {(Algo.RING, Proto.SIMPLE): 0.0}
        out = {}
        for algo, proto in _nccl_table(nbytes, inputs):
            bw = algbw_gbps(algo, proto, inputs) * self.bw_scale[proto]
            if algo is Algo.TREE:
                bw *= tree_correction_factor(proto, nbytes)
            lat = latency_us(algo, proto, inputs) + self.extra_hop_latency_us * _hops(algo, inputs.n_ranks)
            out[(algo, proto)] = max(lat, 0.0) + nbytes / (1000.0 * bw)
        return out

    def predict(self, nbytes: int, inputs: ModelInputs) -> Prediction:
        """Corrected time of the pair NCCL picks for ``nbytes`` (µs, predicted)."""
        nbytes = _check_nbytes(nbytes)
        algo, proto = _pick(_nccl_table(nbytes, inputs))
        table = self.times_us(nbytes, inputs)
        where = "fit on " + (self.fitted_on.value if self.fitted_on else "unlabelled data")
        if self.fitted_on and inputs.transport and inputs.transport is not self.fitted_on:
            where += f", applied to {inputs.transport.value}"
        return Prediction(
            nbytes=nbytes,
            time_us=table[(algo, proto)],
            algo=algo,
            proto=proto,
            times_us=table,
            basis=f"NCCL model + PCIe correction ({where})",
        )


def _rows_arrays(rows: Iterable[_Row]) -> tuple[np.ndarray, np.ndarray]:
    sizes, times = [], []
    for i, r in enumerate(rows):
        try:
            s, t = int(r.size_bytes), float(r.oop_time_us)
        except (AttributeError, TypeError, ValueError):
            raise UserError(
                f"calibration row {i}: expected size_bytes and oop_time_us (a PerfRow), got {r!r}"
            ) from None
        if s < 0 or not math.isfinite(t) or t <= 0:
            raise UserError(f"calibration row {i}: size {s} B, time {t} us; need size >= 0 and a time > 0")
        sizes.append(s)
        times.append(t)
    return np.asarray(sizes, dtype=np.int64), np.asarray(times, dtype=float)


def fit(rows: Iterable[_Row], inputs: ModelInputs) -> CorrectedModel:
    """Fit the PCIe correction to measured all-reduce rows (out-of-place time) of one box.

    δ and the β by least squares on log time (relative error), on a deterministic grid
    (:func:`grid_search`); 3 numbers for about 20 rows, small on purpose.

    Parameters
    ----------
    rows
        Measured rows, e.g. ``PerfTable.rows`` cut to the calibration window; uses ``size_bytes``
        and ``oop_time_us`` (µs, wall time per all-reduce as nccl-tests prints it).
    inputs
        The box and settings the rows were measured with (``inputs.transport`` is recorded).

    Returns
    -------
    CorrectedModel
        δ and the β minimising the sum of squared log errors. A protocol that no row ran (by NCCL's
        own choice), or whose rows are all latency-bound, keeps β = 1 and is left out of
        ``fitted_protos``.

    Raises
    ------
    UserError
        Fewer than 4 usable rows, a single-rank communicator, or a row with a time <= 0.
    """
    sizes, times = _rows_arrays(rows)
    if inputs.n_ranks < 2:
        raise UserError("fit: a 1-rank all-reduce is a local copy; need n_ranks >= 2")
    if len(sizes) < 4:
        raise UserError(f"fit: {len(sizes)} calibration rows; need at least 4 for 3 parameters")
    # Per row: the pair NCCL runs, its NCCL latency, hop count and NCCL bandwidth (Tree factor included).
    lat, hops, bw, proto_of = (np.empty(len(sizes)) for _ in range(4))
    protos = (Proto.LL, Proto.SIMPLE, Proto.LL128)
    for i, s in enumerate(sizes):
        algo, proto = _pick(_nccl_table(int(s), inputs))
        b = algbw_gbps(algo, proto, inputs) * (tree_correction_factor(proto, int(s)) if algo is Algo.TREE else 1.0)
        lat[i], hops[i], bw[i] = latency_us(algo, proto, inputs), _hops(algo, inputs.n_ranks), b
        proto_of[i] = protos.index(proto)
    log_t = np.log(times)
    xfer = sizes / (1000.0 * bw)  # µs at β = 1
    groups = {p: proto_of == k for k, p in enumerate(protos) if np.any(proto_of == k)}
    # A protocol whose rows are all latency-bound (bandwidth term < 5 % of the time at β = 1) says
    # nothing about its β: keep NCCL's bandwidth (β = 1) rather than let the fit wander to a bound.
    fitted = {p for p, m in groups.items() if np.max(xfer[m] / (lat[m] + xfer[m])) >= 0.05}
    loss, delta, log_beta = grid_search(lat, hops, xfer, log_t, groups, fitted)
    return CorrectedModel(
        extra_hop_latency_us=delta,
        bw_scale={p: math.exp(v) for p, v in log_beta.items()},
        fitted_on=inputs.transport,
        fitted_protos=frozenset(fitted),
        n_rows=len(sizes),
        fit_rms_log_error=math.sqrt(loss / len(sizes)),
    )


# Which all-reduce algorithms and protocols an environment leaves enabled, for one NCCL version.
#
# The one public answer that ``fastverify topo`` and ``fastverify tune`` both ask. It replays
# NCCL's own parsing of ``NCCL_ALGO`` / ``NCCL_PROTO`` through :func:`fastverify.nccl.checks.parse_algo_proto`
# (NCCL ``src/graph/tuning.cc`` ``parseList`` for NCCL <= 2.23, the per-function grammar of
# ``src/graph/tuning.cc`` from 2.24 on) and NCCL's default protocol rule
# (:func:`default_protos`, ``tuning.cc`` ``ncclTopoTuneModel``: LL128 only on
# some architectures and links).
#
# Only the algorithms the cost model knows on one PCIe node are answered (Ring, Tree,
# :class:`fastverify.nccl.model.Algo`); CollNet, NVLS and PAT need hardware a PCIe box has not.

_ALL_ALGOS = frozenset({Algo.RING, Algo.TREE})


@dataclass(frozen=True)
class EnabledAlgos:
    """What an environment leaves enabled for AllReduce on one PCIe node.

    Attributes
    ----------
    algos : frozenset of fastverify.nccl.model.Algo
        Never empty: an NCCL_ALGO that turns every algorithm off makes NCCL <= 2.23 switch Ring and
        Tree back on (``tuning.cc``), and fails init on >= 2.24 (a catalogue error finding).
    protos : frozenset of fastverify.nccl.model.Proto
        Never empty. Where the environment does not decide them (``protos_set`` False) this is
        NCCL's default set for a PCIe link, ``default_protos(PCI, sm, version)``.
    notes : tuple of str
        One line per setting that NCCL rejects or ignores (the prediction is made without it).
    protos_set : bool
        True when ``NCCL_PROTO`` decided ``protos``; False when they are NCCL's default (what
        :class:`fastverify.nccl.model.ModelInputs` means by ``protos=None``).
    """

    algos: frozenset[Algo]
    protos: frozenset[Proto]
    notes: tuple[str, ...] = ()
    protos_set: bool = False

    @property
    def protos_or_none(self) -> frozenset[Proto] | None:
        """``protos`` where the environment set them, else ``None`` (NCCL's default rule), the form
        :func:`fastverify.nccl.model.inputs_for_pcie_box` takes."""
        return self.protos if self.protos_set else None


def allreduce_enabled(name: str, value: str, version: NcclVersion | None) -> dict[str, int] | None:
    """What ``NCCL_ALGO`` / ``NCCL_PROTO`` = ``value`` leaves enabled for AllReduce.

    Parameters
    ----------
    name : {"NCCL_ALGO", "NCCL_PROTO"}
    value : str
        The setting as written.
    version : NcclVersion or None
        ``None``: the newest NCCL the catalogue was checked against (its grammar).

    Returns
    -------
    dict or None
        NCCL's name (``"Ring"``, ``"LL128"`` …) → 0 off, 1 on, 2 NCCL's default rule; ``None``
        when NCCL rejects the value (init fails) or ignores all of it.
    """
    if name not in ("NCCL_ALGO", "NCCL_PROTO"):
        raise ValueError(f"name must be NCCL_ALGO or NCCL_PROTO, got {name!r}")
    parsed = parse_algo_proto(name, value, Ctx.of(version))
    if parsed.error:
        return None
    return dict(parsed.enable["AllReduce"])


def enabled_algos_protos(env: Mapping[str, str], version: NcclVersion | None, sm: int) -> EnabledAlgos:
    """The all-reduce algorithms and protocols ``env`` leaves enabled for this NCCL version.

    Parameters
    ----------
    env : mapping of str to str
        ``NCCL_*`` settings (others are ignored); only ``NCCL_ALGO`` and ``NCCL_PROTO`` matter here.
    version : NcclVersion or None
        The NCCL that reads ``env``; ``None`` = unknown (the newest grammar, the model's default
        version for the default protocol rule).
    sm : int
        GPU compute capability × 10 (89 = Ada, 120 = Blackwell workstation): decides LL128 in
        NCCL's default protocol set.

    Returns
    -------
    EnabledAlgos
        Settings NCCL rejects (a catalogue error) or ignores entirely are left out and named in
        ``notes``; their algorithms / protocols are NCCL's defaults.
    """
    notes: list[str] = []
    algos = _ALL_ALGOS
    code = version.code if version else DEFAULT_NCCL_VERSION
    default = default_protos(LinkType.PCI, sm, code)
    protos, protos_set = default, False
    if "NCCL_ALGO" in env and validate_setting("NCCL_ALGO", env["NCCL_ALGO"], version).severity is not Severity.ERROR:
        on = allreduce_enabled("NCCL_ALGO", env["NCCL_ALGO"], version)
        if on is not None:
            algos = frozenset(a for a in Algo if on.get(a.value)) or _ALL_ALGOS
    elif "NCCL_ALGO" in env:
        notes.append(f"NCCL rejects or ignores NCCL_ALGO={env['NCCL_ALGO']!r}: the baseline is predicted without it")
    if (
        "NCCL_PROTO" in env
        and validate_setting("NCCL_PROTO", env["NCCL_PROTO"], version).severity is not Severity.ERROR
    ):
        on = allreduce_enabled("NCCL_PROTO", env["NCCL_PROTO"], version)
        if on is not None:
            chosen = frozenset(p for p in Proto if on.get(p.value) == 1 or (on.get(p.value) == 2 and p in default))
            if chosen:
                protos, protos_set = chosen, True
    elif "NCCL_PROTO" in env:
        notes.append(f"NCCL rejects NCCL_PROTO={env['NCCL_PROTO']!r}: the baseline is predicted without it")
    return EnabledAlgos(algos, protos, tuple(notes), protos_set)


def inputs_for_env(
    env: Mapping[str, str],
    n_ranks: int,
    *,
    p2p: bool,
    version: NcclVersion | None,
    pcie_gen: int,
    sm: int,
    graph_bw_intra_gbps: float | None = None,
    graph_n_channels: int | None = None,
) -> tuple[ModelInputs, tuple[str, ...]]:
    """The cost model's inputs for ``n_ranks`` GPUs of one PCIe box (x16 links) under ``env``: the one
    way ``fastverify topo`` and ``fastverify tune`` turn an environment into :class:`ModelInputs`.

    Parameters
    ----------
    env : mapping of str to str
        The ``NCCL_*`` settings in force (the current environment, or it with a candidate's settings
        on top): ``NCCL_ALGO`` / ``NCCL_PROTO`` decide the algorithms and protocols
        (:func:`enabled_algos_protos`).
    p2p : bool
        The ring's pace-setting transport is P2P (else SHM), recorded only.
    version : NcclVersion or None
        The NCCL that reads ``env``; ``None``, or a release newer than the 2.x ones the model knows,
        gets the model's default version's constants (the latter said in the notes).
    pcie_gen, sm
        PCIe generation and compute capability x10.
    graph_bw_intra_gbps, graph_n_channels
        The ring graph from an NCCL log's GRAPH line, both or neither (else derived,
        :func:`inputs_for_pcie_box`).

    Returns
    -------
    (ModelInputs, notes)
        ``notes``: one line per setting NCCL rejects or ignores, and a version the model does not know.
    """
    enabled = enabled_algos_protos(env, version, sm)
    notes = list(enabled.notes)
    code = DEFAULT_NCCL_VERSION
    if version is not None and version.major > 2:  # the cost model's constants are NCCL 2.x's
        notes.append(
            f"NCCL {version} is newer than the 2.x releases the cost model knows: predicted with its default "
            "version's constants"
        )
    elif version is not None:
        code = version.code
    inputs = inputs_for_pcie_box(
        n_ranks,
        gen=pcie_gen,
        width=16,
        sm=sm,
        p2p=p2p,
        version=code,
        graph_bw_intra_gbps=graph_bw_intra_gbps,
        graph_n_channels=graph_n_channels,
        algos=enabled.algos,
        protos=enabled.protos_or_none,
    )
    return inputs, tuple(notes)
