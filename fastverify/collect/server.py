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

import http.client as http_client
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import orjson

from fastverify.bounds import MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_WORLD_SIZE, duplicate_json_key, implausible_count
from fastverify.bundle import ARCNAMES, MAX_MEMBER_BYTES
from fastverify.collect.core import Context, Outcome, ServerInfo, failed, ok
from fastverify.collect.url import normalise_url  # noqa: F401 - collect's and launch's name for it
from fastverify.errors import UserError, one_line, printable
from fastverify.inputs import loads_json, read_bytes
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


MAX_REPLY_BYTES = 64 << 20
"""Largest server reply read (bytes): /server_info is a few KiB."""
SHOWN_CHARS = 80  # of a server's own text (a status line, a Location) quoted in a message


class ReplyError(OSError):
    """A request that got no usable reply. ``str()`` is one line naming the URL and what came back
    (or why nothing did); ``reason`` is that without the URL; ``reached`` is False when the server
    at the URL never answered (refused, unreachable, no bytes before the deadline)."""

    def __init__(self, method: str, url: str, reason: str, *, reached: bool) -> None:
        super().__init__(f"{method} {url}: {reason}")
        self.reason, self.reached = reason, reached


def _shown(text: object) -> str:
    """A server's own text, quoted, terminal-safe and at most :data:`SHOWN_CHARS` characters."""
    t = printable(str(text).strip())
    return "'" + (t if len(t) <= SHOWN_CHARS else t[:SHOWN_CHARS] + "...") + "'"


