"""The patch's verify timer writes its records while the server runs (issue 10, What to build 1).

SGLang ends its scheduler processes with SIGKILL (``kill_process_tree`` in
``sglang/srt/utils/common.py``), so a timer that writes at exit writes nothing there. The stated
flush interval (``fastverify.patch.verify``): the writer appends every ``DRAIN_EVERY`` = 8 finished
records or every ``FLUSH_INTERVAL_S`` = 1 s, whichever comes first; a ``kill -9`` loses at most
the records of that last interval. Each test below runs the real timer (CPU clock, as on our
CPU SGLang server) in a child process that is killed with SIGKILL, then reads what is on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO_ROOT, subprocess_env

from fastverify.patch import verify as V

EVERY = 8
INTERVAL_S = 1.0

CHILD = r"""
import sys, time
from fastverify.patch.verify import VerifyTimer, WallEvent
out, n, step_s, idle_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
t = VerifyTimer(out, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "0")  # the product's defaults
for i in range(n):
    ev = t.start()
    time.sleep(step_s)  # the verify forward
    t.stop(ev)
    print(f"step {i} {time.monotonic()}", flush=True)
time.sleep(idle_s)
print("idle", flush=True)
time.sleep(600)  # until killed: nothing at exit ever runs
"""


def _run_and_kill(tmp_path: Path, n: int, step_s: float, idle_s: float) -> tuple[list[dict], list[float], float, int]:
    """Start the child, read its step lines, SIGKILL it right after the last (or after the idle
    pause); returns (records on disk, monotonic completion time per step, kill time, child pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(n), str(step_s), str(idle_s)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=subprocess_env(),
    )
    done_at: list[float] = []
    try:
        while len(done_at) < n:
            line = proc.stdout.readline()
            assert line, f"child ended early (rc {proc.poll()})"
            done_at.append(float(line.split()[2]))
        if idle_s > 0:
            assert proc.stdout.readline().strip() == "idle"
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    path = tmp_path / "verify-rank0.jsonl"
    data = path.read_bytes() if path.exists() else b""
    assert data == b"" or data.endswith(b"\n"), "a torn line: the file must be appended in whole lines"
    return [json.loads(ln) for ln in data.splitlines()], done_at, killed_at, proc.pid


def _check_records(rows: list[dict], pid: int) -> None:
    assert [r["step"] for r in rows] == list(range(len(rows))), "records must be the steps in order, none twice"
    for r in rows:
        assert set(r) == {"step", "verify_ms", "clock", "rank", "pid", "batch", "tokens"}
        assert r["batch"] is None and r["tokens"] is None  # stop() was given no load
        assert r["clock"] == "cpu_wall_clock" and r["rank"] == "0" and r["pid"] == pid
        assert r["verify_ms"] > 0


def test_stated_flush_interval():
    assert (V.DRAIN_EVERY, V.FLUSH_INTERVAL_S) == (EVERY, INTERVAL_S)


def test_kill_9_mid_run_loses_at_most_the_last_interval(tmp_path):
    """100 steps of ~5 ms, SIGKILL right after the last: every record but those of the last flush
    interval (< 8 finished records, plus any whose write was under way) is on disk. The timer as
    it was (drained in the verify path every 64 steps, and at exit) had 64 of 100 (lost 36)."""
    rows, _, _, pid = _run_and_kill(tmp_path, n=100, step_s=0.005, idle_s=0)
    _check_records(rows, pid)
    lost = 100 - len(rows)
    assert lost <= 2 * EVERY - 1, f"lost {lost} records"


def test_kill_9_loses_nothing_older_than_the_interval(tmp_path):
    """7 slow steps (0.3 s each, fewer than the 8 that wake the writer): the time trigger alone
    must have written every record that completed more than 1 s (+0.5 s slack for a loaded CI
    box) before the kill. The timer as it was wrote none."""
    rows, done_at, killed_at, pid = _run_and_kill(tmp_path, n=7, step_s=0.3, idle_s=0)
    _check_records(rows, pid)
    old = [i for i, t in enumerate(done_at) if killed_at - t > INTERVAL_S + 0.5]
    assert old, "the test must have steps older than the interval"
    assert len(rows) > max(old), (
        f"steps {old} completed over {INTERVAL_S + 0.5} s before the kill; on disk: {len(rows)}"
    )


def test_kill_9_after_idle_loses_nothing(tmp_path):
    """20 steps, then the server idles 1.5 s (longer than the interval), then SIGKILL: all 20 are
    on disk. The timer as it was had none (20 < 64, and nothing at exit runs)."""
    rows, _, _, pid = _run_and_kill(tmp_path, n=20, step_s=0.002, idle_s=1.5 * INTERVAL_S)
    _check_records(rows, pid)
    assert len(rows) == 20


class _NeverDone:
    """A GPU event still running: query() False, and synchronize() is a host sync the verify
    path must never make."""

    def record(self):
        pass

    def query(self):
        return False

    def synchronize(self):
        raise AssertionError("the verify path synchronized on an event")

    def elapsed_time(self, end):
        raise AssertionError("read before completion")


def test_verify_path_never_syncs_and_keeps_running_events(tmp_path):
    t = V.VerifyTimer(tmp_path, event_factory=_NeverDone, clock="cuda_events", rank=lambda: "0", interval_s=0.05)
    for _ in range(3 * EVERY):
        t.stop(t.start())
    time.sleep(0.2)  # the writer ran a few times: it touches no event
    assert len(t.pending) == 3 * EVERY and t.written == 0
    assert not (tmp_path / "verify-rank0.jsonl").exists()


def test_stuck_file_never_blocks_the_verify_path(tmp_path):
    """The JSON-lines file is a FIFO nobody reads: opening it blocks, like a stuck disk. The
    verify path must go on (no file I/O there), the buffer stays bounded (steps beyond it are
    counted as dropped), and once the file reads again every kept record arrives in whole lines.
    The timer as it was opened the file inside stop() and hung there."""
    fifo = tmp_path / "verify-rank0.jsonl"
    os.mkfifo(fifo)
    t = V.VerifyTimer(
        tmp_path, every=2, event_factory=V.WallEvent, clock="cpu_wall_clock", rank=lambda: "0", max_buffered=10
    )
    finished = threading.Event()

    def steps():
        for _ in range(50):
            t.stop(t.start())
        finished.set()

    threading.Thread(target=steps, daemon=True).start()
    reader = None
    try:
        assert finished.wait(5), "the verify path blocked on the file"
        assert len(t.pending) + len(t._lines) <= 10 and t.dropped > 0
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the disk is back: the writer's open returns
        t.interval_s = 0.05
        t._wake.set()
        data = b""
        deadline = time.monotonic() + 5
        while data.count(b"\n") + t.dropped < 50 and time.monotonic() < deadline:
            try:
                data += os.read(reader, 65536)
            except BlockingIOError:
                time.sleep(0.02)
    finally:
        if reader is None:  # release a writer blocked in open(), whatever happened above
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        time.sleep(0.1)
        os.close(reader)
    assert data.endswith(b"\n")
    rows = [json.loads(ln) for ln in data.splitlines()]
    assert len(rows) + t.dropped == 50
    steps_written = [r["step"] for r in rows]
    assert steps_written == sorted(steps_written) and len(set(steps_written)) == len(rows)
