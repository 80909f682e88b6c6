"""The verify timer and trace of the in-rank patch (``--profile-verify DIR``): events around each
verify forward, no host sync, drained as JSON lines; optionally a torch.profiler trace of N steps.

Wraps ``tp_worker.TpModelWorker.forward_batch_generation(..., is_verify=...)`` (SGLang 0.5.23).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastverify.patch.rank import is_capturing as _is_capturing

log = logging.getLogger("fastverify.patch")

DRAIN_EVERY = 64


# --- the verify timer -------------------------------------------------------------------------------


class _WallEvent:
    """CPU stand-in for ``torch.cuda.Event`` (no GPU): wall clock, always complete."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0

    def record(self) -> None:
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_WallEvent") -> float:
        return (end.t - self.t) / 1e6


def _default_event_factory() -> tuple[Callable[[], Any], str]:
    try:
        import torch

        if torch.cuda.is_available():
            return (lambda: torch.cuda.Event(enable_timing=True)), "cuda_events"
    except Exception:
        pass
    return _WallEvent, "cpu_wall_clock"


def _default_rank() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    return f"pid{os.getpid()}"


class VerifyTimer:
    """Events around each verify forward; :meth:`drain` writes the finished ones as JSON lines
    (``{"step", "verify_ms", "clock", "rank", "pid"}``) to ``out_dir/verify-rank<R>.jsonl``.
    Recording never waits for the GPU; draining reads only events whose ``query()`` is True."""

    def __init__(self, out_dir: str | Path, *, every: int = DRAIN_EVERY,
                 event_factory: Callable[[], Any] | None = None, clock: str | None = None,
                 rank: Callable[[], str] = _default_rank) -> None:
        self.out_dir = Path(out_dir)
        self.every = max(1, int(every))
        if event_factory is None:
            event_factory, default_clock = _default_event_factory()
            clock = clock or default_clock
        self.event_factory = event_factory
        self.clock = clock or "unknown"
        self.rank = rank
        self.pending: list[tuple[int, Any, Any]] = []
        self.steps = 0
        self.written = 0
        self._path: Path | None = None

    def start(self) -> Any:
        ev = self.event_factory()
        ev.record()
        return ev

    def stop(self, start_ev: Any) -> None:
        end = self.event_factory()
        end.record()
        self.pending.append((self.steps, start_ev, end))
        self.steps += 1
        if len(self.pending) >= self.every:
            self.drain()

    def drain(self, *, wait: bool = False) -> int:
        """Write finished events; ``wait=True`` (at exit) synchronizes on the last ones."""
        done, keep = [], []
        for item in self.pending:
            _, s, e = item
            if wait and hasattr(e, "synchronize"):
                try:
                    e.synchronize()
                except Exception:
                    pass
            (done if e.query() else keep).append(item)
        self.pending = keep
        if not done:
            return 0
        try:
            if self._path is None:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self._path = self.out_dir / f"verify-rank{self.rank()}.jsonl"
            rank, pid = self.rank(), os.getpid()
            with open(self._path, "a", encoding="utf-8") as f:
                for step, s, e in done:
                    f.write(json.dumps({"step": step, "verify_ms": round(float(s.elapsed_time(e)), 6),
                                        "clock": self.clock, "rank": rank, "pid": pid}) + "\n")
        except Exception as err:
            log.warning("fastverify patch: verify timings not written to %s: %s", self.out_dir, err)
            return 0
        self.written += len(done)
        return len(done)


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
                self._prof = torch.profiler.profile(activities=acts)
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


def _make_verify_wrapper(original: Callable, timer: VerifyTimer, trace: VerifyTrace | None = None) -> Callable:
    sig = inspect.signature(original)
    names = list(sig.parameters)
    pos = names.index("is_verify") - 1 if "is_verify" in names else -1  # minus self

    def forward_batch_generation(self, *args, **kwargs):
        if "is_verify" in kwargs:
            is_verify = kwargs["is_verify"]
        else:
            is_verify = 0 <= pos < len(args) and args[pos]
        if not is_verify or _is_capturing():
            return original(self, *args, **kwargs)
        tracing = trace is not None and trace.active
        if tracing:
            trace.begin()
        start = timer.start()
        try:
            out = original(self, *args, **kwargs)
        finally:
            timer.stop(start)
            if tracing:
                trace.end()
        return out

    return forward_batch_generation
