"""Per-backend all-reduce time models from published measurements, with their ranges (always *predicted*).

The measurements live in ``fastverify/data/published_allreduce.json``: one :class:`Box` per host
(GPU, SM, GPU count, PCIe generation, switch or root complex, NUMA layout, link) and one
:class:`Measurement` per source table (backend, world size, P2P, tool, settings, sizes in bytes,
times in µs, how the numbers were read, link). :func:`estimate` gives a P2P backend's point and
range for one message size; NCCL's default-settings rows are the misses of NCCL's cost model
(:func:`cost_model_residuals`), and :func:`comparable` gives the raw rows.
A range is the point x/÷ how far its rule missed on published boxes it did not see
(below), or "unknown at this size": NCCL on PCIe differs 5-15x between
hosts with the same GPU, so raw between-box spread is too wide to act on.

* **Comparable**: same world size; NCCL only with default settings (the user's baseline); a backend
  that needs P2P (registry ``needs_p2p``) only with P2P working, nothing when the caller says P2P is
  off; a backend with a kernel SM gate (registry ``kernel_sm_majors`` / ``kernel_sm``) nothing when
  ``sm`` fails it.
* **Interpolation**: log-log between a measurement's neighbouring sizes; up to :data:`EXTRAPOLATE`
  (2x) beyond them: the smallest size's time held below, the last slope (clamped to [0, 1]) above.
* **P2P backends** (pcie_ipc, custom_ar, ...): the P2P kernel model's point and range (below), for
  a backend with at least one published PCIe measurement (else None: no number is invented).
* **Disagreement note**: the backend's comparable values more than :data:`DISAGREE` (3x) apart, or
  published speed-ups of P2P kernels over same-box NCCL more than 3x apart: one-shot kernels collapse on
  some fabrics (sglang-V100 PR #2: 4x V100 behind a PLX switch, 120.3 µs vs NCCL 83.5 µs at 384 KB;
  FlashInfer PR #4393: root-complex PCIe) while staged ones do not (SGLang ``pcie_ipc_ar.py``).

**The P2P kernel model**: a P2P all-reduce kernel's time on PCIe from the box alone, and the ranges of its misses.

The model: ``t = latency + (n - 1) x S / B``. Every GPU takes in the other ``n - 1`` ranks' ``S``
bytes through its own x16 link of :data:`LINK_GB_S` (the one-shot pattern; a staged or
hierarchical kernel moves fewer bytes, and that difference is in its misses). The latency is the
median, over published boxes, of each P2P kernel's time at its smallest size (<= 4 KiB), where
the bytes do not count. Nothing else is fitted: how far real kernels fall from this line (link
efficiency, switch hops, kernels that collapse on some fabrics) is the range, made from the misses
on the published boxes by :func:`fit`, as for NCCL's cost model.

**NCCL's cost model**: its misses on the published boxes, and the range they give its point.

The cost model is :data:`fastverify.topo.diagnose.CALIBRATION` on
:func:`fastverify.nccl.model.inputs_for_pcie_box`, fitted on none of the published boxes but the
8x RTX 4090 one (``chlc-8x4090``), so leaving a box out leaves the model unchanged; only the pool
of misses changes.

This module imports neither torch nor any GPU library.

Ranges for predicted all-reduce times, from the point method's own residuals (always *predicted*).

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
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from fastverify.errors import UserError
from fastverify.inputs import decode_json
from fastverify.nccl.model import Transport, inputs_for_pcie_box
from fastverify.registry import BackendInfo, BackendName, backend_info
from fastverify.topo.diagnose import CALIBRATION

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
    "DATA_FILE",
    "DISAGREE",
    "EXTRAPOLATE",
    "LINK_GB_S",
    "SMALL_BYTES",
    "Box",
    "Estimate",
    "Measurement",
    "PublishedData",
    "comparable",
    "cost_model_residuals",
    "cost_model_us",
    "estimate",
    "interpolate",
    "kernel_fit",
    "kernel_residuals",
    "latency_us",
    "load",
    "measurements",
    "nccl_fit",
    "p2p_kernel",
    "point_us",
    "published_boxes",
    "passes",
]

DATA_FILE = "published_allreduce.json"
EXTRAPOLATE = 2.0  # one power-of-two step beyond a table's sizes, no further
DISAGREE = 3.0  # comparable sources further apart than this get the note

ReadFrom = Literal["table", "text", "docstring table", "derived from busBw", "plot"]

# What measured a table, where a ``tool`` names one of these it starts with the label. Only an
# nccl-tests all_reduce_perf run may be labelled ``nccl-tests``: the NCCL column of another
# benchmark (SGLang's PCIe oneshot crossover table, p2pmark's custom-vs-NCCL table) is labelled by
# that benchmark, since its timing loop is not all_reduce_perf's.
TOOL_LABELS = ("nccl-tests all_reduce_perf", "SGLang PCIe oneshot auto-crossover benchmark", "p2pmark")
Fabric = Literal["switch", "root_complex", "mixed", "unknown"]


class Box(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One published host. ``sm`` is (major, minor); ``pcie_gen`` None where the source does not say."""

    id: str
    gpu: str
    sm: tuple[int, int]
    gpu_count: int
    pcie_gen: int | None
    fabric: Fabric
    numa: str
    link: str
    note: str = ""


