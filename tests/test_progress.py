"""Progress on stderr (fastverify.progress) and where it is used: live runs (their GPU-to-CPU
fallback line, the CPU estimate, the ranks' progress files, the timeout message) and tune sweeps
(plain lines when stderr is not a terminal).

Expected lines and numbers are worked out here by hand from the inputs, not by calling the code
under test; the real runs use the tiny preset on 2 gloo ranks (a few seconds each).
"""

from __future__ import annotations

import io
import sys
import time

import pytest
from rich.console import Console

from fastverify.errors import UserError
from fastverify.progress import AFTER_S, AFTER_S_ENV, Progress, default_after_s, say


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


# ---- fastverify.progress -------------------------------------------------------------------------


def test_silent_before_two_seconds_then_one_line_with_the_time_left(monkeypatch):
    monkeypatch.delenv(AFTER_S_ENV, raising=False)
    clock, out = FakeClock(), io.StringIO()
    bar = Progress("loading traces", 10, stream=out, clock=clock)
    for t, done in ((100.5, 1), (101.0, 1), (101.99, 2)):
        clock.t = t
        assert bar.update(done) is False
    assert out.getvalue() == ""
    clock.t = 102.0  # 2.0 s in, 2 of 10 done: 2.0 / 2 x 8 = 8.0 s left
    assert bar.update(2, "rank 1, 53.7 MB") is True
    assert lines_of(out) == ["fastverify: loading traces 2/10 (rank 1, 53.7 MB), 2.0 s elapsed, about 8.0 s left"]


def test_at_most_one_line_a_second_but_always_the_last():
    clock, out = FakeClock(0.0), io.StringIO()
    bar = Progress("job", 4, stream=out, clock=clock, after_s=2.0, every_s=1.0)
    clock.t = 3.0
    assert bar.update(1)  # 3.0 / 1 x 3 = 9.0 s left
    clock.t = 3.5
    assert not bar.update(2)  # 0.5 s after the last line
    clock.t = 3.9
    assert not bar.update(3)
    clock.t = 4.0
    assert bar.update(3)  # 1.0 s after: due; 4.0 / 3 x 1 = 1.33 s left
    clock.t = 4.2
    assert bar.update(4)  # the last step, 0.2 s after a line: printed anyway, no time left
    assert lines_of(out) == [
        "fastverify: job 1/4, 3.0 s elapsed, about 9.0 s left",
        "fastverify: job 3/4, 4.0 s elapsed, about 1.3 s left",
        "fastverify: job 4/4, 4.2 s elapsed",
    ]
    assert bar.lines == 3


def test_a_phase_counts_elapsed_from_the_job_and_the_time_left_from_its_own_rate():
    clock, out = FakeClock(50.0), io.StringIO()
    # The job began at 20.0; the phase (7 forwards) at 50.0. After 2 forwards at 80.0: 30 s for 2,
    # so 15 s each and 5 to go = 75 s left; 60 s since the job began.
    bar = Progress("live run: forwards", 7, stream=out, clock=clock, job_start=20.0)
    clock.t = 80.0
    bar.update(2, "warm-up 2/2")
    assert lines_of(out) == ["fastverify: live run: forwards 2/7 (warm-up 2/2), 60.0 s elapsed, about 75.0 s left"]
    assert bar.elapsed() == 60.0 and bar.left(2) == 75.0


def test_no_time_left_for_side_by_side_steps_disabled_or_forced():
    clock, out = FakeClock(0.0), io.StringIO()
    side = Progress("ranks started", 8, stream=out, clock=clock, eta=False, after_s=2.0)
    off = Progress("quiet", 8, stream=out, clock=clock, enabled=False, after_s=2.0)
    clock.t = 5.0
    assert side.update(3)
    assert not off.update(3) and not off.update(8, force=True)
    early = Progress("forced", None, stream=out, clock=clock, after_s=2.0)
    clock.t = 5.5
    assert early.update(1, force=True)  # force prints inside the silence; no total: no "/N", no time left
    assert lines_of(out) == ["fastverify: ranks started 3/8, 5.0 s elapsed", "fastverify: forced 1, 0.5 s elapsed"]


