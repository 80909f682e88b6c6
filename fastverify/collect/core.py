"""What every part of ``fastverify collect`` shares: the run's facts (:class:`Context`), a part's
outcome (:class:`Outcome`), the child-process runner with a hard time limit (:func:`run_child`)
and the verify message sizes."""

from __future__ import annotations

import fnmatch
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.errors import path_text, shown
from fastverify.procs import child_env, popen_dying_with_parent

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL of a child's process group that ran past its limit."""
DTYPE_BYTES = 2  # bf16, the verify step's all-reduce dtype on SGLang's DeepSeek/Kimi path


@dataclass
class ServerInfo:
    """A running SGLang server: its base ``url``, the endpoint that answered (``/server_info`` or
    ``/get_server_info``), the JSON as received (``raw``) and decoded (``info``)."""

    url: str
    endpoint: str
    raw: bytes
    info: dict

    def fact(self, key: str):
        """``info[key]``, else the first ``key`` in a nested dict (SGLang nests some argument
        groups); None when absent."""
        if key in self.info:
            return self.info[key]
        stack = [v for k, v in self.info.items() if isinstance(v, dict) and k != "internal_states"]
        while stack:
            d = stack.pop(0)
            if key in d:
                return d[key]
            stack.extend(v for v in d.values() if isinstance(v, dict))
        return None


@dataclass
class Shapes:
    """The verify step's all-reduce shapes: ``tp`` ranks, ``draft_tokens`` (K) per request,
    ``hidden`` size, verify ``batches``; ``source`` says where each came from."""

    tp: int | None
    draft_tokens: int
    hidden: int
    batches: tuple[int, ...]
    source: dict[str, str]

    def msg_bytes(self) -> list[int]:
        """One all-reduce message per batch: batch × K × hidden × 2 bytes (bf16)."""
        return [b * self.draft_tokens * self.hidden * DTYPE_BYTES for b in self.batches]

    def as_meta(self) -> dict:
        return {
            "tp": self.tp,
            "draft_tokens": self.draft_tokens,
            "hidden": self.hidden,
            "batches": list(self.batches),
            "msg_bytes": self.msg_bytes(),
            "shapes_from": self.source,
        }


@dataclass
class Context:
    """Facts of one collect run, read by every part."""

    workdir: Path
    shapes: Shapes
    gpus: int
    quiet: bool = False
    server: ServerInfo | None = None
    cycles: int = 20
    send_requests: int = 0
    verify_log: Path | None = None


