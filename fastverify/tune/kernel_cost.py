"""A P2P all-reduce kernel's time on PCIe from the box alone, and the ranges of its misses (always *predicted*).

The model: ``t = latency + (n - 1) x S / B``. Every GPU takes in the other ``n - 1`` ranks' ``S``
bytes through its own x16 link of :data:`LINK_GB_S` (the one-shot pattern; a staged or
hierarchical kernel moves fewer bytes, and that difference is in its misses). The latency is the
median, over published boxes, of each P2P kernel's time at its smallest size (<= 4 KiB), where
the bytes do not count. Nothing else is fitted: how far real kernels fall from this line (link
efficiency, switch hops, kernels that collapse on some fabrics) is the range, made from the misses
on the published boxes by :func:`fastverify.tune.ranges.fit`, as for NCCL's cost model.

This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

import functools
import math
import statistics

from fastverify.registry import BackendName, backend_info
from fastverify.tune import ranges as R

__all__ = ["LINK_GB_S", "SMALL_BYTES", "kernel_fit", "kernel_residuals", "latency_us", "p2p_kernel", "point_us"]

LINK_GB_S = {3: 15.75, 4: 31.5, 5: 63.0}
"""PCIe x16 bandwidth per direction (GB/s) by generation: 8 / 16 / 32 GT/s x 16 lanes x 128b/130b
(PCI-SIG PCIe 3.0-5.0 base specifications)."""
SMALL_BYTES = 4096  # sizes up to this are latency: their time gives the model's latency


def p2p_kernel(m) -> bool:
    """A published P2P-kernel measurement the model is judged on: not NCCL, P2P working, times given."""
    if m.times_us is None or m.p2p is not True or m.backend is BackendName.nccl:
        return False
    return m.backend is None or backend_info(m.backend).needs_p2p


@functools.lru_cache(maxsize=64)
def _latency(data, exclude_box: str | None) -> float | None:
    per_box: dict[str, list[float]] = {}
    for m in data.measurements:
        if m.box != exclude_box and p2p_kernel(m) and m.sizes_bytes[0] <= SMALL_BYTES:
            per_box.setdefault(m.box, []).append(m.times_us[0])
    return statistics.median(statistics.median(v) for v in per_box.values()) if per_box else None


def latency_us(data, exclude_box: str | None = None) -> float | None:
    """The model's latency in µs (module docstring) over ``data`` (a
    :class:`fastverify.tune.backend_model.PublishedData`); None when no published kernel has a size
    <= :data:`SMALL_BYTES`."""
    return _latency(data, exclude_box)


def point_us(world_size: int, msg_bytes: int, *, pcie_gen: int | None, sm: tuple[int, int] | None,
             latency: float) -> float:
    """The model's time in µs of one all-reduce of ``msg_bytes`` bytes on ``world_size`` GPUs; the PCIe
    generation when not given is that of the published boxes of the same GPU generation."""
    return latency + (world_size - 1) * msg_bytes / (LINK_GB_S[R.assumed_pcie_gen(pcie_gen, sm)] * 1e3)


@functools.lru_cache(maxsize=64)
def _residuals(data, exclude_box: str | None) -> tuple[R.Residual, ...]:
    latency = _latency(data, exclude_box)
    if latency is None:
        return ()
    boxes = {b.id: b for b in data.boxes}
    out = []
    for m in data.measurements:
        if m.box == exclude_box or not p2p_kernel(m):
            continue
        bx = boxes[m.box]
        for size, t in zip(m.sizes_bytes, m.times_us):
            if R.RESIDUAL_BYTES[0] <= size <= R.RESIDUAL_BYTES[1]:
                p = point_us(m.world_size, size, pcie_gen=bx.pcie_gen, sm=bx.sm, latency=latency)
                out.append(R.Residual(m.box, m.world_size, size, math.log(t / p)))
    return tuple(out)


def kernel_residuals(data, exclude_box: str | None = None) -> tuple[R.Residual, ...]:
    """``ln(measured / model)`` of every published P2P-kernel time in ``data`` at 4 KiB .. 4 MiB, the
    model's latency taken without ``exclude_box`` too (no leakage)."""
    return _residuals(data, exclude_box)


def kernel_fit(data, msg_bytes: int, world_size: int, exclude_box: str | None = None) -> R.Fit:
    """The range factor of the model's point for a new box (:func:`fastverify.tune.ranges.fit`)."""
    return R.fit(_residuals(data, exclude_box), world_size=world_size, msg_bytes=msg_bytes)