class _Watch:
    """The sockets of one request (its redirects too), shut down when :meth:`fire` runs at the
    deadline: a blocked read then returns at once, so no header or body can trickle for ever."""

    def __init__(self) -> None:
        self.socks: list = []
        self.fired = False
        self.lock = threading.Lock()

    def add(self, sock) -> None:
        with self.lock:
            self.socks.append(sock)
            if self.fired:
                self._shut(sock)

    def fire(self) -> None:
        with self.lock:
            self.fired = True
            for sock in self.socks:
                self._shut(sock)

    @staticmethod
    def _shut(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _watched(base: type, watch: _Watch) -> type:
    class Watched(base):
        def connect(self):
            super().connect()
            watch.add(self.sock)

    return Watched


class _Http(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.conn = _watched(http_client.HTTPConnection, watch)

    def http_open(self, req):
        return self.do_open(self.conn, req)


class _Https(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.conn = _watched(http_client.HTTPSConnection, watch)

    def https_open(self, req):
        return self.do_open(self.conn, req, context=self._context)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect to an http(s) URL only, and keeps the last target for the messages."""

    def __init__(self) -> None:
        super().__init__()
        self.target: str | None = None

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("location") or headers.get("uri")
        if location is not None:
            try:
                parts = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, location))
                parts.port  # noqa: B018 - raises for a port that is not a number in 0-65535
                (parts.hostname or "").encode("idna")
            except (ValueError, UnicodeError):
                parts = None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ReplyError(
                    req.get_method(),
                    req.full_url,
                    f"HTTP {code} redirect to {_shown(location)}, not an http(s) URL: not followed",
                    reached=True,
                )
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.target = newurl
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_by(r, watch: _Watch) -> bytes:
    """The reply body, read in chunks until ``watch`` fires or past :data:`MAX_REPLY_BYTES`
    (a server that trickles or floods): ValueError then, with what was read."""
    chunks, size = [], 0
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
        if watch.fired:
            raise ValueError(f"the reply did not end in time ({size:,} bytes of body read)")
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ValueError(f"the reply is over {MAX_REPLY_BYTES >> 20} MiB")
        chunks.append(chunk)


def _what_came_back(e: BaseException) -> str:
    """A malformed reply in words (``http.client``'s exceptions)."""
    if isinstance(e, http_client.RemoteDisconnected):
        return "closed the connection without a reply"
    if isinstance(e, http_client.BadStatusLine):
        return f"not an HTTP reply (status line {_shown(e.line if isinstance(e.line, str) else e)})"
    if isinstance(e, http_client.IncompleteRead):
        return f"the body ends early or its chunked encoding is broken ({len(e.partial):,} bytes read)"
    if isinstance(e, http_client.HTTPException):
        text = " ".join(str(e).split()) or type(e).__name__
        return f"not an HTTP reply ({_shown(text)[1:-1]})"
    return " ".join(str(e).split()) or type(e).__name__


def http(method: str, url: str, body: dict | None = None, *, timeout_s: float) -> tuple[int, bytes]:
    """(HTTP status, body) of one request, all within ``timeout_s`` (connect, headers, body and
    redirects together); an HTTP error status is returned, not raised.

    Raises
    ------
    ReplyError
        An OSError: no answer (refused, unreachable, timed out), a redirect that goes nowhere, or a
        reply that is not HTTP (a bad status line, a header line over 64 KiB, over 100 headers, a
        broken chunked body), never ends in time, or is over :data:`MAX_REPLY_BYTES`.
    """
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    watch, redirects = _Watch(), _Redirects()
    opener = urllib.request.build_opener(_Http(watch), _Https(watch), redirects)
    timer = threading.Timer(timeout_s, watch.fire)
    timer.daemon = True
    timer.start()
    got = False  # the server at ``url`` answered something
    try:
        try:
            with opener.open(req, timeout=timeout_s) as r:
                got = True
                return r.status, _read_by(r, watch)
        except urllib.error.HTTPError as e:
            got = True
            with e:
                return e.code, _read_by(e, watch)
    except ReplyError:
        raise
    except urllib.error.URLError as e:  # urllib's wrapper of a failure to connect or to send
        raise _failure(method, url, e.reason, watch, redirects.target, got, timeout_s) from None
    except (OSError, http_client.HTTPException, ValueError, UnicodeError) as e:  # the reply itself
        raise _failure(method, url, e, watch, redirects.target, True, timeout_s) from None
    finally:
        timer.cancel()


def _failure(
    method: str, url: str, e: object, watch: _Watch, target: str | None, got: bool, timeout_s: float
) -> ReplyError:
    """The one-line :class:`ReplyError` of a failed request (see :func:`http`); ``got``: some
    reply came, so the server at ``url`` was reached."""
    reached = got or target is not None
    if watch.fired or (got and isinstance(e, TimeoutError)):  # the deadline, or a read's own timeout
        said = (
            str(e) if isinstance(e, ValueError) and "did not end in time" in str(e) else "the reply did not end in time"
        )
        reason = f"{said}: over {timeout_s:g} s"
    elif isinstance(e, BaseException):
        reason = _what_came_back(e)
    else:
        reason = " ".join(str(e).split()) or "no answer"
    if target is not None:  # urllib followed a redirect: the failure is at its target
        refused = isinstance(e, ConnectionRefusedError) or "refused" in reason.lower()
        reason = f"redirect to {_shown(target)} {'refused' if refused else 'failed'} ({reason})"
    return ReplyError(method, url, reason, reached=reached)


def profiler_steps(cycles: int) -> int:
    """SGLang's ``num_steps`` (scheduler steps; one speculative cycle each) for ``cycles`` complete
    cycles: one more, since a cycle runs to the next cycle's start, and one for a prefill step."""
    return cycles + 2


SERVER_INTS = {
    "tp_size": (1, MAX_WORLD_SIZE),
    "pp_size": (1, MAX_WORLD_SIZE),
    "speculative_num_draft_tokens": (1, MAX_DRAFT_TOKENS),
}
"""The integer facts collect takes from a server, and their bounds (:mod:`fastverify.bounds`)."""
SERVER_TEXTS = ("version", "device", "model_path", "speculative_algorithm")
"""The text facts collect takes from a server."""
MAX_FACT_CHARS = 4096  # PATH_MAX: the longest model path, and far past any version or device name


def _shown_value(value: object) -> str:
    return one_line(repr(value), 80) if not isinstance(value, str) else _shown(value)


def check_server_facts(info: ServerInfo, raw: bytes) -> None:
    """Refuse a server whose facts no SGLang server states: an integer fact
    (:data:`SERVER_INTS`) that is no int (a bool, a float, a string) or out of bounds, a text fact
    (:data:`SERVER_TEXTS`) that is no string, longer than :data:`MAX_FACT_CHARS` or holds a NUL,
    or a key given twice in one JSON object. A fact that is absent or null is not refused.

    Raises
    ------
    UserError
        One line naming the URL, the field and the value.
    """
    where = f"{info.url}{info.endpoint}"
    if (key := duplicate_json_key(raw)) is not None:
        raise UserError(
            f"{where}: the key {_shown(key)} is given twice in one JSON object; which one holds is not known"
        )
    for key, (lower, upper) in SERVER_INTS.items():
        value = info.fact(key)
        if value is not None and implausible_count(value, lower=lower, upper=upper) is not None:
            what = "is outside " if isinstance(value, int) and not isinstance(value, bool) else "is not an integer in "
            raise UserError(f"{where}: {key} {_shown_value(value)} {what}[{lower}, {upper}] (fastverify/bounds.py)")
    for key in SERVER_TEXTS:
        value = info.fact(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_FACT_CHARS or "\0" in value):
            what = (
                f"a {type(value).__name__}, not a string"
                if not isinstance(value, str)
                else "holds a NUL"
                if "\0" in value
                else f"{len(value):,} characters, over {MAX_FACT_CHARS}"
            )
            raise UserError(f"{where}: {key} {_shown_value(value)}: {what}")


def fetch_server_info(url: str, timeout_s: float = REACH_TIMEOUT_S) -> ServerInfo:
    """The server's arguments from ``/server_info``, else ``/get_server_info`` (older SGLang),
    their facts checked (:func:`check_server_facts`).

    Raises
    ------
    UserError
        ``cannot reach <url>: <reason>``; one line naming the endpoint and what came back when the
        reply is not HTTP, never ends, is too large or redirects nowhere (:func:`http`); it
        answers, but neither endpoint with a JSON object; a fact out of bounds.
    """
    answers = []
    for endpoint in INFO_ENDPOINTS:
        try:
            status, raw = http("GET", url + endpoint, timeout_s=timeout_s)
        except ReplyError as e:
            raise UserError(str(e) if e.reached else f"cannot reach {url}: {e.reason}") from None
        if status == 200:
            try:
                info = orjson.loads(raw)
            except orjson.JSONDecodeError:
                info = None
            if isinstance(info, dict):
                server = ServerInfo(url, endpoint, raw, info)
                check_server_facts(server, raw)
                return server
            answers.append(f"{endpoint}: not a JSON object")
        else:
            answers.append(f"{endpoint}: HTTP {status}")
    raise UserError(f"{url} answers but is not an SGLang server ({'; '.join(answers)})")


def model_hidden_size(server: ServerInfo) -> int | None:
    """``hidden_size`` of the served model from ``<model_path>/config.json`` when that folder is on
    this machine (``text_config.hidden_size`` for Kimi-K2.5-style configs); else None.

    Raises
    ------
    UserError
        The config states a ``hidden_size`` that is no int or outside ``[1, MAX_HIDDEN]``, or
        gives a key twice.
    """
    path = server.fact("model_path")
    try:
        config = Path(path) / "config.json" if isinstance(path, str) else None
        if config is None or not config.is_file():
            return None
        raw = read_bytes(config, kind="text")
        doc = loads_json(raw, config)
    except (UserError, OSError, ValueError):  # unreadable, not JSON, a NUL or an over-long name
        return None
    if (key := duplicate_json_key(raw)) is not None:
        raise UserError(f"{config}: the key {_shown(key)} is given twice in one JSON object")
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]
    value = doc.get("hidden_size") if isinstance(doc, dict) else None
    if value is None:
        return None
    if why := implausible_count(value, lower=1, upper=MAX_HIDDEN, what="hidden_size"):
        raise UserError(f"{config}: hidden_size {why} (fastverify/bounds.py MAX_HIDDEN)")
    return value


def server_args(ctx: Context, limit_s: float) -> Outcome:
    """The server-info JSON read before the run (the reachability check), as received; its meta
    has the key facts and the verify shapes collect took from them."""
    s = ctx.server
    return ok(
        {ARCNAMES["server_args"]: s.raw},
        url=s.url,
        endpoint=s.endpoint,
        sglang_version=s.fact("version"),
        tp_size=s.fact("tp_size"),
        pp_size=s.fact("pp_size"),
        device=s.fact("device"),
        speculative_algorithm=s.fact("speculative_algorithm"),
        speculative_num_draft_tokens=s.fact("speculative_num_draft_tokens"),
        model_path=s.fact("model_path"),
        verify_shapes=ctx.shapes.as_meta(),
    )


def activities(server: ServerInfo) -> tuple[list[str], str]:
    """Profiler activities for the server and why: GPU kernels too on a CUDA server."""
    device = server.fact("device")
    if isinstance(device, str) and device:
        return (
            (["CPU", "GPU"], f"server device {device}")
            if device.startswith("cuda")
            else (["CPU"], f"server device {device}")
        )
    import torch

    cuda = torch.cuda.is_available()
    return (
        ["CPU", "GPU"] if cuda else ["CPU"]
    ), f"server names no device; CUDA {'is' if cuda else 'is not'} available here"


def _send_requests(url: str, n: int, deadline: float, statuses: list) -> None:
    body = {"text": REQUEST_PROMPT, "sampling_params": {"max_new_tokens": REQUEST_NEW_TOKENS, "temperature": 0}}
    for _ in range(n):
        left = deadline - time.monotonic()
        if left <= 1:
            return
        try:
            statuses.append(http("POST", url + "/generate", body, timeout_s=left)[0])
        except OSError as e:
            statuses.append(f"no answer: {e.reason if isinstance(e, ReplyError) else e}")


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
            say(
                f"collect: server_trace: {what} ({len(sizes)} of {expected} trace files so far, "
                f"{deadline - time.monotonic():.0f} s left)"
            )
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
    body = {
        "output_dir": str(folder),
        "num_steps": steps,
        "activities": acts,
        "profile_by_stage": False,
        "merge_profiles": False,
    }
    tp, pp = s.fact("tp_size"), s.fact("pp_size")
    expected = (tp if isinstance(tp, int) and tp > 0 else 1) * (pp if isinstance(pp, int) and pp > 0 else 1)
    meta = {
        "output_dir": str(folder),
        "num_steps": steps,
        "cycles_asked": ctx.cycles,
        "activities": acts,
        "activities_why": why_acts,
        "expected_files": expected,
        "traffic": "collect sent requests" if ctx.send_requests else "the server's own",
    }
    try:
        status, text = http("POST", s.url + "/start_profile", body, timeout_s=min(30.0, limit_s))
    except OSError as e:  # ReplyError: one line naming the URL and what came back
        return failed(str(e), **meta)
    if status != 200:
        return failed(f"POST {s.url}/start_profile: HTTP {status}: {_shown(text.decode(errors='replace'))}", **meta)
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
        return failed(
            f"no complete profile: fewer than {steps} scheduler steps ran in {waited:.0f} s (maybe none): "
            "send traffic to the server while collect runs, or lower --cycles (the server writes the "
            f"traces into {folder}: run collect on the server's machine)",
            out,
            **meta,
        )
    return ok(out, **meta)
