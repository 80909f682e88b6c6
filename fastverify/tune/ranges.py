"""Ranges for predicted all-reduce times, from the point method's own residuals (always *predicted*).

A range says where a new box's measurement will land around a point, so its width must come
from how far that point method missed on boxes it did not see, not from how far the boxes'
raw times differ. A *residual* is ``ln(measured / point)`` (dimensionless) for one published
box at one message size, the point computed without that box. This module turns a pool of
residuals into a range factor, or says the evidence is too thin: then the figure is
:data:`UNKNOWN`, never a wide or zero-width range.

Rules. Why a shortest span and a share set by leave-one-box-out: the misses are skewed (a few
boxes miss by 7-13x), and a symmetric median ± 1.28 robust spreads held 85 % of left-out NCCL
points at a median width of 4.8x in ``benchmarks/bench_model.py``, whose aim is >= 80 % at <= 4x.

* **Pool**: every residual of the point method on the comparable published boxes (the caller's
  box left out in the leave-one-box-out benchmark). A box's *offset* is the median of its residuals.
* **Range**: the shortest span holding a share ``L`` of the boxes' offsets, widened each way by the
  within-box spread ``w`` = 1.4826 x the box-weighted median of ``|r - offset|`` (a median
  absolute deviation scaled to a normal's standard deviation), and never narrower than
  :data:`FLOOR` each way around the point (1.25: the run-to-run spread of the one source that
  publishes repeats, FlashInfer PR #4393, 8x L40S, 18.7 / 21.8 / 28.9 µs).
* **Share** ``L``: the smallest of :data:`LEVELS` for which the range made without each pool box
  in turn holds at least :data:`LEVEL` (80 %) of that box's residuals at verify sizes
  (:data:`CALIBRATION_BYTES`): set on the pool itself, never on the box being predicted.
* **Unknown** (:func:`fit` gives a reason): residuals from fewer than :data:`MIN_BOXES` boxes; a
  world size more than :data:`REACH` (2x) from every world size in the pool; a message size more
  than :data:`REACH` outside the pool's sizes; no share reaching 80 %; a range wider than
  :data:`MAX_WIDTH` (8x, twice the 4x aim: wider cannot order NCCL against a P2P kernel whose
  published speed-ups over NCCL span 0.13x to 2x at 64 KB).

This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CALIBRATION_BYTES",
    "FLOOR",
    "LEVEL",
    "LEVELS",
    "MAD_TO_SD",
    "MAX_WIDTH",
    "MIN_BOXES",
    "REACH",
    "GEN_BY_SM_MAJOR",
    "RESIDUAL_BYTES",
    "UNKNOWN",
    "Fit",
    "Residual",
    "assumed_pcie_gen",
    "calibrated_level",
    "fit",
    "weighted_median",
]

LEVEL = 0.80  # share of the held-out boxes' verify-size misses the range must hold (leave-one-box-out)
LEVELS = tuple(round(0.5 + 0.025 * i, 3) for i in range(20))  # box-offset shares tried: 0.500 .. 0.975
CALIBRATION_BYTES = (8 * 1024, 1 << 20)  # verify sizes: T x 14 KiB, T = 1..64, to the powers of two
MAD_TO_SD = 1.4826  # median absolute deviation -> standard deviation of a normal
FLOOR = 1.25  # narrowest factor each way: FlashInfer PR #4393 run-to-run spread, sqrt(28.9/18.7)
MIN_BOXES = 4  # fewer boxes in the pool: unknown
REACH = 2.0  # world size / message size further than this factor from the pool: unknown
MAX_WIDTH = 8.0  # a range wider than this (high / low): unknown
UNKNOWN = "unknown at this size: measure with fastverify tune"
RESIDUAL_BYTES = (4096, 4 << 20)  # bytes: the measured sizes whose misses count (the verify range, widened)
GEN_BY_SM_MAJOR = {7: 3, 8: 4, 9: 5, 10: 5, 12: 5}
"""PCIe generation assumed for a box that does not state it: that of the published boxes of the
same GPU generation (V100 Gen3, Ada Gen4, Blackwell Gen5)."""


def assumed_pcie_gen(pcie_gen: int | None, sm: tuple[int, int] | None) -> int:
    """``pcie_gen`` when known, else :data:`GEN_BY_SM_MAJOR` for ``sm`` (Gen4 when neither tells)."""
    return pcie_gen or (GEN_BY_SM_MAJOR.get(sm[0], 4) if sm is not None else 4)


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
    level : float or None
        Share of the boxes' offsets the range holds, set by leave-one-box-out (module docstring).
    within : float or None
        Within-box spread ``w`` (ln units) the offsets' interval is widened by.
    boxes, residuals : int
        Boxes and residuals in the pool.
    reason : str or None
        Why the figure is unknown (None when known).
    """

    low: float | None
    high: float | None
    level: float | None
    within: float | None
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
        return (
            f"range: {what} x/÷ its misses on {self.boxes} published boxes ({self.residuals} sizes): "
            f"x{self.low:.2f} .. x{self.high:.2f} (the shortest span of {100 * self.level:g} % of the boxes' "
            f"median misses, widened by their within-box spread {self.within:.2f}; that share holds "
            f"{100 * LEVEL:g} % of each box's verify-size misses when the box is left out)"
        )


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


