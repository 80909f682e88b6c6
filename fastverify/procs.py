"""Rank processes shared by the live profiler and the tune sweep: environment, parent-death
signal, and reading a failed rank's exit status and stderr."""

from __future__ import annotations

import os
import signal
import sys
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