@pytest.mark.parametrize(
    "value, want",
    [
        ("0", 0.0),
        ("0.25", 0.25),
        (" 7 ", 7.0),
        ("", AFTER_S),
        ("-1", AFTER_S),
        ("nan", AFTER_S),
        ("inf", AFTER_S),
        ("soon", AFTER_S),
    ],
)
def test_the_silence_can_be_set_by_environment(monkeypatch, value, want):
    monkeypatch.setenv(AFTER_S_ENV, value)
    assert default_after_s() == want
    clock, out = FakeClock(0.0), io.StringIO()
    bar = Progress("job", 2, stream=out, clock=clock)
    assert bar.after_s == want
    assert Progress("job", 2, stream=out, clock=clock, after_s=3.0).after_s == 3.0  # explicit wins


def test_say_is_one_prefixed_line_now():
    out = io.StringIO()
    say("live run on CPU", stream=out)
    assert out.getvalue() == "fastverify: live run on CPU\n"


# ---- live runs: the CPU estimate ------------------------------------------------------------------


def test_forward_work_of_a_small_llama_by_hand():
    from fastverify.live.config import ModelConfig
    from fastverify.live.preflight import forward_work

    cfg = ModelConfig(
        name="l",
        source="test",
        family="llama",
        hidden_size=64,
        num_layers=2,
        vocab_size=1000,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        first_k_dense_replace=2,
    )
    # TP 2: 2 query heads and 1 KV head per rank, MLP width 64 per rank, vocab padded to 1024 -> 512.
    # Per layer [k, n]: q 64x32, kv 64x32, o 32x64, gate/up 64x128, down 64x64 = 18432 elements;
    # 2 layers + lm_head 64x512 = 69632 elements = 139264 bytes. KV context: 1 request x 1 head x
    # 256 x (16 + 16) x 2 B x 2 layers = 32768 bytes.
    # FLOPs: 2 x T (2) x 69632 = 278528, attention 2 x 1 x 2 heads x 2 drafts x 258 x 32 x 2 layers = 132096.
    assert forward_work(cfg, tp=2, batch=1, draft_tokens=2, dtype_bytes=2, context_tokens=256) == (
        139264 + 32768,
        278528 + 132096,
    )


def test_the_estimate_is_close_to_what_was_measured_on_the_calibration_machine():
    """The docstring's measurements (2-core EPYC VM): the estimate for those shapes on 2 cores
    must stay within 25 % of the measured memory and 35 % of the measured wall time."""
    from fastverify.live.config import load_model_config
    from fastverify.live.preflight import estimate_cpu_run

    measured = {("kimi-k2", 2): (156.0, 8883), ("kimi-k2", 8): (135.0, 10056), ("tiny", 2): (4.1, 555)}
    for (model, tp), (wall_s, pss_mib) in measured.items():
        est = estimate_cpu_run(load_model_config(model), tp=tp, batch=1, draft_tokens=4, iters=5, warmup=2, cores=2)
        assert abs(est.memory_bytes / 2**20 - pss_mib) / pss_mib < 0.30, (model, tp, est)
        assert abs(est.seconds - wall_s) / wall_s < 0.35, (model, tp, est)
        assert est.forwards == 7 and est.tp == tp and est.cores == 2


def test_more_cores_make_the_same_run_faster_but_not_smaller():
    from fastverify.live.config import load_model_config
    from fastverify.live.preflight import estimate_cpu_run

    cfg = load_model_config("kimi-k2")
    two = estimate_cpu_run(cfg, tp=8, batch=1, draft_tokens=4, iters=5, warmup=2, cores=2)
    many = estimate_cpu_run(cfg, tp=8, batch=1, draft_tokens=4, iters=5, warmup=2, cores=8)
    assert many.memory_bytes == two.memory_bytes
    # 8 ranks on 8 cores instead of 2: the compute of a forward goes 4x faster; the 124 collectives'
    # latency (a few % of it) does not shrink.
    assert two.forward_s / 4 < many.forward_s < two.forward_s / 4 * 1.1
    assert many.seconds < two.seconds / 3


# ---- live runs: the fallback line and the memory refusal ---------------------------------------


class _Stop(Exception):
    pass


@pytest.fixture
def no_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build on a box without a GPU
    from fastverify.live import preflight

    # Kimi-K2's 8.7-10.1 GiB fits whatever this machine has (the refusal has its own test).
    monkeypatch.setattr(preflight, "available_bytes", lambda cuda, tp, torch: (2**40, "of host memory available"))
    return torch


