"""The verify timer of the in-rank patch (``--profile-verify DIR``): events around each verify
forward, no host sync, written as JSON lines while the server runs (SGLang ends its scheduler
processes with SIGKILL, ``kill_process_tree`` in ``sglang/srt/utils/common.py``, so nothing at exit
runs there). The wrappers that call it: :func:`fastverify.patch.install.make_verify_wrapper`; the optional
torch.profiler trace: :class:`VerifyTrace`, at the end. Two halves:

- the verify path (:meth:`VerifyTimer.stop`) reads ``query()`` of the oldest pending events (never
  ``synchronize``), turns the completed ones into JSON lines in a bounded buffer and wakes the
  writer every ``every`` lines; it does no file I/O and shares no lock with the writer
  (``collections.deque`` appends and pops are atomic), so a slow disk never stalls a forward;
- a daemon writer thread appends the lines with one ``os.write`` on an ``O_APPEND`` descriptor
  every ``interval_s`` seconds or when woken. It never touches a CUDA event: a ``cudaEventQuery``
  from another thread while SGLang captures a CUDA graph in the default global capture mode is
  prohibited, whereas the verify path is never inside a capture.

A reader sees whole lines only (one ``write`` of whole lines is not split by a signal), except a
last line cut by a full disk (:mod:`fastverify.verify_records` skips it). A SIGKILL loses at most
the lines of the last flush interval (fewer than ``every`` records or ``interval_s`` seconds), plus
on CUDA the steps still running on the GPU. A CUDA ``accept_lens`` (:meth:`VerifyTimer.accept`) is
copied ``non_blocking`` into pinned memory and read once an event recorded after the copy completed.

A torch.profiler trace of a few verify forwards of one rank (``launch --trace-verify-steps N``),
in the form ``fastverify profile --trace`` reads. torch is imported only when the trace starts.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("fastverify.patch")

DRAIN_EVERY = 8
"""Wake the writer once this many finished records wait (the "every few steps" of the flush)."""
FLUSH_INTERVAL_S = 1.0
"""The writer appends whatever is finished at least this often (the "every second")."""
MAX_BUFFERED = 4096
"""Bound on records held in memory (pending events plus finished lines); beyond it new records are
dropped and counted in :attr:`VerifyTimer.dropped` (a stuck disk must not grow the server)."""


# --- the verify timer -------------------------------------------------------------------------------


class WallEvent:
    """CPU stand-in for ``torch.cuda.Event`` (no GPU): wall clock, always complete."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0

    def record(self) -> None:
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "WallEvent") -> float:
        return (end.t - self.t) / 1e6


def _default_event_factory() -> tuple[Callable[[], Any], str]:
    try:
        import torch

        if torch.cuda.is_available():
            return (lambda: torch.cuda.Event(enable_timing=True)), "cuda_events"
    except Exception:
        pass
    return WallEvent, "cpu_wall_clock"


def _default_rank() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    return f"pid{os.getpid()}"


_AWAIT = object()
"""``_Step.accepted`` while the step waits for :meth:`VerifyTimer.accept`."""


class _Step:
    """One timed verify step until its line is written: events, load, and accepted tokens
    (``_AWAIT``, None: not known, or ``(host buffer, ready event or None)``)."""

    __slots__ = ("step", "start", "end", "paths", "batch", "tokens", "accepted")

    def __init__(self, step, start, end, paths, batch, tokens, accepted) -> None:
        self.step, self.start, self.end, self.paths = step, start, end, paths
        self.batch, self.tokens, self.accepted = batch, tokens, accepted


