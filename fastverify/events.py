"""Per-rank event tables: the one input of the analyzer, from a trace file or from a live run.

A trace file (:mod:`fastverify.trace.load`) and a live tensor-parallel run
(:mod:`fastverify.live`) both end up as one :class:`RankEvents` per TP rank, so every number in a
profile comes from the same analysis code (:mod:`fastverify.analyze`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class EventClass(str, Enum):
    """What a GPU event (or, in a CPU live run, a timed region) spends its time on.

    ``ALLREDUCE`` and ``FUSED_ALLREDUCE`` are the all-reduce families; a fused kernel does the
    all-reduce and the residual add + RMSNorm in one launch and cannot be split from a trace, so it
    is its own class. ``UNKNOWN_COMM`` is a kernel whose name looks collective but that no rule
    of :data:`fastverify.trace.classify.RULES` knows: it is reported, never counted as compute.
    ``EP_ALLTOALL`` is expert-parallel token dispatch/combine (DeepEP, pplx-kernels, NCCL
    all-to-all): communication that a TP all-reduce backend cannot replace, so it is kept apart
    from both the all-reduces and compute.
    """

    ALLREDUCE = "allreduce"
    FUSED_ALLREDUCE = "fused_allreduce"
    OTHER_COMM = "other_comm"
    UNKNOWN_COMM = "unknown_comm"
    MEMORY = "memory"
    COMPUTE = "compute"
    # Appended last so every older class keeps its code (RankEvents.cls stores codes).
    EP_ALLTOALL = "ep_alltoall"

    @property
    def code(self) -> int:
        return _CODES[self]


CLASSES: tuple[EventClass, ...] = tuple(EventClass)
_CODES = {c: i for i, c in enumerate(CLASSES)}


@dataclass(frozen=True)
class Step:
    """One step of a rank's timeline (a verify forward, a decode step, a ProfilerStep).

    ``start_ns``/``end_ns`` bound the host-side region (annotation or graph launch) in the
    trace clock, in ns; GPU events are assigned to steps by the analyzer (see ``RankEvents.step``).
    """

    name: str
    start_ns: int
    end_ns: int


@dataclass
class RankEvents:
    """The GPU events of one TP rank, as parallel arrays of length ``n`` (one row per event).

    Attributes
    ----------
    rank : int
        TP rank (``distributedInfo.rank``, the file name, or the live worker's rank).
    origin : str
        Where the events came from: a trace file path, or ``"live:<backend>"``.
    start_ns, dur_ns : np.ndarray, shape (n,), int64
        Start in the trace clock and duration, both in nanoseconds (never rounded to µs).
    cls : np.ndarray, shape (n,), int8
        ``EventClass.code`` of each event.
    name_id : np.ndarray, shape (n,), int32
        Index into ``names``.
    msg_bytes : np.ndarray, shape (n,), int64
        Payload of a collective in bytes (``-1`` where unknown, e.g. under CUDA-graph replay).
    step : np.ndarray, shape (n,), int32
        Index into ``steps`` (``-1``: outside every step).
    stream : np.ndarray, shape (n,), int64
        CUDA stream (or ``0`` for a live CPU run).
    label : list[str] | None
        Optional per-event label (a live run names each collective, e.g. ``"layer3.attn_out"``).
    names : list[str]
        Distinct event names.
    steps : list[Step]
        Steps found on this rank, in time order.
    meta : dict
        Facts about the source: world size, GPU name, NCCL version, timing clock, warnings.
    launch_ns : np.ndarray | None, shape (n,), int64
        Host time of the runtime call that launched each event (for a kernel replayed from a CUDA
        graph, the graph launch); the event's own start where the trace has none. None: not known
        (a live run).
    in_graph : np.ndarray | None, shape (n,), bool
        The event was replayed from a CUDA/HIP graph (its correlation is a graph launch's).
    spans : list[Step]
        Coarse speculative stage spans on the host (``draft``, ``draft_extend``), sorted by start.
    host_syncs : list[Step]
        Host calls that block on the GPU (``cudaStreamSynchronize`` and kin), sorted by start.
    """

    rank: int
    origin: str
    start_ns: np.ndarray
    dur_ns: np.ndarray
    cls: np.ndarray
    name_id: np.ndarray
    msg_bytes: np.ndarray
    step: np.ndarray
    stream: np.ndarray
    names: list[str]
    steps: list[Step] = field(default_factory=list)
    label: list[str] | None = None
    meta: dict = field(default_factory=dict)
    launch_ns: np.ndarray | None = None
    in_graph: np.ndarray | None = None
    spans: list[Step] = field(default_factory=list)
    host_syncs: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.start_ns)
        for attr in ("dur_ns", "cls", "name_id", "msg_bytes", "step", "stream", "launch_ns", "in_graph"):
            if getattr(self, attr) is not None and len(getattr(self, attr)) != n:
                raise ValueError(f"RankEvents.{attr} has {len(getattr(self, attr))} rows, start_ns has {n}")
        if self.label is not None and len(self.label) != n:
            raise ValueError(f"RankEvents.label has {len(self.label)} rows, start_ns has {n}")

    def __len__(self) -> int:
        return len(self.start_ns)

    @classmethod
    def from_rows(
        cls_,
        rank: int,
        origin: str,
        rows: list[tuple[str, EventClass, int, int, int]],
        *,
        steps: list[Step] | None = None,
        labels: list[str] | None = None,
        meta: dict | None = None,
    ) -> "RankEvents":
        """Build from ``(name, EventClass, start_ns, dur_ns, msg_bytes)`` rows (``msg_bytes`` -1 if unknown).

        Events get their step from ``steps``: the step whose ``[start_ns, end_ns)`` holds the
        event's start (``-1`` if none). Used by the live runner and by tests.
        """
        names: list[str] = []
        index: dict[str, int] = {}
        name_id = np.empty(len(rows), dtype=np.int32)
        for i, row in enumerate(rows):
            name_id[i] = index.setdefault(row[0], len(index))
            if name_id[i] == len(names):
                names.append(row[0])
        start = np.array([r[2] for r in rows], dtype=np.int64)
        steps = list(steps or [])
        return cls_(
            rank=rank,
            origin=origin,
            start_ns=start,
            dur_ns=np.array([r[3] for r in rows], dtype=np.int64),
            cls=np.array([r[1].code for r in rows], dtype=np.int8),
            name_id=name_id,
            msg_bytes=np.array([r[4] for r in rows], dtype=np.int64),
            step=assign_steps(start, steps),
            stream=np.zeros(len(rows), dtype=np.int64),
            names=names,
            steps=steps,
            label=labels,
            meta=dict(meta or {}),
        )


def assign_steps(start_ns: np.ndarray, steps: list[Step]) -> np.ndarray:
    """Index of the step whose ``[start_ns, end_ns)`` holds each time, else -1.

    Steps must be sorted by start and not overlap. Shape (n,) int32.
    """
    out = np.full(len(start_ns), -1, dtype=np.int32)
    if not steps:
        return out
    starts = np.array([s.start_ns for s in steps], dtype=np.int64)
    ends = np.array([s.end_ns for s in steps], dtype=np.int64)
    idx = np.searchsorted(starts, start_ns, side="right") - 1
    ok = (idx >= 0) & (start_ns < ends[np.clip(idx, 0, None)])
    out[ok] = idx[ok]
    return out