class Measurement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One published table of all-reduce times (µs) or speed-ups over NCCL, per message size (bytes).

    ``backend`` is a registry name, or None for a kernel fastverify does not deploy (kept as
    evidence). ``p2p``: CUDA P2P working in that run (None: not stated). ``settings`` is
    ``"default"`` or what was changed. ``run_range_us[i]`` is the source's own [low, high] over
    repeats at ``sizes_bytes[i]``. ``read_from`` says how the numbers were taken from the source.
    """

    id: str
    box: str
    backend: BackendName | None
    kernel: str
    world_size: int
    p2p: bool | None
    tool: str
    settings: str
    tuned: bool
    dtype: str | None
    sizes_bytes: tuple[int, ...]
    times_us: tuple[float, ...] | None
    speedup_vs_nccl: tuple[float, ...] | None
    run_range_us: tuple[tuple[float, float], ...] | None
    read_from: ReadFrom
    cuda_graph: bool | None
    table_file: str | None
    link: str
    note: str = ""

    def time_at(self, msg_bytes: int) -> float | None:
        """Time in µs at ``msg_bytes`` under the module's interpolation rule; None outside it."""
        return interpolate(self.sizes_bytes, self.times_us, msg_bytes) if self.times_us else None


class PublishedData(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    description: str
    boxes: tuple[Box, ...]
    measurements: tuple[Measurement, ...]


def _check(data: PublishedData, name: str) -> PublishedData:
    boxes = {b.id for b in data.boxes}
    if len(boxes) != len(data.boxes):
        raise UserError(f"{name}: duplicate box id")
    if len({m.id for m in data.measurements}) != len(data.measurements):
        raise UserError(f"{name}: duplicate measurement id")
    for r in (*data.boxes, *data.measurements):
        if not r.link.startswith("https://"):
            raise UserError(f"{name}: record {r.id!r} has no https link ({r.link!r})")
    for m in data.measurements:
        where = f"{name}: measurement {m.id!r}"
        if m.tool.startswith("nccl-tests") and (
            other := next((t for t in TOOL_LABELS[1:] if t.lower() in f"{m.kernel} {m.note}".lower()), None)
        ):
            raise UserError(f"{where}: labelled {m.tool!r} but its note names {other!r}: label it {other!r}")
        if m.box not in boxes:
            raise UserError(f"{where} names unknown box {m.box!r}")
        values = m.times_us if m.times_us is not None else m.speedup_vs_nccl
        if values is None or (m.times_us is not None and m.speedup_vs_nccl is not None):
            raise UserError(f"{where}: exactly one of times_us / speedup_vs_nccl must be given")
        if len(values) != len(m.sizes_bytes) or not m.sizes_bytes:
            raise UserError(f"{where}: {len(m.sizes_bytes)} sizes but {len(values)} values")
        if any(b <= a for a, b in zip(m.sizes_bytes, m.sizes_bytes[1:])) or m.sizes_bytes[0] <= 0:
            raise UserError(f"{where}: sizes must be positive and ascending")
        if not all(v > 0 and math.isfinite(v) for v in values):
            raise UserError(f"{where}: values must be positive")
        if m.run_range_us is not None and (
            len(m.run_range_us) != len(m.sizes_bytes)
            or m.times_us is None
            or any(not lo <= t <= hi for (lo, hi), t in zip(m.run_range_us, m.times_us))
        ):
            raise UserError(f"{where}: run_range_us must bracket times_us, one pair per size")
    return data


def load(path: str | Path | None = None) -> PublishedData:
    """Decode and check a published-measurement file (default: the packaged one, cached).

    Raises
    ------
    UserError
        One line naming the file: bad JSON, a field of the wrong type or unknown, a record without
        an https link, a measurement naming an unknown box, sizes/values that do not line up.
    """
    if path is None:
        return _packaged()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e})") from None
    return _decode(raw, str(p))


