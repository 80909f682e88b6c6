"""``fastverify collect`` on this machine (no GPU): every part in the manifest, each skipped one with
why; the verify records copied; the time budget; the refusals before any work; the server parts
against a stand-in HTTP server that answers like SGLang 0.5.23 (``/server_info``,
``/start_profile`` writing one trace per TP rank, ``/stop_profile``, ``/generate``). The real
SGLang server run is in ``tests/test_sglang_server.py`` (``test_collect_bundles_the_servers_trace``)."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port

from fastverify.bundle import PART_NAMES, open_bundle
from fastverify.collect import client, command, parts, server
from fastverify.collect.core import Context, Shapes, ok
from fastverify.errors import UserError
from fastverify.registry import BackendName

NO_GPU_PARTS = ("nvidia_smi_topo", "nvml", "p2p_check", "nccl_log", "sweep")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p.parse_args(list(argv))


def _collect(tmp_path: Path, *argv: str, capsys=None) -> tuple[Path, object]:
    out = tmp_path / "bundle.tar.gz"
    assert command.run(_args("--output", str(out), "--quiet", *argv)) == 0
    if capsys is not None:
        assert f"wrote {out}" in capsys.readouterr().out
    return out, open_bundle(out)


def _cpu_only():
    import torch

    if torch.cuda.is_available() or shutil.which("nvidia-smi"):
        pytest.skip("this test states what collect does on a machine without NVIDIA GPUs")


def _records(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for rank in (0, 1):
        p = folder / f"verify-rank{rank}.jsonl"
        p.write_text(
            "".join(
                json.dumps(
                    {"step": i, "verify_ms": 1.0 + i, "clock": "cpu_wall_clock", "rank": str(rank), "pid": 100 + rank}
                )
                + "\n"
                for i in range(3)
            )
        )
        out.append(p)
    return out


def test_cpu_collect_lists_every_part(tmp_path, capsys):
    _cpu_only()
    _, b = _collect(tmp_path, capsys=capsys)
    m = b.manifest
    assert m.schema == "fastverify.bundle" and m.schema_version == 1
    assert [p.name for p in m.parts] == list(PART_NAMES)
    assert m.host["gpu_count"] == 0 and m.host["cuda_available"] is False and m.budget_s == 600.0
    for name in NO_GPU_PARTS:
        p = b.part(name)
        assert p.status == "skipped" and ("GPU" in p.reason or "driver" in p.reason), (name, p.reason)
    assert b.part("sweep").reason.startswith("no CUDA GPUs: a gloo sweep times the CPU")
    doctor = b.part("doctor")
    assert doctor.status == "ok" and doctor.files == ("doctor.json",) and doctor.meta["mode"] == "quick"
    assert "verdict" in json.loads(b.read("doctor.json"))
    iommu = b.part("host_iommu")
    assert iommu.status == "ok"
    doc = json.loads(b.read("host/iommu.json"))
    assert set(doc) == {"cmdline_iommu_tokens", "iommu_groups", "acs", "notes"}
    for name in ("server_args", "server_trace"):
        assert (b.part(name).status, b.part(name).reason) == ("skipped", "no --server")
    assert (b.part("verify_log").status, b.part("verify_log").reason) == ("skipped", "no --verify-log")
    assert sorted(b.members) == ["doctor.json", "host/iommu.json"]


def test_verify_log_is_copied(tmp_path):
    recs = _records(tmp_path / "prof")
    (tmp_path / "prof" / "verify-TP-0.trace.json.gz").write_bytes(gzip.compress(b"{}"))
    (tmp_path / "prof" / "unrelated.txt").write_text("not collected")
    _, b = _collect(tmp_path, "--verify-log", str(tmp_path / "prof"), "--skip", "doctor")
    p = b.part("verify_log")
    assert p.status == "ok" and p.meta["records"] == 2 and p.meta["traces"] == 1
    assert p.files == (
        "verify-log/verify-TP-0.trace.json.gz",
        "verify-log/verify-rank0.jsonl",
        "verify-log/verify-rank1.jsonl",
    )
    for r in recs:
        assert b.read(f"verify-log/{r.name}") == r.read_bytes()
    assert (b.part("doctor").status, b.part("doctor").reason) == ("skipped", "--skip")


def test_tiny_budget_skips_what_does_not_fit(tmp_path):
    _records(tmp_path / "prof")
    _, b = _collect(tmp_path, "--budget", "1", "--verify-log", str(tmp_path / "prof"))
    doctor = b.part("doctor")
    assert doctor.status == "skipped" and doctor.reason.startswith("time budget: "), doctor.reason
    for p in b.manifest.parts:  # every part either ran, or says why not
        assert p.status in ("ok", "skipped") and (p.status == "ok" or p.reason), p


def test_a_part_that_overruns_leaves_the_later_ones_skipped(tmp_path, monkeypatch):
    _records(tmp_path / "prof")

    def slow_doctor(ctx, limit_s):
        time.sleep(2.5)  # past its share: the budget is then spent for the parts after it
        return ok()

    monkeypatch.setitem(command.SPECS, "doctor", command.PartSpec("doctor", slow_doctor, 1.0, 0.1))
    _, b = _collect(tmp_path, "--budget", "3", "--verify-log", str(tmp_path / "prof"))
    assert b.part("doctor").status == "ok" and b.part("doctor").seconds >= 2.5
    for name in ("host_iommu", "verify_log"):
        p = b.part(name)
        assert p.status == "skipped" and p.reason.startswith("time budget"), (name, p.reason)


def test_ctrl_c_leaves_nothing_behind(tmp_path, monkeypatch):
    def interrupted(ctx, limit_s):
        (ctx.workdir / "half.json").write_text("{")
        raise KeyboardInterrupt

    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the run's work folder goes here
    (tmp_path / "tmp").mkdir()
    monkeypatch.setitem(command.SPECS, "host_iommu", command.PartSpec("host_iommu", interrupted, 1.0, 0.1))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        command.run(_args("--output", str(out / "b.tar.gz"), "--quiet", "--skip", "doctor"))
    assert list(out.iterdir()) == []  # no bundle, no temporary file
    assert list((tmp_path / "tmp").iterdir()) == []  # the run's work folder is gone too


def test_refusals_before_any_work(tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(UserError, match=rf"^cannot reach http://127\.0\.0\.1:{port}: "):
        command.run(_args("--server", f"127.0.0.1:{port}", "--output", str(tmp_path / "b.tar.gz")))
    for bad in ("ftp://host:1", "http://host:1/generate", "http://host:99999"):
        with pytest.raises(UserError, match="--server"):
            command.run(_args("--server", bad, "--output", str(tmp_path / "b.tar.gz")))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(UserError, match="exists; fastverify never writes over a file: .* --force"):
        command.run(_args("--output", str(notes)))
    assert notes.read_text() == "mine"
    prof = tmp_path / "prof"
    _records(prof)
    with pytest.raises(UserError, match="inside --verify-log"):
        command.run(_args("--output", str(prof / "b.tar.gz"), "--verify-log", str(prof)))
    with pytest.raises(UserError, match="no verify-rank"):
        command.run(_args("--output", str(tmp_path / "b.tar.gz"), "--verify-log", str(tmp_path)))
    with pytest.raises(UserError, match="--send-requests"):
        command.run(_args("--output", str(tmp_path / "b.tar.gz"), "--send-requests", "2"))
    with pytest.raises(SystemExit):  # argparse: a value out of range
        _args("--budget", "0")
    assert not list(tmp_path.glob("*.tar.gz")) and not list(prof.glob("*.tar.gz"))


# ---- the server parts, against a stand-in of SGLang's HTTP API --------------------------------------


class _FakeSGLang:
    """Answers like SGLang 0.5.23's http_server.py: ``/server_info``, ``/start_profile`` (one
    ``<id>-TP-<r>.trace.json.gz`` per rank once ``forwards_needed`` /generate calls came, or at
    once when 0), ``/stop_profile`` (writes what was recorded when ``export_on_stop``)."""

    def __init__(self, info: dict, *, forwards_needed: int = 0, export_on_stop: bool = False) -> None:
        self.info, self.forwards_needed, self.export_on_stop = info, forwards_needed, export_on_stop
        self.profile_req: dict | None = None
        self.generates = 0
        self.stopped = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/server_info":
                    return self._reply(200, json.dumps(fake.info).encode())
                self._reply(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/start_profile":
                    fake.profile_req = json.loads(body)
                    if fake.forwards_needed == 0:
                        fake.export()
                    return self._reply(200, b"Start profiling.\n")
                if self.path == "/stop_profile":
                    fake.stopped = True
                    if fake.export_on_stop:
                        fake.export()
                    return self._reply(200, b"Stop profiling.\n")
                if self.path == "/generate":
                    fake.generates += 1
                    if fake.profile_req and fake.generates == fake.forwards_needed:
                        fake.export()
                    return self._reply(200, b'{"text": "ok"}')
                self._reply(404, b"")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def export(self) -> None:
        out = Path(self.profile_req["output_dir"])
        for r in range(self.info.get("tp_size", 1)):
            (out / f"1700000000.5-TP-{r}.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    return d


def test_server_parts_against_a_stand_in(tmp_path, model_dir):
    fake = _FakeSGLang(
        {
            "tp_size": 2,
            "device": "cpu",
            "speculative_num_draft_tokens": 3,
            "model_path": str(model_dir),
            "version": "0.5.23",
        },
        forwards_needed=2,
    )
    try:
        _, b = _collect(
            tmp_path,
            "--server",
            fake.url + "/",
            "--skip",
            "doctor",
            "--cycles",
            "3",
            "--send-requests",
            "2",
            "--budget",
            "60",
            "--batch",
            "1",
            "2",
        )
    finally:
        fake.close()
    args = b.part("server_args")
    assert args.status == "ok" and args.meta["tp_size"] == 2 and args.meta["sglang_version"] == "0.5.23"
    assert json.loads(b.read("server/server_info.json"))["model_path"] == str(model_dir)
    shapes = args.meta["verify_shapes"]
    assert (shapes["tp"], shapes["draft_tokens"], shapes["hidden"], shapes["batches"]) == (2, 3, 64, [1, 2])
    assert shapes["msg_bytes"] == [1 * 3 * 64 * 2, 2 * 3 * 64 * 2]
    assert shapes["shapes_from"]["hidden"] == "the served model's config.json"
    trace = b.part("server_trace")
    assert trace.status == "ok", trace.reason
    assert trace.files == (
        "server/traces/1700000000.5-TP-0.trace.json.gz",
        "server/traces/1700000000.5-TP-1.trace.json.gz",
    )
    assert trace.meta["activities"] == ["CPU"] and trace.meta["traffic"] == "collect sent requests"
    assert trace.meta["requests_sent"] == ["200", "200"] and fake.generates == 2
    # exactly SGLang 0.5.23's ProfileReq fields (managers/io_struct.py), a fresh folder, the cycles + 2 (the last cycle's end, a prefill)
    req = fake.profile_req
    assert set(req) == {"output_dir", "num_steps", "activities", "profile_by_stage", "merge_profiles"}
    assert req["num_steps"] == 3 + 2 and req["profile_by_stage"] is False and req["merge_profiles"] is False
    assert not fake.stopped  # the profiler stopped by itself after num_steps


def test_server_trace_without_forwards_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "STOP_WAIT_S", 1.0)
    fake = _FakeSGLang({"tp_size": 2, "device": "cuda"}, forwards_needed=5, export_on_stop=False)
    try:
        info = server.fetch_server_info(fake.url)
        assert info.endpoint == "/server_info"
        ctx = Context(workdir=tmp_path, shapes=Shapes(2, 4, 7168, (1,), {}), gpus=0, quiet=True, server=info, cycles=5)
        res = server.server_trace(ctx, 3.0)
    finally:
        fake.close()
    assert res.status == "failed" and "fewer than 7 scheduler steps ran in" in res.reason, res.reason
    assert "send traffic to the server while collect runs" in res.reason
    assert res.files == {} and fake.stopped  # the server's profiler is not left running
    assert fake.profile_req["activities"] == ["CPU", "GPU"]  # a CUDA server: its kernels too


def test_old_server_info_endpoint_and_not_sglang(tmp_path):
    fake = _FakeSGLang({"tp_size": 4})
    try:
        fake.httpd.RequestHandlerClass.do_GET = lambda self: (
            self._reply(200, json.dumps(fake.info).encode())
            if self.path == "/get_server_info"
            else self._reply(404, b"")
        )
        info = server.fetch_server_info(fake.url)
        assert (info.endpoint, info.fact("tp_size")) == ("/get_server_info", 4)
        fake.httpd.RequestHandlerClass.do_GET = lambda self: self._reply(404, b"")
        with pytest.raises(UserError, match="not an SGLang server"):
            server.fetch_server_info(fake.url)
    finally:
        fake.close()


# ---- host parts and the GPU machinery, without GPUs ------------------------------------------------

LSPCI = """0000:00:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge
\tCapabilities: [2a0 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+
\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-

0000:41:00.0 3D controller: NVIDIA Corporation Device 2330
\tCapabilities: <access denied>
"""


def test_lspci_acs_lines_and_host_iommu(tmp_path, monkeypatch):
    acs, denied = parts.parse_lspci_acs(LSPCI)
    assert (
        acs
        == [
            {
                "device": "0000:00:01.1",
                "description": "PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge",
                "acsctl": "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-",
            }
        ]
        and denied
    )
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "cmdline").write_text("BOOT_IMAGE=/vmlinuz ro amd_iommu=on iommu=pt iommu.strict=0 quiet\n")
    for g in range(3):
        (sys_root / "kernel" / "iommu_groups" / str(g)).mkdir(parents=True)
    monkeypatch.setattr(parts.shutil, "which", lambda name: None)
    ctx = Context(workdir=tmp_path, shapes=Shapes(None, 4, 7168, (1,), {}), gpus=0)
    res = parts.host_iommu(ctx, 10.0, proc_root=proc, sys_root=sys_root)
    doc = json.loads(res.files["host/iommu.json"])
    assert doc["cmdline_iommu_tokens"] == ["amd_iommu=on", "iommu=pt", "iommu.strict=0"]
    assert doc["iommu_groups"] == 3 and doc["acs"] == []
    assert any("lspci not found" in n for n in doc["notes"])


def test_nccl_log_trial_runs_on_the_tune_machinery(tmp_path):
    """The GPU part's trial, on gloo over CPU: the same TrialSpec and launcher, no NCCL log."""
    ctx = Context(workdir=tmp_path, shapes=Shapes(2, 2, 64, (1, 2), {}), gpus=0, quiet=True)
    res = parts.nccl_log(ctx, 120.0, device="cpu", backend=BackendName.gloo.value)
    assert res.meta["trial"] == "ok", res.meta
    assert res.status == "failed" and res.reason.startswith("no NCCL log written (trial ok")
    assert res.meta["env"]["NCCL_DEBUG"] == "INFO" and res.meta["env"]["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log")


def test_a_server_that_trickles_its_reply_is_cut_off_at_the_timeout():
    """A reply with Content-Length 1,000,000 sent at one byte per 0.2 s: urlopen's timeout bounds
    each read only, so collect bounds the whole body."""
    import http.server
    import threading
    import time

    from fastverify.collect.server import fetch_server_info
    from fastverify.errors import UserError

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = time.monotonic()
        with pytest.raises(UserError, match="did not end in time"):
            fetch_server_info(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=1.0)
        assert time.monotonic() - t < 5.0
    finally:
        srv.shutdown()


@pytest.mark.parametrize(
    "text, said",
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://" + "a" * 300 + ".com", "idna"),  # a host label over 63 characters
        ("http://a b", "no spaces or control characters"),
        ("http://a\x1b[2Jb:1", "no spaces or control characters"),
    ],
)
def test_a_malformed_server_url_is_one_line(text, said):
    with pytest.raises(UserError) as e:
        client.normalise_url(text)
    line = str(e.value)
    assert said in line and line.startswith("--server '") and "\n" not in line and len(line) < 300