def _stop_at_launch(monkeypatch, capsys):
    """Replace the rank launcher by one that records stderr as it stood when ranks would start."""
    from fastverify.live import runner

    seen = {}

    def launch(*args, **kwargs):
        seen["stderr"] = capsys.readouterr().err
        raise _Stop

    monkeypatch.setattr(runner, "launch_ranks", launch)
    return seen


def test_auto_without_cuda_says_so_before_any_rank_starts(monkeypatch, capsys, no_gpu):
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    seen = _stop_at_launch(monkeypatch, capsys)
    with pytest.raises(_Stop):
        run_live(load_model_config("kimi-k2"), tp=8, draft_tokens=4, batch=1, device="auto", timeout_s=300)
    lines = seen["stderr"].splitlines()
    assert len(lines) == 1, seen["stderr"]
    line = lines[0]
    assert line.startswith(
        "fastverify: live run on CPU + gloo, not CUDA: no CUDA GPU found "
        "(torch.cuda.is_available() is False); estimated "
    ), line
    assert "for kimi-k2 at --tp 8 (8 ranks on " in line and "7 forwards of " in line
    # Memory by hand: rank_memory's lower bound for Kimi-K2 at TP 8 is 1.03 GiB a rank (weights of
    # one layer, 32 reachable experts: 3 x 32 x 7168 x 256 x 2 B = 0.33 GiB of them); with 192 MiB a
    # process and 320 MiB for the parent: 8 x (1.0335 + 0.1875) + 0.3125 = 10.1 GiB.
    assert " and 10.1 GiB " in line, line
    time_text = line.split("estimated ")[1].split(" and ")[0]
    assert time_text.endswith((" s", " min"))


def test_fewer_gpus_than_tp_names_the_count_and_warns_about_the_timeout(monkeypatch, capsys, no_gpu):
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    monkeypatch.setattr(no_gpu.cuda, "is_available", lambda: True)
    monkeypatch.setattr(no_gpu.cuda, "device_count", lambda: 1)
    seen = _stop_at_launch(monkeypatch, capsys)
    with pytest.raises(_Stop):
        run_live(load_model_config("kimi-k2"), tp=2, draft_tokens=4, batch=1, device="auto", timeout_s=5)
    (line,) = seen["stderr"].splitlines()
    assert line.startswith("fastverify: live run on CPU + gloo, not CUDA: only 1 GPU for --tp 2; estimated "), line
    # Building 2 x 4 GiB of random weights alone takes longer than 5 s on any CPU the model knows.
    assert line.endswith("; that is over --timeout 5 s, so raise --timeout or the run will be stopped"), line


def test_an_explicit_cpu_run_within_its_timeout_says_nothing_at_start(monkeypatch, capsys):
    pytest.importorskip("torch")
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    seen = _stop_at_launch(monkeypatch, capsys)
    with pytest.raises(_Stop):
        run_live(load_model_config("tiny"), tp=2, draft_tokens=4, batch=1, device="cpu", timeout_s=300)
    assert seen["stderr"] == ""


def test_a_cpu_fallback_that_cannot_fit_is_refused_at_once_in_one_line(monkeypatch, capsys, no_gpu):
    from fastverify.live import preflight, runner
    from fastverify.live.config import load_model_config

    monkeypatch.setattr(preflight, "available_bytes", lambda cuda, tp, torch: (8 * 2**30, "of host memory available"))
    seen = _stop_at_launch(monkeypatch, capsys)
    t0 = time.monotonic()
    with pytest.raises(UserError) as info:
        runner.run_live(load_model_config("kimi-k2"), tp=8, draft_tokens=4, batch=1, device="auto")
    assert time.monotonic() - t0 < 10 and seen == {}  # no rank started
    msg = str(info.value)
    assert "\n" not in msg and capsys.readouterr().err == ""  # the error is the only line
    assert msg.startswith(
        "--batch 1 x --draft-tokens 4 (T = 4 tokens) of kimi-k2 at --tp 8 on CPU (no CUDA GPU "
        "found (torch.cuda.is_available() is False)): 8 ranks need at least 10.1 GiB"
    ), msg
    assert "this machine has 8.0 GiB of host memory available" in msg
    assert msg.endswith("lower --batch or --draft-tokens, or --tp (each CPU rank is a process of its own)")


# ---- live runs: progress from the ranks -----------------------------------------------------------


def _progress_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("fastverify: live run: ")]


