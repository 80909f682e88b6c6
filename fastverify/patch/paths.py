"""Which path every tensor-parallel all-reduce of a TP rank took, counted per forward mode.

A path is named by who ran it and how:

* ``sglang.<method>``: SGLang's own dispatch (``GroupCoordinator.all_reduce``, SGLang 0.5.23
  ``distributed/parallel_state.py``), with the method it chose as it ran: the out-of-place method
  handed to ``_all_reduce_out_place`` (``pcie_ipc``, ``ca``, ``qr``, ``pymscclpp``,
  ``torch_symm_mem``, ``pynccl``), else ``_all_reduce_in_place``'s (``pynccl``,
  ``torch_symm_mem``, or torch.distributed: the device group's backend, ``nccl`` / ``gloo``),
  ``flashinfer`` (``_flashinfer_allreduce``) or ``pynccl_symm_mem`` (the symmetric-memory path,
  PyNccl called directly; :mod:`fastverify.patch.counting`); a
  CPU tensor takes ``shm`` where SGLang's own ``is_shm_available`` holds, else torch.distributed
  on the device group. SGLang's names map onto the registry's (:data:`SGLANG_TO_REGISTRY`).
* ``fastverify.<backend>``: one of the patch's slots ran its backend's kernel;
  ``fastverify.<backend>.fallback``: the slot was offered the tensor and declined it (too many
  rows, a shape or dtype it does not take), so SGLang's own path ran it.

Counted per forward mode (:func:`mode_of`), and for CUDA graphs per captured graph
(:class:`PathCounter`). One :class:`PathCounter` per process (:data:`COUNTER`); the patch's
wrappers call it. Nothing here imports SGLang.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastverify.registry import BACKENDS

SGLANG_TO_REGISTRY = {method: b.name.value for b in BACKENDS for method in b.sglang_methods}
"""SGLang 0.5.23 method names (``parallel_state.py``; the keys are SGLang's spellings) → fastverify
registry names (``BackendName``), where one exists (the registry's ``sglang_methods``)."""
MODES = ("verify", "draft", "draft_extend", "extend", "decode", "idle", "other")
WARMUP = "capture_warmup"


def mode_of(forward_mode: Any, is_draft_worker: bool) -> str:
    """The counting mode of a forward: SGLang's ``ForwardMode`` (an enum with ``name``; 0.5.23
    ``model_executor/forward_batch_info.py``) on the target or the draft runner: ``verify``
    (TARGET_VERIFY on the target model), ``draft`` and ``draft_extend`` (the draft model's runner:
    it shares the GPUs and its all-reduces are counted apart), ``extend`` (prefill), ``decode``,
    ``idle``, ``other``."""
    name = str(getattr(forward_mode, "name", forward_mode) or "").upper()
    if is_draft_worker:
        if name in ("DRAFT_EXTEND", "DRAFT_EXTEND_V2", "EXTEND", "MIXED"):
            return "draft_extend"
        return "draft" if name in ("DECODE", "TARGET_VERIFY", "IDLE") else "other"
    return {
        "TARGET_VERIFY": "verify",
        "EXTEND": "extend",
        "MIXED": "extend",
        "SPLIT_PREFILL": "extend",
        "DECODE": "decode",
        "IDLE": "idle",
    }.get(name, "other")


def backend_of(path: str) -> str | None:
    """The registry name a path ran on, None for a fallback or a method with no registry name:
    ``sglang.pcie_ipc`` → ``pcie_ipc``, ``fastverify.b12x`` → ``b12x``."""
    who, _, rest = path.partition(".")
    if rest.endswith(".fallback"):
        return None
    return SGLANG_TO_REGISTRY.get(rest) if who == "sglang" else rest or None


class PathCounter:
    """Counts per mode (thread-local current mode), per captured graph, and since the last
    :meth:`take` (what one verify-log record carries).

    CUDA graphs: Python runs only while a graph is captured. The all-reduces issued while the
    stream captures (``torch.cuda.is_current_stream_capturing``) are counted for that graph, keyed
    by (capture mode, size, backend) (:func:`fastverify.patch.counting.graph_key`); the capture's
    warm-up runs are kept apart (``capture_warmup``), and so is everything a graph that runs its
    forward eagerly at replay issues (``eager=True``: it keeps no counts, its replays count as they
    run). Each replay adds the counts of the graph SGLang replays to the replaying mode. Eager
    steps are counted as they run.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.total: dict[str, Counter[str]] = {}
        self.since: dict[str, Counter[str]] = {}
        self.graphs: dict[tuple[str, int], Counter[str]] = {}
        self.unattributed_replays = 0

    # -- the current forward ---------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return getattr(self._local, "mode", None) or "other"

    @property
    def forward_mode(self) -> str | None:
        """The mode of the forward this thread is in (:meth:`in_mode`), None outside one."""
        return getattr(self._local, "mode", None)

    @contextmanager
    def in_mode(self, mode: str) -> Iterator[None]:
        """Attribute the all-reduces of the block to ``mode``."""
        old = getattr(self._local, "mode", None)
        self._local.mode = mode
        self._local.fallback = None
        try:
            yield
        finally:
            self._local.mode = old

    @contextmanager
    def capturing(self, key: tuple, *, eager: bool = False) -> Iterator[None]:
        """The block captures the graph ``key`` = (mode, size, ...): its counts start afresh.
        ``eager``: the graph reruns its forward in Python at every replay, so nothing issued here
        is the graph's (all of it is a warm-up)."""
        old = getattr(self._local, "capture", None), getattr(self._local, "eager", False)
        self._local.capture, self._local.eager = key, eager
        with self._lock:
            self.graphs[key] = Counter()
        try:
            yield
        finally:
            self._local.capture, self._local.eager = old

    def mark_fallback(self, backend: str) -> None:
        """A slot declined the tensor: the next all-reduce of this thread is its fallback."""
        self._local.fallback = backend

    def take_fallback(self) -> str | None:
        fb = getattr(self._local, "fallback", None)
        self._local.fallback = None
        return fb

    # -- counting -------------------------------------------------------------------------------

    def count(self, path: str, *, capturing: bool = False) -> None:
        """One all-reduce took ``path``. ``capturing``: the CUDA stream is capturing a graph."""
        key = getattr(self._local, "capture", None)
        with self._lock:
            if key is not None:
                into_graph = capturing and not getattr(self._local, "eager", False)
                (self.graphs.setdefault(key, Counter()) if into_graph else self.total.setdefault(WARMUP, Counter()))[
                    path
                ] += 1
                return
            mode = self.mode
            self.total.setdefault(mode, Counter())[path] += 1
            self.since.setdefault(mode, Counter())[path] += 1

    def replayed(self, key: tuple, *, into: str) -> bool:
        """One replay of the graph captured as ``key`` (:meth:`capturing`): its counts are added
        to the mode ``into`` (the replaying forward's). False (and counted as unattributed) when
        no such capture was seen."""
        with self._lock:
            got = self.graphs.get(key)
            if got is None:
                self.unattributed_replays += 1
                return False
            for path, n in got.items():
                self.total.setdefault(into, Counter())[path] += n
                self.since.setdefault(into, Counter())[path] += n
            return True

    def take(self) -> dict[str, dict[str, int]]:
        """Counts per mode since the last call (then reset), JSON-ready."""
        with self._lock:
            out = {m: dict(sorted(c.items())) for m, c in self.since.items() if c}
            self.since = {}
        return out

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Counts per mode since the process started (captured graphs' warm-ups under
        ``capture_warmup``)."""
        with self._lock:
            return {m: dict(sorted(c.items())) for m, c in self.total.items() if c}

    def reset(self) -> None:
        with self._lock:
            self.total, self.since, self.graphs, self.unattributed_replays = {}, {}, {}, 0


COUNTER = PathCounter()


def summary(counts: Mapping[str, Mapping[str, int]], *, backend: str | None = None) -> str:
    """One phrase per mode: ``verify: sglang.gloo 5 of 5; extend: fastverify.gloo.fallback 10 of
    10``; with ``backend`` (a registry name) each mode says how many it took first
    (``verify: pcie_ipc took 120 of 123 (sglang.pcie_ipc 120, sglang.nccl 3)``)."""
    parts = []
    for mode in [*MODES, *sorted(set(counts) - set(MODES))]:
        c = counts.get(mode)
        if not c:
            continue
        n = sum(c.values())
        paths = ", ".join(f"{p} {k}" for p, k in sorted(c.items(), key=lambda pk: (-pk[1], pk[0])))
        if backend is not None:
            took = sum(k for p, k in c.items() if backend_of(p) == backend)
            parts.append(f"{mode}: {backend} took {took} of {n} ({paths})")
        else:
            parts.append(f"{mode}: {paths} of {n}")
    return "; ".join(parts) or "no all-reduce counted"
