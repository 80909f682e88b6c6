"""The one rank-process launcher (``fastverify.procs.RankGroup``, issue 12 item 6): its kill rule
(SIGTERM to the process group, SIGKILL after the grace period, temporary folder removed), that the
live runner, the tune sweep and the P2P check all go through it, and that no
``fastverify-live-*`` folder outlives a live run, even one ended by ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import alive, subprocess_env

from fastverify import procs
from fastverify.errors import UserError
from fastverify.procs import RankGroup, make_workdir

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")


def _group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (field 5 of /proc/<pid>/stat)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


def _wait_for(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


# A rank that ignores SIGTERM and starts a grandchild (same process group) that ignores it too.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open('child.ready', 'w'); time.sleep(600)"])
open("grandchild.pid", "w").write(str(child.pid))
while True:
    time.sleep(0.05)
"""


@linux_only
def test_rank_ignoring_sigterm_gets_sigkill_after_grace_and_its_group_and_folder_go():
    group = RankGroup(prefix="fastverify-test-launcher-", grace_s=1.5)
    workdir = group.workdir
    with group:
        group.start([[sys.executable, "-c", STUBBORN]])
        _wait_for(workdir / "child.ready")
        leader = group.procs[0].pid
        grandchild = int((workdir / "grandchild.pid").read_text())
        assert sorted(_group_members(leader)) == sorted([leader, grandchild])  # one group, its own
        assert os.getpgid(leader) == leader != os.getpgid(0)
        t0 = time.monotonic()
    waited = time.monotonic() - t0
    assert 1.4 <= waited < 10, waited  # SIGTERM ignored: SIGKILL came after the 1.5 s grace, not before
    assert group.procs[0].returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _group_members(leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_members(leader) == [] and not alive(grandchild)
    assert not workdir.exists()  # the launcher's temporary folder is removed


@linux_only
def test_sigterm_comes_first_and_a_rank_that_honours_it_does_not_wait_for_the_grace():
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (open('got-term', 'w'), sys.exit(7)))\n"
        "open('ready', 'w'); time.sleep(600)"
    )
    with RankGroup(prefix="fastverify-test-launcher-", grace_s=30) as group:
        group.start([[sys.executable, "-c", code]] * 2)
        _wait_for(group.workdir / "ready")
        time.sleep(0.3)  # both ranks past their handler set-up
        t0 = time.monotonic()
        group.stop()
        assert time.monotonic() - t0 < 10  # not the 30 s grace
        assert (group.workdir / "got-term").exists()
        assert [p.returncode for p in group.procs] == [7, 7]


