"""The NCCL cost model's misses on the published boxes, and the range they give its point (always *predicted*).

The cost model is :data:`fastverify.topo.diagnose.CALIBRATION` on
:func:`fastverify.nccl.model.inputs_for_pcie_box`, fitted on none of the published boxes but the
8x RTX 4090 one (``chlc-8x4090``), so leaving a box out leaves the model unchanged; only the pool
of misses changes. This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

import functools
import math

from fastverify.nccl import model as M
from fastverify.registry import BackendName
from fastverify.topo.diagnose import CALIBRATION
from fastverify.tune import backend_model as BM
from fastverify.tune import ranges as R

__all__ = ["cost_model_residuals", "cost_model_us", "nccl_fit"]


def cost_model_us(box: BM.Box, world_size: int, p2p: bool | None, msg_bytes: int) -> float:
    """The cost model's time in µs of one all-reduce of ``msg_bytes`` bytes on ``world_size`` GPUs of
    published ``box`` (its SM, its PCIe generation else :func:`fastverify.tune.ranges.assumed_pcie_gen`,
    x16), on P2P unless ``p2p`` is False (not stated: NCCL's default, P2P where the path allows it)."""
    on_p2p = p2p is not False
    inputs = M.inputs_for_pcie_box(world_size, gen=R.assumed_pcie_gen(box.pcie_gen, box.sm), width=16,
                                   sm=box.sm[0] * 10 + box.sm[1], p2p=on_p2p)
    return CALIBRATION[M.Transport.P2P if on_p2p else M.Transport.SHM].predict(msg_bytes, inputs).time_us


@functools.lru_cache(maxsize=64)
def _residuals(data: BM.PublishedData, exclude_box: str | None) -> tuple[R.Residual, ...]:
    boxes = {b.id: b for b in data.boxes}
    out = []
    for m in data.measurements:
        if m.backend is not BackendName.nccl or m.box == exclude_box or not BM.passes(m):
            continue
        for size, t in zip(m.sizes_bytes, m.times_us or ()):
            if R.RESIDUAL_BYTES[0] <= size <= R.RESIDUAL_BYTES[1]:
                out.append(R.Residual(m.box, m.world_size, size,
                                      math.log(t / cost_model_us(boxes[m.box], m.world_size, m.p2p, size))))
    return tuple(out)


def cost_model_residuals(exclude_box: str | None = None, *, data: BM.PublishedData | None = None,
                         ) -> tuple[R.Residual, ...]:
    """``ln(measured / cost model)`` of every published NCCL measurement with default settings, at
    its measured sizes in :data:`fastverify.tune.ranges.RESIDUAL_BYTES`, with the box's GPU count,
    SM, PCIe generation and P2P (:func:`cost_model_us`). ``data``: a file read with
    :func:`fastverify.tune.backend_model.load`; default the packaged one."""
    return _residuals(data if data is not None else BM.load(), exclude_box)


def nccl_fit(msg_bytes: int, world_size: int, *, exclude_box: str | None = None,
             data: BM.PublishedData | None = None) -> R.Fit:
    """The range factor of the NCCL cost model's point for a new box (:func:`fastverify.tune.ranges.fit`
    of :func:`cost_model_residuals`); the cost model covers every GPU count, so a 7-GPU box gets a
    range from the 4-, 8- and 16-GPU boxes' misses."""
    return R.fit(cost_model_residuals(exclude_box, data=data), world_size=world_size, msg_bytes=msg_bytes)
