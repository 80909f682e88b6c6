"""The tune sweep on real gloo rank processes: an injected hang and crash, the journal, resume after
``kill -9``, no orphaned ranks. World size 2, tiny messages, 3 timed iterations."""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from conftest import REPO_ROOT, subprocess_env
from rich.console import Console

from fastverify.errors import UserError
from fastverify.tune.ranking import plot_latency, print_report, rank_candidates
from fastverify.tune.sweep import CPU_NOTE, read_journal, run_sweep
from fastverify.tune.trial import Clock, TrialSpec, TrialStatus

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal")

WORKER_MARKER = b"fastverify.tune.worker"
HANG_TIMEOUT_S = 4.0


def _spec(env=None, **kw) -> TrialSpec:
    base = dict(
        backend="gloo",
        env=env or {},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2), (512, 4)),
        warmup=1,
        iters=3,
    )
    base.update(kw)
    return TrialSpec(**base)


def _worker_pids(marker: bytes = WORKER_MARKER, parent: int | None = None) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if WORKER_MARKER in cmd and marker in cmd and state != "Z":
            if parent is None or int(ppid) == parent:
                pids.append(int(entry.name))
    return pids


TRIALS = [
    _spec(baseline=True, label="baseline"),
    _spec({"FASTVERIFY_TEST_INJECT": "hang:1"}, label="hangs"),
    _spec({"FASTVERIFY_TEST_INJECT": "crash:1"}, label="crashes"),
    _spec({"NCCL_PROTO": "LL"}, op="all_reduce_residual_rmsnorm", label="fused path"),
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    journal = tmp_path_factory.mktemp("sweep") / "journal.jsonl"
    t0 = time.monotonic()
    results = run_sweep(TRIALS, journal_path=journal, timeout_s=HANG_TIMEOUT_S, resume=False, progress=False)
    return journal, results, time.monotonic() - t0


def test_hang_and_crash_are_recorded_and_the_sweep_goes_on(sweep):
    journal, results, elapsed = sweep
    by_label = {t.label: r for t, r in zip(TRIALS, results)}
    assert [r.trial_id for r in results] == [t.trial_id for t in TRIALS]

    hang = by_label["hangs"]
    assert hang.status is TrialStatus.FAILED
    assert hang.reason.startswith(f"timeout after {HANG_TIMEOUT_S:g} s") and "injected hang" in hang.reason
    crash = by_label["crashes"]
    assert crash.status is TrialStatus.FAILED
    assert crash.reason.startswith("rank 1 crashed (exit code 3)") and "injected crash" in crash.reason
    for r in (hang, crash):
        assert "\n" not in r.reason and r.step_us is None

    for label in ("baseline", "fused path"):
        r = by_label[label]
        assert r.status is TrialStatus.OK, r.reason
        assert r.clock is Clock.CPU_WALL_CLOCK and r.note == CPU_NOTE and "gloo ignores NCCL" in r.note
        assert [(s.numel, s.msg_bytes, s.count_per_step) for s in r.sizes] == [(64, 128, 2), (512, 1024, 4)]
        for s in r.sizes:
            assert math.isfinite(s.median_us) and 0 < s.median_us <= s.p90_us
            assert s.max_rel_err is not None and s.max_rel_err <= 2.0**-5  # checked against the reference
        assert r.step_us == pytest.approx(sum(s.count_per_step * s.median_us for s in r.sizes))
        assert r.norm == "torch"  # CPU: every trial's backend added + normalized with the torch kernels
        assert r.started_unix_s <= r.finished_unix_s
    assert by_label["baseline"].sizes[0].max_rel_err == 0.0  # plain sum of exact quarter steps
    assert elapsed < 45
    assert not _worker_pids(parent=os.getpid())  # the hung ranks were killed and reaped


def test_journal_holds_every_trial_and_resume_runs_nothing(sweep):
    journal, results, _ = sweep
    contents = read_journal(journal)
    assert contents.torn_bytes == 0
    assert [r.result for r in contents.records] == results
    assert [r.spec for r in contents.records] == TRIALS
    before = journal.read_bytes()
    t0 = time.monotonic()
    again = run_sweep(TRIALS, journal_path=journal, timeout_s=HANG_TIMEOUT_S, resume=True)
    assert time.monotonic() - t0 < 2  # no trial ran (a trial starts two interpreters importing torch)
    assert again == results and journal.read_bytes() == before


def test_resume_drops_a_torn_last_line(sweep, tmp_path):
    journal, results, _ = sweep
    copy = tmp_path / "j.jsonl"
    lines = journal.read_bytes().split(b"\n")
    torn = lines[-2][: len(lines[-2]) // 2]  # the last record, half written
    copy.write_bytes(b"\n".join(lines[:-2]) + b"\n" + torn)
    assert read_journal(copy).torn_bytes == len(torn)
    # The torn trial is the last one (ok, ~3 s); resuming runs just it and leaves a clean journal.
    again = run_sweep(TRIALS, journal_path=copy, timeout_s=HANG_TIMEOUT_S, resume=True)
    assert [r.status for r in again] == [r.status for r in results]
    assert again[:3] == results[:3] and again[3].started_unix_s > results[3].finished_unix_s
    contents = read_journal(copy)
    assert contents.torn_bytes == 0 and [r.spec for r in contents.records] == TRIALS


def test_resume_of_another_sweep_is_refused(sweep):
    journal, _, _ = sweep
    with pytest.raises(UserError, match="different sweep") as err:
        run_sweep(TRIALS[:2], journal_path=journal, timeout_s=HANG_TIMEOUT_S, resume=True)
    assert "\n" not in str(err.value)


def test_report_labels_cpu_timings(sweep, tmp_path):
    _, results, _ = sweep
    ranking = rank_candidates(TRIALS, results)
    assert [c.spec.label for c in ranking.candidates] in (["baseline", "fused path"], ["fused path", "baseline"])
    assert ranking.baseline.spec.label == "baseline" and ranking.baseline.vs_baseline_us == 0
    assert {b.msg_bytes for b in ranking.buckets} == {128, 1024}
    assert {s.label for s, _ in ranking.not_ok} == {"hangs", "crashes"}
    out = io.StringIO()
    print_report(ranking, Console(file=out, width=200))
    text = out.getvalue()
    assert "CPU/gloo" in text and "step ms (CPU/gloo)" in text and "timeout after" in text
    assert "CPU wall clock, not GPU time" in text and "step µs" not in text
    assert "GPU (" not in text and "µs (GPU)" not in text
    png = plot_latency(ranking, tmp_path / "lat.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_DRIVER = """
import sys
from fastverify.tune.sweep import run_sweep
from fastverify.tune.trial import TrialSpec
import orjson
trials = [TrialSpec.from_dict(d) for d in orjson.loads(open(sys.argv[1], 'rb').read())]
run_sweep(trials, journal_path=sys.argv[2], timeout_s=60, resume=False, progress=False)
"""


def _journaled_ids(path: Path) -> list[str]:
    try:
        return [r.result.trial_id for r in read_journal(path).records]
    except (UserError, OSError):
        return []


def test_kill_9_mid_sweep_then_resume_runs_only_the_unfinished_trials(tmp_path):
    trials = [
        _spec({"NCCL_MAX_NCHANNELS": str(i)}, label=f"t{i}", sizes=((64, 1),), baseline=i == 1) for i in (1, 2, 3)
    ]
    spec_file = tmp_path / "trials.json"
    spec_file.write_bytes(orjson.dumps([t.to_dict() for t in trials]))
    journal = tmp_path / "journal.jsonl"
    scratch = tmp_path / "tmp"  # the driver's TMPDIR: its ranks' command lines carry this path
    scratch.mkdir()
    env = subprocess_env()
    env["TMPDIR"] = str(scratch)
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(spec_file), str(journal)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _journaled_ids(journal) and driver.poll() is None:
            time.sleep(0.02)
        assert _journaled_ids(journal), driver.stderr.read().decode() if driver.poll() is not None else "no record"
        marker = str(scratch).encode()
        deadline = time.monotonic() + 20  # wait for the second trial's ranks, so the kill hits mid-trial
        while time.monotonic() < deadline and len(_worker_pids(marker)) < 2 and driver.poll() is None:
            time.sleep(0.02)
        ranks = _worker_pids(marker)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stderr.close()
    done_before = _journaled_ids(journal)
    assert ranks and 1 <= len(done_before) < 3, (ranks, done_before)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _worker_pids(marker):
        time.sleep(0.05)
    assert not _worker_pids(marker), "ranks outlived the killed sweep"
    prefix = journal.read_bytes()[: read_journal(journal).good_bytes]

    results = run_sweep(trials, journal_path=journal, timeout_s=60, resume=True)
    assert [r.status for r in results] == [TrialStatus.OK] * 3
    after = read_journal(journal)
    ids = [r.result.trial_id for r in after.records]
    assert len(ids) == 3 and set(ids) == {t.trial_id for t in trials}  # each trial exactly once
    assert ids[: len(done_before)] == done_before  # the finished ones were not run again
    new = ids[len(done_before) :]
    assert new == [t.trial_id for t in trials if t.trial_id not in done_before]
    assert journal.read_bytes().startswith(prefix)  # appended to, never rewritten


def test_start_up_has_its_own_limit(tmp_path):
    # Two fresh interpreters importing torch take well over 0.3 s: the start-up limit ends the trial.
    [r] = run_sweep([_spec(label="slow start")], journal_path=tmp_path / "j.jsonl", timeout_s=60, startup_timeout_s=0.3)
    assert r.status is TrialStatus.FAILED and r.reason.startswith("start-up timeout after 0.3 s"), r.reason
    assert not _worker_pids(parent=os.getpid())


def test_cuda_trial_without_gpus_is_skipped_with_a_reason(tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this box has the GPUs")
    [r] = run_sweep([_spec(device="cuda", backend="nccl")], journal_path=tmp_path / "j.jsonl", timeout_s=5)
    assert r.status is TrialStatus.SKIPPED and r.reason.startswith("needs 2 GPUs, found ")
    assert r.note == ""  # not a CPU/gloo measurement


def test_one_rank_off_makes_the_trial_wrong_result(tmp_path):
    from fastverify.tune.sweep import collect_trial

    spec = _spec(sizes=((64, 2),))
    docs = [
        {
            "status": "wrong_result",
            "clock": "cpu_wall_clock",
            "meta": {},
            "reason": "numel 64: max relative error 0.5 on rank 0",
            "sizes": [{"numel": 64, "times_ns": [], "max_rel_err": 0.5}],
        },
        {
            "status": "wrong_result",
            "clock": "cpu_wall_clock",
            "meta": {},
            "reason": "numel 64: result differs from the torch reference on another rank",
            "sizes": [{"numel": 64, "times_ns": [], "max_rel_err": 0.0}],
        },
    ]
    for rank, doc in enumerate(docs):
        (tmp_path / f"rank{rank}.json").write_bytes(orjson.dumps(doc))
    r = collect_trial(spec, tmp_path, time.time(), CPU_NOTE)
    assert r.status is TrialStatus.WRONG_RESULT and r.reason == docs[0]["reason"] and r.step_us is None
    assert r.sizes[0].max_rel_err == 0.5 and r.sizes[0].median_us is None
