"""`fastverify doctor` on the command line: JSON summary, exit codes, a bad env file."""

from __future__ import annotations

import json
import os

from conftest import run_fastverify


def test_doctor_json_on_cpu(tmp_path):
    proc = run_fastverify(["doctor", "--json"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    by = {c["name"]: c for c in doc["checks"]}
    assert by["gloo_allreduce"]["status"] == "ok"
    assert by["trace_analyzer"]["status"] == "ok"
    assert doc["counts"]["fail"] == 0 and doc["verdict"] in ("ok", "warn")
    assert sum(doc["counts"].values()) == len(doc["checks"])


def test_doctor_bad_env_file_fails_with_exit_1(tmp_path):
    (tmp_path / "bad.env").write_text("NCCL_P2P_LEVEL=SYS\nLD_PRELOAD=/tmp/x.so\n")
    proc = run_fastverify(["doctor", "--quick", "--json", "--env-file", "bad.env"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    check = next(c for c in json.loads(proc.stdout)["checks"] if c["name"] == "env_file")
    assert check["status"] == "fail" and "line 2" in check["reason"] and "LD_PRELOAD" in check["reason"]


def test_doctor_json_with_nccl_debug_names_the_log_file(tmp_path, monkeypatch):
    """``NCCL_DEBUG=INFO fastverify doctor --quick --json``: stdout is one JSON document, naming
    the file NCCL's log goes to (NCCL_DEBUG_FILE, one per host and process), said on stderr too."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    proc = run_fastverify(["doctor", "--quick", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    said = next(ln for ln in proc.stderr.splitlines() if "NCCL's log" in ln)
    assert said.rstrip().endswith("/nccl.%h.%p.log")
    # --quick on CPU starts no NCCL: no log was written, and no folder is left behind
    assert doc["nccl_log"] is None and not os.path.exists(os.path.dirname(said.split(" goes to ")[1].strip()))