def test_exit_statuses_are_read_without_reaping(tmp_path):
    with RankGroup(tmp_path) as group:
        group.start(
            [
                [sys.executable, "-c", "import sys; sys.exit(3)"],
                [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
            ]
        )
        deadline = time.monotonic() + 20
        while not group.all_exited():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [group.returncode(0), group.returncode(1)] == [3, -signal.SIGKILL]
        assert all(p.returncode is None for p in group.procs)  # zombies still: pids not reusable
    assert [p.returncode for p in group.procs] == [3, -signal.SIGKILL]
    assert tmp_path.exists()  # a caller's folder is the caller's to remove


# ---- every caller goes through the launcher --------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch):
    """Replace RankGroup in the three callers by a subclass that records each use."""
    uses = []

    class Recording(RankGroup):
        def start(self, argvs):
            argvs = [list(a) for a in argvs]
            uses.append((self.caller, argvs))
            super().start(argvs)

    from fastverify.live import runner
    from fastverify.topo import p2p
    from fastverify.tune import sweep

    for module, name in ((runner, "live"), (sweep, "tune"), (p2p, "p2p")):
        monkeypatch.setattr(module, "RankGroup", type(f"Recording_{name}", (Recording,), {"caller": name}))
        assert not hasattr(module, "subprocess"), f"{module.__name__} starts processes itself"
    return uses


def test_live_tune_and_p2p_start_their_processes_through_the_launcher(tmp_path, recorded):
    from fastverify.live import runner
    from fastverify.topo import p2p
    from fastverify.tune import sweep

    runner.launch_ranks(lambda r: [sys.executable, "-c", "pass"], 2, 60.0, str(tmp_path))
    (tmp_path / "bad.json").write_text("{")
    reason = sweep.launch_trial(
        str(tmp_path / "bad.json"), 2, sweep.TrialLimits(60.0), str(tmp_path), procs.child_env()
    )
    assert reason.startswith("rank ") and " crashed (exit code " in reason, reason
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\nI, J, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
        "json.dump({'results': [{'src': I, 'dst': J, 'ok': True, 'reason': 'r'}]}, open(OUT, 'w'))\n"
    )
    out = p2p.check_p2p(
        n_gpus=2,
        key={"test": "launcher"},
        cache_dir=tmp_path / "cache",
        child_argv=lambda i, j, o: [sys.executable, str(script), str(i), str(j), str(o)],
    )
    assert out[(0, 1)] == p2p.P2PResult(True, "r")
    p2p.run_pair(0, 1, tmp_path / "pair.json", 60.0)  # the sides; without CUDA they fail, with a reason
    assert (tmp_path / "pair.json").exists()
    callers = [caller for caller, _ in recorded]
    assert callers == ["live", "tune", "p2p", "p2p"]
    assert [len(argvs) for _, argvs in recorded] == [2, 2, 1, 2]
    assert recorded[1][1][0][1:3] == ["-m", sweep.WORKER_MODULE]
    assert recorded[3][1][0][3:5] == ["side", "a"] and recorded[3][1][1][3:5] == ["side", "b"]


