"""The server parts of ``fastverify collect``: a running SGLang server's arguments and a profiler
trace of its forwards, over its HTTP API (``urllib``).

Endpoints and fields, as SGLang 0.5.23 defines them (``sglang/srt/entrypoints/http_server.py``):
``GET /server_info`` (older releases, and 0.5.23 as a deprecated alias: ``/get_server_info``) is the
resolved server arguments (``tp_size``, ``pp_size``, ``device``, ``speculative_num_draft_tokens``,
``model_path``...) plus ``version``; ``POST /start_profile`` takes a ``ProfileReq``
(``sglang/srt/managers/io_struct.py``), of which collect sends ``output_dir``, ``num_steps``,
``activities`` (``"CPU"``, ``"GPU"``), ``profile_by_stage`` and ``merge_profiles``. With
``num_steps`` the profiler stops by itself after that many forwards and each TP rank writes
``<profile id>-TP-<rank>.trace.json.gz`` into ``output_dir`` (``utils/profile_utils.py``);
``POST /stop_profile`` stops it early. The traces are written by the server, on its own machine.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import orjson

from fastverify.bundle import ARCNAMES, MAX_MEMBER_BYTES
from fastverify.collect.core import Context, Outcome, ServerInfo, failed, ok
from fastverify.errors import UserError
from fastverify.progress import say

INFO_ENDPOINTS = ("/server_info", "/get_server_info")
REACH_TIMEOUT_S = 10.0
POLL_S = 0.5
STABLE_S = 1.0  # a trace file counts as written once its size has not changed for this long
STOP_WAIT_S = 30.0  # after /stop_profile: the ranks export their traces
REQUEST_PROMPT = "fastverify collect: a short request so that the profiler sees forwards."
REQUEST_NEW_TOKENS = 16
SAY_EVERY_S = 10.0
TRACE_GLOB = "*.trace.json*"


def normalise_url(text: str) -> str:
    """``http://host:port`` from ``--server`` (``host:port`` gets ``http://``); no path, query or
    fragment beyond a trailing slash."""
    url = text.strip()
    shown = repr(text if len(text) <= 80 else text[:60] + "...")
    if "://" not in url:
        url = "http://" + url
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UserError(f"--server {shown}: a URL holds no spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        (parts.hostname or "").encode("idna")  # a label over 63 characters, or empty, is no host name
    except (ValueError, UnicodeError) as e:  # urllib's "Invalid IPv6 URL"; the idna codec's refusal
        raise UserError(f"--server {shown}: {' '.join(str(e).split())[:120]}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--server {shown}: expected an HTTP URL such as http://127.0.0.1:30000")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise UserError(f"--server {shown}: give the server's base URL (http://host:port), not an endpoint")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in 0-65535
    except ValueError as e:
        raise UserError(f"--server {shown}: {e}") from None
    return f"{parts.scheme}://{parts.netloc}"


MAX_REPLY_BYTES = 64 << 20
"""Largest server reply read (bytes): /server_info is a few KiB."""


def _read_by(r, deadline: float, url: str) -> bytes:
    """The reply body, read in chunks until ``deadline`` (monotonic s); OSError past it or past
    :data:`MAX_REPLY_BYTES` (a server that trickles or floods)."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise OSError(f"{url}: the reply did not end in time ({size:,} bytes read)")
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise OSError(f"{url}: the reply is over {MAX_REPLY_BYTES >> 20} MiB")
        chunks.append(chunk)


def http(method: str, url: str, body: dict | None = None, *, timeout_s: float) -> tuple[int, bytes]:
    """(HTTP status, body) of one request; an HTTP error status is returned, not raised.

    Raises
    ------
    OSError
        No answer (refused, unreachable, timed out).
    """
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + timeout_s  # urlopen's timeout bounds each socket read, not the whole body
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, _read_by(r, deadline, url)
    except urllib.error.HTTPError as e:
        return e.code, _read_by(e, deadline, url)
    except urllib.error.URLError as e:
        raise OSError(str(e.reason)) from None
    except (TimeoutError, ConnectionError) as e:
        raise OSError(str(e) or type(e).__name__) from None


