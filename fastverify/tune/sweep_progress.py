"""A sweep's trial progress on stderr: a rich bar on a terminal, plain ``fastverify:`` lines with
a heartbeat elsewhere (CI, a log file), and a line for every trial that does not end ``ok``.
"""

from __future__ import annotations

from fastverify.console import say as say_line
from fastverify.tune.path_counts import NotRankedStatus, fell_back, path_counts
from fastverify.tune.trial import TrialResult, TrialSpec, TrialStatus

HEARTBEAT_S = 5.0
"""Longest a sweep's plain progress lines stay silent while a trial runs (s)."""


class TrialProgress:
    """Trial progress on stderr, or nothing when disabled.

    On a terminal: a rich bar, ``tune ━━━━━━ 3/8 0:01:12 ETA 0:02:05 <trial name>`` (trials done
    of all, elapsed, rich's estimate of the time left, the running trial). Anywhere else (CI, a
    log file, ``2>&1 | tee``), where a bar shows nothing until it ends: plain lines from
    :class:`fastverify.progress.Progress`, e.g. ``fastverify: tune: trials 2/8 (running nccl
    NCCL_PROTO=LL), 12.3 s elapsed, about 36.9 s left`` when a trial starts (none in the first
    2 s, at most one a second) and one when the last has finished. A trial that does not end
    ``ok`` is reported either way: a rich line on the terminal, a ``fastverify:`` line elsewhere.

    Parameters
    ----------
    enabled : bool
        False (or no trials): nothing at all.
    total : int
        Trials to run.
    console : rich.console.Console or None
        Where the bar goes and whether that is a terminal (``Console.is_terminal``); None: a
        console on stderr.
    """

    def __init__(self, enabled: bool, total: int, *, console=None) -> None:
        self.enabled = enabled and total > 0
        self.total = total
        self._console = console
        self._bar = None
        self._lines = None  # fastverify.progress.Progress when stderr is not a terminal
        self._done = 0
        self._running: tuple[TrialSpec | None, float] = (None, 0.0)
        self._last_line = float("-inf")
        self._stop = None

    def __enter__(self) -> TrialProgress:
        if self.enabled:
            from rich.console import Console

            console = self._console or Console(stderr=True)
            if console.is_terminal:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self._bar = Progress(TextColumn("[bold]tune[/]"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     TextColumn("{task.description}"), console=console, transient=False)
                self._bar.__enter__()
                self._task = self._bar.add_task("", total=self.total)
            else:
                import threading

                from fastverify.progress import Progress as Lines

                self._lines = Lines("tune: trials", self.total, stream=console.file)
                self._stop = threading.Event()
                self._beat = threading.Thread(target=self._heartbeat, name="fastverify-tune-progress", daemon=True)
                self._beat.start()
        return self

    def _heartbeat(self) -> None:
        """Plain-lines mode: with no line for :data:`HEARTBEAT_S` (a trial can build kernels for
        minutes), say which trial runs and for how long."""
        import time

        from fastverify.progress import default_after_s, say

        while not self._stop.wait(0.5):
            now = time.monotonic()
            spec, since = self._running
            if spec is None or now - self._last_line < HEARTBEAT_S or self._lines.elapsed() < default_after_s():
                continue
            self._last_line = now
            say(f"tune: trial {self._done + 1}/{self.total} running {spec.name} for {now - since:.0f} s, "
                f"{self._lines.elapsed():.1f} s elapsed", stream=self._lines.stream)

    def start(self, spec: TrialSpec) -> None:
        import time

        self._running = (spec, time.monotonic())
        if self._bar is not None:
            self._bar.update(self._task, description=spec.name)
        elif self._lines is not None and self._lines.update(self._done, f"running {spec.name}"):
            self._last_line = time.monotonic()

    def finish(self, spec: TrialSpec, result: TrialResult) -> None:
        if not self.enabled:
            return
        self._done += 1
        self._running = (None, 0.0)
        status, reason = result.status.value, result.reason
        counts = path_counts(result) if result.ok else None
        if counts is not None and (why := fell_back(spec, counts)) is not None:
            # measured, but not as its backend: said like a failure
            status, reason = NotRankedStatus.FELL_BACK.value, why
        if self._bar is not None:
            if status != TrialStatus.OK.value:
                say_line(self._bar.console, f"{spec.name}: {status} {reason}", "yellow")
            self._bar.advance(self._task)
            return
        if self._lines is None:
            return
        if status != TrialStatus.OK.value:
            from fastverify.progress import say

            say(f"tune: trial {self._done}/{self.total} {spec.name}: {status}"
                f"{f' ({reason})' if reason else ''}", stream=self._lines.stream)
        if self._done == self.total:
            self._lines.update(self._done, "all run")

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop.set()
            self._beat.join()
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
