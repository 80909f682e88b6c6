"""Rank processes shared by the live profiler, the tune sweep and the P2P check: the one launcher
(:class:`RankGroup`, with the one kill rule), environment, parent-death signal, reading a failed
rank's exit status and stderr, and the checks on output paths."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def child_env() -> dict[str, str]:
    """The parent's environment (NCCL_*, CUDA_VISIBLE_DEVICES pass through) with this package importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the folder holding the fastverify package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL this rank when the parent dies, so a killed
    ``fastverify`` never leaves ranks computing (and holding GPUs) as orphans. No-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


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


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode when both exist, else the same
    resolved path (symlinks and ``./`` folded)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def check_outputs(outputs: "dict[str, Path | str | None]", inputs: "dict[str, Path | str | None]" = None) -> None:
    """Refuse, before any work, an output that would replace an input or another output.

    Parameters
    ----------
    outputs : dict[str, path or None]
        Flag (``"--output"``) → the file it writes; None entries are ignored. Each is also checked
        with :func:`writable_target` (no directory, device or FIFO).
    inputs : dict[str, path or None]
        Flag → a file (or folder) it reads. A folder input also protects every existing file
        inside it (a new file may be written there).

    Raises
    ------
    UserError
        One line naming both flags and the path.
    """
    from fastverify.errors import UserError

    outs = [(flag, Path(p)) for flag, p in outputs.items() if p]
    ins = [(flag, Path(p)) for flag, p in (inputs or {}).items() if p]
    for i, (flag, path) in enumerate(outs):
        writable_target(path)
        for in_flag, in_path in ins:
            # a file that already sits in an input folder is one of the inputs read from it
            inside = in_path.is_dir() and path.exists() and \
                Path(os.path.realpath(path)).is_relative_to(os.path.realpath(in_path))
            if inside or _same_file(path, in_path):
                raise UserError(f"{flag} {path}: is the input of {in_flag}; an output never replaces an input")
        for other_flag, other in outs[:i]:
            if _same_file(path, other):
                raise UserError(f"{flag} {path}: is also the output of {other_flag}; give each output its own file")


def writable_target(path: Path) -> Path:
    """The file to write for ``path``: a symlink's target; anything but a regular file (a directory,
    a device, a FIFO) is refused with a UserError naming it, so an output never replaces one."""
    from fastverify.errors import UserError

    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise UserError(f"{path}: is {kind}; give a file path to write")
    return path


def refuse_symlink(path: Path | str, flag: str | None = None) -> None:
    """Refuse an output path that is a symlink (dangling or not): fastverify replaces the file at
    ``path`` by renaming a new one over it, and never writes through a link to somewhere else.

    Raises
    ------
    UserError
        One line naming the flag, the path and where the link points.
    """
    from fastverify.errors import UserError

    p = Path(path)
    if os.path.islink(p):
        try:
            target = os.readlink(p)
        except OSError:
            target = "?"
        name = f"{flag} {p}" if flag else str(p)
        raise UserError(f"{name}: is a symlink (to {target}); outputs are never written through a symlink, "
                        "so it is refused: give the real file's path")


def write_error(path: Path, err: OSError) -> str:
    """The one line for a failed write of ``path``: where a folder on the way is a file (mkdir says
    only "File exists" / "Not a directory"), that file is named; else the OS reason."""
    for parent in Path(path).parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{path}: cannot write: {parent} is a file, not a folder"
            break
    return f"{path}: cannot write ({err.strerror or err})"


# ---- the one output writer ----------------------------------------------------------------------

_RESERVED: dict[str, tuple[int, int]] = {}
"""Placeholders this process made with :func:`reserve_names` (absolute path -> ``(st_dev, st_ino)``)
and has not yet filled (:func:`write_files`) or removed (:func:`release_reserved`)."""
_CREATED: list[str] = []
"""Folders :func:`reserve_names` made; :func:`release_reserved` removes each one left empty."""
_MAX_TRIES = 10_000