def profiler_steps(cycles: int) -> int:
    """SGLang's ``num_steps`` (scheduler steps; one speculative cycle each) for ``cycles`` complete
    cycles: one more, since a cycle runs to the next cycle's start, and one for a prefill step."""
    return cycles + 2


def fetch_server_info(url: str, timeout_s: float = REACH_TIMEOUT_S) -> ServerInfo:
    """The server's arguments from ``/server_info``, else ``/get_server_info`` (older SGLang).

    Raises
    ------
    UserError
        ``cannot reach <url>: <reason>``; or it answers, but neither endpoint with a JSON object.
    """
    answers = []
    for endpoint in INFO_ENDPOINTS:
        try:
            status, raw = http("GET", url + endpoint, timeout_s=timeout_s)
        except OSError as e:
            raise UserError(f"cannot reach {url}: {e}") from None
        if status == 200:
            try:
                info = orjson.loads(raw)
            except orjson.JSONDecodeError:
                info = None
            if isinstance(info, dict):
                return ServerInfo(url, endpoint, raw, info)
            answers.append(f"{endpoint}: not a JSON object")
        else:
            answers.append(f"{endpoint}: HTTP {status}")
    raise UserError(f"{url} answers but is not an SGLang server ({'; '.join(answers)})")


def model_hidden_size(server: ServerInfo) -> int | None:
    """``hidden_size`` of the served model from ``<model_path>/config.json`` when that folder is on
    this machine (``text_config.hidden_size`` for Kimi-K2.5-style configs); else None."""
    from fastverify.inputs import read_json

    path = server.fact("model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return None
    try:
        doc = read_json(Path(path) / "config.json", kind="text")
    except UserError:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]
    value = doc.get("hidden_size") if isinstance(doc, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_args(ctx: Context, limit_s: float) -> Outcome:
    """The server-info JSON read before the run (the reachability check), as received; its meta
    has the key facts and the verify shapes collect took from them."""
    s = ctx.server
    return ok({ARCNAMES["server_args"]: s.raw}, url=s.url, endpoint=s.endpoint, sglang_version=s.fact("version"),
              tp_size=s.fact("tp_size"), pp_size=s.fact("pp_size"), device=s.fact("device"),
              speculative_algorithm=s.fact("speculative_algorithm"),
              speculative_num_draft_tokens=s.fact("speculative_num_draft_tokens"), model_path=s.fact("model_path"),
              verify_shapes=ctx.shapes.as_meta())


def activities(server: ServerInfo) -> tuple[list[str], str]:
    """Profiler activities for the server and why: GPU kernels too on a CUDA server."""
    device = server.fact("device")
    if isinstance(device, str) and device:
        return (["CPU", "GPU"], f"server device {device}") if device.startswith("cuda") else \
            (["CPU"], f"server device {device}")
    import torch

    cuda = torch.cuda.is_available()
    return (["CPU", "GPU"] if cuda else ["CPU"]), f"server names no device; CUDA {'is' if cuda else 'is not'} available here"


def _send_requests(url: str, n: int, deadline: float, statuses: list) -> None:
    body = {"text": REQUEST_PROMPT, "sampling_params": {"max_new_tokens": REQUEST_NEW_TOKENS, "temperature": 0}}
    for _ in range(n):
        left = deadline - time.monotonic()
        if left <= 1:
            return
        try:
            statuses.append(http("POST", url + "/generate", body, timeout_s=left)[0])
        except OSError as e:
            statuses.append(f"no answer: {e}")


def _written(folder: Path, expected: int, sizes: dict) -> list[Path] | None:
    """The trace files once at least ``expected`` exist and none has changed size for
    :data:`STABLE_S`; else None. ``sizes``: name -> (size, since when), kept between calls."""
    now = time.monotonic()
    files = sorted(p for p in folder.glob(TRACE_GLOB) if p.is_file())
    for p in files:
        size = p.stat().st_size
        if sizes.get(p.name, (None,))[0] != size:
            sizes[p.name] = (size, now)
    if len(files) >= expected and all(now - sizes[p.name][1] >= STABLE_S for p in files):
        return files
    return None


def _wait(folder: Path, expected: int, deadline: float, quiet: bool, what: str) -> list[Path] | None:
    sizes: dict = {}
    next_say = time.monotonic() + SAY_EVERY_S
    while time.monotonic() < deadline:
        files = _written(folder, expected, sizes)
        if files is not None:
            return files
        if not quiet and time.monotonic() >= next_say:
            next_say += SAY_EVERY_S
            say(f"collect: server_trace: {what} ({len(sizes)} of {expected} trace files so far, "
                f"{deadline - time.monotonic():.0f} s left)")
        time.sleep(POLL_S)
    return None


def _stop_profile(url: str) -> None:
    try:
        http("POST", url + "/stop_profile", timeout_s=10.0)
    except OSError:
        pass


def server_trace(ctx: Context, limit_s: float) -> Outcome:
    """Start the server's profiler for ``ctx.cycles`` forwards, wait (at most ``limit_s``) for one
    trace per rank, copy them under ``server/traces/``. With ``ctx.send_requests`` collect drives
    the traffic itself (small ``/generate`` requests); by default it sends none."""
    s = ctx.server
    t0 = time.monotonic()
    deadline = t0 + limit_s - min(STOP_WAIT_S, 0.15 * limit_s)  # the rest: the export after /stop_profile
    folder = ctx.workdir / "server-traces"
    folder.mkdir()
    acts, why_acts = activities(s)
    steps = profiler_steps(ctx.cycles)
    body = {"output_dir": str(folder), "num_steps": steps, "activities": acts, "profile_by_stage": False,
            "merge_profiles": False}
    tp, pp = s.fact("tp_size"), s.fact("pp_size")
    expected = (tp if isinstance(tp, int) and tp > 0 else 1) * (pp if isinstance(pp, int) and pp > 0 else 1)
    meta = {"output_dir": str(folder), "num_steps": steps, "cycles_asked": ctx.cycles, "activities": acts, "activities_why": why_acts,
            "expected_files": expected, "traffic": "collect sent requests" if ctx.send_requests else "the server's own"}
    try:
        status, text = http("POST", s.url + "/start_profile", body, timeout_s=min(30.0, limit_s))
    except OSError as e:
        return failed(f"POST {s.url}/start_profile: no answer ({e})", **meta)
    if status != 200:
        return failed(f"POST {s.url}/start_profile: HTTP {status}: {text.decode(errors='replace').strip()[:200]}", **meta)
    sent: list = []
    sender = None
    if ctx.send_requests:
        sender = threading.Thread(target=_send_requests, args=(s.url, ctx.send_requests, deadline, sent), daemon=True)
        sender.start()
    try:
        files = _wait(folder, expected, deadline, ctx.quiet, f"waiting for {steps} scheduler steps")
    except BaseException:  # Ctrl-C: the server's profiler is not left running
        _stop_profile(s.url)
        raise
    complete = files is not None
    if not complete:  # free the server's profiler; its ranks export what they recorded
        _stop_profile(s.url)
        files = _wait(folder, expected, t0 + limit_s, ctx.quiet, "stopped early; waiting for the export")
    if sender is not None:
        sender.join(timeout=5.0)
        meta["requests_sent"] = [str(x) for x in sent]
    waited = time.monotonic() - t0
    files = [p for p in (files or sorted(folder.glob(TRACE_GLOB))) if p.is_file()]
    too_big = [p.name for p in files if p.stat().st_size > MAX_MEMBER_BYTES]
    out = {ARCNAMES["server_trace"] + p.name: p for p in files if p.name not in too_big}
    meta.update(trace_files=len(out), complete=complete, waited_s=round(waited, 1))
    if too_big:
        meta["left_out_over_2_GiB"] = too_big
    if not complete:
        return failed(f"no complete profile: fewer than {steps} scheduler steps ran in {waited:.0f} s (maybe none): "
                      "send traffic to the server while collect runs, or lower --cycles (the server writes the "
                      f"traces into {folder}: run collect on the server's machine)", out, **meta)
    return ok(out, **meta)
