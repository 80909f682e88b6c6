"""Hostile input against the facts fastverify takes from outside: ``collect --server`` pointed at
something that is not an HTTP server (raw TCP servers in a thread), a server or model config that
states absurd facts, a described box (``--describe-box``) of absurd size, and sweep times read back
from a tune journal or a bundle's sweep part that are zero-like (1e-300 µs). Each must be one line
naming the URL / field and the value, within a bounded time, and never believed."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fastverify.bounds import MAX_WORLD_SIZE, MIN_TIME_US, duplicate_json_key, implausible_work_us
from fastverify.cli import main
from fastverify.collect import client
from fastverify.collect.server import fetch_server_info, model_hidden_size
from fastverify.errors import UserError
from fastverify.topo.box import box_from_description
from fastverify.tune.sweep import Journal, fingerprint, read_journal
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec
from tests.test_cycle_report import ct, make_bundle, report_json

# ---- a TCP server that answers with whatever bytes a case gives --------------------------------------


class RawServer:
    """Accepts connections on 127.0.0.1; for each, reads the request and calls ``reply(conn)``."""

    def __init__(self, reply) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        try:
            conn.recv(65536)
            self.reply(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _trickle_headers(conn) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    for _ in range(300):  # 30 s of one header byte per 0.1 s: each read is well inside the timeout
        conn.sendall(b"X")
        time.sleep(0.1)


def _flood(conn) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000000\r\n\r\n")
    for _ in range(64):
        conn.sendall(b" " * (1 << 20))


REFUSED_PORT = _free_port()
HOSTILE = {
    "bad status line": (
        lambda c: c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"),
        "not an HTTP reply (status line 'SSH-2.0-OpenSSH_9.6')",
    ),
    "a 4-digit status": (
        lambda c: c.sendall(b"HTTP/1.1 2000 OK\r\n\r\n"),
        "not an HTTP reply (status line 'HTTP/1.1 2000 OK')",
    ),
    "header over 64 KiB": (
        lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n"),
        "not an HTTP reply (got more than 65536 bytes when reading header line)",
    ),
    "101 headers": (
        lambda c: c.sendall(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(101)) + b"\r\n"),
        "not an HTTP reply (got more than 100 headers)",
    ),
    "bad chunk size": (
        lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"),
        "the body ends early or its chunked encoding is broken (0 bytes read)",
    ),
    "closed at once": (lambda c: None, "closed the connection without a reply"),
    "headers that never end": (_trickle_headers, "the reply did not end in time (0 bytes of body read): over 1 s"),
    "a body over the cap": (_flood, "the reply is over 1 MiB"),
    "redirect to a closed port": (
        lambda c: c.sendall(
            f"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{REFUSED_PORT}/server_info\r\n"
            "Content-Length: 0\r\n\r\n".encode()
        ),
        f"redirect to 'http://127.0.0.1:{REFUSED_PORT}/server_info' refused ([Errno 111] Connection refused)",
    ),
    "redirect to ftp": (
        lambda c: c.sendall(b"HTTP/1.1 301 Moved\r\nLocation: ftp://x/\r\nContent-Length: 0\r\n\r\n"),
        "HTTP 301 redirect to 'ftp://x/', not an http(s) URL: not followed",
    ),
    "redirect to a broken URL": (
        lambda c: c.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://[::1/\r\nContent-Length: 0\r\n\r\n"),
        "HTTP 302 redirect to 'http://[::1/', not an http(s) URL: not followed",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_server_that_is_not_http_is_one_line_naming_the_url(case, monkeypatch):
    """Before: BadStatusLine / LineTooLong / HTTPException / IncompleteRead / ValueError
    tracebacks; headers trickled for as long as the server liked; a refused redirect read as
    "cannot reach <the original URL>"."""
    monkeypatch.setattr(client, "MAX_REPLY_BYTES", 1 << 20)
    reply, said = HOSTILE[case]
    srv = RawServer(reply)
    try:
        t = time.monotonic()
        with pytest.raises(UserError) as err:
            fetch_server_info(srv.url, timeout_s=1.0)
        took = time.monotonic() - t
    finally:
        srv.close()
    line = str(err.value)
    if case == "headers that never end":  # the deadline, or on a loaded box first a read's own timeout
        assert line in (
            f"GET {srv.url}/server_info: {said}",
            f"GET {srv.url}/server_info: the reply did not end in time: over 1 s",
        )
    else:
        assert line == f"GET {srv.url}/server_info: {said}"
    assert took < 5.0  # the whole request is bounded by its timeout, however the server trickles


def test_collect_against_a_non_http_server_exits_2_with_one_line(tmp_path, capsys):
    srv = RawServer(lambda c: c.sendall(b"\x1b[2JSSH-2.0\r\n"))
    try:
        rc = main(["collect", "--server", srv.url, "--output", str(tmp_path / "b.tar.gz"), "--quiet"])
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "\x1b" not in err
    assert err.strip().splitlines() == [
        f"fastverify: error: GET {srv.url}/server_info: not an HTTP reply (status line '\\x1b[2JSSH-2.0')"
    ]


def test_nothing_listening_is_still_cannot_reach():
    port = _free_port()
    refused = rf"^cannot reach http://127\.0\.0\.1:{port}: \[Errno 111\] Connection refused$"
    with pytest.raises(UserError, match=refused):
        fetch_server_info(f"http://127.0.0.1:{port}", timeout_s=1.0)


# ---- facts a server states -----------------------------------------------------------------------


class JsonServer:
    """Answers every GET with ``body`` (bytes) and 200."""

    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _info(body: bytes):
    srv = JsonServer(body)
    try:
        return fetch_server_info(srv.url, timeout_s=5.0), srv.url
    finally:
        srv.close()


@pytest.mark.parametrize(
    "body, said",
    [
        (b'{"tp_size": 1000000000000000000}', "tp_size 1000000000000000000 is outside [1, 640]"),
        (b'{"tp_size": true}', "tp_size True is not an integer in [1, 640]"),
        (b'{"tp_size": "8"}', "tp_size '8' is not an integer in [1, 640]"),
        (b'{"tp_size": 8.0}', "tp_size 8.0 is not an integer in [1, 640]"),
        (b'{"tp_size": 8, "pp_size": 0}', "pp_size 0 is outside [1, 640]"),
        (
            b'{"server_args": {"speculative_num_draft_tokens": 1000000000000000000}}',
            "speculative_num_draft_tokens 1000000000000000000 is outside [1, 64]",
        ),
        (b'{"tp_size": 2, "tp_size": 8}', "the key 'tp_size' is given twice in one JSON object"),
        (b'{"model_path": 5}', "model_path 5: a int, not a string"),
        (b'{"device": "cu\\u0000da"}', "device 'cu\\x00da': holds a NUL"),
    ],
)
def test_a_servers_absurd_fact_is_refused_naming_field_and_value(body, said):
    """Before: taken into the shapes and the bundle (10^18 draft tokens gave 1.4e22-byte messages)."""
    with pytest.raises(UserError) as err:
        _info(body)
    line = str(err.value)
    assert "\n" not in line and said in line and "/server_info: " in line


def test_a_servers_plausible_facts_are_kept():
    info, url = _info(
        b'{"tp_size": 8, "pp_size": 1, "speculative_num_draft_tokens": 4, "device": "cuda", '
        b'"speculative_algorithm": null, "version": "0.5.23"}'
    )
    assert (info.url, info.fact("tp_size"), info.fact("speculative_num_draft_tokens")) == (url, 8, 4)
    assert MAX_WORLD_SIZE == 640


@pytest.mark.parametrize(
    "config, said",
    [
        ({"hidden_size": 10**12}, "hidden_size 1000000000000 is outside [1, 65536]"),
        ({"text_config": {"hidden_size": True}}, "hidden_size True is not an integer hidden_size"),
        ({"hidden_size": 0}, "hidden_size 0 is outside [1, 65536]"),
    ],
)
def test_a_model_config_with_an_absurd_hidden_size_is_refused(tmp_path, config, said):
    (tmp_path / "config.json").write_text(json.dumps(config))
    info, _ = _info(json.dumps({"model_path": str(tmp_path)}).encode())
    with pytest.raises(UserError) as err:
        model_hidden_size(info)
    assert str(err.value) == f"{tmp_path / 'config.json'}: {said} (fastverify/bounds.py MAX_HIDDEN)"


def test_a_model_config_hidden_size_given_twice_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "hidden_size": 7168}')
    info, _ = _info(json.dumps({"model_path": str(tmp_path)}).encode())
    with pytest.raises(UserError, match="the key 'hidden_size' is given twice"):
        model_hidden_size(info)
    (tmp_path / "config.json").write_text('{"hidden_size": 7168}')
    assert model_hidden_size(info) == 7168
    long = _info(json.dumps({"model_path": "a" * 4000}).encode())[0]
    assert model_hidden_size(long) is None  # a name too long names no folder: no config, no traceback


# ---- a described box ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc, said",
    [
        (
            '{"sm": [12, 0], "gpu_count": 1000000000000000000}',
            'field "gpu_count": 1000000000000000000 is outside [0, 640]',
        ),
        ('{"sm": [12, 0], "gpu_count": 8, "tp": 100000}', 'field "tp": 100000 is outside [0, 640]'),
        ('{"sm": [1000000, 0], "gpu_count": 8}', 'field "sm": [1000000, 0] is no compute capability'),
        ('{"sm": [12, 15], "gpu_count": 8}', 'field "sm": [12, 15] is no compute capability'),
        (
            '{"sm": [12, 0], "gpu_count": 8, "gpu_memory_bytes": 100000000000000000000}',
            'field "gpu_memory_bytes": 1e+20 bytes is over 1,099,511,627,776 (1 TiB)',
        ),
        ('{"sm": [12, 0], "gpu_count": 8, "gpu_count": 9}', "the key 'gpu_count' is given twice"),
        (
            '{"gpu_name": "' + "A" * 500 + '", "sm": [12, 0], "gpu_count": 8}',
            'field "gpu_name": a gpu_name of 500 characters is over 256',
        ),
        (
            '{"sm": [12, 0], "gpu_count": 8, "gpus": [{"index": 1000000000, "uuid": "GPU-1"}]}',
            'field "gpus[0].index": 1e+09 is over 640',
        ),
        (
            '{"sm": [12, 0], "gpu_count": ' + "9" * 5000 + "}",
            "the box description holds a number too large to be real",
        ),
    ],
)
def test_a_described_box_past_the_bounds_is_refused(doc, said):
    """Before: 10^18 GPUs printed as the box; sm [1000000, 0] a ValueError traceback from the cost
    model; a 5000-digit count a ValueError traceback; a key given twice kept its last value."""
    with pytest.raises(UserError) as err:
        box_from_description(doc, where="--describe-box")
    line = str(err.value)
    assert line.startswith("--describe-box: ") and said in line and "\n" not in line


def test_a_described_box_that_names_a_too_long_path_is_one_line():
    with pytest.raises(UserError) as err:
        box_from_description("9" * 5000, where="--describe-box")
    assert "File name too long" in str(err.value)


def test_a_plausible_described_box_is_kept():
    box = box_from_description(
        '{"gpu_name": "X", "sm": [12, 0], "gpu_count": 640, "tp": 8, "gpu_memory_bytes": 102005473280}',
        where="--describe-box",
    )
    assert (box.sm, box.gpu_count, box.tp, box.gpu_memory_bytes) == ((12, 0), 640, 8, 102005473280)


# ---- sweep times read back ------------------------------------------------------------------------


def _spec() -> TrialSpec:
    return TrialSpec(
        backend="gloo",
        env={"NCCL_PROTO": "LL"},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2),),
        warmup=1,
        iters=3,
    )


@pytest.mark.parametrize(
    "median, step, field", [(1e-300, 2e-300, "median_us"), (0.0, 0.0, "median_us"), (10.0, 1e-300, "step_us")]
)
def test_a_journal_time_below_any_work_is_corrupt(tmp_path, median, step, field):
    """Before: a median of 1e-300 µs read back and ranked (printed as 0.0 µs; ratios of 300 digits)."""
    spec = _spec()
    path = tmp_path / "j.jsonl"
    result = TrialResult(
        spec.trial_id, "ok", "", (SizeResult(64, 128, 2, median, median, 0.0),), step, "cpu_wall_clock", 1.0, 2.0
    )
    with Journal.open(path, fingerprint=fingerprint([spec]), resume=False) as j:
        j.append(spec, result)
    with pytest.raises(UserError) as err:
        read_journal(path)
    line = str(err.value)
    assert "line 2 is corrupt" in line and field in line and f"below {MIN_TIME_US:g} µs" in line


def test_a_journal_of_real_times_reads_back(tmp_path):
    spec = _spec()
    path = tmp_path / "j.jsonl"
    with Journal.open(path, fingerprint=fingerprint([spec]), resume=False) as j:
        j.append(
            spec,
            TrialResult(
                spec.trial_id, "ok", "", (SizeResult(64, 128, 2, 10.0, 12.0, 0.0),), 20.0, "cpu_wall_clock", 1.0, 2.0
            ),
        )
    (rec,) = read_journal(path).records
    assert (rec.result.step_us, rec.result.sizes[0].median_us) == (20.0, 10.0)


def test_a_bundle_sweep_of_1e_300_us_is_no_reference(tmp_path, capsys):
    """Before: "this box's measured sweep: NCCL 0.0 µs" and a slow-transfer ratio of 300 digits."""
    sweep = {
        "mode": "measure",
        "label": "measured",
        "candidates": [
            {
                "is_baseline": True,
                "name": "current environment",
                "sizes": [{"msg_bytes": 57344, "count_per_step": 1, "median_us": 1e-300, "p90_us": 1e-300}],
            }
        ],
    }
    doc = report_json(make_bundle(tmp_path, ct.Plan(transfer_us=200.0), sweep=sweep), capsys)
    slow = next(f for f in doc["flags"] if f["kind"] == "slow_transfer")
    assert "published NCCL" in slow["evidence"][1] and "0.0 µs" not in slow["evidence"][1]
    assert len(slow["finding"]) < 200


def test_a_json_true_is_no_count_of_iommu_groups(tmp_path, capsys):
    iommu = {"cmdline_iommu_tokens": ["intel_iommu=on"], "iommu_groups": True, "acs": []}
    doc = report_json(make_bundle(tmp_path, None, iommu=iommu), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "iommu_acs")
    assert not [e for e in flag["evidence"] if "IOMMU groups" in e]  # before: "True IOMMU groups"


def test_bounds_helpers():
    assert duplicate_json_key(b'{"a": {"b": 1, "b": 2}}') == "b" and duplicate_json_key(b'{"a": 1}') is None
    assert duplicate_json_key(b"not json") is None
    assert implausible_work_us(1.5) is None and implausible_work_us(MIN_TIME_US) is None
    assert "below" in implausible_work_us(1e-300) and "below" in implausible_work_us(0.5)
    assert "1 hour" in implausible_work_us(1e10)


def test_a_trial_whose_ranks_timed_nothing_is_failed_not_ranked(tmp_path):
    """Ranks that report 1 ns per all-reduce (a clock that did not tick): before, ranked as a
    0.001 µs step, the fastest candidate by a factor of thousands. (``collect_trial`` is the sweep's
    one reader of the ranks' files; ``run_sweep`` needs real worker processes.)"""
    from fastverify.tune.sweep import collect_trial
    from fastverify.tune.trial import TrialStatus

    spec = _spec()
    for rank in range(2):
        doc = {
            "status": "ok",
            "clock": "cpu_wall_clock",
            "meta": {},
            "reason": "",
            "sizes": [{"numel": 64, "times_ns": [1, 1, 1], "max_rel_err": 0.0}],
        }
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    r = collect_trial(spec, tmp_path, time.time(), "")
    assert r.status is TrialStatus.FAILED and r.step_us is None
    assert r.reason == "numel 64: the ranks' time 0.001 µs is below 1 µs, less than any measured work takes"
    for rank in range(2):
        doc = {
            "status": "ok",
            "clock": "cpu_wall_clock",
            "meta": {},
            "reason": "",
            "sizes": [{"numel": 64, "times_ns": [20_000, 30_000, 40_000], "max_rel_err": 0.0}],
        }
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    r = collect_trial(spec, tmp_path, time.time(), "")
    assert r.status is TrialStatus.OK and r.step_us == 2 * 30.0  # count 2 x median 30 µs