def _decode(raw: bytes, name: str) -> PublishedData:
    try:
        data = decode_json(raw, name, PublishedData)
    except msgspec.ValidationError as e:
        raise UserError(f"{name}: {e}") from None
    return _check(data, name)


@functools.cache
def _packaged() -> PublishedData:
    ref = resources.files("fastverify.data").joinpath(DATA_FILE)
    return _decode(ref.read_bytes(), f"fastverify/data/{DATA_FILE}")


def published_boxes() -> list[str]:
    """Box ids in the packaged data file, in file order."""
    return [b.id for b in _packaged().boxes]


def measurements(box: str | None = None) -> list[Measurement]:
    """The packaged file's measurements, all or those of one box (``KeyError`` for an unknown box)."""
    data = _packaged()
    if box is not None and box not in {b.id for b in data.boxes}:
        raise KeyError(f"no box {box!r} in {DATA_FILE}; boxes: {published_boxes()}")
    return [m for m in data.measurements if box is None or m.box == box]


def interpolate(sizes: tuple[int, ...], values: tuple[float, ...], msg_bytes: int) -> float | None:
    """``values`` at ``msg_bytes``: log-log between neighbours; beyond the ends by <= EXTRAPOLATE
    (held flat below, last slope clamped to [0, 1] above, flat for one point); else None."""
    if msg_bytes <= 0 or not sizes:
        return None
    x = math.log(msg_bytes)
    lx = [math.log(s) for s in sizes]
    ly = [math.log(v) for v in values]
    if msg_bytes < sizes[0]:
        return values[0] if msg_bytes * EXTRAPOLATE >= sizes[0] else None
    if msg_bytes > sizes[-1]:
        if msg_bytes > sizes[-1] * EXTRAPOLATE:
            return None
        if len(sizes) == 1:
            return values[-1]
        slope = min(1.0, max(0.0, (ly[-1] - ly[-2]) / (lx[-1] - lx[-2])))
        return math.exp(ly[-1] + slope * (x - lx[-1]))
    for i in range(len(sizes) - 1):
        if sizes[i] <= msg_bytes <= sizes[i + 1]:
            f = (x - lx[i]) / (lx[i + 1] - lx[i])
            return math.exp(ly[i] + f * (ly[i + 1] - ly[i]))
    return values[-1]  # msg_bytes == sizes[-1] with one point


@dataclass(frozen=True)
class Estimate:
    """Predicted all-reduce time of ONE message size on one backend. Always predicted.

    Attributes
    ----------
    backend : BackendName
    msg_bytes : int
        Message size in bytes (the whole buffer each rank reduces).
    point_us : float
        Point estimate in µs.
    low_us, high_us : float or None
        The range in µs, ``low_us < point_us < high_us``; None when the evidence cannot give one
        (``unknown`` says why).
    sources : tuple[str, ...]
        Measurement ids used (each names box, GPU, P2P, tool and link in the data file).
    evidence : str
        One line naming what the figure comes from.
    notes : tuple[str, ...]
        The disagreement note (see the module docstring), if any.
    unknown : str or None
        Why there is no range (:data:`UNKNOWN` and the reason).
    label : str
        Always ``"predicted"``.
    """

    backend: BackendName
    msg_bytes: int
    point_us: float
    low_us: float | None
    high_us: float | None
    sources: tuple[str, ...]
    evidence: str
    notes: tuple[str, ...] = ()
    unknown: str | None = None
    label: str = "predicted"


def _gate_ok(backend: BackendName, sm: tuple[int, int] | None, p2p: bool | None) -> bool:
    info = backend_info(backend)
    if info.needs_p2p and p2p is False:
        return False
    if sm is not None:
        if info.kernel_sm is not None and tuple(sm) not in info.kernel_sm:
            return False
        if info.kernel_sm_majors is not None and sm[0] not in info.kernel_sm_majors:
            return False
    return True


