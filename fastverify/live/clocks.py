"""The clocks of a live run: each op region of a timed forward becomes a row ``[name, cls, start_ns,
dur_ns, msg_bytes]`` in nanoseconds of one clock shared by every rank.

* CPU (gloo): each region is bracketed by ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC`` on Linux,
  one clock for every process on the machine), so ranks line up without conversion. Wall time,
  labelled ``timing = "cpu_wall_clock"``: it is not GPU time.
* CUDA (NCCL): each region is bracketed by ``torch.cuda.Event(enable_timing=True)`` on the
  current stream. Before each timed forward the ranks synchronise (device sync, barrier, device
  sync), then record a base event on an idle GPU and read ``perf_counter_ns()``; an event's time is
  that host time plus its ``elapsed_time`` from the base event (ms → ns). ``timing = "cuda_events"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


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
    """CUDA: regions bracketed by timing events on the current stream, resolved after a sync."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.pending: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        return _CudaRegion(self, name, cls, label, msg_bytes)

    def event(self):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, base_event, base_ns: int) -> tuple[list[list], list[str]]:
        """Rows in host ns: ``base_ns`` + elapsed ms since ``base_event`` × 1e6. Call after a device sync."""
        rows, labels = [], []
        for name, cls, label, nbytes, e0, e1 in self.pending:
            start = base_ns + round(base_event.elapsed_time(e0) * 1e6)
            rows.append([name, cls.value, start, round(e0.elapsed_time(e1) * 1e6), nbytes])
            labels.append(label)
        return rows, labels


class _CudaRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "e0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.e0 = self.rec.event()

    def __exit__(self, *exc):
        self.rec.pending.append((self.name, self.cls, self.label, self.msg_bytes, self.e0, self.rec.event()))
        return False


def time_forwards(model, iters: int, rank: int, cuda: bool, torch, dist,
                  done: Callable[[int], None] | None = None) -> tuple[list[list], list[str], list[list]]:
    """Run ``iters`` timed forwards, each after a barrier. Returns rows ``[name, cls, start_ns, dur_ns,
    msg_bytes]``, their labels, and steps ``[name, start_ns, end_ns]`` (clocks: module docstring).
    ``done(i)`` is called after timed forward ``i`` (0-based), outside its timed window."""
    rows: list[list] = []
    labels: list[str] = []
    steps: list[list] = []
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            rec = CudaEventRecorder(torch)
            base_ns = time.perf_counter_ns()
            base = rec.event()
            model.forward(rec)
            end = rec.event()
            torch.cuda.synchronize()
            r, lab = rec.resolve(base, base_ns)
            step_end = base_ns + round(base.elapsed_time(end) * 1e6)
            steps.append([f"verify#{i}", base_ns, max(step_end, r[-1][2] + r[-1][3])])
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
    return rows, labels, steps