def test_a_real_cpu_run_reports_ranks_weights_and_forwards(monkeypatch, capsys, no_gpu):
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    monkeypatch.setenv(AFTER_S_ENV, "0")  # every due line, from the first
    t0 = time.monotonic()
    ranks = run_live(
        load_model_config("tiny"), tp=2, draft_tokens=4, batch=1, iters=3, warmup=1, device="auto", timeout_s=120
    )
    assert time.monotonic() - t0 < 30 and [r.rank for r in ranks] == [0, 1]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fastverify: live run on CPU + gloo, not CUDA: no CUDA GPU found"), err
    lines = _progress_lines("\n".join(err))
    assert err[1:] == lines  # nothing else on stderr
    started = [ln for ln in lines if ln.startswith("fastverify: live run: ranks started ")]
    built = [ln for ln in lines if ln.startswith("fastverify: live run: weights built ")]
    forwards = [ln for ln in lines if ln.startswith("fastverify: live run: forwards ")]
    assert started and started[-1].startswith("fastverify: live run: ranks started 2/2, ")
    assert built and built[-1].startswith("fastverify: live run: weights built 2/2 (")
    # tiny at TP 2 allocates 1.87 MiB a rank (rank_memory's setup, plus the routing plans).
    assert " MiB per rank), " in built[-1]
    assert forwards[-1].startswith("fastverify: live run: forwards 4/4 (timed 3/3), ") and "left" not in forwards[-1]
    assert lines.index(started[-1]) < lines.index(built[-1]) < lines.index(forwards[-1])
    assert all("left" not in ln for ln in started + built)  # side by side: no time left from one rank
    for ln in forwards[:-1]:  # 1/4 is the warm-up; any other shown says timed i/3 and a time left
        k = int(ln.split("forwards ")[1].split("/")[0])
        assert (f"(warm-up {k}/1)" if k == 1 else f"(timed {k - 1}/3)") in ln and "s left" in ln


def test_progress_off_prints_nothing(monkeypatch, capsys, no_gpu):
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    monkeypatch.setenv(AFTER_S_ENV, "0")
    # --quiet: nothing on stderr, not even the fallback line.
    ranks = run_live(
        load_model_config("tiny"),
        tp=2,
        draft_tokens=4,
        batch=1,
        iters=1,
        warmup=0,
        device="auto",
        timeout_s=120,
        progress=False,
    )
    assert len(ranks) == 2 and capsys.readouterr().err == ""


def test_a_timeout_says_how_far_the_run_got(tmp_path):
    from fastverify.live.runner import LiveWatch, launch_ranks

    # Rank 0 joined and built (1 GiB), rank 1 joined only; both then hang. The ranks run in the
    # run's folder (cwd), where the parent reads rank<r>.progress.
    code = {
        0: "open('rank0.progress', 'a').write('up\\nbuilt 1073741824\\n'); import time; time.sleep(60)",
        1: "open('rank1.progress', 'a').write('up\\n'); import time; time.sleep(60)",
    }
    watch = LiveWatch(tmp_path, 2, warmup=2, iters=5, enabled=False)
    with pytest.raises(UserError) as info:
        launch_ranks(lambda r: [sys.executable, "-c", code[r]], 2, 2.0, str(tmp_path), watch=watch)
    assert str(info.value) == (
        "live rank 0 did not finish within 2 s (reached: 2/2 ranks started, 1/2 built; "
        "last stderr line: no stderr output)"
    )
    assert watch.weight_bytes == 2**30


def test_the_watch_reads_only_whole_lines_and_counts_forwards_of_rank_0(tmp_path, monkeypatch):
    from fastverify.live.runner import LiveWatch

    monkeypatch.setenv(AFTER_S_ENV, "0")
    out = io.StringIO()
    r0, r1 = tmp_path / "rank0.progress", tmp_path / "rank1.progress"
    r0.write_text("up\nbuilt 2097152\nforward 1\nforw")  # a line being written is not read yet
    r1.write_text("up\n")
    watch = LiveWatch(tmp_path, 2, warmup=2, iters=5, enabled=True, job_start=time.monotonic() - 10, stream=out)
    watch.poll()
    assert watch.reached() == "reached: 2/2 ranks started, 1/2 built"
    r1.write_text("up\nbuilt 2097152\nforward 9\n")  # every rank built; rank 1's forwards are not counted
    watch.poll()  # the forwards phase begins now: its rate counts from here
    time.sleep(0.2)
    r0.write_text("up\nbuilt 2097152\nforward 1\nforward 2\nforward 3\n")
    watch._fwd.every_s = 0.0
    watch.poll()
    assert watch.reached() == "reached: 2/2 ranks started, 2/2 built, forward 3/7 (timed 1/5)"
    got = lines_of(out)
    assert got[0].startswith("fastverify: live run: ranks started 2/2, 10.")
    assert got[1].startswith("fastverify: live run: weights built 1/2 (2.0 MiB per rank), 10.")
    assert got[2].startswith("fastverify: live run: weights built 2/2 (2.0 MiB per rank), 10.")
    assert got[3].startswith("fastverify: live run: forwards 1/7 (warm-up 1/2), 10.")
    # 3 forwards in about 0.2 s since the phase began, 4 to go: about 0.27 s left.
    assert got[4].startswith("fastverify: live run: forwards 3/7 (timed 1/5), 10.")
    left = float(got[4].split("about ")[1].split(" s left")[0])
    assert 0.2 <= left <= 1.0, got[4]
    assert len(got) == 5