def passes(m: Measurement) -> bool:
    """The comparable rule of ``m``'s own backend, world size and size aside (module docstring):
    times given; NCCL: default settings; a backend that needs P2P, or a kernel with no registry
    backend: P2P working."""
    if m.times_us is None:
        return False
    if m.backend is BackendName.nccl:
        return m.settings == "default"
    if m.backend is None or backend_info(m.backend).needs_p2p:
        return m.p2p is True
    return True


def _comparable(
    backend: BackendName, world_size: int, exclude_box: str | None, data: PublishedData
) -> Iterable[Measurement]:
    for m in data.measurements:
        if m.backend is backend and m.world_size == world_size and m.box != exclude_box and passes(m):
            yield m


def comparable(
    backend: BackendName, world_size: int, exclude_box: str | None = None, *, data: PublishedData | None = None
) -> list[Measurement]:
    """The measurements :func:`estimate` draws on for ``backend`` at ``world_size`` (before the size test).

    ``data``: a file read with :func:`load` instead of the packaged one."""
    return list(_comparable(backend, world_size, exclude_box, data if data is not None else _packaged()))


def _speedups(msg_bytes: int, exclude_box: str | None, data: PublishedData) -> dict[str, float]:
    """Published speed-up over same-box NCCL of every peer-write kernel at ``msg_bytes`` (any world size)."""
    out: dict[str, float] = {}
    for m in data.measurements:
        if m.box == exclude_box or (m.backend is BackendName.nccl) or m.p2p is not True:
            continue
        if m.speedup_vs_nccl is not None:
            s = interpolate(m.sizes_bytes, m.speedup_vs_nccl, msg_bytes)
        else:
            t = m.time_at(msg_bytes)
            ref = [
                n.time_at(msg_bytes)
                for n in data.measurements
                if n.box == m.box
                and n.backend is BackendName.nccl
                and n.world_size == m.world_size
                and n.settings == "default"
            ]
            ref = [r for r in ref if r is not None]
            s = statistics.median(ref) / t if ref and t else None
        if s is not None:
            out[m.id] = s
    return out


def _collapse_note(lo: float, hi: float) -> str:
    return (
        f"published measurements disagree: peer-write all-reduce kernels measured {lo:.2g}x to {hi:.2g}x "
        "NCCL's speed at this size; one-shot all-to-all kernels collapse on some PCIe fabrics (4x V100 behind "
        "a PLX switch, sglang-V100 PR #2; root-complex PCIe, FlashInfer PR #4393) while staged-ring ones do "
        "not; measure with `fastverify tune`"
    )


def estimate(
    backend: BackendName,
    msg_bytes: int,
    *,
    world_size: int,
    sm: tuple[int, int] | None,
    pcie_gen: int | None = None,
    p2p: bool | None = None,
    exclude_box: str | None = None,
    data: PublishedData | None = None,
    elem_bytes: int = 2,
) -> Estimate | None:
    """Predicted time of one all-reduce of ``msg_bytes`` bytes on a P2P ``backend`` (pcie_ipc,
    custom_ar, b12x, fused): the P2P kernel model's point and range (module docstring).

    Parameters
    ----------
    msg_bytes : int
        Bytes per rank (e.g. 4 tokens x 7168 x 2 B bf16 = 57,344).
    world_size : int
        Tensor-parallel ranks; the published measurements named as evidence are those at this size.
    sm : (major, minor) or None
        The box's GPU: its PCIe generation when ``pcie_gen`` is not given, and the backend's kernel
        SM gate (registry).
    p2p : bool or None
        False: None (the backend needs P2P).
    exclude_box : str or None
        Leave that box out of everything (leave-one-box-out benchmark).
    data : PublishedData or None
        Measurements read with :func:`load` from another file; default the packaged one.
    elem_bytes : int
        Bytes per element of the tensor (2: bf16/fp16); with the registry's ``wire_bytes`` (a
        quantized backend) it turns ``msg_bytes`` into the bytes the model moves (:func:`wire_size`).

    Returns
    -------
    Estimate or None
        None when the gate fails or the backend has no published PCIe measurement at all (``b12x``:
        b12x PR #139's 16-GPU kernels are other kernels); otherwise ``low_us .. high_us`` in µs, or
        None with ``unknown`` set.

    Raises
    ------
    ValueError
        ``backend`` needs no P2P (NCCL's figure is its cost model's, :func:`nccl_fit`).
    """
    info = backend_info(backend)
    if not info.needs_p2p:
        raise ValueError(f"{backend.value}: no published-measurement model; NCCL's figure is the cost model's")
    if msg_bytes <= 0 or not _gate_ok(backend, sm, p2p):
        return None
    if data is None:
        data = _packaged()
    vals = [(m, t) for m in _comparable(backend, world_size, exclude_box, data) if (t := m.time_at(msg_bytes))]
    wire = wire_size(info, msg_bytes, elem_bytes)
    return _kernel_estimate(backend, msg_bytes, wire, world_size, sm, pcie_gen, vals, exclude_box, data)


