"""Ranges for predicted all-reduce times, from the point method's own residuals (always *predicted*).

A range says where a new box's measurement will land around a point, so its width must come
from how far that point method missed on boxes it did not see, not from how far the boxes'
raw times differ. A *residual* is ``ln(measured / point)`` (dimensionless) for one published
box at one message size, the point computed without that box. This module turns a pool of
residuals into a range factor, or says the evidence is too thin: then the figure is
:data:`UNKNOWN`, never a wide or zero-width range.

Rules (revised 2026-12-10 after a reviewer measured the previous rule, a t interval of the raw
between-box spread joined with the min..max envelope, against 37 public points: 29 inside but a
median width of 36x; the level, the robust scale and the thresholds below were set from that
review and the 4x aim, before this module's leave-one-box-out run):

* **Pool**: every residual of the point method on the comparable published boxes (the caller's
  box left out in the leave-one-box-out benchmark). Each box weighs 1 in all, shared over its
  residuals, so a box with 15 sizes counts no more than one with 2.
* **Centre and scale**: the weighted median ``c`` of the residuals and ``s = 1.4826 x`` the
  weighted median of ``|r - c|`` (the median absolute deviation, scaled to a normal's standard
  deviation). A median, because a few boxes miss by 7-13x (the SGLang ``pcie_ipc_ar.py`` 8x SM120
  host, the SGLang PR #32479 8x RTX 6000D host): they are misses, and must not widen every range.
* **Range**: ``point x exp(c ± z s)``, ``z`` the normal 0.90 quantile (1.2816: an 80 % central
  interval, :data:`LEVEL`), widened to hold the point, and never narrower than :data:`FLOOR` each
  way (1.25: the run-to-run spread of the one source that publishes repeats, FlashInfer PR #4393,
  8x L40S, 18.7 / 21.8 / 28.9 µs, sqrt(28.9 / 18.7) = 1.24).
* **Unknown** (:func:`fit` gives a reason): residuals from fewer than :data:`MIN_BOXES` boxes; a
  world size more than :data:`REACH` (2x) from every world size in the pool; a message size more
  than :data:`REACH` outside the pool's sizes; a range wider than :data:`MAX_WIDTH` (8x, twice the
  4x aim: wider cannot order NCCL against a P2P kernel whose published speed-ups over NCCL span
  0.13x to 2x at 64 KB).

This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FLOOR",
    "LEVEL",
    "MAD_TO_SD",
    "MAX_WIDTH",
    "MIN_BOXES",
    "REACH",
    "UNKNOWN",
    "Fit",
    "Residual",
    "fit",
    "weighted_median",
]

LEVEL = 0.80  # central coverage the range aims at
Z = statistics.NormalDist().inv_cdf(0.5 + LEVEL / 2)  # 1.2816
MAD_TO_SD = 1.4826  # median absolute deviation -> standard deviation of a normal
FLOOR = 1.25  # narrowest factor each way: FlashInfer PR #4393 run-to-run spread, sqrt(28.9/18.7)
MIN_BOXES = 4  # fewer boxes in the pool: unknown
REACH = 2.0  # world size / message size further than this factor from the pool: unknown
MAX_WIDTH = 8.0  # a range wider than this (high / low): unknown
UNKNOWN = "unknown at this size: measure with fastverify tune"


@dataclass(frozen=True)
class Residual:
    """One published box's miss: ``log_ratio = ln(measured / point)`` at ``msg_bytes`` (bytes) on
    ``world_size`` GPUs, the point computed without that box."""

    box: str
    world_size: int
    msg_bytes: int
    log_ratio: float


@dataclass(frozen=True)
class Fit:
    """A range factor, or why there is none.

    Attributes
    ----------
    low, high : float or None
        Multiply the point (µs) by them for the range; ``low < 1 < high``. None when unknown.
    centre, scale : float or None
        ``c`` and ``s`` of the module docstring (dimensionless, ln units).
    boxes, residuals : int
        Boxes and residuals in the pool.
    reason : str or None
        Why the figure is unknown (None when known).
    """

    low: float | None
    high: float | None
    centre: float | None
    scale: float | None
    boxes: int
    residuals: int
    reason: str | None = None

    @property
    def known(self) -> bool:
        return self.reason is None

    @property
    def width(self) -> float | None:
        return None if self.low is None or self.high is None else self.high / self.low

    def text(self, what: str) -> str:
        """One evidence line: how the range was made, or why it is unknown."""
        if not self.known:
            return f"range: {UNKNOWN} ({self.reason})"
        return (f"range: {what} x/÷ its misses on {self.boxes} published boxes left out one at a time "
                f"({self.residuals} sizes): x{self.low:.2f} .. x{self.high:.2f} (median miss "
                f"{math.exp(self.centre):.2f}x, robust spread s {self.scale:.2f}, {100 * LEVEL:g} % central)")


def weighted_median(pairs: Iterable[tuple[float, float]]) -> float:
    """The lower weighted median of ``(value, weight)`` pairs (weights > 0).

    Raises
    ------
    ValueError
        No pairs.
    """
    items = sorted(pairs)
    if not items:
        raise ValueError("weighted_median of nothing")
    total = sum(w for _, w in items)
    acc = 0.0
    for v, w in items:
        acc += w
        if acc >= total / 2 - 1e-12:
            return v
    return items[-1][0]


def _reach(values: Sequence[float], x: float) -> bool:
    return min(values) / REACH <= x <= max(values) * REACH


def fit(residuals: Sequence[Residual], *, world_size: int, msg_bytes: int) -> Fit:
    """The range factor for a new box of ``world_size`` GPUs at ``msg_bytes`` bytes (module docstring).

    Returns
    -------
    Fit
        ``low`` / ``high`` to multiply the point by, or a ``reason`` it is unknown. Never raises.
    """
    boxes: dict[str, list[float]] = {}
    for r in residuals:
        boxes.setdefault(r.box, []).append(r.log_ratio)
    n, k = len(boxes), len(residuals)
    if n < MIN_BOXES:
        return Fit(None, None, None, None, n, k, f"the point's misses are known on {n} published box"
                   f"{'es' if n != 1 else ''}, fewer than {MIN_BOXES}")
    if not _reach([r.world_size for r in residuals], world_size):
        sizes = sorted({r.world_size for r in residuals})
        return Fit(None, None, None, None, n, k, f"{world_size} GPUs is more than {REACH:g}x from every published "
                   f"GPU count ({', '.join(map(str, sizes))})")
    if not _reach([r.msg_bytes for r in residuals], msg_bytes):
        return Fit(None, None, None, None, n, k, f"{msg_bytes:,} B is more than {REACH:g}x outside the published "
                   "sizes")
    pairs = [(x, 1.0 / len(v)) for v in boxes.values() for x in v]
    c = weighted_median(pairs)
    s = MAD_TO_SD * weighted_median((abs(x - c), w) for x, w in pairs)
    lo = min(c - Z * s, -math.log(FLOOR))
    hi = max(c + Z * s, math.log(FLOOR))
    if hi - lo > math.log(MAX_WIDTH):
        return Fit(None, None, c, s, n, k, f"the point's misses on {n} published boxes give a range "
                   f"{math.exp(hi - lo):.0f}x wide (more than {MAX_WIDTH:g}x)")
    return Fit(math.exp(lo), math.exp(hi), c, s, n, k)


# --- the NCCL cost model's misses on the published boxes -------------------------------------------

GEN_BY_SM_MAJOR = {7: 3, 8: 4, 9: 5, 10: 5, 12: 5}
"""PCIe generation assumed for a published box that does not state it: that of the boxes of the
same GPU generation in the data (V100 Gen3, Ada Gen4, Blackwell Gen5)."""
COST_MODEL_SIZES = (4096, 4 << 20)  # bytes: the measured sizes whose misses count (as the verify range)


def _cost_model_us(box, world_size: int, p2p: bool | None, msg_bytes: int) -> float:
    from fastverify.nccl import model as M
    from fastverify.topo import diagnose as D

    gen = box.pcie_gen or GEN_BY_SM_MAJOR.get(box.sm[0], 4)
    on_p2p = p2p is not False  # not stated: NCCL's default, P2P where the path allows it
    inputs = M.inputs_for_pcie_box(world_size, gen=gen, width=16, sm=box.sm[0] * 10 + box.sm[1], p2p=on_p2p)
    transport = M.Transport.P2P if on_p2p else M.Transport.SHM
    return D.CALIBRATION[transport].predict(msg_bytes, inputs).time_us


def cost_model_residuals(exclude_box: str | None = None, *, data=None) -> tuple[Residual, ...]:
    """``ln(measured / cost model)`` of every published NCCL measurement with default settings, at
    its measured sizes in :data:`COST_MODEL_SIZES` (bytes), with the box's GPU count, SM, PCIe
    generation (else :data:`GEN_BY_SM_MAJOR`) and P2P (not stated: P2P). The cost model is
    :data:`fastverify.topo.diagnose.CALIBRATION` on :func:`fastverify.nccl.model.inputs_for_pcie_box`,
    fitted on none of these boxes but the 8x RTX 4090 one (``chlc-8x4090``), so leaving a box out
    leaves the model unchanged. ``data``: a file read with
    :func:`fastverify.tune.backend_model.load`; default the packaged one."""
    from fastverify.registry import BackendName
    from fastverify.tune import backend_model as BM

    data = data if data is not None else BM.load()
    boxes = {b.id: b for b in data.boxes}
    out = []
    for m in data.measurements:
        if m.backend is not BackendName.nccl or m.box == exclude_box or not BM.passes(m):
            continue
        for size, t in zip(m.sizes_bytes, m.times_us or ()):
            if COST_MODEL_SIZES[0] <= size <= COST_MODEL_SIZES[1]:
                point = _cost_model_us(boxes[m.box], m.world_size, m.p2p, size)
                out.append(Residual(m.box, m.world_size, size, math.log(t / point)))
    return tuple(out)


def nccl_fit(msg_bytes: int, world_size: int, *, exclude_box: str | None = None, data=None) -> Fit:
    """The range factor of the NCCL cost model's point for a new box (:func:`fit` of
    :func:`cost_model_residuals`); the cost model covers every GPU count, so a 7-GPU box gets a
    range from the 4-, 8- and 16-GPU boxes' misses."""
    return fit(_cached_cost_residuals(exclude_box, data), world_size=world_size, msg_bytes=msg_bytes)


_CACHE: dict = {}


def _cached_cost_residuals(exclude_box, data) -> tuple[Residual, ...]:
    key = (exclude_box, id(data))
    if key not in _CACHE or _CACHE[key][0] is not data:
        _CACHE[key] = (data, cost_model_residuals(exclude_box, data=data))
    return _CACHE[key][1]