def host_copy(lens: Any) -> tuple[Any, Any] | None:
    """Start reading ``accept_lens`` without a sync: ``(host values, ready event or None)``.

    Parameters
    ----------
    lens : list of int, or torch.Tensor of shape ``(batch,)``
        A list or a CPU tensor is read at once (no device involved); a CUDA tensor is copied
        with ``non_blocking=True`` into a pinned CPU tensor, and a ``torch.cuda.Event`` recorded
        on the current stream after the copy says when it holds the values. Any other device:
        None (not read).
    """
    if isinstance(lens, (list, tuple)):
        return list(lens), None
    device = getattr(getattr(lens, "device", None), "type", None)
    if device == "cpu":
        return lens.tolist(), None
    if device != "cuda":
        return None
    import torch

    buf = torch.empty(tuple(lens.shape), dtype=lens.dtype, pin_memory=True)
    buf.copy_(lens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return buf, ready


def _accepted_of(values: Any) -> list[int] | None:
    """Accepted draft tokens per request, ``accept_lens - 1``, from the host values; None when a
    value is not an int >= 1 (an accept length always counts the bonus token)."""
    vals = values if isinstance(values, list) else values.tolist()
    if not all(type(v) is int and v >= 1 for v in vals):
        return None
    return [v - 1 for v in vals]


class VerifyTimer:
    """Events around each verify forward, written as JSON lines to ``out_dir/verify-rank<R>.jsonl``
    while the server runs (see the module docstring for the two halves and what a SIGKILL loses).

    One line per verify step: ``{"step": int, "verify_ms": float, "clock": str, "rank": str,
    "pid": int, "batch": int | null, "tokens": int | null, "accepted": [int, ...], "allreduce_paths":
    {mode: {path: count}}}``; ``accepted`` (only where :meth:`accept` gave it) holds the accepted
    draft tokens of each request, bonus excluded (see the module docstring); ``allreduce_paths`` (when the patch counts) holds the all-reduces since the
    previous record per forward mode, this step's under ``verify`` (:mod:`fastverify.patch.paths`);
    ``step`` counts this process's verify forwards from 0, ``verify_ms`` is milliseconds between
    the events around the forward, ``clock`` is ``cuda_events`` (GPU time) or ``cpu_wall_clock``
    (host ``perf_counter``, not a GPU time); ``batch`` is the requests in the verify forward and
    ``tokens`` the rows the target verifies (batch × draft tokens per request), as the forward
    batch held them (:func:`fastverify.patch.install.verify_load`), null where they could not be read.

    Parameters
    ----------
    out_dir : str or Path
        Folder of the JSON lines (created on the first write).
    every : int
        Wake the writer once this many finished lines wait (:data:`DRAIN_EVERY`).
    interval_s : float
        The writer appends at least this often (:data:`FLUSH_INTERVAL_S`); ``0`` or less: no
        writer thread, lines are written only by :meth:`drain` (tests, the doctor).
    event_factory, clock
        Events with ``record()``, ``query()`` and ``elapsed_time(end)`` (ms), and the clock name
        written into each line; default CUDA events when CUDA is available, else the wall clock.
    rank : callable returning str
        The rank in the file name and lines (read once, at the first finished record).
    max_buffered : int
        :data:`MAX_BUFFERED`.
    copy : callable
        :func:`host_copy` (tests give a stand-in for the CUDA copy).

    Attributes
    ----------
    expect_accepted : bool
        Set by the patch once the accept sampler is wrapped: each step then waits for
        :meth:`accept` (at most until the next step; a step the sampler never follows turns it
        off, so a worker that samples elsewhere loses nothing but its first step's wait).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        every: int = DRAIN_EVERY,
        interval_s: float = FLUSH_INTERVAL_S,
        event_factory: Callable[[], Any] | None = None,
        clock: str | None = None,
        rank: Callable[[], str] = _default_rank,
        max_buffered: int = MAX_BUFFERED,
        copy: Callable[[Any], tuple[Any, Any] | None] = host_copy,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.every = max(1, int(every))
        self.interval_s = float(interval_s)
        if event_factory is None:
            event_factory, default_clock = _default_event_factory()
            clock = clock or default_clock
        self.event_factory = event_factory
        self.clock = clock or "unknown"
        self.rank = rank
        self.max_buffered = max(1, int(max_buffered))
        self.copy = copy
        self.expect_accepted = False
        self._awaiting: _Step | None = None  # the last step, until accept() gives its accepted tokens
        self.pending: collections.deque[_Step] = collections.deque()  # not yet complete
        self.steps = 0
        self.written = 0
        self.dropped = 0
        self._lines: collections.deque[str] = collections.deque()  # finished, not yet written
        self._rank_pid: tuple[str, int] | None = None
        self._path: Path | None = None
        self._fd: int | None = None
        self._failed = False
        self._write_lock = threading.Lock()  # the writer thread vs drain(): whole batches, in order
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        _after_fork_timers.add(self)

    # -- the verify path: no I/O, no lock, no wait ----------------------------------------------------

    def start(self) -> Any:
        ev = self.event_factory()
        ev.record()
        return ev

    def stop(
        self, start_ev: Any, paths: dict | None = None, *, batch: int | None = None, tokens: int | None = None
    ) -> None:
        """End the step begun by ``start_ev``; ``paths``: the all-reduce path counts per forward
        mode since the previous record (:meth:`fastverify.patch.paths.PathCounter.take`);
        ``batch`` / ``tokens``: the step's requests and verified rows (None: not known, written
        as null)."""
        end = self.event_factory()
        end.record()
        if self._awaiting is not None:  # the previous step had no accept(): this worker samples elsewhere
            self._awaiting.accepted = None
            self._awaiting = None
            self.expect_accepted = False
        if len(self.pending) + len(self._lines) >= self.max_buffered:
            self.dropped += 1
        else:
            step = _Step(self.steps, start_ev, end, paths, batch, tokens, _AWAIT if self.expect_accepted else None)
            self.pending.append(step)
            if self.expect_accepted:
                self._awaiting = step
        self.steps += 1
        self._advance()

    def accept(self, accept_lens: Any) -> None:
        """Attach ``accept_lens`` (per request, bonus included: SGLang's ``eagle_sample``) to the
        step just timed; nothing when no step waits. Starts a copy, never waits for one."""
        step, self._awaiting = self._awaiting, None
        if step is None:
            return
        step.accepted = None  # should the copy raise, the record goes without it
        step.accepted = self.copy(accept_lens)
        self._advance()

    def _advance(self) -> None:
        self._finish_completed()
        if self._thread is None and self.interval_s > 0:
            self._start_writer()
        elif len(self._lines) >= self.every and not self._wake.is_set():
            self._wake.set()  # the one lock on this path: Event's own, once per `every` lines

    def _finish_completed(self, *, wait: bool = False) -> None:
        """Turn the oldest pending events that have completed into lines; stop at the first that
        has not (events of one stream complete in order). ``wait`` (exit only) synchronizes."""
        pending = self.pending
        while pending:
            st = pending[0]
            if wait and st.accepted is _AWAIT:  # at exit: no accept() comes any more
                st.accepted, self._awaiting = None, None
            ready = st.accepted[1] if isinstance(st.accepted, tuple) else None
            for ev in (st.end, ready) if wait else ():
                if hasattr(ev, "synchronize"):
                    try:
                        ev.synchronize()
                    except Exception:
                        pass
            if st.accepted is _AWAIT or not st.end.query() or (ready is not None and not ready.query()):
                return
            pending.popleft()
            if self._rank_pid is None:
                self._rank_pid = (str(self.rank()), os.getpid())
            rank, pid = self._rank_pid
            rec = {
                "step": st.step,
                "verify_ms": round(float(st.start.elapsed_time(st.end)), 6),
                "clock": self.clock,
                "rank": rank,
                "pid": pid,
                "batch": st.batch,
                "tokens": st.tokens,
            }
            accepted = _accepted_of(st.accepted[0]) if isinstance(st.accepted, tuple) else None
            if accepted is not None:
                rec["accepted"] = accepted
            if st.paths is not None:
                rec["allreduce_paths"] = st.paths
            self._lines.append(json.dumps(rec))

    # -- writing ----------------------------------------------------------------------------------------

    def _start_writer(self) -> None:
        self._thread = threading.Thread(
            target=_writer_loop, args=(weakref.ref(self),), name="fastverify-verify-log", daemon=True
        )
        try:
            self._thread.start()
        except RuntimeError as err:  # e.g. at interpreter shutdown: drain() at exit still writes
            log.warning("fastverify patch: verify-log writer not started: %s", err)
            self.interval_s = 0

    def _write_lines(self) -> int:
        """Append every finished line with one ``os.write`` (whole lines only); returns how many."""
        with self._write_lock:
            batch = []
            while self._lines:
                try:
                    batch.append(self._lines.popleft())
                except IndexError:
                    break
            if not batch or self._failed:
                return 0
            try:
                if self._fd is None:
                    self.out_dir.mkdir(parents=True, exist_ok=True)
                    if self._rank_pid is None:
                        self._rank_pid = (str(self.rank()), os.getpid())
                    self._path = self.out_dir / f"verify-rank{self._rank_pid[0]}.jsonl"
                    self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                data = ("\n".join(batch) + "\n").encode()
                view = memoryview(data)
                while view:  # a regular file takes it in one call; a short write (disk full) goes on
                    view = view[os.write(self._fd, view) :]
            except OSError as err:
                self._failed = True
                log.warning("fastverify patch: verify timings not written to %s: %s", self.out_dir, err)
                return 0
            self.written += len(batch)
            return len(batch)

    def drain(self, *, wait: bool = False) -> int:
        """Write every finished record now; returns how many this call wrote.

        Reads only events whose ``query()`` is True, unless ``wait`` (at exit), which first
        synchronizes on each pending end event. Called by the patch at exit and by tests and the
        doctor; the verify path never calls it.
        """
        self._finish_completed(wait=wait)
        return self._write_lines()

    def _after_fork(self) -> None:
        """In a forked child: no writer thread, fresh locks, nothing of the parent's records (the
        parent writes those), and a file of the child's own rank."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self.pending.clear()
        self._awaiting = None
        self._lines.clear()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._fd = None
        self._path = None
        self._rank_pid = None