# ---- no fastverify-live-* folder outlives a live run ---------------------------------------------


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """This test's own temporary root, for this process (tempfile caches it) and its children."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    return root


def _live_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("fastverify-live-*"))


def test_no_live_folder_left_after_a_live_run_that_succeeds_or_fails(private_tmp):
    pytest.importorskip("torch")
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    tiny = load_model_config("tiny")
    ranks = run_live(tiny, tp=2, draft_tokens=4, batch=2, iters=1, warmup=0, device="cpu", timeout_s=120)
    assert len(ranks) == 2
    assert _live_dirs(private_tmp) == []
    with pytest.raises(UserError, match=r"^live rank [01] failed"):
        run_live(
            replace(tiny, num_experts_per_tok=17),
            tp=2,
            draft_tokens=4,
            batch=2,
            iters=1,
            warmup=0,
            device="cpu",
            timeout_s=120,
        )
    assert _live_dirs(private_tmp) == []


@linux_only
def test_the_folder_of_a_kill_9ed_live_run_is_removed_by_the_next_run(private_tmp, tmp_path):
    pytest.importorskip("torch")
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    proc = subprocess.Popen(
        [sys.executable, "-m", "fastverify", "profile", "--iters", "100000", "--output", "p.json", "--quiet"],
        cwd=tmp_path,
        env={**subprocess_env(), "TMPDIR": str(private_tmp)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not any((d / "rank1.stderr").exists() for d in _live_dirs(private_tmp)):
            assert time.monotonic() < deadline and proc.poll() is None, "the live run never started its ranks"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    left = _live_dirs(private_tmp)
    assert len(left) == 1  # SIGKILL: the run could not remove it itself
    run_live(load_model_config("tiny"), tp=2, draft_tokens=4, batch=2, iters=1, warmup=0, device="cpu", timeout_s=120)
    assert _live_dirs(private_tmp) == []


@linux_only
def test_make_workdir_removes_only_folders_of_dead_owners(private_tmp):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ticks = procs.start_ticks(os.getpid())
    folders = {name: private_tmp / f"fastverify-live-{name}" for name in ("dead", "reused", "mine", "bare")}
    for path in folders.values():
        path.mkdir()
    (folders["dead"] / ".fastverify-owner").write_text(f"{dead.pid} 1")
    (folders["reused"] / ".fastverify-owner").write_text(f"{os.getpid()} {int(ticks) + 1}")  # pid reused
    (folders["mine"] / ".fastverify-owner").write_text(f"{os.getpid()} {ticks}")  # a running run
    other = private_tmp / "fastverify-tune-dead"
    other.mkdir()
    (other / ".fastverify-owner").write_text(f"{dead.pid} 1")
    new = make_workdir("fastverify-live-")
    assert sorted(p.name for p in private_tmp.iterdir()) == sorted(
        ["fastverify-live-mine", "fastverify-live-bare", "fastverify-tune-dead", new.name]
    )
    assert (new / ".fastverify-owner").read_text() == f"{os.getpid()} {ticks}"


# ---- die with the parent, without preexec_fn (safe from threads) ------------------------------------


def test_no_process_is_started_with_preexec_fn(tmp_path, monkeypatch):
    """Python's subprocess docs: ``preexec_fn`` is not safe with threads in the parent (the child
    can deadlock before exec), and the P2P check starts its children from a thread pool. The
    launcher and collect's child runner start theirs without it; in the package only
    ``proof/run.py`` keeps it (started from ``launch``'s only thread)."""
    import ast
    import subprocess as sp

    from fastverify.collect import core

    seen = []
    real = sp.Popen

    class Spy(real):
        def __init__(self, *a, **kw):
            seen.append(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr(sp, "Popen", Spy)
    with RankGroup(tmp_path) as group:
        group.start([[sys.executable, "-c", "pass"]])
    core.run_child([sys.executable, "-c", "pass"], timeout_s=60)
    assert len(seen) == 2 and all(kw.get("preexec_fn") is None for kw in seen), seen
    users = []
    for path in sorted((Path(procs.__file__).parent).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                users.append(path.relative_to(Path(procs.__file__).parent).as_posix())
    assert users == ["proof/run.py"]


DIES_WITH_PARENT = """
import sys, threading, time
from fastverify.collect.core import run_child
from fastverify.procs import RankGroup
def rank():
    group = RankGroup(prefix="fastverify-test-launcher-")
    group.start([[sys.executable, "-c", "import time; time.sleep(600)"]])
    open("rank.pid", "w").write(str(group.procs[0].pid))
    time.sleep(600)
def child():
    run_child([sys.executable, "-c", "import os, time; open('child.pid', 'w').write(str(os.getpid())); time.sleep(600)"],
              timeout_s=600)
for target in (rank, child):
    threading.Thread(target=target, daemon=True).start()  # started from threads, as the P2P check does
time.sleep(600)
"""


@linux_only
def test_ranks_started_from_a_thread_die_with_a_killed_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", DIES_WITH_PARENT], cwd=tmp_path, env=subprocess_env())
    try:
        _wait_for(tmp_path / "rank.pid")
        _wait_for(tmp_path / "child.pid")
        time.sleep(0.2)
        pids = [int((tmp_path / f).read_text()) for f in ("rank.pid", "child.pid")]
        assert all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_the_program_gets_its_environment_exactly_and_a_missing_one_raises(tmp_path):
    """What ``Popen`` does: the program's environment is the one given, nothing added (a Python
    wrapper in the C locale would add LC_CTYPE), and a program that cannot run raises OSError."""
    env = {"PATH": "/usr/bin:/bin", "FV_TEST": "a=b é"}
    with RankGroup(tmp_path, env=env, capture_stdout=True) as group:
        group.start([["env"]])
        while not group.all_exited():
            time.sleep(0.02)
        assert group.returncode(0) == 0
    assert (tmp_path / "rank0.stdout").read_text().splitlines() == ["PATH=/usr/bin:/bin", "FV_TEST=a=b é"]
    with RankGroup(tmp_path) as group, pytest.raises(FileNotFoundError):
        group.start([[str(tmp_path / "no-such-program")]])