def test_a_long_forward_gets_a_heartbeat_line_every_5_s(tmp_path, monkeypatch):
    """A CPU forward of Kimi-K2 takes 15 s and more: the parent says what is running every
    HEARTBEAT_S (5 s) without a new stage, so no live run is silent for over 10 s."""
    import fastverify.live.runner as R

    monkeypatch.setenv(AFTER_S_ENV, "0")
    now = [1000.0]
    monkeypatch.setattr(R.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    (tmp_path / "rank0.progress").write_text("up\nbuilt 1024\nforward 1\n")
    (tmp_path / "rank1.progress").write_text("up\nbuilt 1024\n")
    watch = R.LiveWatch(tmp_path, 2, warmup=2, iters=5, enabled=True, job_start=990.0, stream=out)
    watch.poll()
    first = len(lines_of(out))
    now[0] += R.HEARTBEAT_S - 0.1
    watch.poll()
    assert len(lines_of(out)) == first  # under 5 s: nothing more
    now[0] += 0.2
    watch.poll()
    got = lines_of(out)
    assert len(got) == first + 1
    assert got[-1] == "fastverify: live run: forward 2/7 running (warm-up 2/2), 15.1 s elapsed"
    now[0] += R.HEARTBEAT_S
    watch.poll()
    assert lines_of(out)[-1] == "fastverify: live run: forward 2/7 running (warm-up 2/2), 20.1 s elapsed"


# ---- tune sweeps -----------------------------------------------------------------------------------


def _trial(label: str, **kw):
    from fastverify.tune.trial import TrialSpec

    base = dict(
        backend="gloo",
        env={},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2),),
        warmup=1,
        iters=3,
        label=label,
    )
    base.update(kw)
    return TrialSpec(**base)


def _ended(spec, status, reason=""):
    """The result the sweep hands its progress when trial ``spec`` ends."""
    from fastverify.tune.trial import TrialResult

    now = time.time()
    return TrialResult(spec.trial_id, status, reason, (), None, None, now, now)


def test_a_sweep_off_a_terminal_prints_plain_lines(monkeypatch):
    from fastverify.tune.sweep import TrialProgress as _Progress
    from fastverify.tune.trial import TrialStatus

    monkeypatch.setenv(AFTER_S_ENV, "0")
    file = io.StringIO()
    console = Console(file=file, force_terminal=False)
    trials = [_trial("first"), _trial("second", baseline=True), _trial("third")]
    with _Progress(True, 3, console=console) as bar:
        for i, t in enumerate(trials):
            bar.start(t)
            status = TrialStatus.FAILED if t.label == "second" else TrialStatus.OK
            bar.finish(t, _ended(t, status, "rank 1 crashed (exit code 3): boom" if i == 1 else ""))
            time.sleep(1.05)  # past the one-line-a-second throttle
    lines = lines_of(file)
    assert "\x1b" not in file.getvalue() and "━" not in file.getvalue()  # no bar, no escapes
    assert lines[0].startswith("fastverify: tune: trials 0/3 (running first), ") and "left" not in lines[0]
    # 1 of 3 done when "second" starts, 2 of 3 when "third" does, each with the time left.
    assert lines[1].startswith("fastverify: tune: trials 1/3 (running second), ") and lines[1].endswith(" s left")
    assert lines[2] == "fastverify: tune: trial 2/3 second: failed (rank 1 crashed (exit code 3): boom)"
    assert lines[3].startswith("fastverify: tune: trials 2/3 (running third), ") and lines[3].endswith(" s left")
    assert lines[4].startswith("fastverify: tune: trials 3/3 (all run), ")
    assert len(lines) == 5


