"""Rank processes shared by the live profiler, the tune sweep and the P2P check: the one launcher
(:class:`RankGroup`, with the one kill rule), environment, parent-death signal, reading a failed
rank's exit status and stderr, the temporary folders of rank runs, and the signals and cores of
forked helpers (the profile's painter, the trace-decoding workers). (Output paths and files:
:mod:`fastverify.outputs`, :mod:`fastverify.outputs`.)"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def child_env() -> dict[str, str]:
    """The parent's environment (NCCL_*, CUDA_VISIBLE_DEVICES pass through) with this package importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the folder holding the fastverify package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# The parent-death request runs in a tiny Python wrapper that then execs the real program, not in
# ``preexec_fn``: Python's subprocess documentation warns that ``preexec_fn`` is not safe with
# threads in the parent (the child can deadlock before exec), and the P2P check and ``tune`` start
# ranks while other threads run. The wrapper (argv: signal, parent pid, report fd, program...)
# asks for the signal (``prctl(PR_SET_PDEATHSIG)``, <linux/prctl.h> option 1), sends it to itself
# if the parent already died, and execs the program with the environment it was started with
# (``/proc/self/environ``: Python's start-up may add LC_CTYPE to ``os.environ``, PEP 538). An
# exec failure is written to the report fd (close-on-exec, so a successful exec closes it); the
# parent raises it as :class:`OSError`, as ``subprocess.Popen`` would.
_PDEATH_WRAPPER = """\
import ctypes, os, sys
sig, parent, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.set_inheritable(fd, False)
ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)
if os.getppid() != parent:
    os.kill(os.getpid(), sig)
raw = open("/proc/self/environ", "rb").read().split(b"\\0")
env = dict(os.fsdecode(e).split("=", 1) for e in raw if b"=" in e)
try:
    os.execvpe(sys.argv[4], sys.argv[4:], env)
except OSError as err:
    os.write(fd, f"{err.errno}\\0{err.strerror}".encode())
    os._exit(127)
"""


def popen_dying_with_parent(argv, *, death_signal: int = signal.SIGKILL, **popen_kw):
    """``subprocess.Popen(argv, **popen_kw)`` whose process gets ``death_signal`` from Linux when
    the thread that started it ends (``PR_SET_PDEATHSIG``: the parent *thread*, so call it from a
    thread that outlives the child), so a killed ``fastverify`` never leaves ranks computing (and
    holding GPUs) as orphans. Safe from any thread: no ``preexec_fn`` (see the wrapper above).
    Elsewhere than Linux a plain ``Popen``. The returned ``Popen``'s pid is the program's own.

    Raises
    ------
    OSError
        The program cannot be started (not found, not executable), as ``Popen`` raises it.
    """
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(list(argv), **popen_kw)
    read_fd, write_fd = os.pipe()
    try:
        wrapper = [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _PDEATH_WRAPPER,
            str(int(death_signal)),
            str(os.getpid()),
            str(write_fd),
            *[os.fspath(a) for a in argv],
        ]
        proc = subprocess.Popen(wrapper, pass_fds=(write_fd,), **popen_kw)
        os.close(write_fd)
        write_fd = -1
        with os.fdopen(read_fd, "rb") as report:
            read_fd = -1
            failure = report.read()  # EOF once the program is exec'd (or the wrapper died)
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
    if failure:
        proc.wait()
        code, _, text = failure.decode(errors="replace").partition("\0")
        raise OSError(int(code), text, os.fspath(argv[0]))
    proc.args = list(argv)
    return proc


