"""An approximation of NCCL's ring search on a symmetric PCIe box: the graph
(``bwIntra`` GB/s per channel, ``nChannels``) that NCCL's topology search (NVIDIA/nccl
``src/graph/search.cc`` ``ncclTopoCompute``) would find, for when no GRAPH log line is at hand.
"""

from __future__ import annotations

import math

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
