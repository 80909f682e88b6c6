"""Output safety, signals and data warnings: the cases a first-time user hit by accident."""

from __future__ import annotations

import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import assert_user_error, run_fastverify, subprocess_env

DATA = Path(__file__).parent / "data"
GOOD = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"  # a valid one-rank trace (rank 3)


def test_output_on_a_fifo_is_refused_and_left_alone(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    proc = run_fastverify(["profile", "--trace", str(GOOD), "--output", str(fifo), "--no-png", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, str(fifo))
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still a FIFO, not replaced by a regular file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_output_on_a_directory_names_the_directory(tmp_path):
    (tmp_path / "out").mkdir()
    proc = run_fastverify(["profile", "--trace", str(GOOD), "--output", "out", "--quiet"], cwd=tmp_path)
    line = assert_user_error(proc, "out", "directory")
    assert ".tmp" not in line  # the user's path, never a temporary file
    assert list((tmp_path / "out").iterdir()) == []


def test_png_and_json_on_the_same_path_are_refused(tmp_path):
    proc = run_fastverify(
        ["profile", "--trace", str(GOOD), "--output", "p.json", "--png", "p.json", "--quiet"], cwd=tmp_path
    )
    assert_user_error(proc, "p.json")
    assert not (tmp_path / "p.json").exists()


def test_png_on_a_directory_leaves_no_json(tmp_path):
    (tmp_path / "d").mkdir()
    proc = run_fastverify(
        ["profile", "--trace", str(GOOD), "--output", "x/p.json", "--png", "d", "--quiet"], cwd=tmp_path
    )
    assert_user_error(proc, "d")
    assert not (tmp_path / "x" / "p.json").exists()


def test_output_through_a_symlink_is_refused_and_the_target_kept(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    proc = run_fastverify(
        ["profile", "--trace", str(GOOD), "--output", "link.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "symlink" in proc.stderr, proc.stderr
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "old"


def test_default_names_do_not_overwrite_each_other(tmp_path):
    for _ in range(3):
        proc = run_fastverify(["profile", "--trace", str(GOOD), "--quiet"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len([f for f in files if f.endswith(".json")]) == 3
    assert len([f for f in files if f.endswith(".png")]) == 3


def test_profile_written_into_the_trace_folder_is_skipped_by_the_next_scan(tmp_path):
    (tmp_path / "tr").mkdir()
    (tmp_path / "tr" / "t.json.gz").write_bytes(GOOD.read_bytes())
    first = run_fastverify(
        ["profile", "--trace", "tr", "--output", "tr/verify.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    second = run_fastverify(["profile", "--trace", "tr", "--output", "again.json", "--no-png", "--quiet"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert json.loads((tmp_path / "again.json").read_text())["source"]["files"] == [str(Path("tr") / "t.json.gz")]


def _trace(events: list[dict], **top) -> bytes:
    return gzip.compress(json.dumps({"traceEvents": events, **top}).encode())


def _kernel(name: str, ts: float, dur: float, **args) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"stream": 7, **args},
    }


def test_negative_and_implausible_durations_are_warned_about(tmp_path):
    events = [_kernel("gemm", 0, 5), _kernel("gemm", 10, -3), _kernel("gemm", 20, 11e6)]  # 11 s
    (tmp_path / "t.json.gz").write_bytes(_trace(events, distributedInfo={"rank": 0, "world_size": 1}))
    proc = run_fastverify(
        ["profile", "--trace", "t.json.gz", "--output", "p.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads((tmp_path / "p.json").read_text())["warnings"]
    assert any("1 GPU events had a negative duration" in w for w in warnings), warnings
    assert any("1 GPU events last over 10 s" in w for w in warnings), warnings


def test_rank_in_file_name_disagreeing_with_distributed_info_is_warned_about(tmp_path):
    (tmp_path / "x-TP-1.trace.json.gz").write_bytes(
        _trace([_kernel("gemm", 0, 5)], distributedInfo={"rank": 0, "world_size": 2})
    )
    proc = run_fastverify(
        ["profile", "--trace", "x-TP-1.trace.json.gz", "--output", "p.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["ranks"][0]["rank"] == 0
    assert any("file name says 1" in w for w in prof["warnings"]), prof["warnings"]


def test_no_usable_timestamps_is_its_own_error(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [_kernel("gemm", 1e30, 5), _kernel("gemm", "x", 5)]}))
    proc = run_fastverify(["profile", "--trace", "t.json", "--output", "p.json", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "t.json", "2 GPU events, none with a usable ts/dur")


def test_event_array_of_numbers_is_not_a_trace(tmp_path):
    (tmp_path / "t.json").write_text("[1, 2, 3]")
    proc = run_fastverify(["profile", "--trace", "t.json", "--output", "p.json", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "t.json", "no event objects")


@pytest.mark.parametrize(
    "config, field",
    [
        (
            {
                "hidden_size": 2048,
                "num_hidden_layers": 4,
                "intermediate_size": 6144,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "vocab_size": 1000,
                "num_experts": 128,
                "num_experts_per_tok": 8,
            },
            "num_experts",
        ),
        (
            {
                "hidden_size": 256,
                "num_hidden_layers": 1_000_000_000,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
            },
            "num_hidden_layers",
        ),
    ],
)
def test_config_that_would_be_mis_modelled_or_hang_is_refused(tmp_path, config, field):
    (tmp_path / "config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    proc = run_fastverify(["profile", "--model", "config.json", "--output", "p.json", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "config.json", field)
    assert time.monotonic() - t0 < 30  # refused up front, not after minutes of work
    assert not (tmp_path / "p.json").exists()


def _rank_processes(marker: str) -> list[int]:
    """Live ranks started by this test: a ``_worker_main`` command line whose environment holds
    ``FASTVERIFY_TEST_RUN=<marker>`` (the test's own ``fastverify`` passes its environment on to
    its ranks, procs.child_env), so ranks of any other profile on the machine are never counted.
    The environment, not the parent pid: a rank whose parent was killed is re-parented to init."""
    pids = []
    tag = f"{_MARKER_VAR}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                env = (entry / "environ").read_bytes() if b"_worker_main" in cmd else b""
            except OSError:
                continue
            if b"_worker_main" in cmd and tag in env.split(b"\0"):
                pids.append(int(entry.name))
    return pids


_MARKER_VAR = "FASTVERIFY_TEST_RUN"


def _marked_env(marker: str) -> dict:
    return {**subprocess_env(), _MARKER_VAR: marker}


@pytest.fixture
def marker():
    return f"robustness-{os.getpid()}-{uuid.uuid4().hex}"


@pytest.fixture
def bystander():
    """A process that looks like a live rank of someone else's profile (a ``fastverify-live-``
    spec path and ``_worker_main`` on its command line, without this test's marker); the scans
    must not count it, or wait for it to die."""
    code = "import time; time.sleep(300)  # _worker_main"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "/tmp/fastverify-live-bystander/spec.json", "0"],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield proc
    proc.kill()
    proc.wait()


def test_scan_counts_only_this_tests_ranks(marker, bystander):
    deadline = time.monotonic() + 10  # until the bystander's command line is readable
    while time.monotonic() < deadline and not (Path(f"/proc/{bystander.pid}/cmdline").read_bytes()):
        time.sleep(0.05)
    assert bystander.pid not in _rank_processes(marker)
    mine = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)  # _worker_main", "0"],
        env=_marked_env(marker),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and mine.pid not in _rank_processes(marker):
            time.sleep(0.05)
        assert _rank_processes(marker) == [mine.pid]
    finally:
        mine.kill()
        mine.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find rank processes")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_live_run_stops_every_rank_and_writes_nothing(tmp_path, sig, marker, bystander):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastverify", "profile", "--iters", "100000", "--output", "p.json", "--quiet"],
        cwd=tmp_path,
        env=_marked_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_rank_processes(marker)) < 2:
        time.sleep(0.1)
    started = _rank_processes(marker)
    assert len(started) == 2, "the ranks never started"  # --tp 2: exactly this run's two ranks
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    deadline = time.monotonic() + 10  # ranks die with their parent (SIGKILL via PR_SET_PDEATHSIG)
    while time.monotonic() < deadline and set(started) & set(_rank_processes(marker)):
        time.sleep(0.1)
    assert not set(started) & set(_rank_processes(marker))  # no orphaned ranks
    assert not (tmp_path / "p.json").exists()
    assert not (tmp_path / "profiles").exists()
    assert bystander.poll() is None  # another run's rank is left alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_ranks_die_with_a_killed_parent(tmp_path, marker, bystander):
    # A SIGKILLed run cannot remove its temporary folder (the next run does: procs.make_workdir,
    # tests/test_procs_launcher.py); keep it in tmp_path rather than leave one in /tmp per run.
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastverify", "profile", "--iters", "100000", "--output", "p.json", "--quiet"],
        cwd=tmp_path,
        env={**_marked_env(marker), "TMPDIR": str(tmp_path / "tmp")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_rank_processes(marker)) < 2:
        time.sleep(0.1)
    started = _rank_processes(marker)
    assert len(started) == 2, "the ranks never started"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(started) & set(_rank_processes(marker)):
        time.sleep(0.1)
    assert not set(started) & set(_rank_processes(marker))
    assert bystander.poll() is None


def _tune_ranks(marker: str) -> list[int]:
    """Live tune worker ranks (``-m fastverify.tune.worker``) whose environment holds the marker."""
    tag = f"{_MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                if b"fastverify.tune.worker" in cmd and tag in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find rank processes")
def test_ctrl_c_during_a_tune_sweep_stops_its_ranks_within_seconds(tmp_path, marker, shared_dir):
    """SIGINT while a trial's ranks run: one line, exit 130, no rank left, no journal trial
    half-written, within seconds (the ranks are stopped, not waited for)."""
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastverify",
            "tune",
            "--topology",
            str(topo),
            "--model",
            "tiny",
            "--tp",
            "2",
            "--top",
            "1",
            "--iters",
            "10000",
            "--warmup",
            "1",
            "--journal",
            "j.jsonl",
            "--timeout",
            "600",
        ],
        cwd=tmp_path,
        env=_marked_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_tune_ranks(marker)) < 2:
        time.sleep(0.1)
    started = _tune_ranks(marker)
    assert len(started) == 2, "the trial's ranks never started"
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "fastverify: interrupted", err
    assert took < 10, f"tune took {took:.1f} s to stop after SIGINT"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(started) & set(_tune_ranks(marker)):
        time.sleep(0.1)
    assert not set(started) & set(_tune_ranks(marker))
