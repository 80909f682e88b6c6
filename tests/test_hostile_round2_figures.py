"""Hostile figures and closed streams (a second outside hostile run, issue 34): verify records of
0 or 1e-300 ms, a load run of 1e-300 tok/s, all-reduce kernels of 0 µs in a trace, and ``tune`` /
``compare`` with stdout or stderr closed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import REPO_ROOT, assert_user_error, cli, one_line_error, run_fastverify, subprocess_env

from fastverify.proof.answers import Answer, prompt_digest, read_prompts
from fastverify.proof.record import LoadRun
from fastverify.proof.throughput import ThroughputRun

TOPOLOGY = REPO_ROOT / "docs" / "topo-nccl-tests-307.txt"
PREDICT = ["tune", "--predict", "--topology", str(TOPOLOGY), "--model", "kimi-k2.5", "--tp-size", "8"]
PREDICT += ["--sm", "120", "--pcie-gen", "5"]
CLOSED = "fastverify: error: cannot write to standard output (it is closed)"


def _verify_log(folder: Path, times, *, batch: int = 1, tokens: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "step": i,
                "verify_ms": t,
                "clock": "cpu_wall_clock",
                "rank": "0",
                "pid": 1,
                "batch": batch,
                "tokens": tokens,
            }
        )
        for i, t in enumerate(times)
    ]
    (folder / "verify-rank0.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _load_run(folder: Path, *, tok_s, verify) -> Path:
    """A complete run folder of fastverify's prompts, one throughput run at concurrency 1 with
    ``tok_s`` per stream, and the verify times ``verify`` (ms) of bucket 1 x 4 tokens."""
    prompts, source = read_prompts(None)
    answers = [Answer(p.id, [i] * 8, [-0.1] * 8, [4.0] * 8, 8, 4, 0.1) for i, p in enumerate(prompts)]
    t = ThroughputRun(1, len(tok_s), len(tok_s), 16, 24, 1, 1.0, sum(tok_s) / len(tok_s), list(tok_s), [10.0], 2.0, 0)
    run = LoadRun(
        complete=True,
        incomplete=None,
        prompts=prompts,
        prompts_source=source,
        prompts_digest=prompt_digest(prompts),
        max_new_tokens=8,
        answers=answers,
        throughput=[t],
        server={"tp": 2, "algorithm": "NGRAM", "draft_tokens": 4, "dtype": "float32"},
        server_info={"dtype": "float32"},
        clock="cpu_server_wall_clock",
        backend="pcie_ipc",
    )
    _verify_log(folder, verify)
    (folder / "load.json").write_bytes(msgspec.json.encode(run))
    return folder


# 1. verify records under 1 µs ------------------------------------------------------------------


@pytest.mark.parametrize("ms", [0, 0.0, 1e-300, 0.0009])
def test_a_verify_record_under_one_microsecond_is_refused_naming_file_and_line(tmp_path, capsys, ms):
    log = _verify_log(tmp_path / "tiny", [2.0, ms, 2.0])
    rc, out, err = cli(["profile", "--verify-log", log, "--output", tmp_path / "o.json"], capsys)
    line = one_line_error(rc, out, err, f"verify-rank0.jsonl:2: verify_ms {ms!r}", "0.001", "1 µs")
    assert "is not a verify time" in line and not (tmp_path / "o.json").exists()
    ok = _verify_log(tmp_path / "ok", [2.0] * 3)
    rc, out, err = cli(["profile", "--verify-log", ok, log, "--output", tmp_path / "o2.json"], capsys)
    one_line_error(rc, out, err, "tiny/verify-rank0.jsonl:2", "verify_ms")


def test_a_verify_record_of_one_microsecond_still_counts(tmp_path, capsys):
    log = _verify_log(tmp_path / "v", [0.001, 0.001, 0.003])
    rc, out, err = cli(["profile", "--verify-log", log, "--output", tmp_path / "o.json"], capsys)
    assert rc == 0, err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["before"]["overall"]["p50_ms"] == pytest.approx(0.001)  # median of 0.001, 0.001, 0.003


def test_compare_refuses_an_after_run_of_zero_ms_verify_steps(tmp_path, capsys):
    before = _load_run(tmp_path / "b", tok_s=[41.0] * 4, verify=[2.0] * 5)
    after = _load_run(tmp_path / "a", tok_s=[41.0] * 4, verify=[1e-300] * 5)
    rc, out, err = cli(["compare", before, after], capsys)
    one_line_error(rc, out, err, "a/verify-rank0.jsonl:1: verify_ms 1e-300")
    assert "-100" not in out


# 2. tok/s under one token per hour ---------------------------------------------------------------


@pytest.mark.parametrize("tok_s", [1e-300, 0.0002])
def test_compare_refuses_a_stream_slower_than_one_token_an_hour(tmp_path, capsys, tok_s):
    before = _load_run(tmp_path / "b", tok_s=[41.0] * 4, verify=[2.0] * 5)
    after = _load_run(tmp_path / "a", tok_s=[tok_s, 41.0, 41.0, 41.0], verify=[2.0] * 5)
    rc, out, err = cli(["compare", before, after], capsys)
    one_line_error(rc, out, err, "a/load.json", "tok/s must be finite in [0.000278 (one token per hour)")
    assert "-> 0.0" not in out


def test_compare_takes_a_stream_of_one_token_an_hour(tmp_path, capsys):
    before = _load_run(tmp_path / "b", tok_s=[41.0] * 4, verify=[2.0] * 5)
    after = _load_run(tmp_path / "a", tok_s=[1 / 3600 + 1e-9] * 4, verify=[2.0] * 5)
    rc, out, err = cli(["compare", before, after, "--json"], capsys)
    assert rc == 0, err
    (s,) = json.loads(out)["streams"]
    assert s["after"]["mean"] == pytest.approx(1 / 3600, abs=1e-6)  # the document rounds to 6 places


# 3. all-reduce kernels under 1 µs in a trace -----------------------------------------------------

AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel__5x_cublas"


def _trace(path: Path, ar_durs) -> Path:
    events, ts = [], 0.0
    for i, d in enumerate(ar_durs):
        for name, dur in ((GEMM, 20.0), (AR, d)):
            args = {"device": 0, "stream": 7, "correlation": 2 * i + (name == AR)}
            events.append(
                {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}
            )
            ts += 30.0
    doc = {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
        "traceEvents": events,
    }
    path.write_text(json.dumps(doc))
    return path


def test_all_reduce_kernels_under_one_microsecond_are_warned_about(tmp_path):
    _trace(tmp_path / "t.json", [0, 1e-300, 0.5, 12.0])
    proc = run_fastverify(["profile", "--trace", "t.json", "--output", "p.json", "--no-png"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    want = "rank 0: 3 of 4 all-reduce kernels last under 1 µs"
    warnings = json.loads((tmp_path / "p.json").read_text())["warnings"]
    assert [w for w in warnings if want in w] and "no measurement" in next(w for w in warnings if want in w)
    assert f"# warning: {want}" in proc.stdout


def test_a_trace_of_measurable_all_reduces_has_no_such_warning(tmp_path):
    _trace(tmp_path / "t.json", [1.0, 12.0, 13.0])  # 1 µs exactly is a time of work
    proc = run_fastverify(["profile", "--trace", "t.json", "--output", "p.json", "--no-png"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads((tmp_path / "p.json").read_text())["warnings"]
    assert not [w for w in warnings if "all-reduce kernels last under" in w], warnings


# 4-6. closed standard streams ---------------------------------------------------------------------


def _run(argv, cwd: Path, *, close: int | None = None, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    return subprocess.run(
        [sys.executable, "-m", "fastverify", *map(str, argv)],
        cwd=cwd,
        env=subprocess_env(),
        stdout=stdout,
        stderr=stderr,
        text=True,
        preexec_fn=(lambda: os.close(close)) if close is not None else None,
        timeout=300,
    )


def test_tune_predict_json_with_stdout_closed_is_one_line_and_exit_2(tmp_path):
    proc = _run([*PREDICT, "--json", "--write-env", "box.env"], tmp_path, close=1, stdout=None)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == CLOSED and "Traceback" not in proc.stderr
    assert not (tmp_path / "box.env").exists()  # the document comes first: nothing written after it failed


@pytest.mark.parametrize("as_json", [False, True])
def test_compare_with_stdout_closed_is_the_one_line(tmp_path, as_json):
    before = _load_run(tmp_path / "b", tok_s=[41.0] * 4, verify=[2.0] * 5)
    after = _load_run(tmp_path / "a", tok_s=[42.0] * 4, verify=[1.9] * 5)
    proc = _run(["compare", before, after, *(["--json"] if as_json else [])], tmp_path, close=1, stdout=None)
    assert proc.returncode == 2 and proc.stderr == CLOSED + "\n", proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_compare_into_a_full_device_is_the_one_line(tmp_path):
    before = _load_run(tmp_path / "b", tok_s=[41.0] * 4, verify=[2.0] * 5)
    after = _load_run(tmp_path / "a", tok_s=[42.0] * 4, verify=[1.9] * 5)
    with open("/dev/full", "w") as full:
        proc = _run(["compare", before, after], tmp_path, stdout=full)
    assert proc.returncode == 2
    assert proc.stderr == "fastverify: error: cannot write to standard output (No space left on device)\n"


def test_tune_predict_json_with_stderr_closed_keeps_stdout_one_json_document(tmp_path):
    proc = _run([*PREDICT, "--json"], tmp_path, close=2, stderr=None)
    assert proc.returncode == 0
    assert not proc.stdout.startswith("#"), proc.stdout[:200]
    doc = json.loads(proc.stdout)  # the whole of stdout is the document
    assert doc["schema"] == "fastverify.tune" and doc["mode"] == "predict"


def test_a_user_error_with_stderr_closed_still_exits_2_and_prints_nothing(tmp_path):
    proc = _run(["tune", "--predict", "--verify-ms", "1e-300", "--allreduce-ms", "1"], tmp_path, close=2, stderr=None)
    assert proc.returncode == 2 and proc.stdout == ""


def test_a_user_error_is_one_line(tmp_path):
    proc = run_fastverify(["profile", "--verify-log", str(_verify_log(tmp_path / "z", [0]))], cwd=tmp_path)
    assert_user_error(proc, "verify_ms 0", "z/verify-rank0.jsonl:1")