def _interval(boxes: dict[str, list[Residual]], level: float) -> tuple[float, float, float]:
    """``(lo, hi, w)`` in ln units: the shortest span holding ``ceil(level x n)`` of the n boxes'
    median misses, widened by ``w`` each way (``w`` = 1.4826 x the box-weighted median distance of a
    miss from its box's median), and at least ±ln(:data:`FLOOR`) around 0 (the point)."""
    med = {b: statistics.median(r.log_ratio for r in v) for b, v in boxes.items()}
    offsets = sorted(med.values())
    k = max(1, math.ceil(level * len(offsets) - 1e-9))
    lo, hi = min(((offsets[i], offsets[i + k - 1]) for i in range(len(offsets) - k + 1)), key=lambda p: p[1] - p[0])
    w = MAD_TO_SD * weighted_median((abs(r.log_ratio - med[b]), 1.0 / len(v)) for b, v in boxes.items() for r in v)
    return min(lo - w, -math.log(FLOOR)), max(hi + w, math.log(FLOOR)), w


def calibrated_level(boxes: dict[str, list[Residual]]) -> float | None:
    """The smallest of :data:`LEVELS` whose range, made without each box in turn, holds at least
    :data:`LEVEL` of the left-out boxes' misses at :data:`CALIBRATION_BYTES`; None when none does."""
    for level in LEVELS:
        held = inside = 0
        for b, mine in boxes.items():
            lo, hi, _ = _interval({o: v for o, v in boxes.items() if o != b}, level)
            judged = [r for r in mine if CALIBRATION_BYTES[0] <= r.msg_bytes <= CALIBRATION_BYTES[1]]
            held += len(judged)
            inside += sum(lo <= r.log_ratio <= hi for r in judged)
        if held and inside >= LEVEL * held:
            return level
    return None


def fit(residuals: Sequence[Residual], *, world_size: int, msg_bytes: int) -> Fit:
    """The range factor for a new box of ``world_size`` GPUs at ``msg_bytes`` bytes (module docstring).

    Returns
    -------
    Fit
        ``low`` / ``high`` to multiply the point by, or a ``reason`` it is unknown. Never raises.
    """
    boxes = _by_box(residuals)
    n, k = len(boxes), len(residuals)
    if n < MIN_BOXES:
        return Fit(
            None,
            None,
            None,
            None,
            n,
            k,
            f"the point's misses are known on {n} published box{'es' if n != 1 else ''}, fewer than {MIN_BOXES}",
        )
    if not _reach([r.world_size for r in residuals], world_size):
        sizes = sorted({r.world_size for r in residuals})
        return Fit(
            None,
            None,
            None,
            None,
            n,
            k,
            f"{world_size} GPUs is more than {REACH:g}x from every published GPU count ({', '.join(map(str, sizes))})",
        )
    if not _reach([r.msg_bytes for r in residuals], msg_bytes):
        return Fit(None, None, None, None, n, k, f"{msg_bytes:,} B is more than {REACH:g}x outside the published sizes")
    level = _cached_level(tuple(residuals))
    if level is None:
        return Fit(
            None,
            None,
            None,
            None,
            n,
            k,
            f"no share of the {n} published boxes' misses holds {100 * LEVEL:g} % of a left-out box's",
        )
    lo, hi, w = _interval(boxes, level)
    if hi - lo > math.log(MAX_WIDTH):
        return Fit(
            None,
            None,
            level,
            w,
            n,
            k,
            f"the point's misses on {n} published boxes give a range "
            f"{math.exp(hi - lo):.0f}x wide (more than {MAX_WIDTH:g}x)",
        )
    return Fit(math.exp(lo), math.exp(hi), level, w, n, k)


def _by_box(residuals) -> dict[str, list[Residual]]:
    boxes: dict[str, list[Residual]] = {}
    for r in residuals:
        boxes.setdefault(r.box, []).append(r)
    return boxes


@functools.lru_cache(maxsize=512)
def _cached_level(residuals: tuple[Residual, ...]) -> float | None:
    return calibrated_level(_by_box(residuals))