def wire_size(info: BackendInfo, msg_bytes: int, elem_bytes: int) -> int:
    """Bytes each rank puts on the wire for a message of ``msg_bytes`` bytes of ``elem_bytes``-byte
    elements: ``msg_bytes`` itself, or scaled by the registry's ``wire_bytes`` per element (a
    quantized backend, scales included)."""
    if info.wire_bytes is None:
        return msg_bytes
    return math.ceil(msg_bytes / elem_bytes * info.wire_bytes)


def _kernel_estimate(
    backend: BackendName,
    msg_bytes: int,
    wire_bytes: int,
    world_size: int,
    sm: tuple[int, int] | None,
    pcie_gen: int | None,
    vals: list[tuple[Measurement, float]],
    exclude_box: str | None,
    data: PublishedData,
) -> Estimate | None:
    """A P2P backend's figure: the P2P kernel model's point (of ``wire_bytes`` on the wire) and
    range; None when the backend has no published PCIe measurement at all (no number is invented
    for it)."""
    if not any(m.backend is backend and m.box != exclude_box and passes(m) for m in data.measurements):
        return None
    latency = latency_us(data, exclude_box)
    if latency is None:
        return None
    point = point_us(world_size, wire_bytes, pcie_gen=pcie_gen, sm=sm, latency=latency)
    rf = kernel_fit(data, msg_bytes, world_size, exclude_box)
    low, high = (point * rf.low, point * rf.high) if rf.known else (None, None)
    notes: list[str] = []
    su = _speedups(msg_bytes, exclude_box, data)
    ratio = max(t for _, t in vals) / min(t for _, t in vals) if vals else 1.0
    if ratio > DISAGREE or (len(su) >= 2 and max(su.values()) / min(su.values()) > DISAGREE):
        notes.append(_collapse_note(min(su.values(), default=float("nan")), max(su.values(), default=float("nan"))))
    seen = "; ".join(f"{m.id} {t:.3g} µs" for m, t in vals) or f"none at TP{world_size} and this size"
    evidence = (
        f"P2P kernel model: {latency:.3g} µs latency (published P2P kernels' smallest sizes) + "
        f"{world_size - 1} x {wire_bytes:,} B over one PCIe x16 link; published {backend.value}: {seen}; "
        f"{rf.text('the point')}"
    )
    return Estimate(
        backend=backend,
        msg_bytes=msg_bytes,
        point_us=point,
        low_us=low,
        high_us=high,
        sources=tuple(m.id for m, _ in vals),
        evidence=evidence,
        notes=tuple(notes),
        unknown=None if rf.known else f"{UNKNOWN} ({rf.reason})",
    )


# --- the P2P kernel model -------------------------------------------------------------------------------

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
def _kernel_latency(data, exclude_box: str | None) -> float | None:
    per_box: dict[str, list[float]] = {}
    for m in data.measurements:
        if m.box != exclude_box and p2p_kernel(m) and m.sizes_bytes[0] <= SMALL_BYTES:
            per_box.setdefault(m.box, []).append(m.times_us[0])
    return statistics.median(statistics.median(v) for v in per_box.values()) if per_box else None


def latency_us(data, exclude_box: str | None = None) -> float | None:
    """The P2P kernel model's latency in µs (module docstring) over ``data`` (a
    :class:`PublishedData`); None when no published kernel has a size
    <= :data:`SMALL_BYTES`."""
    return _kernel_latency(data, exclude_box)


