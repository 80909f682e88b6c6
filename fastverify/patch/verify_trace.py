"""A torch.profiler trace of a few verify forwards of one rank (``launch --trace-verify-steps N``),
in the form ``fastverify profile --trace`` reads. torch is imported only when the trace starts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastverify.patch.verify import _default_rank

log = logging.getLogger("fastverify.patch")


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
