"""The ``--server`` URL of ``fastverify collect`` (and of ``launch``'s proof run), checked before
any request: ``http://host:port``, nothing else."""

from __future__ import annotations

import re
import urllib.parse

from fastverify.errors import UserError, shown

__all__ = ["normalise_url"]


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
