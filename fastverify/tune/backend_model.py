"""Per-backend all-reduce time models fitted to published measurements (always *predicted*).

The measurements live in ``fastverify/data/published_allreduce.json``: one :class:`Box` per host
(GPU, SM, GPU count, PCIe generation, switch or root complex, NUMA layout, link) and one
:class:`Measurement` per source table (backend, world size, P2P, tool, settings, sizes in bytes,
times in µs, how the numbers were read, link). :func:`estimate` turns them into a range and a point
for one backend and one message size.

Why a range over boxes and not a fitted curve: NCCL time on PCIe differs 5-15x between hosts
with the same GPU (at 12-96 KiB the SGLang ``pcie_ipc_ar.py`` 8x SM120 host measured 205-585 µs,
the rtx6kpro 8x RTX PRO 6000 Turin host 48-49 µs). Switches, NUMA and P2P decide it and the
topology alone does not tell them, so the honest answer is a wide range ("a new box like the
published ones lands here"); the user's own measurement (``fastverify tune``, ``--perf-table``)
replaces it.

Rules. All but the range rule were fixed before the leave-one-box-out benchmark
``benchmarks/bench_model.py`` first ran and were not adjusted to its result. The range rule was
revised on 2026-12-01 after that first run (1/6 NCCL boxes, 0/2 PCIe IPC boxes inside the range;
3/9 and 0/2 once the data file grew to 14 boxes): the old range, the min..max envelope of the
comparable boxes, cannot reach the 80 % aim by construction (a new box falls inside the envelope
of n others with probability at most (n-1)/(n+1) at one size, and must be inside at every size).
The 90 % level, the size grid and the fallback threshold below were chosen before the second run
and were not tuned to it.

* **Comparable**: same world size; for NCCL only measurements taken with default settings (the
  baseline a user has before tuning); for a backend that needs P2P (registry ``needs_p2p``) only
  measurements with P2P working, and nothing at all when the caller says P2P is off; a backend
  with a kernel SM gate (registry ``kernel_sm_majors`` / ``kernel_sm``) nothing when ``sm`` fails it.
* **Interpolation**: log-log linear between a measurement's neighbouring sizes. Beyond its sizes by
  at most :data:`EXTRAPOLATE` (2x, one power-of-two step): below the smallest size the smallest
  size's time is held (small all-reduces are latency-bound); above the largest the last segment's
  log-log slope is continued, clamped to [0, 1] (time cannot grow faster than the bytes), flat
  when the table has one size. Further away the measurement does not count.
* **Box value**: a box with several comparable measurements at a size counts once, as their median.
* **Range** (revised 2026-12-01, see above): the union of two intervals, and always
  ``low <= point <= high``:

  - a :data:`PREDICTION_LEVEL` (90 %, two-sided) prediction interval for a *new* box in log space:
    ``exp(mean ± q·s·sqrt(1 + 1/n))``, the mean of ln(box value) over the n comparable boxes at the
    size (n = 1 included), ``s`` the pooled between-box standard deviation of ln(time)
    (:func:`spread`), ``q`` the 0.95 quantile of Student's t with the pool's degrees of freedom
    (:func:`t_quantile`; the normal quantile 1.645 from 30 degrees of freedom on);
  - the old envelope: min .. max over the comparable measurements (a source's own run-to-run
    spread included where it gives one), widened by :data:`RANGE_WIDEN` each way. 1.25 is the
    run-to-run spread of the one source that publishes repeats: FlashInfer PR #4393, 8x L40S TP8
    batch 1, three runs 18.7 / 21.8 / 28.9 µs, sqrt(28.9 / 18.7) = 1.24. So the range is never
    narrower than before the revision.
* **Pooled spread** ``s`` (:func:`spread`): a *cell* is (backend, or for a measurement with no
  registry backend its ``kernel`` string; world size; message size on :data:`SPREAD_GRID`, the
  powers of two 4 KiB .. 4 MiB). Every measurement with times that passes the comparable rule of
  its backend (NCCL: default settings; a P2P backend, or a kernel with no registry backend: P2P
  working) is interpolated at the grid sizes; each box gives one value per cell (median); cells
  with at least 2 boxes count: ``s² = Σ_cells Σ_boxes (ln v - cell mean)² / Σ_cells (n_cell - 1)``.
  NCCL cells and P2P-kernel cells are pooled apart (``s`` of NCCL for ``nccl``, of the kernels for
  every other backend); a group with fewer than :data:`MIN_GROUP_DF` (10) degrees of freedom uses
  the pool of all cells instead. With ``exclude_box`` the box is left out of ``s`` too (no leakage
  in the leave-one-box-out benchmark). With no degrees of freedom at all only the envelope is left.
* **Point**: the median over boxes (a box with several measurements counts once, as their
  median) of the boxes closest to the caller's: same SM major when any comparable box has it
  (same GPU generation: same PCIe generation and host platforms in the data), then same PCIe
  generation when given and known; otherwise the median of every comparable box. A median
  because one outlying host (the 205 µs SM120 box) must not drag the point alone.
* **Disagreement note**: added when the comparable values at the size differ by more than
  :data:`DISAGREE` (3x), or, for a P2P kernel, when published speed-ups over NCCL of peer-write
  kernels at that size (any world size, same-box NCCL) differ by more than 3x: one-shot kernels
  collapse on some fabrics (SGLang-V100 PR #2: 4x V100 behind a PLX switch, one-shot push 120.3 µs
  vs NCCL 83.5 µs at 384 KB; FlashInfer PR #4393: all-to-all peer writes collapse on root-complex
  PCIe) while staged-ring ones do not (SGLang ``pcie_ipc_ar.py``: 34x faster than NCCL at 384 KiB).

This module imports neither torch nor any GPU library.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from fastverify.errors import UserError
from fastverify.registry import BackendName, backend_info

__all__ = [
    "DATA_FILE",
    "DISAGREE",
    "EXTRAPOLATE",
    "MIN_GROUP_DF",
    "NORMAL_DF",
    "PREDICTION_LEVEL",
    "RANGE_WIDEN",
    "SPREAD_GRID",
    "Box",
    "Estimate",
    "Measurement",
    "PublishedData",
    "Spread",
    "comparable",
    "estimate",
    "interpolate",
    "load",
    "measurements",
    "published_boxes",
    "spread",
    "t_quantile",
]

DATA_FILE = "published_allreduce.json"
RANGE_WIDEN = 1.25  # see the module docstring: FlashInfer PR #4393 run-to-run spread, sqrt(28.9/18.7)
EXTRAPOLATE = 2.0  # one power-of-two step beyond a table's sizes, no further
DISAGREE = 3.0  # comparable sources further apart than this get the note
PREDICTION_LEVEL = 0.90  # two-sided level of the prediction interval; chosen before the second LOBO run
SPREAD_GRID = tuple(4096 << k for k in range(11))  # 4 KiB .. 4 MiB, the sizes s is pooled over
MIN_GROUP_DF = 10  # a group (NCCL / P2P kernels) with fewer degrees of freedom uses the pool of all cells
NORMAL_DF = 30  # from this many degrees of freedom on, t_quantile returns the normal quantile

ReadFrom = Literal["table", "text", "docstring table", "derived from busBw", "plot"]
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

    def range_at(self, msg_bytes: int) -> tuple[float, float] | None:
        """The source's own [low, high] in µs at ``msg_bytes`` (its repeats), else (time, time)."""
        t = self.time_at(msg_bytes)
        if t is None:
            return None
        if not self.run_range_us or not self.times_us:
            return t, t
        lo = interpolate(self.sizes_bytes, tuple(r[0] / v for r, v in zip(self.run_range_us, self.times_us)), msg_bytes)
        hi = interpolate(self.sizes_bytes, tuple(r[1] / v for r, v in zip(self.run_range_us, self.times_us)), msg_bytes)
        return t * (lo or 1.0), t * (hi or 1.0)


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
        if m.run_range_us is not None and (len(m.run_range_us) != len(m.sizes_bytes) or m.times_us is None or any(
                not lo <= t <= hi for (lo, hi), t in zip(m.run_range_us, m.times_us))):
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
        data = msgspec.json.decode(raw, type=PublishedData)
    except msgspec.DecodeError as e:
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


