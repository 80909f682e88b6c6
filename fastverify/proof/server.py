"""The server ``launch`` keeps as its child (with ``--load`` or ``--baseline``): started in its own
process group, killed by the kernel if ``launch`` dies (``PR_SET_PDEATHSIG``), sent the signals
``launch`` receives, waited for until healthy (bounded), and stopped (SIGTERM, then SIGKILL).

SGLang 0.5.23's scheduler and detokenizer processes ask for SIGKILL when their parent dies
(``srt/utils/common.py::kill_itself_when_parent_died``), so a server whose main process ends takes
its workers with it; its HTTP server turns SIGINT/SIGTERM into a graceful stop
(``srt/entrypoints/http_server.py``). ``GET /health_generate`` answers 200 once the server has run
a generation (the same file).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from fastverify.collect.server import http
from fastverify.errors import UserError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEALTH = "/health_generate"
POLL_S = 2.0
PROBE_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ServerExited(Exception):
    """The server's main process ended on its own; ``returncode`` as :attr:`subprocess.Popen.returncode`."""

    def __init__(self, returncode: int) -> None:
        super().__init__(returncode)
        self.returncode = returncode


class Stopped(Exception):
    """``launch`` received ``signum`` (forwarded to the server's process group)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_code(returncode: int) -> int:
    """A shell's exit code for a child's ``returncode`` (``-N``: killed by signal N, 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing). ``launch``
    calls Popen from its only thread, so ``preexec_fn`` is safe here."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Server:
    """The server command, started at construction.

    Raises
    ------
    UserError
        The command cannot be run (not found, not executable).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        try:
            self.proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as err:
            raise UserError(f"cannot run {argv[0]!r}: {err.strerror or err}") from None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Server:
        for s in FORWARDED:
            self._previous[s] = signal.signal(s, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _forward(self, signum, _frame) -> None:
        self.signal(signum)
        raise Stopped(signum)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the server's process group (nothing when it is gone)."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def check_alive(self) -> None:
        """Raise :class:`ServerExited` when the server's main process has ended."""
        rc = self.proc.poll()
        if rc is not None:
            raise ServerExited(rc)

    def wait_healthy(self, url: str, timeout_s: float) -> float:
        """Seconds until ``url + /health_generate`` answered 200.

        Raises
        ------
        ServerExited
            The server ended first.
        TimeoutError
            Not healthy within ``timeout_s``.
        """
        t0 = time.monotonic()
        while True:
            self.check_alive()
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"{url} was not healthy after {timeout_s:g} s ({HEALTH} never answered 200)")
            try:
                status, _ = http("GET", url + HEALTH, timeout_s=min(PROBE_TIMEOUT_S, max(left, 1.0)))
            except OSError:
                status = 0
            if status == 200:
                return time.monotonic() - t0
            time.sleep(min(POLL_S, max(left, 0.05)))

    def wait(self) -> int:
        """Wait for the server to end; its :attr:`~subprocess.Popen.returncode`."""
        return self.proc.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM to the process group, SIGKILL to it after ``grace_s``; the main process's
        return code (its own, when it had already ended)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever of the group is left (a worker that ignored SIGTERM)
        return self.proc.wait()
