"""The clocks of a live run: each op region of a timed forward becomes a row ``[name, cls, start_ns,
dur_ns, msg_bytes]`` in nanoseconds of one clock shared by every rank.

* CPU (gloo, no CUDA graphs): the eager forward, each region bracketed by
  ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC`` on Linux, one clock for every process on the
  machine), so ranks line up without conversion. Wall time, labelled ``timing =
  "cpu_wall_clock"`` and ``timed_forward = "eager"``: it is not GPU time.
* CUDA (NCCL): the CUDA-graph forward, as SGLang serves it (its ``CudaGraphRunner`` replays the
  verify forward), labelled ``timed_forward = "cuda_graph"``. A CUDA event cannot bracket one
  kernel inside a captured graph: recorded during capture, ``torch.cuda.Event`` (not
  ``external``) becomes a cross-stream dependency, not a timestamp (PyTorch
  ``torch/cuda/streams.py``, ``Event(external=...)``). So the forward is captured once more as one
  graph per region (:class:`ForwardGraphs`, every region graph in one memory pool, replayed in
  capture order as ``torch.cuda.graph`` requires of a shared pool, PyTorch
  ``torch/cuda/graphs.py``), and the events are recorded on the current stream between the
  region graphs' replays, outside any capture. Before each timed forward the ranks synchronise
  (device sync, barrier, device sync), then record a base event on an idle GPU and read
  ``perf_counter_ns()``; an event's time is that host time plus its ``elapsed_time`` from the base
  event (ms → ns). ``timing = "cuda_events"``. Each region's time holds its graph's launch on the
  GPU (about a µs) that one whole-forward graph does not pay: the replay of the whole-forward graph
  is timed too (``graph_forward_us``, the served step), and the eager forward only as a second,
  labelled figure (``eager_forward_us``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class WallClockRecorder:
    """CPU: regions bracketed by ``perf_counter_ns``; rows ``[name, cls, start_ns, dur_ns, bytes]``."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.labels: list[str] = []

    def region(self, name, cls, label, msg_bytes):
        return _WallRegion(self, name, cls, label, msg_bytes)


class _WallRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "t0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        t1 = time.perf_counter_ns()
        self.rec.rows.append([self.name, self.cls.value, self.t0, t1 - self.t0, self.msg_bytes])
        self.rec.labels.append(self.label)
        return False


class CudaEventRecorder:
    """CUDA, eager: regions bracketed by timing events on the current stream, resolved after a
    sync. The live run no longer times with it (it times graph replays); doctor measures the
    host cost of this per-region timer around an eager collective."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.pending: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        return _CudaRegion(self, name, cls, label, msg_bytes)

    def event(self):
        return _record(self.torch)


class _CudaRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "e0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.e0 = self.rec.event()

    def __exit__(self, *exc):
        self.rec.pending.append((self.name, self.cls, self.label, self.msg_bytes, self.e0, self.rec.event()))
        return False


@dataclass
class ForwardGraphs:
    """One rank's verify forward captured in CUDA graphs (CUDA only).

    ``whole``: the forward in one graph (what SGLang replays; the trace replays it too).
    ``sections``: ``(name, cls, label, msg_bytes, graph)`` per region of the forward, in forward
    order, one graph each, all in one memory pool. ``keep``: the outputs of both captures, whose
    memory the replays write (freed, it could be handed to other tensors).
    """

    whole: object
    sections: list[tuple] = field(default_factory=list)
    keep: list = field(default_factory=list)


class _SectionCapture:
    """Recorder that captures each region of a forward as its own CUDA graph, in one pool."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.pool = torch.cuda.graph_pool_handle()
        self.sections: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        return _CaptureRegion(self, name, cls, label, msg_bytes)


class _CaptureRegion:
    __slots__ = ("cls", "ctx", "graph", "label", "msg_bytes", "name", "rec")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        cuda = self.rec.torch.cuda
        self.graph = cuda.CUDAGraph()
        self.ctx = cuda.graph(self.graph, pool=self.rec.pool)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        self.rec.sections.append((self.name, self.cls, self.label, self.msg_bytes, self.graph))
        return False