def exit_reason(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def stderr_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.stderr"


def failure_time(workdir: str, rank: int, seen_ns: int) -> int:
    """When ``rank`` failed, in ``time.monotonic_ns()`` (one clock for all processes on Linux)."""
    try:
        return int((Path(workdir) / f"rank{rank}.failed").read_text())
    except (OSError, ValueError):
        return seen_ns  # died without recording (signal, OOM kill, import error)


def last_stderr_line(workdir: str, rank: int) -> str:
    try:
        lines = stderr_path(workdir, rank).read_text(errors="replace").splitlines()
    except OSError:
        return "no stderr output"
    lines = [ln.strip() for ln in lines if ln.strip()]
    return lines[-1] if lines else "no stderr output"


def rank_device(rank: int, cuda: bool, cpu_threads: int):
    """In a rank process: pin GPU ``rank`` (CUDA) or cap torch's CPU threads so that ranks sharing
    the cores do not oversubscribe them; returns the ``torch.device`` the rank computes on."""
    import torch

    if cuda:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(cpu_threads)
    return torch.device("cpu")


# ---- the one rank-process launcher ----------------------------------------------------------------

KILL_GRACE_S = 5.0
"""Seconds a rank's process group has between SIGTERM and SIGKILL when :class:`RankGroup` stops it."""


class RankGroup:
    """The one launcher of rank processes (live profiler, tune trials, P2P check children and sides).

    Each ``argv`` starts in its own session, hence its own process group (``start_new_session``),
    asks Linux to SIGKILL it when the parent dies (:func:`popen_dying_with_parent`), reads nothing on stdin
    and writes stderr to ``workdir/rank<r>.stderr`` (stdout too, to ``rank<r>.stdout``, with
    ``capture_stdout``; else it is discarded: data never passes through stdout).

    One kill rule, applied by :meth:`stop` (and on leaving the ``with`` block, whatever happened):
    every rank's process group gets SIGTERM; after ``grace_s`` seconds, or as soon as every rank
    has exited, every group gets SIGKILL (so a descendant that ignores SIGTERM, or outlives its
    rank, goes too), and then every rank is reaped. A temporary ``workdir`` made here is removed
    on leaving. Exits are observed without reaping (``waitid`` with ``WNOWAIT``) until then, so a
    rank's pid, which is its group id, cannot be reused by another process before the group is
    killed.

    Parameters
    ----------
    workdir : path or None
        Folder of the stderr/stdout files (and of the callers' spec and result files); ``None``
        makes one with :func:`make_workdir` and removes it on leaving.
    prefix : str
        Prefix of the temporary folder.
    env : dict[str, str] or None
        The ranks' environment (``None``: the parent's).
    grace_s : float
        Seconds from SIGTERM to SIGKILL.
    capture_stdout : bool
        Keep stdout in ``rank<r>.stdout`` instead of discarding it.

    Raises
    ------
    OSError
        From :meth:`start`: a program that cannot be started (the ranks started so far are stopped
        on leaving the ``with`` block).
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        prefix: str = "fastverify-",
        env: dict[str, str] | None = None,
        grace_s: float = KILL_GRACE_S,
        capture_stdout: bool = False,
    ) -> None:
        self._owned = workdir is None
        self.workdir = make_workdir(prefix) if workdir is None else Path(workdir)
        self.env = env
        self.grace_s = float(grace_s)
        self.capture_stdout = capture_stdout
        self.procs: list = []
        self._codes: dict[int, int] = {}  # rank -> exit status as Popen.returncode spells it
        self._seen_ns: dict[int, int] = {}  # rank -> time.monotonic_ns() when its exit was first seen

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, argvs) -> None:
        """Start one process per ``argv`` in ``argvs`` (a sequence of argument lists); rank ``r``
        is ``argvs[r]``, run with ``cwd=workdir``."""
        for argv in argvs:
            rank = len(self.procs)
            out_path = self.workdir / f"rank{rank}.stdout"
            with (
                open(stderr_path(self.workdir, rank), "wb") as err,
                open(out_path, "wb") if self.capture_stdout else open(os.devnull, "wb") as out,
            ):
                self.procs.append(
                    popen_dying_with_parent(
                        list(argv),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=self.env,
                        cwd=self.workdir,
                        start_new_session=True,
                    )
                )

    def returncode(self, rank: int) -> int | None:
        """Rank ``rank``'s exit status (negative: killed by that signal), or None while it runs;
        the process is not reaped."""
        if rank not in self._codes:
            try:
                info = os.waitid(os.P_PID, self.procs[rank].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already (by stop): Popen has the status
                info, code = None, self.procs[rank].returncode
            else:
                if info is None:
                    return None
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self._codes[rank] = code
            self._seen_ns[rank] = time.monotonic_ns()
        return self._codes[rank]

    def poll(self) -> dict[int, int]:
        """The ranks that have exited so far → ``time.monotonic_ns()`` when each exit was first seen."""
        for rank in range(len(self.procs)):
            self.returncode(rank)
        return dict(self._seen_ns)

    def all_exited(self) -> bool:
        return len(self.poll()) == len(self.procs)

    def stop(self) -> None:
        """The kill rule (class docstring): SIGTERM to every group, SIGKILL after the grace period
        or once every rank has exited, then reap every rank. Safe to call more than once."""
        live = [p for p in self.procs if p.returncode is None]  # not reaped: pid = our group id
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.all_exited():
            time.sleep(0.01)
        for p in live:
            _signal_group(p, signal.SIGKILL)
        for p in live:
            p.wait()

    def close(self) -> None:
        """:meth:`stop`, then remove the workdir when it was made here."""
        try:
            self.stop()
        finally:
            if self._owned:
                shutil.rmtree(self.workdir, ignore_errors=True)


def _signal_group(proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the group is empty: every member has been reaped
    except PermissionError:
        proc.send_signal(sig)


# ---- temporary folders of rank runs ---------------------------------------------------------------

_OWNER_FILE = ".fastverify-owner"


def start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot): with the pid it
    names one process, so a reused pid is not taken for the folder's owner. None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X") else None


def make_workdir(prefix: str) -> Path:
    """A new temporary folder ``<tmp>/<prefix>XXXXXXXX`` stamped with this process (pid and start
    time, in ``.fastverify-owner``), after removing every ``<prefix>*`` folder whose stamped owner
    is gone.

    A run ended by SIGKILL (``kill -9``, the OOM killer) cannot remove its own folder; the next run
    with the same prefix does. Only folders carrying an owner stamp whose process no longer exists
    are removed, so a concurrent run's folder, or anything else in ``/tmp``, is never touched.
    Linux only for the sweep (it reads ``/proc``); elsewhere nothing is swept.

    Returns
    -------
    Path
        The new folder; the caller removes it (:func:`rank_workdir` and :class:`RankGroup` do).
    """
    base = Path(tempfile.gettempdir())
    if Path("/proc/self/stat").exists():
        for old in base.glob(f"{glob.escape(prefix)}*"):
            try:
                pid_text, ticks = (old / _OWNER_FILE).read_text().split()
                stale = start_ticks(int(pid_text)) != ticks
            except (OSError, ValueError):
                continue  # not stamped by us (or being written): leave it
            if stale:
                shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    ticks = start_ticks(os.getpid())
    if ticks is not None:
        (path / _OWNER_FILE).write_text(f"{os.getpid()} {ticks}")
    return path


@contextlib.contextmanager
def rank_workdir(prefix: str) -> Iterator[str]:
    """:func:`make_workdir` as a ``with`` block (its path as a str), removed on leaving."""
    path = make_workdir(prefix)
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity on Linux, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP in this thread while helpers are forked: a helper starts with
    them held until :func:`quiet_child_signals` has set its own handling, so a Ctrl-C that lands
    during the fork cannot interrupt the new process half-way (a traceback from the child). The
    parent gets a signal that came meanwhile as soon as the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def quiet_child_signals() -> None:
    """In a forked helper (painter, trace-decoding worker): Ctrl-C goes to the whole process group,
    and the parent alone answers it (one line, then it stops its children); SIGTERM/SIGHUP end the
    helper without Python's handler, which the fork copied from the CLI and which would print a
    traceback. Then the signals held over the fork (:func:`signals_held`) are let through."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
