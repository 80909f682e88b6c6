"""Progress lines on stderr for work that runs longer than about two seconds.

One line per update, never a redraw: a log file, a CI job or ``2>&1 | tee`` reads the same as a
terminal. Short jobs print nothing: the first line comes only once ``after_s`` seconds have gone
by (default :data:`AFTER_S`), and then at most one line per ``every_s`` seconds, plus the last.

    fastverify: loading traces 3/8 (rank 2, 53.7 MB), 4.1 s elapsed, about 6.8 s left

The environment variable ``FASTVERIFY_PROGRESS_AFTER_S`` (seconds, a number >= 0) replaces
:data:`AFTER_S` for every :class:`Progress` made without an explicit ``after_s``; ``0`` prints from
the first step, which is how a test (or a user who wants every line) forces the lines on. A value
that is not a number >= 0 is ignored.

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TextIO

from fastverify.errors import printable, shown

__all__ = ["AFTER_S", "AFTER_S_ENV", "Progress", "default_after_s", "progress_lost", "say"]

AFTER_S = 2.0  # silent before this many seconds of work
AFTER_S_ENV = "FASTVERIFY_PROGRESS_AFTER_S"


def default_after_s() -> float:
    """Seconds of silence before the first line: ``$FASTVERIFY_PROGRESS_AFTER_S`` when it holds a
    finite number >= 0, else :data:`AFTER_S`."""
    text = os.environ.get(AFTER_S_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if math.isfinite(value) and value >= 0:
            return value
        if text not in _WARNED:  # said once per value, on stderr; the default is used
            _WARNED.add(text)
            say(f"warning: {AFTER_S_ENV}={text!r} is not a number of seconds >= 0; using {AFTER_S:g} s")
    return AFTER_S


_WARNED: set[str] = set()


_LOST: list[tuple[object, str]] = []  # (a stream a line could not be written to, why); then dropped


def progress_lost() -> str | None:
    """Why a line could not be written to this process's stderr (a full device, a closed stream,
    a reader gone), or None when every line was; a command that finished its work exits 1 then,
    as for a stdout it could not write."""
    return next((why for s, why in _LOST if s is sys.stderr), None)


def say(text: str, *, stream: TextIO | None = None) -> None:
    """One ``fastverify: <text>`` line on stderr now (for facts a user must see at once, e.g. a
    live run that falls back from GPU to CPU). Never raises for the stream: stderr holds progress
    only, so once one line cannot be written (``2>/dev/full``, ``2>&-``, a reader gone) it and
    every later line to that stream are dropped and the work goes on (:func:`progress_lost`)."""
    out = stream or sys.stderr
    if out is None or any(out is s for s, _ in _LOST):
        return
    try:
        print(f"fastverify: {shown(text)}", file=out, flush=True)
    except (OSError, ValueError) as e:  # ValueError: a closed file
        why = printable(getattr(e, "strerror", None) or str(e))
        _LOST.append((out, why))
        if out is sys.stderr:  # its unwritten buffer would fail again at exit: nothing more goes there
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - kept open to the end
            _LOST.append((sys.stderr, why))


class Progress:
    """Counted progress of one job (``what``), ``total`` steps (None when unknown).

    Parameters
    ----------
    what : str
        The job, e.g. ``"loading traces"``, ``"live run"``, ``"sweep"``.
    total : int or None
        Number of steps; with it each line gives ``i/N`` and an estimate of the time left:
        the seconds since this object was made / steps done × steps remaining.
    enabled : bool
        False prints nothing (``--quiet``).
    after_s, every_s : float
        Seconds of silence at the start (None: :func:`default_after_s`, i.e. :data:`AFTER_S`
        unless ``$FASTVERIFY_PROGRESS_AFTER_S`` says otherwise), and the least seconds between two
        lines (the line of the last step is always printed once past the silence).
    clock : callable
        Seconds, monotonic (``time.monotonic``; a test passes its own).
    job_start : float or None
        Clock value at which the whole job began, when this object counts one phase of a longer
        job (the forwards of a live run after its start-up): the silence and the "elapsed" of each
        line count from it, while the time left still comes from this phase's own rate. None: now.
    eta : bool
        Give the time left. False for steps that run side by side (ranks starting at once), where
        the rate of the first says nothing about the others.
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        enabled: bool = True,
        after_s: float | None = None,
        every_s: float = 1.0,
        stream: TextIO | None = None,
        clock=time.monotonic,
        job_start: float | None = None,
        eta: bool = True,
    ) -> None:
        self.what = what
        self.total = total
        self.enabled = enabled
        self.after_s = default_after_s() if after_s is None else after_s
        self.every_s = every_s
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self.job_start = self.start if job_start is None else job_start
        self.eta = eta
        self._last: float | None = None
        self.lines = 0

    def elapsed(self) -> float:
        """Seconds since the job started (``job_start``)."""
        return self.clock() - self.job_start

    def left(self, done: int) -> float | None:
        """Seconds still to go after ``done`` steps at this phase's rate so far; None when unknown
        (no total, nothing done yet, all done, or ``eta`` off)."""
        if not self.eta or self.total is None or not 0 < done < self.total:
            return None
        return (self.clock() - self.start) / done * (self.total - done)

    def update(self, done: int, detail: str = "", *, force: bool = False) -> bool:
        """Report ``done`` steps finished; prints when due (or ``force``). True when a line was printed."""
        if not self.enabled:
            return False
        now = self.clock()
        el = now - self.job_start
        last = self.total is not None and done >= self.total
        due = el >= self.after_s and (self._last is None or now - self._last >= self.every_s or last)
        if not (due or force):
            return False
        self._last = now
        self.lines += 1
        count = f" {done}/{self.total}" if self.total is not None else f" {done}"
        left = self.left(done)
        tail = "" if left is None else f", about {left:.1f} s left"
        say(f"{self.what}{count}{f' ({detail})' if detail else ''}, {el:.1f} s elapsed{tail}", stream=self.stream)
        return True