@dataclass
class Outcome:
    """What a part returns: ``status`` ok / skipped / failed, a one-line ``reason`` (None when
    ok), its ``files`` (arcname -> bytes or a Path to copy) and small ``meta`` facts."""

    status: str
    reason: str | None = None
    files: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _text(value, depth: int = 0):
    """``value`` with every string valid UTF-8 (the ``\\x..`` of a non-UTF-8 path's bytes,
    :func:`fastverify.errors.path_text`), through dicts, lists and tuples: the manifest is JSON,
    and one undecodable name in a part's facts must not cost the whole collection."""
    if isinstance(value, str):
        return path_text(value)
    if depth > 20:
        return value
    if isinstance(value, dict):
        return {_text(k, depth + 1): _text(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_text(v, depth + 1) for v in value)
    return value


def unfit_name(name: str) -> str | None:
    """Why ``name`` cannot be a bundle member's name (a member name is UTF-8 text a terminal shows
    as it is): ``"is not UTF-8"``, ``"holds control characters"`` (an ``ESC[2J`` or a newline that
    would forge a line where the name is printed), or None for a fit name."""
    if path_text(name) != name:
        return "is not UTF-8"
    if not name.isprintable():
        return "holds control characters"
    return None


NOT_REGULAR = "is no regular file (a symbolic link, a FIFO, a folder): never read through"
LEFT_OUT_KEYS = {
    "is not UTF-8": "left_out_not_utf8",
    "holds control characters": "left_out_control_chars",
    NOT_REGULAR: "left_out_not_regular",
}
"""The meta key that lists (escaped) the files a part left out, by reason (:func:`unfit_name`'s,
or :data:`NOT_REGULAR`)."""


def left_out_text(meta: dict) -> str | None:
    """The files a part's ``meta`` says were left out, in words (count, reason, the first names),
    ``; ``-joined; None when none were."""
    said = []
    for why, key in LEFT_OUT_KEYS.items():
        names = [str(n) for n in meta.get(key) or ()]
        if names:
            more = " ..." if len(names) > 3 else ""
            verb = "that" if why == NOT_REGULAR else "whose name"
            said.append(f"{len(names)} file(s) left out {verb} {why}: {', '.join(names[:3])}{more}")
    return "; ".join(said) or None


def scan_folder(folder: Path, patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The names in ``folder`` that match one of the glob ``patterns``: those of regular files
    (``lstat``: a symbolic link is never followed) and those of anything else (a link, a FIFO, a
    folder), each sorted by their shown text. A folder that cannot be listed has none.

    Raises nothing."""
    regular, other = [], []
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                if not any(fnmatch.fnmatchcase(e.name, p) for p in patterns):
                    continue
                try:
                    (regular if e.is_file(follow_symlinks=False) else other).append(e.name)
                except OSError:
                    other.append(e.name)
    except OSError:
        pass
    return sorted(regular, key=shown), sorted(other, key=shown)


def take_regular(folder: Path, name: str, dest: Path, *, move: bool) -> bool:
    """Put the regular file ``folder/name`` at ``dest`` (a new name in a folder only this process
    writes): ``move`` renames it (the entry itself, never what a link points to), else its bytes
    are copied through a descriptor opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
    ``fstat``. False, and nothing left at ``dest``, when it is no regular file (a symbolic link, a
    FIFO, a device: swapped in since it was listed) or cannot be read.

    Raises nothing."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    src = os.fspath(folder / name)
    try:
        if move:
            os.rename(src, dest)
            src = os.fspath(dest)
        fd = os.open(src, flags)
    except OSError:
        if move:
            _unlink(dest)
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            if move:
                _unlink(dest)
            return False
        if not move:
            with os.fdopen(os.dup(fd), "rb") as f, open(dest, "xb") as out:
                while chunk := f.read(1 << 20):
                    out.write(chunk)
        return True
    except OSError:
        _unlink(dest)
        return False
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _outcome(status: str, reason: str | None, files: dict | None, meta: dict) -> Outcome:
    """An :class:`Outcome` whose text is UTF-8 (:func:`_text`); a file whose member name is not
    UTF-8 or holds control characters (:func:`unfit_name`) is left out and named, escaped, in
    ``meta["left_out_not_utf8"]`` or ``meta["left_out_control_chars"]``."""
    kept, left_out = {}, {}
    for name, src in (files or {}).items():
        why = unfit_name(name)
        if why is None:
            kept[name] = src
        else:
            left_out.setdefault(LEFT_OUT_KEYS[why], []).append(shown(name))
    if left_out:
        meta = {**meta, **{k: [*meta.get(k, ()), *v] for k, v in left_out.items()}}
    if status == "ok" and files and not kept:  # nothing usable came of the part
        status, reason = "failed", f"every file was left out: {left_out_text(meta)}"
    return Outcome(status, None if reason is None else path_text(reason), kept, _text(meta))


def ok(files: dict | None = None, **meta) -> Outcome:
    return _outcome("ok", None, files, meta)


def skipped(reason: str, **meta) -> Outcome:
    return _outcome("skipped", reason, None, meta)


def failed(reason: str, files: dict | None = None, **meta) -> Outcome:
    return _outcome("failed", reason, files, meta)


@dataclass
class Child:
    """A finished child: exit code (None: killed at its limit), output, wall time (s)."""

    rc: int | None
    stdout: bytes
    stderr: bytes
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def last_line(self) -> str:
        """The child's last non-empty stderr line (else stdout's), for a one-line reason."""
        for stream in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in stream.decode(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1][:300]
        return "no output"

    def why(self, what: str, limit_s: float) -> str:
        if self.timed_out:
            return f"{what} ran past its {limit_s:.0f} s share of the time budget and was stopped"
        return f"{what} exited {self.rc}: {self.last_line()}"


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(argv: list[str], *, timeout_s: float, env: dict | None = None, cwd: Path | None = None) -> Child:
    """Run ``argv`` in its own process group (SIGKILLed if this process dies), stdin closed, and
    stop the whole group past ``timeout_s`` seconds (SIGTERM, then SIGKILL after
    :data:`KILL_GRACE_S`); Ctrl-C stops it the same way and is re-raised.

    Raises
    ------
    OSError
        The program cannot be started.
    """
    t0 = time.monotonic()
    proc = popen_dying_with_parent(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env() if env is None else env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 0.1))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        rc = None
    except BaseException:
        _kill_group(proc)
        raise
    return Child(rc, out or b"", err or b"", time.monotonic() - t0)


def fastverify_argv(*args: str) -> list[str]:
    """``python -m fastverify ARGS`` with this interpreter (the checkout in ``child_env``)."""
    return [sys.executable, "-m", "fastverify", *args]