def capture_forward_graphs(model, torch, warmup: int = 2) -> ForwardGraphs:
    """Warm ``model.forward`` up ``warmup`` times on a side stream (the ``torch.cuda.graph`` rule:
    lazy allocations and kernel choices happen outside capture; the same steps as
    :func:`fastverify.cudagraph.capture_cuda_graph`), then capture it whole in one graph and once
    more region by region (:class:`ForwardGraphs`). Every rank captures the same collectives in
    the same order; capture runs none of them."""
    cuda = torch.cuda
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for _ in range(warmup):
            model.forward()
    cuda.current_stream().wait_stream(side)
    cuda.synchronize()
    whole = cuda.CUDAGraph()
    with cuda.graph(whole):
        out = model.forward()
    rec = _SectionCapture(torch)
    out_sections = model.forward(rec)
    cuda.synchronize()
    return ForwardGraphs(whole=whole, sections=rec.sections, keep=[out, out_sections])


def _ns(ms: float) -> int:
    return round(ms * 1e6)


def _cuda_sync_barrier(torch, dist, rank: int) -> None:
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()


def _time_sections(graphs: ForwardGraphs, torch) -> tuple[list[list], list[str], int, int]:
    """Replay the region graphs back to back, an event before each and one after the last; after
    a device sync: rows, labels, the host ns of the base event and of the end event."""
    base_ns = time.perf_counter_ns()
    base = _record(torch)
    marks = []
    for *_, graph in graphs.sections:
        marks.append(_record(torch))
        graph.replay()
    marks.append(_record(torch))
    torch.cuda.synchronize()
    rows, labels = [], []
    for (name, cls, label, nbytes, _), e0, e1 in zip(graphs.sections, marks, marks[1:]):
        rows.append([name, cls.value, base_ns + _ns(base.elapsed_time(e0)), _ns(e0.elapsed_time(e1)), nbytes])
        labels.append(label)
    return rows, labels, base_ns, base_ns + _ns(base.elapsed_time(marks[-1]))


def _record(torch):
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _time_whole(run: Callable[[], object], torch) -> float:
    """µs of one ``run()`` (a graph replay or an eager forward) between two events."""
    e0 = _record(torch)
    run()
    e1 = _record(torch)
    e1.synchronize()
    return round(e0.elapsed_time(e1) * 1e3, 3)


def time_forwards(
    model,
    iters: int,
    rank: int,
    cuda: bool,
    torch,
    dist,
    done: Callable[[int], None] | None = None,
    graphs: ForwardGraphs | None = None,
) -> tuple[list[list], list[str], list[list], dict]:
    """Run ``iters`` timed forwards, each after a barrier. Returns rows ``[name, cls, start_ns,
    dur_ns, msg_bytes]``, their labels, steps ``[name, start_ns, end_ns]`` and ``figures`` for the
    rank's meta (clocks: module docstring): ``timed_forward`` (``"cuda_graph"`` or ``"eager"``)
    and, on CUDA, ``graph_forward_us`` and ``eager_forward_us`` (one µs value per timed forward)
    and ``graph_sections`` (region graphs). ``graphs``: the forward's graphs on CUDA
    (:func:`capture_forward_graphs`; captured here when None). ``done(i)`` is called after timed
    forward ``i`` (0-based), outside its timed window."""
    rows: list[list] = []
    labels: list[str] = []
    steps: list[list] = []
    if cuda and graphs is None:
        graphs = capture_forward_graphs(model, torch)
    figures: dict = {"timed_forward": "cuda_graph" if cuda else "eager"}
    if cuda:
        figures.update(graph_forward_us=[], eager_forward_us=[], graph_sections=len(graphs.sections))
    for i in range(iters):
        if cuda:
            _cuda_sync_barrier(torch, dist, rank)
            r, lab, start, end = _time_sections(graphs, torch)
            steps.append([f"verify#{i}", start, end])
            _cuda_sync_barrier(torch, dist, rank)
            figures["graph_forward_us"].append(_time_whole(graphs.whole.replay, torch))
            _cuda_sync_barrier(torch, dist, rank)
            figures["eager_forward_us"].append(_time_whole(model.forward, torch))
        else:
            dist.barrier()
            rec = WallClockRecorder()
            start = time.perf_counter_ns()
            model.forward(rec)
            steps.append([f"verify#{i}", start, time.perf_counter_ns()])
            r, lab = rec.rows, rec.labels
        rows += r
        labels += lab
        if done is not None:
            done(i)
    return rows, labels, steps, figures
