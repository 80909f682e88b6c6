"""Per-backend all-reduce time models fitted to published measurements (always *predicted*).

The measurements live in ``fastverify/data/published_allreduce.json``: one :class:`Box` per host
(GPU, SM, GPU count, PCIe generation, switch or root complex, NUMA layout, link) and one
:class:`Measurement` per source table (backend, world size, P2P, tool, settings, sizes in bytes,
times in µs, how the numbers were read, link). :func:`estimate` turns them into a range and a point
for one backend and one message size.

Why a range over boxes and not a fitted curve: NCCL time on PCIe differs 5-15x between hosts
with the same GPU (at 12-96 KiB the SGLang ``pcie_ipc_ar.py`` 8x SM120 host measured 205-585 µs,
the rtx6kpro 8x RTX PRO 6000 Turin host 48-49 µs). Switches, NUMA and P2P decide it and the
topology alone does not tell them, so the honest answer is "comparable boxes measured between
low and high"; the user's own measurement (``fastverify tune``, ``--perf-table``) replaces it.

Rules (fixed before the leave-one-box-out benchmark ``benchmarks/bench_model.py`` was run; they
were not adjusted to its result):

* **Comparable**: same world size; for NCCL only measurements taken with default settings (the
  baseline a user has before tuning); for a backend that needs P2P (registry ``needs_p2p``) only
  measurements with P2P working, and nothing at all when the caller says P2P is off; a backend
  with a kernel SM gate (registry ``kernel_sm_majors`` / ``kernel_sm``) nothing when ``sm`` fails it.
* **Interpolation**: log-log linear between a measurement's neighbouring sizes. Beyond its sizes by
  at most :data:`EXTRAPOLATE` (2x, one power-of-two step): below the smallest size the smallest
  size's time is held (small all-reduces are latency-bound); above the largest the last segment's
  log-log slope is continued, clamped to [0, 1] (time cannot grow faster than the bytes), flat
  when the table has one size. Further away the measurement does not count.
* **Range**: min .. max over the comparable measurements (a source's own run-to-run spread
  included where it gives one), widened by :data:`RANGE_WIDEN` each way. 1.25 is the run-to-run
  spread of the one source that publishes repeats: FlashInfer PR #4393, 8x L40S TP8 batch 1,
  three runs 18.7 / 21.8 / 28.9 µs, sqrt(28.9 / 18.7) = 1.24.
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
    "RANGE_WIDEN",
    "Box",
    "Estimate",
    "Measurement",
    "PublishedData",
    "comparable",
    "estimate",
    "interpolate",
    "load",
    "measurements",
    "published_boxes",
]

DATA_FILE = "published_allreduce.json"
RANGE_WIDEN = 1.25  # see the module docstring: FlashInfer PR #4393 run-to-run spread, sqrt(28.9/18.7)
EXTRAPOLATE = 2.0  # one power-of-two step beyond a table's sizes, no further
DISAGREE = 3.0  # comparable sources further apart than this get the note

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


def _box(box_id: str) -> Box:
    return next(b for b in _packaged().boxes if b.id == box_id)


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


def _comparable(backend: BackendName, world_size: int, exclude_box: str | None) -> Iterable[Measurement]:
    needs_p2p = backend_info(backend).needs_p2p
    for m in _packaged().measurements:
        if m.backend is not backend or m.world_size != world_size or m.box == exclude_box or m.times_us is None:
            continue
        if backend is BackendName.nccl and m.settings != "default":
            continue
        if needs_p2p and m.p2p is not True:
            continue
        yield m


def comparable(backend: BackendName, world_size: int, exclude_box: str | None = None) -> list[Measurement]:
    """The measurements :func:`estimate` draws on for ``backend`` at ``world_size`` (before the size test)."""
    return list(_comparable(backend, world_size, exclude_box))


def _speedups(msg_bytes: int, exclude_box: str | None) -> dict[str, float]:
    """Published speed-up over same-box NCCL of every peer-write kernel at ``msg_bytes`` (any world size)."""
    data = _packaged()
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
             exclude_box: str | None = None) -> Estimate | None:
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
        Leave that box's measurements out (leave-one-box-out benchmark).

    Returns
    -------
    Estimate or None
        None when no comparable published measurement covers this size (then the backend is not a
        candidate). In the packaged data that is so for ``b12x``: no isolated figure of its one-shot
        all-reduce + residual + RMSNorm kernel is published (b12x PR #139's hierarchical and
        island kernels are other kernels, at 16 GPUs), and for ``custom_ar`` at world size 2: the
        only PCIe figure (sglang-V100 PR #2) is at 4 GPUs. No number is invented for either.
    """
    if msg_bytes <= 0 or not _gate_ok(backend, sm, p2p):
        return None
    vals: list[tuple[Measurement, float, float, float]] = []
    for m in _comparable(backend, world_size, exclude_box):
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
    if sm is not None and any(_box(b).sm[0] == sm[0] for b in pool):
        pool = [b for b in pool if _box(b).sm[0] == sm[0]]
        basis = f"median of the SM{sm[0]}x boxes"
        if pcie_gen is not None and any(_box(b).pcie_gen == pcie_gen for b in pool):
            pool = [b for b in pool if _box(b).pcie_gen == pcie_gen]
            basis += f" on PCIe Gen{pcie_gen}"
    point = statistics.median(box_val[b] for b in pool)
    low = min(v[2] for v in vals) / RANGE_WIDEN
    high = max(v[3] for v in vals) * RANGE_WIDEN
    notes: list[str] = []
    spread = max(v[1] for v in vals) / min(v[1] for v in vals)
    if backend is BackendName.nccl:
        if spread > DISAGREE:
            notes.append(f"published NCCL times on comparable boxes differ {spread:.0f}x at this size (hosts differ in "
                         "switches, NUMA and P2P; topology alone cannot predict it); measure with `fastverify tune` "
                         "or give an all_reduce_perf table (--perf-table)")
    else:
        sp = _speedups(msg_bytes, exclude_box)
        if spread > DISAGREE or (len(sp) >= 2 and max(sp.values()) / min(sp.values()) > DISAGREE):
            notes.append(_collapse_note(min(sp.values(), default=float("nan")), max(sp.values(), default=float("nan"))))
    described = ", ".join(f"{(bx := _box(b)).gpu_count}x {bx.gpu}" for b in box_val)
    evidence = (f"published: {len(box_val)} comparable box{'es' if len(box_val) > 1 else ''} ({described}), "
                f"TP{world_size}; point = {basis}; range = their min..max x/÷ {RANGE_WIDEN:g}")
    return Estimate(backend=backend, msg_bytes=msg_bytes, point_us=point, low_us=low, high_us=high,
                    sources=tuple(v[0].id for v in vals), evidence=evidence, notes=tuple(notes))
