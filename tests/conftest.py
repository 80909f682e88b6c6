"""Shared fixtures and small, independent helpers for the fastverify tests.

The helpers here (interval union, intersection) are written from scratch in plain Python on
purpose: tests compare fastverify's numbers with values computed this way from the raw trace
JSON, never by calling fastverify's own analysis code.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from fastverify.patch.sglang_info import SGLangInfo
from fastverify.registry import BackendName, backend_info

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
DATA = Path(__file__).resolve().parent / "data"
SHARED_MISSING = "../shared not found beside the repo; the shared traces are needed"

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started in the background by a shell (`pytest &` ignores SIGINT), every child would inherit the
    # ignored SIGINT and the Ctrl-C tests could not reach the product; a handler resets on exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)

PCIE_IPC_SWITCH = frozenset({backend_info(BackendName.pcie_ipc).sglang_switch_module})
"""SGLang 0.5.23's own PCIe IPC module, as the registry names it."""
SGLANG_0523 = SGLangInfo(
    found=True,
    location="/x/sglang",
    version="0.5.23",
    has_plugins=True,
    switch_modules=PCIE_IPC_SWITCH,
    entry_point_installed=True,
)
"""An SGLang 0.5.23 as the launcher sees it: general plugins, its PCIe IPC switch, fastverify's
entry point installed."""

# Test this checkout, whatever the state of an installed (editable) copy of the package.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the repository root; the test is skipped when it is absent."""
    if not (SHARED / "traces").is_dir():
        pytest.skip(SHARED_MISSING)
    return SHARED


@pytest.fixture(scope="session")
def traces_dir(shared_dir: Path) -> Path:
    return shared_dir / "traces"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


def subprocess_env() -> dict:
    """Environment for running ``python -m fastverify`` from another working directory.

    PYTHONPATH points at this checkout, so the subprocess runs the code under test whatever
    state the installed (editable) package is in.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONSTARTUP", None)
    return env


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a gloo rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fastverify(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m fastverify ARGS`` in ``cwd``; returns the completed process (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", "fastverify", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_raw_trace(path: Path) -> dict:
    """Parse a trace with the standard library only; floats become ``Decimal`` (exact text)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw, parse_float=Decimal)


def merge(intervals) -> list[tuple]:
    """Sorted, disjoint union of ``(start, end)`` pairs (touching intervals merge)."""
    out: list[list] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> Decimal | int | float:
    total = 0
    for s, e in merge(intervals):
        total += e - s
    return total