def point_us(
    world_size: int, msg_bytes: int, *, pcie_gen: int | None, sm: tuple[int, int] | None, latency: float
) -> float:
    """The model's time in µs of one all-reduce of ``msg_bytes`` bytes on ``world_size`` GPUs; the PCIe
    generation when not given is that of the published boxes of the same GPU generation."""
    return latency + (world_size - 1) * msg_bytes / (LINK_GB_S[assumed_pcie_gen(pcie_gen, sm)] * 1e3)


@functools.lru_cache(maxsize=64)
def _kernel_residuals(data, exclude_box: str | None) -> tuple[Residual, ...]:
    latency = _kernel_latency(data, exclude_box)
    if latency is None:
        return ()
    boxes = {b.id: b for b in data.boxes}
    out = []
    for m in data.measurements:
        if m.box == exclude_box or not p2p_kernel(m):
            continue
        bx = boxes[m.box]
        for size, t in zip(m.sizes_bytes, m.times_us):
            if RESIDUAL_BYTES[0] <= size <= RESIDUAL_BYTES[1]:
                p = point_us(m.world_size, size, pcie_gen=bx.pcie_gen, sm=bx.sm, latency=latency)
                out.append(Residual(m.box, m.world_size, size, math.log(t / p)))
    return tuple(out)


def kernel_residuals(data, exclude_box: str | None = None) -> tuple[Residual, ...]:
    """``ln(measured / model)`` of every published P2P-kernel time in ``data`` at 4 KiB .. 4 MiB, the
    model's latency taken without ``exclude_box`` too (no leakage)."""
    return _kernel_residuals(data, exclude_box)


def kernel_fit(data, msg_bytes: int, world_size: int, exclude_box: str | None = None) -> Fit:
    """The range factor of the model's point for a new box (:func:`fit`)."""
    return fit(_kernel_residuals(data, exclude_box), world_size=world_size, msg_bytes=msg_bytes)


# --- NCCL's cost model on the published boxes -------------------------------------------------------


def cost_model_us(box: Box, world_size: int, p2p: bool | None, msg_bytes: int) -> float:
    """The cost model's time in µs of one all-reduce of ``msg_bytes`` bytes on ``world_size`` GPUs of
    published ``box`` (its SM, its PCIe generation else :func:`assumed_pcie_gen`,
    x16), on P2P unless ``p2p`` is False (not stated: NCCL's default, P2P where the path allows it)."""
    on_p2p = p2p is not False
    inputs = inputs_for_pcie_box(
        world_size,
        gen=assumed_pcie_gen(box.pcie_gen, box.sm),
        width=16,
        sm=box.sm[0] * 10 + box.sm[1],
        p2p=on_p2p,
    )
    return CALIBRATION[Transport.P2P if on_p2p else Transport.SHM].predict(msg_bytes, inputs).time_us


@functools.lru_cache(maxsize=64)
def _cost_model_residuals(data: PublishedData, exclude_box: str | None) -> tuple[Residual, ...]:
    boxes = {b.id: b for b in data.boxes}
    out = []
    for m in data.measurements:
        if m.backend is not BackendName.nccl or m.box == exclude_box or not passes(m):
            continue
        for size, t in zip(m.sizes_bytes, m.times_us or ()):
            if RESIDUAL_BYTES[0] <= size <= RESIDUAL_BYTES[1]:
                out.append(
                    Residual(
                        m.box, m.world_size, size, math.log(t / cost_model_us(boxes[m.box], m.world_size, m.p2p, size))
                    )
                )
    return tuple(out)


def cost_model_residuals(
    exclude_box: str | None = None,
    *,
    data: PublishedData | None = None,
) -> tuple[Residual, ...]:
    """``ln(measured / cost model)`` of every published NCCL measurement with default settings, at
    its measured sizes in :data:`RESIDUAL_BYTES`, with the box's GPU count,
    SM, PCIe generation and P2P (:func:`cost_model_us`). ``data``: a file read with
    :func:`load`; default the packaged one."""
    return _cost_model_residuals(data if data is not None else load(), exclude_box)


def nccl_fit(
    msg_bytes: int, world_size: int, *, exclude_box: str | None = None, data: PublishedData | None = None
) -> Fit:
    """The range factor of the NCCL cost model's point for a new box (:func:`fit`
    of :func:`cost_model_residuals`); the cost model covers every GPU count, so a 7-GPU box gets a
    range from the 4-, 8- and 16-GPU boxes' misses."""
    return fit(cost_model_residuals(exclude_box, data=data), world_size=world_size, msg_bytes=msg_bytes)
