"""The ``#`` header lines of an ``all_reduce_perf`` table, and its rank count.

Header lines (NVIDIA/nccl-tests ``src/util.cu``, ``src/common.cu``): ``# nccl-tests version …``
(recent), ``# nThread 1 nGpus 8 minBytes 8 maxBytes … step: 2(factor) warmup iters: 5 iters: 20
agg iters: 1 validation: 1 graph: 0 [unalign: 0]``, ``#  Rank  0 Group  0 Pid 1756513 on host
device  0 [0x01] NVIDIA GeForce RTX 4090`` (the bus id is ``[0x%02x]`` in older builds,
``[%04x:%02x:%02x]`` in newer ones), two column-header rows and a units row, then the footer
``# Out of bounds values : 0 OK`` and ``# Avg bus bandwidth    : 4.85265``.

Rank count: the ``#  Rank`` lines when the table has them, else nThread × nGpus of the header, but
both halves' busBw/algBw = 2(n−1)/n (nccl-tests ``doc/PERFORMANCE.md``) is solved for n as well;
where the header's product disagrees with a ratio that every row agrees on, the ratio wins (under
MPI the header counts one process's GPUs).
"""

from __future__ import annotations

import re

from fastverify.nccl.perfrows import PerfRow, to_float, to_int

_RUN_KEYS = re.compile(
    r"(nThread|nGpus|minBytes|maxBytes|step:|warmup iters:|agg iters:|iters:|validation:|graph:|unalign:)"
    r"\s*(\S+)"
)
_VERSION_LINE = re.compile(r"^#\s*nccl-tests version\s+(\S+)(.*)$")
_RANK_LINE = re.compile(
    r"^#\s*Rank\s+([0-9]+)(?:\s+Group\s+([0-9]+))?\s+Pid\s+([0-9]+)\s+on\s+(\S+)\s+device\s+([0-9]+)\s+"
    r"\[([^\]]*)\]\s*(.*?)\s*$"
)
_KV_LINE = re.compile(r"^#\s*([A-Za-z][\w .()-]*?)\s*:\s*(.*?)\s*$")


def read_header_line(s: str, header: dict[str, str], ranks: dict[int, str], hosts: dict[str, None]) -> None:
    """One ``#`` line into ``header`` (key → value as printed), ``ranks`` (rank → GPU name) and ``hosts``."""
    if len(s) > 4096:  # nccl-tests header lines are short; keeps the lazy regexes below linear
        return
    m = _RANK_LINE.match(s)
    if m:
        ranks[int(m.group(1))] = m.group(7)
        hosts.setdefault(m.group(4), None)
        return
    m = _VERSION_LINE.match(s)
    if m:
        header["nccl-tests version"] = m.group(1)
        for k, v in re.findall(r"([\w-]+)=(\S+)", m.group(2)):
            header[k] = v
        return
    if "nThread" in s and "nGpus" in s:
        for k, v in _RUN_KEYS.findall(s):
            header[k.rstrip(":")] = v
        return
    m = _KV_LINE.match(s)
    if m:
        header[m.group(1)] = m.group(2)


def rank_count(header: dict[str, str], ranks: dict[int, str], bw_ranks: int | None) -> tuple[int | None, str | None]:
    """The rank count and where it comes from (module docstring). Rank lines fewer than
    nThread × nGpus are an excerpt of the header: the product wins then."""
    t, g = to_int(header.get("nThread", "")), to_int(header.get("nGpus", ""))
    product = t * g if t is not None and g is not None and t > 0 and g > 0 else None
    if ranks and (product is None or len(ranks) >= product):
        return len(ranks), "rank lines"
    if product is not None and (ranks or bw_ranks in (None, product)):
        return product, "nThread x nGpus"
    if bw_ranks is not None:
        return bw_ranks, "busBw/algBw"
    return None, None


def _half_unit(v: float) -> float:
    """Half the last printed digit of a bandwidth: nccl-tests prints ``%6.2f`` and drops decimals
    to keep 6 characters (``124.85``, ``1234.5``, ``16253``)."""
    return 0.005 if v < 1000 else 0.05 if v < 10000 else 0.5


def ranks_from_bw(rows: list[PerfRow]) -> int | None:
    """n from busBw/algBw = 2(n−1)/n (nccl-tests ``src/all_reduce.cu`` GetBw), over both halves of
    every row with algBw >= 0.5 GB/s (smaller ones are printed with too few digits): solved on the
    summed ratio, rounded, and kept only when every such row's ratio, within its printed rounding
    (and 0.1 %), agrees. ``None`` without such rows or when they disagree."""
    pts = [(a, b) for r in rows for a, b in ((r.oop_algbw_gbps, r.oop_busbw_gbps), (r.ip_algbw_gbps, r.ip_busbw_gbps))
           if a >= 0.5]
    if not pts:
        return None
    ratio = sum(b for _, b in pts) / sum(a for a, _ in pts)
    if not 0 <= ratio < 2 - 2e-6:
        return None
    n = round(2 / (2 - ratio))
    if not 1 <= n <= 1 << 20:
        return None
    want = 2 * (n - 1) / n
    for a, b in pts:
        lo = max(b - _half_unit(b), 0.0) / (a + _half_unit(a)) * 0.999
        hi = (b + _half_unit(b)) / (a - _half_unit(a)) * 1.001
        if not lo <= want <= hi:
            return None
    return n


def avg_busbw(header: dict[str, str]) -> float | None:
    """The footer's ``Avg bus bandwidth`` in GB/s, ``None`` without one."""
    v = header.get("Avg bus bandwidth", "").split()
    return to_float(v[0]) if v else None
