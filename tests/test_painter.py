"""The PNG drawn by the painter process is the in-process PNG, pixel for pixel; a painter that
fails hands the drawing back; several trace files load the same in worker processes as in one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import children

from fastverify.procs import usable_cores
from fastverify.profile.build import as_builtins, build_profile
from fastverify.profile.painter import Painter
from fastverify.profile.plot import plot_profile
from fastverify.trace.load import PARALLEL_MIN_BYTES, load_traces, load_workers

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
PAIR = [SHARED / "HolisticTraceAnalysis" / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
needs_shared = pytest.mark.skipif(
    not all(p.is_file() for p in PAIR), reason=f"{SHARED} not present (CI copies shared/)"
)
needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="the painter runs only with 2+ cores")


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path))


@needs_shared
@needs_two_cores
def test_painter_png_equals_in_process_png(tmp_path):
    prof = as_builtins(build_profile(load_traces(PAIR), {"kind": "trace", "files": [str(p) for p in PAIR]}))
    here = tmp_path / "here.png"
    plot_profile(prof, here)
    painter = Painter.start()
    assert painter is not None
    try:
        there = tmp_path / "there.png"
        assert painter.draw(prof, there) is True
    finally:
        painter.close()
    a, b = _pixels(here), _pixels(there)
    assert a.shape == b.shape and (a != b).sum() == 0


@needs_two_cores
def test_a_dead_painter_hands_the_drawing_back(tmp_path):
    painter = Painter.start()
    assert painter is not None
    painter._proc.kill()
    painter._proc.join()
    try:
        assert painter.draw({"ranks": []}, tmp_path / "x.png") is False
    finally:
        painter.close()
    assert not (tmp_path / "x.png").exists()


@needs_shared
def test_parallel_load_equals_sequential_load():
    seq = load_traces(PAIR, workers=1)
    par = load_traces(PAIR, workers=2)
    assert [r.rank for r in seq] == [r.rank for r in par] == [0, 1]
    for a, b in zip(seq, par):
        for attr in ("start_ns", "dur_ns", "cls", "name_id", "msg_bytes", "step", "stream"):
            assert np.array_equal(getattr(a, attr), getattr(b, attr)), attr
        assert a.names == b.names and a.meta == b.meta and a.steps == b.steps


def test_a_bad_file_among_several_is_named_in_one_line(tmp_path):
    good = tmp_path / "rank0.json"
    good.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "k",
                        "ts": 1,
                        "dur": 2,
                        "pid": 0,
                        "tid": 7,
                        "args": {"stream": 7},
                    }
                ]
            }
        )
    )
    bad = tmp_path / "rank1.json"
    bad.write_text('{"traceEvents": [')
    from fastverify.errors import UserError

    with pytest.raises(UserError) as ei:
        load_traces([good, bad], workers=2)
    assert str(bad) in str(ei.value) and "\n" not in str(ei.value)


def test_small_traces_are_not_worth_worker_processes(tmp_path):
    files = []
    for r in range(2):
        f = tmp_path / f"rank{r}.json"
        f.write_bytes(b" " * 1024)
        files.append(f)
    assert load_workers(files) == 1
    big = []
    for r in range(2):
        f = tmp_path / f"big{r}.json"
        with open(f, "wb") as fh:
            fh.truncate(PARALLEL_MIN_BYTES)  # sparse: the size counts, not the bytes
        big.append(f)
    want = min(len(os.sched_getaffinity(0)), 2)
    assert load_workers(big) == want


@needs_two_cores
def test_an_interrupted_draw_stops_the_child_before_the_caller_cleans_up(tmp_path, monkeypatch):
    painter = Painter.start()
    assert painter is not None

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(painter._conn, "recv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        painter.draw({"ranks": []}, tmp_path / "x.png")
    assert not painter._proc.is_alive()  # the child can no longer write the PNG after the clean-up
    painter.close()


B200 = SHARED / "TraceLens" / "eager_trace.json.gz"


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        return text in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return False


@needs_shared
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.3])
def test_ctrl_c_to_the_process_group_gives_one_line_and_leaves_nothing(tmp_path, delay):
    """A terminal's Ctrl-C reaches every process of the group (the painter and the decoding workers
    too): only the parent speaks, and no file or temporary file is left half-written."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "o"
    out.mkdir()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastverify",
            "profile",
            "--trace",
            *map(str, PAIR),
            "--jobs",
            "2",
            "--output",
            str(out / "p.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    # from the painter's fork on, main() runs (a signal during interpreter start-up is Python's)
    deadline = time.monotonic() + 30
    while not children(p.pid) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    lines = err.decode().strip().splitlines()
    time.sleep(0.3)
    left = [d for d in os.listdir("/proc") if d.isdigit() and _cmdline_has(int(d), str(out))]
    assert left == [], f"processes of the run still alive: {left}"  # no orphaned painter or worker
    if p.returncode == 0:  # finished before the signal
        assert sorted(f.name for f in out.iterdir()) == ["p.json", "p.png"]
        return
    # 130, or killed by SIGINT itself: a shell shows 130 for both. The second comes when the
    # signal lands just as the painter is forked (Python then ends the process by re-raising it;
    # seen in about 1 run in 3 at delay 0, before this session's changes as after them)
    assert p.returncode in (130, -signal.SIGINT) and lines == ["fastverify: interrupted"], err.decode()[-2000:]
    assert [f.name for f in out.iterdir() if f.name.startswith(".")] == []  # no temporary file left


def test_an_unknown_mplbackend_does_not_stop_the_png(tmp_path):
    """MPLBACKEND names a pyplot backend; the PNG is drawn on the Agg canvas whatever it says."""
    import subprocess
    import sys

    trace = PAIR[0]
    if not trace.is_file():
        pytest.skip(f"{trace} absent")
    env = dict(os.environ, MPLBACKEND="nonsense_backend")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastverify",
            "profile",
            "--trace",
            str(trace),
            "--output",
            str(tmp_path / "p.json"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_a_painter_never_sent_a_profile_is_stopped_not_waited_for():
    """An error before the drawing closes the painter at once: killed in its matplotlib import
    (SIGKILL), not left to finish it (0.3 s before the error line)."""
    import signal

    p = Painter.start()
    if p is None:
        pytest.skip("the painter runs only with two or more cores on Linux")
    p.close()
    assert p._proc.exitcode == -signal.SIGKILL
