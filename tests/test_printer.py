"""One printer: user-controlled strings reach the terminal with control characters escaped, paths
that are not UTF-8 with their bytes escaped, and stdout/stderr survive any encoding."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from fastverify.errors import one_line, path_text, printable

SHARED = Path(__file__).resolve().parents[2] / "shared"
REPO = Path(__file__).resolve().parents[1]


def test_printable_escapes_controls_and_undecodable_bytes_only():
    assert printable("a\x1b[2Jb\x07c\x9bd\x7f") == "a\\x1b[2Jb\\x07c\\x9bd\\x7f"
    assert printable(os.fsdecode(b"tr\xffce")) == "tr\\xffce"
    assert printable("µs ─ table\twith\nlines") == "µs ─ table\twith\nlines"
    assert printable("a\u2028b") == "a\\u2028b"  # a line separator is a line break to a terminal
    assert one_line("first\nsecond\x1b[2J") == "first second\\x1b[2J"


def test_path_text_is_valid_utf8_for_records():
    p = os.fsdecode(b"/tmp/r\xff.json")
    assert path_text(p) == "/tmp/r\\xff.json"
    path_text(p).encode("utf-8")  # orjson and msgspec take it
    assert path_text("/tmp/plain µ.json") == "/tmp/plain µ.json"


def _run(args: list, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastverify", *args],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_an_escape_sequence_in_a_file_name_is_shown_escaped(tmp_path):
    bad = os.fsencode(tmp_path) + b"/topo\x1b[2J.txt"  # does not exist: the error names it
    cp = _run(["topo", "--nvidia-smi", os.fsdecode(bad)])
    assert cp.returncode == 2 and b"\x1b" not in cp.stderr, cp.stderr
    assert cp.stderr.count(b"\n") == 1 and b"topo\\x1b[2J.txt" in cp.stderr


@pytest.mark.skipif(not (SHARED / "traces").is_dir(), reason="../shared/traces is absent on this machine")
def test_ascii_only_stdout_still_prints_and_writes(tmp_path):
    out = tmp_path / "p.json"
    cp = _run(
        ["profile", "--trace", str(SHARED / "traces" / "HolisticTraceAnalysis"), "--no-png", "--output", str(out)],
        env={"PYTHONIOENCODING": "ascii"},
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert b"\\xb5s" in cp.stdout and orjson.loads(out.read_bytes())["schema"] == "fastverify.profile"


@pytest.mark.skipif(not (SHARED / "inputs").is_dir(), reason="../shared/inputs is absent on this machine")
def test_non_utf8_names_go_into_json_escaped(tmp_path):
    topo = os.fsencode(tmp_path) + b"/t\xff.txt"
    shutil.copy(SHARED / "inputs" / "topo-nccl-tests-307.txt", topo)
    cp = _run(["topo", "--nvidia-smi", os.fsdecode(topo), "--json"])
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert orjson.loads(cp.stdout)["sources"] == [path_text(os.fsdecode(topo))]
    trace = os.fsencode(tmp_path) + b"/r\xff-rank0.json.gz"
    shutil.copy(SHARED / "traces" / "HolisticTraceAnalysis" / "sampled_rank-0.json.gz", trace)
    out = tmp_path / "p.json"
    cp = _run(["profile", "--trace", os.fsdecode(trace), "--no-png", "--output", str(out)])
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert orjson.loads(out.read_bytes())["source"]["files"] == [path_text(os.fsdecode(trace))]


def test_a_folder_of_ten_thousand_traces_is_refused_before_reading(tmp_path):
    from fastverify.trace.load import MAX_TRACE_FILES

    for i in range(MAX_TRACE_FILES + 1):
        (tmp_path / f"t-TP-{i}.json").write_bytes(b"{}")
    cp = _run(["profile", "--trace", str(tmp_path), "--no-png", "--output", str(tmp_path / "out.json")])
    assert cp.returncode == 2 and cp.stderr.count(b"\n") == 1, cp.stderr[-2000:]
    assert f"{MAX_TRACE_FILES + 1:,} trace files".encode() in cp.stderr and not (tmp_path / "out.json").exists()


@pytest.mark.skipif(not (SHARED / "inputs").is_dir(), reason="../shared/inputs is absent on this machine")
def test_tune_write_env_with_a_non_utf8_input_name_and_an_escape_in_a_name(tmp_path):
    topo = os.fsencode(tmp_path) + b"/\xfftopo.txt"
    shutil.copy(SHARED / "inputs" / "topo-nccl-tests-307.txt", topo)
    env = tmp_path / "ff.env"
    cp = _run(
        [
            "tune",
            "--predict",
            "--topology",
            os.fsdecode(topo),
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--write-env",
            str(env),
        ]
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    record = orjson.loads((tmp_path / "ff.deploy.json").read_bytes())
    assert "\\xfftopo.txt" in orjson.dumps(record).decode()  # the name, escaped, in valid UTF-8
    esc = os.fsencode(tmp_path) + b"/a\x1b[2Jb.txt"
    shutil.copy(SHARED / "inputs" / "topo-nccl-tests-307.txt", esc)
    cp = _run(["tune", "--predict", "--topology", os.fsdecode(esc), "--model", "kimi-k2", "--tp", "8"])
    assert cp.returncode == 0 and b"\x1b" not in cp.stdout + cp.stderr and b"a\\x1b[2Jb.txt" in cp.stdout


def test_doctor_names_the_fix_for_settings_that_contradict(tmp_path):
    from fastverify.doctor import run_doctor

    env = tmp_path / "b.env"
    env.write_text("NCCL_MIN_NCHANNELS=64\nNCCL_MAX_NCHANNELS=1\n")
    c = next(c for c in run_doctor(quick=True, env_file=str(env)) if c.name == "env_file")
    assert "contradict" in c.reason and "agree" in c.fix, c