def test_lines_order_when_a_trial_fails():
    """The failure line comes when the trial ends, between its start line and the next one."""
    from fastverify.tune.sweep import TrialProgress as _Progress
    from fastverify.tune.trial import TrialStatus

    file = io.StringIO()
    t = _trial("only")
    with _Progress(True, 1, console=Console(file=file, force_terminal=False)) as bar:
        bar.start(t)  # inside the 2 s silence: no line
        bar.finish(t, _ended(t, TrialStatus.SKIPPED, "needs 2 GPUs, found 0"))
    assert lines_of(file) == ["fastverify: tune: trial 1/1 only: skipped (needs 2 GPUs, found 0)"]


def test_a_long_trial_off_a_terminal_gets_a_heartbeat_line(monkeypatch):
    """One trial that runs for a long time (a JIT build, a slow CPU trial) is not silent: a line
    every HEARTBEAT_S names it and how long it has run."""
    import fastverify.tune.sweep as S
    from fastverify.tune.trial import TrialStatus

    monkeypatch.setenv(AFTER_S_ENV, "0")
    monkeypatch.setattr(S, "HEARTBEAT_S", 0.6)
    file = io.StringIO()
    t = _trial("slow")
    with S.TrialProgress(True, 1, console=Console(file=file, force_terminal=False)) as bar:
        bar.start(t)
        time.sleep(1.5)  # two heartbeats at about 0.6 s and 1.2 s (checked every 0.5 s)
        bar.finish(t, _ended(t, TrialStatus.OK))
    lines = lines_of(file)
    beats = [ln for ln in lines if " running slow for " in ln]
    assert lines[0].startswith("fastverify: tune: trials 0/1 (running slow), ")
    assert 1 <= len(beats) <= 2, lines
    assert beats[0].startswith("fastverify: tune: trial 1/1 running slow for ")
    assert lines[-1].startswith("fastverify: tune: trials 1/1 (all run), ")


def test_a_sweep_on_a_terminal_draws_a_bar_with_count_and_eta():
    from fastverify.tune.sweep import TrialProgress as _Progress
    from fastverify.tune.trial import TrialStatus

    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=120, color_system=None)
    trials = [_trial("a"), _trial("b", baseline=True)]
    with _Progress(True, 2, console=console) as bar:
        for t in trials:
            bar.start(t)
            bar.finish(t, _ended(t, TrialStatus.OK))
    text = file.getvalue()
    assert "2/2" in text and "ETA" in text and "fastverify:" not in text


def test_a_real_sweep_under_capture_prints_plain_lines(monkeypatch, capsys, tmp_path):
    from fastverify.tune.sweep import run_sweep
    from fastverify.tune.trial import TrialStatus

    monkeypatch.setenv(AFTER_S_ENV, "0")
    trials = [_trial("base", baseline=True), _trial("crash", env={"FASTVERIFY_TEST_INJECT": "crash:1"})]
    results = run_sweep(trials, journal_path=tmp_path / "j.jsonl", timeout_s=30, progress=True)
    assert [r.status for r in results] == [TrialStatus.OK, TrialStatus.FAILED]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify: tune: ")]
    assert lines[0].startswith("fastverify: tune: trials 0/2 (running base), ")
    assert any(ln.startswith("fastverify: tune: trial 2/2 crash: failed (rank 1 crashed") for ln in lines), lines
    assert lines[-1].startswith("fastverify: tune: trials 2/2 (all run), ")


def test_a_bad_after_s_value_is_said_once_and_the_default_used(monkeypatch, capsys):
    import fastverify.progress as P

    bad = f"abc{time.monotonic_ns()}"  # a value this process has not warned about
    monkeypatch.setenv(AFTER_S_ENV, bad)
    assert P.default_after_s() == P.AFTER_S and P.default_after_s() == P.AFTER_S
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fastverify: warning: {AFTER_S_ENV}={bad!r} is not a number of seconds >= 0; using 2 s"]
    monkeypatch.setenv(AFTER_S_ENV, "-1")
    assert P.default_after_s() == P.AFTER_S
    monkeypatch.setenv(AFTER_S_ENV, "0.5")
    assert P.default_after_s() == 0.5