def _writer_loop(ref: weakref.ref[VerifyTimer]) -> None:
    """The writer thread: append finished lines every ``interval_s`` or when woken; ends with the
    timer (weak reference: a timer a test drops takes its thread with it)."""
    while True:
        t = ref()
        if t is None or t.interval_s <= 0:
            return
        wake, interval = t._wake, t.interval_s
        del t
        wake.wait(interval)
        wake.clear()
        t = ref()
        if t is None:
            return
        t._write_lines()
        del t


_after_fork_timers: weakref.WeakSet[VerifyTimer] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for t in list(_after_fork_timers):
        t._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class VerifyTrace:
    """A torch.profiler trace of the next ``steps`` verify forwards of this rank, each inside a
    ``step[TARGET_VERIFY #i]`` span (the form ``fastverify profile --trace`` splits steps on),
    written to ``out_dir/verify-TP-<rank>.trace.json.gz`` when the last one ends. Profiling costs
    time, so the timings in the JSON lines of those steps are not representative; it stops itself."""

    def __init__(self, out_dir: str | Path, steps: int, *, rank: Callable[[], str] = _default_rank) -> None:
        self.out_dir = Path(out_dir)
        self.steps = int(steps)
        self.rank = rank
        self.done = 0
        self._prof: Any = None
        self._span: Any = None
        self.path: Path | None = None

    @property
    def active(self) -> bool:
        return self.done < self.steps

    def begin(self) -> None:
        if not self.active:
            return
        try:
            import torch

            if self._prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                # Shapes give the all-reduce sizes of a CPU trace (gloo spans carry Input Dims).
                self._prof = torch.profiler.profile(activities=acts, record_shapes=True)
                self._prof.__enter__()
            self._span = torch.profiler.record_function(f"step[TARGET_VERIFY #{self.done}]")
            self._span.__enter__()
        except Exception as err:  # profiling must never break serving
            log.warning("fastverify patch: verify trace not started: %s", err)
            self.steps = 0

    def end(self) -> None:
        if self._span is None:
            return
        try:
            self._span.__exit__(None, None, None)
            self._span = None
            self.done += 1
            if self.done >= self.steps:
                self._prof.__exit__(None, None, None)
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self.path = self.out_dir / f"verify-TP-{self.rank()}.trace.json.gz"
                self._prof.export_chrome_trace(str(self.path))
                self._prof = None
                log.info("fastverify patch: wrote a trace of %d verify steps to %s", self.done, self.path)
        except Exception as err:
            log.warning("fastverify patch: verify trace not written: %s", err)
            self.steps = 0