def _exclusive_create(path: Path) -> tuple[int, int]:
    """Create ``path`` empty, failing with FileExistsError if any entry (a symlink too) has the name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def reserve_names(folder: Path | str, base: str, suffixes: tuple[str, ...],
                  free: tuple[str, ...] = ()) -> list[Path]:
    """New, unique file names ``folder/<base>[-<n>]<suffix>`` for each of ``suffixes``, each created
    empty with an exclusive create (``O_CREAT | O_EXCL``) so that no other run, started in the same
    second, can take the same name; ``-<n>`` (2, 3, ...) is added until every name is new and no
    entry named ``<base>[-<n>]<s>`` for ``s`` in ``free`` exists. The placeholders are filled by
    :func:`write_files` (a temporary file renamed over each) and removed by :func:`release_reserved`
    (at the latest when the process exits) if they never are.

    Raises
    ------
    UserError
        The folder cannot be created or written.
    """
    import atexit

    from fastverify.errors import UserError

    folder = Path(folder)
    if not _RESERVED:
        atexit.register(release_reserved)
    n = remade = 0
    while n < _MAX_TRIES:
        n += 1
        if n == 1 or remade:  # again if a concurrent run removed its empty new folder
            try:
                if not folder.is_dir():
                    folder.mkdir(parents=True)
                    _CREATED.append(os.path.abspath(folder))
            except FileExistsError:
                pass  # made meanwhile by a concurrent run, or a file: the create below says which
            except OSError as e:
                raise UserError(write_error(folder / f"{base}{suffixes[0]}", e)) from None
        stem = base if n == 1 else f"{base}-{n}"
        made: list[Path] = []
        current = folder / f"{stem}{suffixes[0]}"
        try:
            for suffix in suffixes:
                current = folder / f"{stem}{suffix}"
                ident = _exclusive_create(current)
                made.append(current)
                _RESERVED[os.path.abspath(current)] = ident
            if any(os.path.lexists(folder / f"{stem}{s}") for s in free if s not in suffixes):
                raise FileExistsError
        except FileExistsError:
            release_reserved(made)
            continue
        except FileNotFoundError as e:  # the folder went (a concurrent run's clean-up): make it again
            release_reserved(made)
            if folder.is_dir() or remade >= 3:
                raise UserError(write_error(current, e)) from None
            n, remade = n - 1, remade + 1
            continue
        except OSError as e:
            release_reserved(made)
            raise UserError(write_error(current, e)) from None
        return made
    raise UserError(f"{folder}: {_MAX_TRIES} names {base}-<n>{suffixes[0]} are taken; give --output")


def release_reserved(paths: list[Path] | None = None) -> None:
    """Remove placeholders of :func:`reserve_names` that were never filled (all of them when
    ``paths`` is None): only while the entry is still the empty file made here."""
    keys = list(_RESERVED) if paths is None else [os.path.abspath(p) for p in paths]
    for key in keys:
        ident = _RESERVED.pop(key, None)
        if ident is None:
            continue
        try:
            st = os.lstat(key)
            if (st.st_dev, st.st_ino) == ident and st.st_size == 0:
                os.unlink(key)
        except OSError:
            pass
    if paths is None:
        while _CREATED:  # a folder made for the names, left empty: removed (rmdir fails if not empty)
            try:
                os.rmdir(_CREATED.pop())
            except OSError:
                pass


def _check_target(path: Path) -> None:
    """A path an output may replace: not a symlink (:func:`refuse_symlink`), and nothing but a
    regular file (a directory, a device, a FIFO) where it exists."""
    from fastverify.errors import UserError

    refuse_symlink(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(write_error(path, e)) from None
    import stat as _stat

    if not _stat.S_ISREG(st.st_mode):
        kind = "a directory" if _stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError(f"{path}: is {kind}; give a file path to write")


def write_files(targets: list[tuple[Path, Callable[[Path], object]]]) -> None:
    """The one output writer: for each ``(path, fill)``, ``fill(tmp)`` writes the whole content to
    a temporary file in ``path``'s folder; only when every one is complete are they renamed into
    place (over a placeholder of :func:`reserve_names`, or over the user's file), so a failure
    leaves no output, no temporary file and no placeholder behind. A symlink, a directory, a device
    or a FIFO at a ``path`` is refused, never written through. Placeholders reserved by this process
    and not among ``targets`` (a PNG name not used) are removed.

    Raises
    ------
    UserError
        A path refused as above, or the folder cannot be created or written (one line naming the
        user's path, never the temporary file).
    """
    from fastverify.errors import UserError

    paths = [Path(p) for p, _ in targets]
    tmps: list[Path] = []
    current = paths[0] if paths else None
    try:
        for i, p in enumerate(paths):
            if any(os.path.abspath(p) == os.path.abspath(q) for q in paths[:i]):
                raise UserError(f"{p}: two outputs would be the same file")
        for path in paths:
            current = path
            if os.path.abspath(path) not in _RESERVED:
                _check_target(path)
            path.parent.mkdir(parents=True, exist_ok=True)
        for path, fill in zip(paths, (f for _, f in targets)):
            current = path
            suffix = ".tmp.png" if path.suffix.lower() == ".png" else ".tmp"  # a plotter goes by the suffix
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
            os.close(fd)
            tmps.append(Path(tmp))
            fill(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        for tmp, path in zip(tmps, paths):
            current = path
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        for tmp, path in zip(tmps, paths):
            current = path
            if os.path.abspath(path) not in _RESERVED:
                _check_target(path)  # again, just before the rename: nothing swapped in meanwhile
            os.replace(tmp, path)
            _RESERVED.pop(os.path.abspath(path), None)
        tmps = []
    except OSError as e:
        raise UserError(write_error(current, e)) from None
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        release_reserved()


def check_writable(path: Path) -> None:
    """Refuse, before any work, an output that cannot be written: its folder (or the nearest one
    that exists, where it will be created) must take new files, since outputs are written to a
    temporary file there and renamed. ``os.access`` answers for the real user and sees read-only
    mounts.

    Raises
    ------
    UserError
        One line naming the path and the folder that refuses it.
    """
    from fastverify.errors import UserError

    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{path}: {folder.name or folder} is a file, not a folder; give a path in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write in {folder} (no write permission, or a read-only file system)")


# ---- the one rank-process launcher ----------------------------------------------------------------

KILL_GRACE_S = 5.0
"""Seconds a rank's process group has between SIGTERM and SIGKILL when :class:`RankGroup` stops it."""


class RankGroup:
    """The one launcher of rank processes (live profiler, tune trials, P2P check children and sides).

    Each ``argv`` starts in its own session, hence its own process group (``start_new_session``),
    asks Linux to SIGKILL it when the parent dies (:func:`die_with_parent`), reads nothing on stdin
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

    def __init__(self, workdir: str | Path | None = None, *, prefix: str = "fastverify-",
                 env: dict[str, str] | None = None, grace_s: float = KILL_GRACE_S,
                 capture_stdout: bool = False) -> None:
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
        import subprocess

        for argv in argvs:
            rank = len(self.procs)
            out_path = self.workdir / f"rank{rank}.stdout"
            with open(stderr_path(self.workdir, rank), "wb") as err, \
                    (open(out_path, "wb") if self.capture_stdout else open(os.devnull, "wb")) as out:
                self.procs.append(subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=self.env,
                    cwd=self.workdir, start_new_session=True, preexec_fn=die_with_parent))

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


def _start_ticks(pid: int) -> str | None:
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
                stale = _start_ticks(int(pid_text)) != ticks
            except (OSError, ValueError):
                continue  # not stamped by us (or being written): leave it
            if stale:
                shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    ticks = _start_ticks(os.getpid())
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
