"""Hostile input against ``fastverify collect`` and ``report``, second outside run: a server that
leaves symbolic links in its trace folder, trace names that are all left out, stderr on a full
device, a bad ``Content-Length`` and an empty ``/server_info``, a sweep point at the verify size
that is no time of work."""

from __future__ import annotations

import dataclasses
import gzip
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fastverify.bundle import open_bundle
from fastverify.collect import command
from fastverify.collect.server import fetch_server_info
from fastverify.errors import UserError
from tests import cycle_traces as ct
from tests.test_collect import _args, _FakeSGLang, _records
from tests.test_cycle_report import make_bundle, report_json

ROOT = Path(__file__).resolve().parents[1]


def _collect_server(tmp_path: Path, fake: _FakeSGLang, *extra: str):
    out = tmp_path / "b.tar.gz"
    rc = command.run(
        _args("--output", str(out), "--quiet", "--server", fake.url, "--skip", "doctor", "--budget", "30", *extra)
    )
    return rc, open_bundle(out)


def test_trace_symlinks_left_by_the_server_are_never_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:secret\n")
    fake = _FakeSGLang({"tp_size": 2, "device": "cpu", "version": "0.5.23"})

    def export():
        out = Path(fake.profile_req["output_dir"])
        os.symlink(secret, out / "1.5-TP-0.trace.json.gz")
        (out / "1.5-TP-1.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))

    fake.export = export
    try:
        assert _collect_server(tmp_path, fake)[0] == 0
    finally:
        fake.close()
    b = open_bundle(tmp_path / "b.tar.gz")
    part = b.part("server_trace")
    assert part.files == ("server/traces/1.5-TP-1.trace.json.gz",)
    assert part.meta["left_out_not_regular"] == ["1.5-TP-0.trace.json.gz"]
    assert all(b"secret" not in b.read(f) for f in part.files)

    # every trace a link: nothing usable, the part is not ok
    fake = _FakeSGLang({"tp_size": 1, "device": "cpu", "version": "0.5.23"})
    fake.export = lambda: os.symlink(secret, Path(fake.profile_req["output_dir"]) / "1.5-TP-0.trace.json.gz")
    (tmp_path / "b.tar.gz").unlink()
    try:
        _, b = _collect_server(tmp_path, fake)
    finally:
        fake.close()
    part = b.part("server_trace")
    assert part.status == "failed" and part.files == () and "no regular file" in part.reason


def test_verify_log_links_are_never_read(tmp_path):
    logs = tmp_path / "logs"
    _records(logs)
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    os.symlink(secret, logs / "verify-rank7.jsonl")
    out = tmp_path / "b.tar.gz"
    assert command.run(_args("--output", str(out), "--quiet", "--verify-log", str(logs), "--skip", "doctor")) == 0
    part = open_bundle(out).part("verify_log")
    assert part.status == "ok" and part.meta["records"] == 2
    assert "verify-log/verify-rank7.jsonl" not in part.files
    assert part.meta["left_out_not_regular"] == ["verify-rank7.jsonl"]


def test_a_trace_part_whose_files_were_all_left_out_is_not_ok(tmp_path, capsys):
    fake = _FakeSGLang({"tp_size": 2, "device": "cpu", "version": "0.5.23"})

    def export():
        out = Path(fake.profile_req["output_dir"])
        for r in range(2):
            (out / f"1.5-TP-{r}\x1b[2J.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))

    fake.export = export
    try:
        _, b = _collect_server(tmp_path, fake)
    finally:
        fake.close()
    part = b.part("server_trace")
    assert part.status == "failed" and part.files == () and part.meta["trace_files"] == 0
    assert "2 file(s) left out whose name holds control characters" in part.reason
    capsys.readouterr()  # collect's own line
    doc = report_json(tmp_path / "b.tar.gz", capsys)
    said = " ".join(doc["notes"])
    assert "collect left out 2 trace file(s) whose name holds control characters" in said
    assert "while the server serves traffic" not in said


def test_collect_with_stderr_on_a_full_device_still_writes_the_bundle(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "fastverify", "collect", "--skip", "doctor", "--budget", "20", "--output", "b.tgz"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=full,
            timeout=300,
        )
    assert r.returncode == 1 and b"wrote b.tgz" in r.stdout
    assert open_bundle(tmp_path / "b.tgz").part("host_iommu").status == "ok"


def _raw_server(reply: bytes) -> tuple[str, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.recv(65536)
            c.sendall(reply)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


def test_a_negative_content_length_and_an_empty_server_info_are_refused():
    url, srv = _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\nConnection: close\r\n\r\n{}")
    try:
        with pytest.raises(UserError, match=r"Content-Length '-5' is not one byte count") as e:
            fetch_server_info(url, timeout_s=5)
        assert "\n" not in str(e.value)
    finally:
        srv.close()
    url, srv = _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    try:
        with pytest.raises(UserError, match=r"none of the facts collect reads \(tp_size, .*model_path") as e:
            fetch_server_info(url, timeout_s=5)
    finally:
        srv.close()


@pytest.mark.parametrize("bad", [0, -3.0, 1e-300, 1e300])
def test_a_sweep_point_at_the_verify_size_that_is_no_time_is_named_not_replaced(tmp_path, capsys, bad):
    sweep = {
        "mode": "measure",
        "label": "measured",
        "candidates": [
            {
                "is_baseline": True,
                "sizes": [
                    {"msg_bytes": 28672, "count_per_step": 1, "median_us": 25.0, "p90_us": 27.0},
                    {"msg_bytes": 57344, "count_per_step": 1, "median_us": bad, "p90_us": 33.0},
                ],
            }
        ],
    }
    plan = dataclasses.replace(ct.Plan(), straggler=None, transfer_us=70.0)
    doc = report_json(make_bundle(tmp_path, plan, sweep=sweep), capsys)
    assert doc["verify_msg_bytes"] == 57344
    for f in doc["flags"]:
        assert "28,672 B" not in " ".join(f["evidence"])
    note = next(n for n in doc["notes"] if n.startswith("sweep: its point at the verify size 57,344 B"))
    assert repr(bad) in note and "dropped" in note