def intersect_length(a, b):
    """Length of (union of a) ∩ (union of b)."""
    a, b = merge(a), merge(b)
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """A user mistake as the CLI must report it: exit code 2, no traceback anywhere, exactly one
    non-empty line on stderr that contains each of ``words``. Returns that line."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def cli(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``fastverify ARGV`` run in this process."""
    from fastverify.cli import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc: int, out: str, err: str, *words: str) -> str:
    """As :func:`assert_user_error`, for an in-process :func:`cli` run: exit 2, one
    ``fastverify: error:`` line on stderr holding each of ``words``. Returns that line."""
    assert rc == 2, (out, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def tree_state(root: Path) -> dict:
    """Every entry under ``root`` (bytes paths; links as links) → the SHA-256 of a regular file's
    bytes, ``"dir"``, ``("link", target)`` or ``"special"`` (a FIFO is never opened)."""
    import hashlib

    out = {}
    for dirpath, dirnames, filenames in os.walk(os.fsencode(root)):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                out[p] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[p] = "dir"
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[p] = "special"
    return out


# ---- processes (/proc) --------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then ppid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """``pid`` exists and is neither a zombie nor dead."""
    fields = _proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            fields = _proc_stat(int(d))
            if fields is not None and int(fields[1]) == pid:
                out.append(int(d))
    return out


# ---- the real SGLang venv ------------------------------------------------------------------------

SGLANG_PYTHON_ENV = "FASTVERIFY_SGLANG_PYTHON"


def sglang_python_or_skip() -> str:
    """The SGLang 0.5.23 venv's interpreter from ``$FASTVERIFY_SGLANG_PYTHON``; skips (saying why)
    when it is unset or not an executable file."""
    py = os.environ.get(SGLANG_PYTHON_ENV)
    if not py:
        pytest.skip(
            f"{SGLANG_PYTHON_ENV} is not set (make the SGLang venv with .ci/sglang-venv.sh and export its python)"
        )
    if not Path(py).is_file() or not os.access(py, os.X_OK):
        pytest.skip(f"{SGLANG_PYTHON_ENV}={py} is not an executable file")
    return py


# ---- CI: the contract tests run, they do not skip --------------------------------------------------

CI_REQUIRED_ENV = (SGLANG_PYTHON_ENV, "FASTVERIFY_FLASHINFER_WHEEL", "FASTVERIFY_SGLANG_WHEEL")
"""What the contract tests read (the SGLang venv's python, the two released wheels); each skips
without its file. ``.ci/run`` provides all three."""


def ci_missing() -> list[str]:
    """Under ``CI=true``: one phrase per :data:`CI_REQUIRED_ENV` variable that is unset or names
    no file; empty elsewhere, and when all are there."""
    if os.environ.get("CI") != "true":
        return []
    out = []
    for name in CI_REQUIRED_ENV:
        value = os.environ.get(name)
        if not value:
            out.append(f"{name} is unset")
        elif not Path(value).is_file():
            out.append(f"{name}={value} is not a file")
    return out


def pytest_configure(config) -> None:
    """Under ``CI=true`` refuse to start (one line, pytest's usage-error exit code 4) when a
    contract test's input is missing (:func:`ci_missing`): a green run must not hide ~100 skips."""
    missing = ci_missing()
    if missing:
        raise pytest.UsageError(
            f"CI=true but {'; '.join(missing)}: the contract tests that need it would "
            "skip; run .ci/run, which fetches the wheels and builds the SGLang venv"
        )


# ---- a minimal trace profile -----------------------------------------------------------------------


def two_rank_trace_profile() -> dict:
    """A version-1 trace profile of 2 ranks: 6 all-reduces of 4096 B per run, 2 per step (no hidden
    size, as every trace profile), for tune's workload readers."""
    return {
        "schema": "fastverify.profile",
        "schema_version": 1,
        "timing": {"clock": "trace"},
        "world_size": 2,
        "source": {"kind": "trace", "files": ["a", "b"]},
        "allreduce_by_msg_size": [{"msg_bytes": 4096, "count": 6}],
        "ranks": [
            {
                "rank": r,
                "step_median": {
                    "steps": 3,
                    "allreduce_count": 2,
                    "compute_us": 10.0,
                    "allreduce_us": 5.0,
                    "window_us": 20.0,
                },
            }
            for r in (0, 1)
        ],
    }


RANK_ARRAYS = ("start_ns", "dur_ns", "cls", "name_id", "msg_bytes", "step", "stream")


def assert_same_ranks(got: list, want: list) -> None:
    """Two ``load_trace`` results equal field for field: every per-event array (values and
    dtype), the names, the steps and the meta, rank by rank."""
    import numpy as np

    assert [r.rank for r in got] == [r.rank for r in want]
    for g, w in zip(got, want):
        for key in RANK_ARRAYS:
            a, b = getattr(g, key), getattr(w, key)
            assert a.dtype == b.dtype and np.array_equal(a, b), (g.rank, key)
        assert g.names == w.names
        assert g.steps == w.steps
        assert g.meta == w.meta


def pin_pcie_ipc(monkeypatch):
    """Published evidence that pins pcie_ipc: its packaged point with a x/÷ 1.25 range (the
    packaged data alone leave its range unknown at every size, so no backend could win)."""
    from dataclasses import replace

    from fastverify.registry import BackendName
    from fastverify.tune import backend_model

    real = backend_model.estimate

    def pinned(backend, msg_bytes, **kw):
        e = real(backend, msg_bytes, **kw)
        if e is None or backend is not BackendName.pcie_ipc:
            return e
        return replace(e, low_us=e.point_us / 1.25, high_us=e.point_us * 1.25, unknown=None)

    monkeypatch.setattr(backend_model, "estimate", pinned)


def run_with_stdout(argv: list[str], cwd: Path, stdout: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``argv`` with its standard output ``"closed"`` (``>&-``) or ``"full"`` (``>/dev/full``,
    skipped where the box has none); returns the finished process (stderr captured as text) and the
    reason fastverify should give: "it is closed" or "No space left on device"."""
    if stdout == "closed":
        cp = subprocess.run(
            argv,
            env=subprocess_env(),
            cwd=cwd,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.close(1),
            timeout=300,
        )
        return cp, "it is closed"
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        cp = subprocess.run(
            argv, env=subprocess_env(), cwd=cwd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    return cp, "No space left on device"
