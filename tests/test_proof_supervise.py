"""``launch --baseline`` as the server's parent, against a stand-in HTTP server
(``tests/proof_server/fake.py``): the start-up answer check, signals forwarded, a ``kill -9`` of
launch, a server that never becomes healthy, one that dies mid-load, and a folder that already
holds a run. The real SGLang server runs the same paths in ``tests/test_sglang_proof.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from conftest import cli, free_port, run_fastverify, subprocess_env

from fastverify.proof.answers import answer_of, prompt_digest, read_prompts
from fastverify.proof.record import LoadRun
from tests.proof_server.fake import answer

FAKE = Path(__file__).resolve().parent / "proof_server" / "fake.py"
N = 8


def _baseline(folder: Path) -> Path:
    """A complete run of the stand-in's own answers to fastverify's 16 prompts, N tokens each."""
    prompts, source = read_prompts(None)
    run = LoadRun(
        complete=True,
        prompts=prompts,
        prompts_source=source,
        prompts_digest=prompt_digest(prompts),
        max_new_tokens=N,
        answers=[answer_of(p, answer(p.text, N), 0.01) for p in prompts],
        server={},
        server_info={"dtype": "float32"},
        clock="cpu_server_wall_clock",
    )
    folder.mkdir(parents=True)
    (folder / "load.json").write_bytes(msgspec.json.encode(run))
    return folder


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _launch(tmp: Path, mode: str, *extra: str) -> tuple[subprocess.Popen, Path, int]:
    port = free_port()
    pid_file = tmp / f"fake-{mode}.pid"
    env = dict(subprocess_env(), FAKE_PID_FILE=str(pid_file))
    cmd = [
        sys.executable,
        "-m",
        "fastverify",
        "launch",
        "--backend",
        "off",
        "--url",
        f"http://127.0.0.1:{port}",
        *extra,
        "--",
        sys.executable,
        str(FAKE),
        str(port),
        mode,
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait(lambda: pid_file.exists() and pid_file.read_text().strip(), 30), proc.communicate(timeout=30)
    return proc, pid_file, int(pid_file.read_text())


def test_the_startup_check_passes_then_serves_until_sigterm_which_reaches_the_server(tmp_path):
    base = _baseline(tmp_path / "base")
    proc, _, server = _launch(tmp_path, "ok", "--baseline", str(base), "--profile-verify", str(tmp_path / "run"))
    assert _wait(lambda: (tmp_path / "run" / "load.json").exists()), proc.communicate(timeout=30)
    time.sleep(0.3)
    assert proc.poll() is None and _alive(server)  # still serving
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err  # the server's own end: killed by the forwarded SIGTERM
    assert not _alive(server)
    assert "answers against --baseline" in err and "same answers (16/16)" in err, err


def test_kill_9_of_launch_leaves_no_server(tmp_path):
    base = _baseline(tmp_path / "base")
    proc, _, server = _launch(tmp_path, "ok", "--baseline", str(base))
    time.sleep(3)  # past the answer phase: serving
    assert _alive(server)
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait(lambda: not _alive(server), 20), "the server outlived a kill -9 of launch"


def test_changed_answers_stop_the_server_with_one_line_naming_prompt_and_token(tmp_path):
    base = _baseline(tmp_path / "base")
    proc, _, server = _launch(tmp_path, "shift", "--baseline", str(base), "--profile-verify", str(tmp_path / "run"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert not _alive(server)
    # "List three ..." is fastverify's prompt p02; the stand-in changed its token 3 (baseline margin 3 nats)
    line = next(x for x in err.splitlines() if "answers against --baseline" in x)
    assert "CHANGED: prompt p02: diverged at token 3" in line and "do not deploy" in line, line
    doc = msgspec.json.decode((tmp_path / "run" / "load.json").read_bytes())
    assert doc["complete"] is False and doc["answers_verdict"] == "CHANGED" and len(doc["answers"]) == 16


def test_a_server_never_healthy_is_stopped_after_the_bounded_wait_and_nothing_is_written(tmp_path):
    base = _baseline(tmp_path / "base")
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc, _, server = _launch(
        tmp_path, "never", "--baseline", str(base), "--profile-verify", str(run), "--ready-timeout", "3"
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and time.monotonic() - t0 < 60, err
    lines = [x for x in err.splitlines() if x.startswith("fastverify: error:")]
    assert len(lines) == 1 and "not healthy after 3 s" in lines[0] and "stopped" in lines[0], err
    assert not _alive(server)
    assert list(run.iterdir()) == []


def test_a_server_dying_mid_load_keeps_the_answers_so_far_marked_incomplete(tmp_path, capsys):
    base = _baseline(tmp_path / "base")
    run = tmp_path / "run"
    proc, _, server = _launch(tmp_path, "die-after-5", "--baseline", str(base), "--profile-verify", str(run))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err  # the server's own exit code
    doc = msgspec.json.decode((run / "load.json").read_bytes())
    assert doc["complete"] is False and "exited with code 3" in doc["incomplete"] and len(doc["answers"]) == 5
    assert len((run / "answers.jsonl").read_text().splitlines()) == 5
    rc, out, err = cli(["compare", base, run], capsys)
    assert rc == 2 and "incomplete run" in err and len(err.strip().splitlines()) == 1, err


def test_a_folder_holding_a_run_is_refused_unless_force(tmp_path, capsys):
    base = _baseline(tmp_path / "base")
    run = tmp_path / "run"
    run.mkdir()
    (run / "verify-rank0.jsonl").write_text("{}\n")
    rc, out, err = cli(
        [
            "launch",
            "--backend",
            "off",
            "--baseline",
            base,
            "--profile-verify",
            run,
            "--url",
            "http://127.0.0.1:9",
            "--",
            "true",
        ],
        capsys,
    )
    assert rc == 2 and "already holds a run" in err and "--force" in err, err
    assert (run / "verify-rank0.jsonl").read_text() == "{}\n"


def test_baseline_must_be_a_run(tmp_path, capsys):
    rc, out, err = cli(
        ["launch", "--backend", "off", "--baseline", tmp_path, "--url", "http://127.0.0.1:9", "--", "true"], capsys
    )
    assert rc == 2 and "no load.json" in err, err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--load"], ["--profile-verify"]),
        (["--load", "--concurrency", "1,x"], ["--concurrency", "not an integer"]),
    ],
)
def test_load_misuse_is_one_line(tmp_path, capsys, args, words):
    rc, out, err = cli(["launch", "--backend", "off", *args, "--url", "http://127.0.0.1:9", "--", "true"], capsys)
    assert rc == 2 and all(w in err for w in words), err
    assert os.listdir(tmp_path) == []


def test_tune_keeps_the_baseline_in_the_record_and_launch_checks_it_then_falls_back(tmp_path, shared_dir):
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    base = _baseline(tmp_path / "base")
    env_file = tmp_path / "box.env"
    cp = run_fastverify(
        [
            "tune",
            "--predict",
            "--topology",
            str(topo),
            "--model",
            "kimi-k2.5",
            "--tp-size",
            "8",
            "--sm",
            "120",
            "--pcie-gen",
            "5",
            "--write-env",
            str(env_file),
            "--baseline",
            str(base),
        ],
        cwd=tmp_path,
    )
    assert cp.returncode == 0, cp.stderr
    rec = json.loads((tmp_path / "box.deploy.json").read_text())
    assert rec["baseline"]["max_new_tokens"] == N and len(rec["baseline"]["answers"]) == 16
    assert rec["baseline"]["source"] == str(base.resolve())
    # launch --env: the record's baseline is asked of the server before it serves; the stand-in changes
    # one token, so launch stops it and, asked to, starts the command again in its own place, unpatched
    proc, pid_file, first = _launch(
        tmp_path, "shift", "--env", str(env_file), "--describe-box", json.dumps(rec["box"]), "--on-mismatch", "fallback"
    )
    assert _wait(lambda: pid_file.read_text().strip() == str(proc.pid), 60), "launch did not start the server again"
    assert not _alive(first)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "the deployment record" in err and "CHANGED: prompt p02" in err and "without the swap" in err, err


def test_tune_baseline_needs_write_env(tmp_path, capsys):
    rc, out, err = cli(["tune", "--predict", "--model", "kimi-k2.5", "--tp-size", "8", "--baseline", tmp_path], capsys)
    assert rc == 2 and "--write-env" in err, err


def test_baseline_folder_as_the_run_folder_is_refused_and_kept(tmp_path, capsys):
    base = _baseline(tmp_path / "base")
    before = (base / "load.json").read_bytes()
    rc, out, err = cli(
        [
            "launch",
            "--backend",
            "off",
            "--baseline",
            base,
            "--profile-verify",
            base,
            "--force",
            "--url",
            "http://127.0.0.1:9",
            "--",
            "true",
        ],
        capsys,
    )
    assert rc == 2 and "is the --baseline folder" in err, err
    assert (base / "load.json").read_bytes() == before


@pytest.mark.parametrize("url", ["notaurl://x", "http://", "http://127.0.0.1:99999", "http://[::1"])
def test_a_bad_url_is_one_line_before_the_server_starts(tmp_path, capsys, url):
    base = _baseline(tmp_path / "base")
    marker = tmp_path / "started"
    rc, out, err = cli(["launch", "--backend", "off", "--baseline", base, "--url", url, "--", "touch", marker], capsys)
    assert rc == 2 and "--url" in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()


def test_empty_profile_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own refusal, one line
        cli(
            [
                "launch",
                "--backend",
                "off",
                "--load",
                "--profile-verify",
                "",
                "--url",
                "http://127.0.0.1:9",
                "--",
                "true",
            ],
            capsys,
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--profile-verify" in err and "empty" in err, err


def test_a_signal_while_serving_leaves_the_finished_check_record_complete(tmp_path):
    base = _baseline(tmp_path / "base")
    proc, _, server = _launch(tmp_path, "ok", "--baseline", str(base), "--profile-verify", str(tmp_path / "run"))
    assert _wait(lambda: (tmp_path / "run" / "load.json").exists())
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    doc = msgspec.json.decode((tmp_path / "run" / "load.json").read_bytes())
    assert doc["complete"] is True and not (tmp_path / "run" / "load.json.bak").exists()


def test_dry_run_says_what_the_load_would_refuse(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "load.json").write_text("{}")
    rc, out, err = cli(
        [
            "launch",
            "--backend",
            "off",
            "--dry-run",
            "--load",
            "--profile-verify",
            run,
            "--url",
            "http://127.0.0.1:9",
            "--",
            "true",
        ],
        capsys,
    )
    assert rc == 2 and "command: true" in out and "already holds a run" in err, (out, err)
    assert (run / "load.json").read_text() == "{}"
