"""The HTTP client of ``fastverify collect`` and ``launch`` (``urllib``): the ``--server`` URL checked
before any request (:func:`normalise_url`: ``http://host:port``, nothing else), then one request, its
redirects and its whole reply within one deadline, every failure one line (:class:`ReplyError`)."""

from __future__ import annotations

import http.client as http_client
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

import orjson

from fastverify.errors import UserError, printable, shown

MAX_REPLY_BYTES = 64 << 20
"""Largest server reply read (bytes): /server_info is a few KiB."""
SHOWN_CHARS = 80  # of a server's own text (a status line, a Location) quoted in a message


def _without_userinfo(text: str) -> str | None:
    """``text`` with the ``user:password@`` of its authority (RFC 3986 section 3.2.1) as ``***@``,
    or None when it has none."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" not in authority:
        return None
    return f"{scheme}{sep}***@{rest[len(authority.rsplit('@', 1)[0]) + 1 :]}"


def normalise_url(text: str) -> str:
    """``http://host:port`` from ``--server`` (``host:port`` gets ``http://``); no path, query or
    fragment beyond a trailing slash.

    Raises
    ------
    UserError
        One line for a URL that is not such: a user name or password in it (never printed: the
        line shows ``***@``), spaces or control characters, no host, an endpoint, a bad port."""
    if (hidden := _without_userinfo(text.strip())) is not None:
        raise UserError(
            f"--server {shown(hidden, 80)!r}: a URL with a user name or password is not taken (collect "
            "writes the URL into the bundle): give http://host:port"
        )
    url = text.strip()
    quoted = repr(text if len(text) <= 80 else text[:60] + "...")
    if "://" not in url:
        url = "http://" + url
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UserError(f"--server {quoted}: a URL holds no spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        (parts.hostname or "").encode("idna")  # a label over 63 characters, or empty, is no host name
    except (ValueError, UnicodeError) as e:  # urllib's "Invalid IPv6 URL"; the idna codec's refusal
        raise UserError(f"--server {quoted}: {' '.join(str(e).split())[:120]}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--server {quoted}: expected an HTTP URL such as http://127.0.0.1:30000")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise UserError(f"--server {quoted}: give the server's base URL (http://host:port), not an endpoint")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in 0-65535
    except ValueError as e:
        raise UserError(f"--server {quoted}: {e}") from None
    return f"{parts.scheme}://{parts.netloc}"


class ReplyError(OSError):
    """A request that got no usable reply. ``str()`` is one line naming the URL and what came back
    (or why nothing did); ``reason`` is that without the URL; ``reached`` is False when the server
    at the URL never answered (refused, unreachable, no bytes before the deadline)."""

    def __init__(self, method: str, url: str, reason: str, *, reached: bool) -> None:
        super().__init__(f"{method} {url}: {reason}")
        self.reason, self.reached = reason, reached


def shown_reply(text: object) -> str:
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
                    f"HTTP {code} redirect to {shown_reply(location)}, not an http(s) URL: not followed",
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


def _check_length(headers) -> None:
    """Refuse a ``Content-Length`` that is no byte count (negative, not a number, values that
    differ: RFC 9110 section 8.6), which ``http.client`` would ignore and read to the close.

    Raises
    ------
    ValueError
        Naming the header's value."""
    values = [v.strip() for h in headers.get_all("Content-Length") or () for v in str(h).split(",")]
    if values and (not all(v.isascii() and v.isdigit() for v in values) or len(set(map(int, values))) > 1):
        raise ValueError(f"a bad reply: Content-Length {shown_reply(', '.join(values))} is not one byte count")


def _what_came_back(e: BaseException) -> str:
    """A malformed reply in words (``http.client``'s exceptions)."""
    if isinstance(e, http_client.RemoteDisconnected):
        return "closed the connection without a reply"
    if isinstance(e, http_client.BadStatusLine):
        return f"not an HTTP reply (status line {shown_reply(e.line if isinstance(e.line, str) else e)})"
    if isinstance(e, http_client.IncompleteRead):
        return f"the body ends early or its chunked encoding is broken ({len(e.partial):,} bytes read)"
    if isinstance(e, http_client.HTTPException):
        text = " ".join(str(e).split()) or type(e).__name__
        return f"not an HTTP reply ({shown_reply(text)[1:-1]})"
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
                _check_length(r.headers)
                return r.status, _read_by(r, watch)
        except urllib.error.HTTPError as e:
            got = True
            with e:
                _check_length(e.headers)
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
        reason = f"redirect to {shown_reply(target)} {'refused' if refused else 'failed'} ({reason})"
    return ReplyError(method, url, reason, reached=reached)