def _box(box_id: str, data: PublishedData) -> Box:
    return next(b for b in data.boxes if b.id == box_id)


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
    point_us, low_us, high_us : float
        Point estimate and range in µs; ``low_us <= point_us <= high_us``.
    sources : tuple[str, ...]
        Measurement ids used (each names box, GPU, P2P, tool and link in the data file).
    evidence : str
        One line naming what the figure comes from.
    notes : tuple[str, ...]
        The disagreement note (see the module docstring), if any.
    label : str
        Always ``"predicted"``.
    """

    backend: BackendName
    msg_bytes: int
    point_us: float
    low_us: float
    high_us: float
    sources: tuple[str, ...]
    evidence: str
    notes: tuple[str, ...] = ()
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


def _passes(m: Measurement) -> bool:
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


def _comparable(backend: BackendName, world_size: int, exclude_box: str | None,
                data: PublishedData) -> Iterable[Measurement]:
    for m in data.measurements:
        if m.backend is backend and m.world_size == world_size and m.box != exclude_box and _passes(m):
            yield m


def comparable(backend: BackendName, world_size: int, exclude_box: str | None = None, *,
               data: PublishedData | None = None) -> list[Measurement]:
    """The measurements :func:`estimate` draws on for ``backend`` at ``world_size`` (before the size test).

    ``data``: a file read with :func:`load` instead of the packaged one."""
    return list(_comparable(backend, world_size, exclude_box, data if data is not None else _packaged()))


def t_quantile(df: int, p: float = 0.95) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (no scipy).

    df 1 and 2: the closed forms (df 1: tan(pi (p - 1/2)); df 2: (2p - 1) / sqrt(2 p (1 - p)));
    3 <= df < :data:`NORMAL_DF` (30): the Cornish-Fisher expansion of t in powers of 1/df to the
    fourth term (Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.5), within 0.001 of
    the tables from df 3 on (df 5: 2.015, df 10: 1.812, df 20: 1.725 at p = 0.95); df >= 30: the
    normal quantile ``statistics.NormalDist().inv_cdf(p)`` (1.645 at p = 0.95, where t is 1.697 at
    df 30 and 1.671 at df 60: the interval is up to 3 % narrower in log space than t's).

    Raises
    ------
    ValueError
        ``df < 1`` or ``p`` outside (0, 1).
    """
    if df < 1 or not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs df >= 1 and 0 < p < 1 (got df {df}, p {p})")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    if df >= NORMAL_DF:
        return z
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


SpreadGroup = Literal["nccl", "kernel"]


@dataclass(frozen=True)
class Spread:
    """The pooled between-box spread of ln(time) that sets the prediction interval's width.

    Attributes
    ----------
    group : "nccl", "kernel" or "all"
        The pool used: the one asked for, or ``"all"`` when it had fewer than :data:`MIN_GROUP_DF`
        degrees of freedom.
    s : float or None
        Pooled standard deviation of ln(time in µs) between boxes in one cell (dimensionless;
        e^s is a factor); None when no cell has two boxes.
    df : int
        Degrees of freedom, Σ_cells (n_cell - 1).
    cells : int
        Cells with at least two boxes in the pool.
    q : float or None
        ``t_quantile(df, (1 + PREDICTION_LEVEL) / 2)``; None with ``s``.
    """

    group: Literal["nccl", "kernel", "all"]
    s: float | None
    df: int
    cells: int
    q: float | None


def _group_of(m: Measurement) -> SpreadGroup:
    return "nccl" if m.backend is BackendName.nccl else "kernel"


@functools.lru_cache(maxsize=256)
def _cell_logs(data: PublishedData, exclude_box: str | None) -> dict[SpreadGroup, tuple[tuple[float, ...], ...]]:
    """Per group, the ln(box value) of every cell with >= 2 boxes (module docstring, Pooled spread)."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for m in data.measurements:
        if m.box == exclude_box or not _passes(m):
            continue
        key = ("backend", m.backend.value) if m.backend is not None else ("kernel", m.kernel)
        for size in SPREAD_GRID:
            t = m.time_at(size)
            if t is not None:
                cells.setdefault((_group_of(m), key, m.world_size, size), {}).setdefault(m.box, []).append(t)
    out: dict[SpreadGroup, list[tuple[float, ...]]] = {"nccl": [], "kernel": []}
    for (group, *_), boxes in cells.items():
        if len(boxes) >= 2:
            out[group].append(tuple(math.log(statistics.median(ts)) for ts in boxes.values()))
    return {g: tuple(v) for g, v in out.items()}


def _pool(cells: Iterable[tuple[float, ...]]) -> tuple[float | None, int, int]:
    ss, df, n = 0.0, 0, 0
    for logs in cells:
        mean = statistics.fmean(logs)
        ss += sum((x - mean) ** 2 for x in logs)
        df += len(logs) - 1
        n += 1
    return (math.sqrt(ss / df) if df else None), df, n


def spread(group: SpreadGroup, *, exclude_box: str | None = None, data: PublishedData | None = None) -> Spread:
    """Pooled between-box spread of ln(time) for ``"nccl"`` or ``"kernel"`` (every other backend).

    Parameters
    ----------
    group : "nccl" or "kernel"
    exclude_box : str or None
        Leave that box out of every cell (leave-one-box-out: the held-out box must not widen or
        narrow its own interval).
    data : PublishedData or None
        A file read with :func:`load`; default the packaged one.

    Returns
    -------
    Spread
        The rule is the module docstring's "Pooled spread". ``group`` falls back to ``"all"``
        when the asked group has fewer than :data:`MIN_GROUP_DF` degrees of freedom.
    """
    logs = _cell_logs(data if data is not None else _packaged(), exclude_box)
    s, df, n = _pool(logs[group])
    used: Literal["nccl", "kernel", "all"] = group
    if df < MIN_GROUP_DF:
        s, df, n = _pool(logs["nccl"] + logs["kernel"])
        used = "all"
    q = t_quantile(df, (1 + PREDICTION_LEVEL) / 2) if s is not None else None
    return Spread(group=used, s=s, df=df, cells=n, q=q)


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
            ref = [n.time_at(msg_bytes) for n in data.measurements if n.box == m.box and n.backend is BackendName.nccl
                   and n.world_size == m.world_size and n.settings == "default"]
            ref = [r for r in ref if r is not None]
            s = statistics.median(ref) / t if ref and t else None
        if s is not None:
            out[m.id] = s
    return out


def _collapse_note(lo: float, hi: float) -> str:
    return (f"published measurements disagree: peer-write all-reduce kernels measured {lo:.2g}x to {hi:.2g}x "
            "NCCL's speed at this size; one-shot all-to-all kernels collapse on some PCIe fabrics (4x V100 behind "
            "a PLX switch, sglang-V100 PR #2; root-complex PCIe, FlashInfer PR #4393) while staged-ring ones do "
            "not; measure with `fastverify tune`")


def estimate(backend: BackendName, msg_bytes: int, *, world_size: int, sm: tuple[int, int] | None,
             pcie_gen: int | None = None, p2p: bool | None = None,
             exclude_box: str | None = None, data: PublishedData | None = None) -> Estimate | None:
    """Predicted time of one all-reduce of ``msg_bytes`` bytes on ``backend``, from published boxes.

    Parameters
    ----------
    backend : BackendName
        ``nccl`` (default settings: the baseline), ``pcie_ipc``, ``custom_ar``, ``b12x``, ...
    msg_bytes : int
        Bytes per rank (e.g. 4 tokens x 7168 x 2 B bf16 = 57,344).
    world_size : int
        Tensor-parallel ranks; only measurements at the same world size count.
    sm : (major, minor) or None
        The box's GPU; picks the point among boxes of the same SM major, and applies the
        backend's kernel SM gate (registry).
    pcie_gen : int or None
        Breaks ties among same-SM boxes whose generation is known.
    p2p : bool or None
        False: a backend that needs P2P gets None.
    exclude_box : str or None
        Leave that box's measurements out (leave-one-box-out benchmark), from the pooled spread
        ``s`` too.
    data : PublishedData or None
        Measurements read with :func:`load` from another file (tests, a user's own collection);
        default the packaged file.

    Returns
    -------
    Estimate or None
        None when no comparable published measurement covers this size (then the backend is not a
        candidate). In the packaged data that is so for ``b12x``: no isolated figure of its one-shot
        all-reduce + residual + RMSNorm kernel is published (b12x PR #139's hierarchical and
        island kernels are other kernels, at 16 GPUs), and for ``custom_ar`` at world size 2: the
        only PCIe figure (sglang-V100 PR #2) is at 4 GPUs. No number is invented for either.
        Otherwise ``low_us .. high_us`` is the module docstring's range (a 90 % prediction interval
        for a new box joined with the comparable boxes' min..max x/÷ 1.25), in µs.
    """
    if msg_bytes <= 0 or not _gate_ok(backend, sm, p2p):
        return None
    if data is None:
        data = _packaged()
    vals: list[tuple[Measurement, float, float, float]] = []
    for m in _comparable(backend, world_size, exclude_box, data):
        t = m.time_at(msg_bytes)
        if t is not None:
            lo, hi = m.range_at(msg_bytes) or (t, t)
            vals.append((m, t, lo, hi))
    if not vals:
        return None
    per_box: dict[str, list[float]] = {}
    for m, t, _, _ in vals:
        per_box.setdefault(m.box, []).append(t)
    box_val = {b: statistics.median(ts) for b, ts in per_box.items()}
    pool = list(box_val)
    basis = "median of every comparable box"
    boxes = {b: _box(b, data) for b in box_val}
    if sm is not None and any(boxes[b].sm[0] == sm[0] for b in pool):
        pool = [b for b in pool if boxes[b].sm[0] == sm[0]]
        basis = f"median of the SM{sm[0]}x boxes"
        if pcie_gen is not None and any(boxes[b].pcie_gen == pcie_gen for b in pool):
            pool = [b for b in pool if boxes[b].pcie_gen == pcie_gen]
            basis += f" on PCIe Gen{pcie_gen}"
    point = statistics.median(box_val[b] for b in pool)
    low = min(v[2] for v in vals) / RANGE_WIDEN
    high = max(v[3] for v in vals) * RANGE_WIDEN
    n = len(box_val)
    sp = spread("nccl" if backend is BackendName.nccl else "kernel", exclude_box=exclude_box, data=data)
    if sp.s is not None and sp.q is not None:
        centre = statistics.fmean(math.log(v) for v in box_val.values())
        half = sp.q * sp.s * math.sqrt(1 + 1 / n)
        low, high = min(low, math.exp(centre - half)), max(high, math.exp(centre + half))
        pool_name = {"nccl": "NCCL", "kernel": "P2P-kernel", "all": "all"}[sp.group]
        rng = (f"range = 90 % prediction interval for a new box: geometric mean of the comparable boxes x/÷ "
               f"e^(q·s·sqrt(1+1/n)) = x/÷ {math.exp(half):.3g} (s {sp.s:.3f} = pooled between-box spread of ln "
               f"time over the {pool_name} cells, df {sp.df}, q {sp.q:.3f}, n {n}), joined with their min..max "
               f"x/÷ {RANGE_WIDEN:g}")
    else:
        rng = f"range = their min..max x/÷ {RANGE_WIDEN:g} (no pooled spread: no cell has two boxes)"
    low, high = min(low, point), max(high, point)
    notes: list[str] = []
    ratio = max(v[1] for v in vals) / min(v[1] for v in vals)
    if backend is BackendName.nccl:
        if ratio > DISAGREE:
            notes.append(f"published NCCL times on comparable boxes differ {ratio:.0f}x at this size (hosts differ in "
                         "switches, NUMA and P2P; topology alone cannot predict it); measure with `fastverify tune` "
                         "or give an all_reduce_perf table (--perf-table)")
    else:
        su = _speedups(msg_bytes, exclude_box, data)
        if ratio > DISAGREE or (len(su) >= 2 and max(su.values()) / min(su.values()) > DISAGREE):
            notes.append(_collapse_note(min(su.values(), default=float("nan")), max(su.values(), default=float("nan"))))
    described = ", ".join(f"{(bx := boxes[b]).gpu_count}x {bx.gpu}" for b in box_val)
    evidence = (f"published: {n} comparable box{'es' if n > 1 else ''} ({described}), "
                f"TP{world_size}; point = {basis}; {rng}")
    return Estimate(backend=backend, msg_bytes=msg_bytes, point_us=point, low_us=low, high_us=high,
                    sources=tuple(v[0].id for v in vals), evidence=evidence, notes=tuple(notes))
