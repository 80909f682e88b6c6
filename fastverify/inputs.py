"""The one way fastverify opens a file it reads.

Every input a command reads (a trace, a model config, ``nvidia-smi topo -m`` text, an NCCL log, a
perf table, a profile or deployment record, an env file) goes through :func:`read_bytes` /
:func:`read_text` / :func:`read_json`, so that a hostile file is refused at once, in one line that
names the file, with exit code 2 (:class:`fastverify.errors.UserError`):

- only a regular file is read: a FIFO, a device (``/dev/zero``), a socket or a directory is refused
  before any byte is read, so nothing hangs and nothing fills memory;
- a size cap per kind of input (:data:`CAPS`), checked on the file's size and again while reading
  (a file that grows) and, for a gzip trace, on the inflated size (a gzip bomb);
- text inputs must be text (no NUL byte) and decode errors name the file and the byte;
- a JSON object that gives one key twice is refused (parsers keep the last value silently, so a
  hand-edited record would say one thing and do another), unless the caller opts out for a large
  document such as a trace (:func:`loads_json`'s ``unique_keys``);
- an integer of more digits than Python converts (4,300 by default, ``sys.int_info``) is one
  line saying the number is too large, never the parser's advice to raise the limit;
- JSON nesting is bounded by the parser: orjson >= 3.9.15 and msgspec >= 0.18 raise on deep
  nesting, which is mapped to one line. Where an older orjson shadows the pinned one (a venv made
  with ``--system-site-packages``), :func:`loads_json` says so once on stderr and parses with the
  standard library instead, which raises RecursionError rather than crashing.

Measured here (``orjson.loads`` on a 200,000-deep array, Python 3.11): 3.8.3, 3.8.14, 3.9.0 ... 3.9.14
die with SIGSEGV; 3.9.15 and 3.10.0 raise ``JSONDecodeError: array and object recursion depth
exceeded`` (already at 1,100 levels). msgspec 0.18.0 and 0.23.0 raise RecursionError at 1,100.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any

import msgspec

from fastverify.bounds import duplicate_json_key
from fastverify.errors import UserError, one_line, shown

GiB = 1 << 30
MiB = 1 << 20

#: Largest file read, per kind of input (bytes). Traces of a real TP-8 verify run are ~60 MB
#: gzipped and ~0.6 GB inflated, so the trace cap leaves a wide margin; text inputs are a few KB.
CAPS = {
    "trace": 2 * GiB,  # a trace file as stored (gzip or JSON)
    "json": 512 * MiB,  # profile records, verify logs, deployment records, journals
    "log": 512 * MiB,  # NCCL_DEBUG logs, which may be a whole server's stderr
    "text": 16 * MiB,  # model config, nvidia-smi text, perf tables, env files, box descriptions
}
#: Largest inflated size of a gzip trace (bytes).
TRACE_INFLATED_CAP = 4 * GiB

#: First orjson release whose ``loads`` raises on deep nesting instead of crashing (see above).
ORJSON_FLOOR = (3, 9, 15)


def _name(path: Path, flag: str | None) -> str:
    return f"{flag} {path}" if flag else str(path)


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _cannot(p: Path, flag: str | None, what: str | None, e: OSError) -> UserError:
    return UserError(f"{_name(p, flag)}: cannot read{' ' + what if what else ''} ({e.strerror or e})")


def _not_regular(p: Path, flag: str | None, what: str | None, mode: int) -> UserError:
    return UserError(
        f"{_name(p, flag)}: cannot read{' ' + what if what else ''}: is {_kind_of(mode)}; give a regular file"
    )


def check_regular(path: str | Path, *, flag: str | None = None, what: str | None = None) -> Path:
    """Refuse anything but an existing regular file (symlinks followed), without opening it.

    Raises
    ------
    UserError
        Missing, unreadable, a directory, a FIFO, a device or a socket: one line naming it.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise _cannot(p, flag, what, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(p, flag, what, st.st_mode)
    return p


def read_bytes(path: str | Path, *, kind: str = "text", flag: str | None = None, what: str | None = None) -> bytes:
    """The bytes of a regular file of at most ``CAPS[kind]`` bytes.

    The file is opened with ``O_NONBLOCK`` and checked again with ``fstat`` after opening, so a FIFO
    swapped in after :func:`check_regular` still cannot block the open.

    Parameters
    ----------
    path : str or Path
    kind : {"trace", "json", "log", "text"}
        Selects the size cap (:data:`CAPS`).
    flag : str, optional
        The command-line flag that named the file, for the message.
    what : str, optional
        What the file is ("the deployment record"), for the "cannot read" message.

    Raises
    ------
    UserError
        As :func:`check_regular`, or the file is larger than the cap (message gives both sizes).
    """
    cap = CAPS[kind]
    p = check_regular(path, flag=flag, what=what)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _cannot(p, flag, what, e) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(p, flag, what, st.st_mode)
        if st.st_size > cap:
            raise UserError(f"{_name(p, flag)}: {_size(st.st_size)} is over the {_size(cap)} limit for a {kind} input")
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise _cannot(p, flag, what, e) from None
    if len(data) > cap:  # grew while being read
        raise UserError(f"{_name(p, flag)}: over the {_size(cap)} limit for a {kind} input")
    return data


def inflate_trace(raw: bytes, path: str | Path, *, flag: str | None = None) -> bytes:
    """``raw`` inflated if it is gzip (magic bytes), else ``raw``; at most :data:`TRACE_INFLATED_CAP`.
    A file of several gzip members (``cat a.gz b.gz``) inflates to their texts one after the other,
    as ``zcat`` and Python's ``gzip`` read it; zero bytes after the last member are allowed.

    Raises
    ------
    UserError
        Truncated or corrupt gzip, other bytes after the gzip data, or an inflated size over the cap.
    """
    if raw[:2] != b"\x1f\x8b":
        return raw
    import zlib

    try:  # python-isal inflates about 1.5x faster than zlib; same format and the same max_length API
        from isal.igzip_lib import DECOMP_GZIP, IgzipDecompressor, IsalError

        def member():
            return IgzipDecompressor(DECOMP_GZIP)

        errors: tuple = (EOFError, OSError, zlib.error, IsalError)
    except ImportError:  # pragma: no cover - isal is a declared dependency

        def member():
            return zlib.decompressobj(16 + zlib.MAX_WBITS)

        errors = (EOFError, OSError, zlib.error)
    d = member()
    name = _name(Path(path), flag)
    parts: list[bytes] = []
    total = 0
    while True:  # a gzip file may hold several members, read one after the other (RFC 1952 2.2)
        try:
            out = d.decompress(raw, TRACE_INFLATED_CAP + 1 - total)
            eof = d.eof
        except errors as e:
            raise UserError(f"{name}: truncated or corrupt gzip ({e})") from None
        total += len(out)
        if total > TRACE_INFLATED_CAP:
            raise UserError(f"{name}: inflates to over the {_size(TRACE_INFLATED_CAP)} limit for a trace")
        if not eof:
            raise UserError(f"{name}: truncated or corrupt gzip (the stream ends early)")
        parts.append(out)
        raw = d.unused_data
        if not raw.strip(b"\0"):  # nothing more, or zero padding (which gzip itself allows)
            break
        if raw[:2] != b"\x1f\x8b":
            raise UserError(
                f"{name}: {len(raw)} bytes after the end of the gzip data that are not "
                "another gzip member (a damaged or appended-to file?)"
            )
        d = member()
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_text(
    path: str | Path, *, kind: str = "text", flag: str | None = None, errors: str = "strict", what: str | None = None
) -> str:
    """A text file (UTF-8) of at most ``CAPS[kind]`` bytes.

    Parameters
    ----------
    errors : str
        ``"strict"``: bytes that are not UTF-8 are an error naming the offset; ``"replace"``: they
        become U+FFFD (logs from other tools may carry stray bytes).

    Raises
    ------
    UserError
        As :func:`read_bytes`; a NUL byte (a binary file, not text); invalid UTF-8 when strict.
    """
    data = read_bytes(path, kind=kind, flag=flag, what=what)
    w = " " + what if what else ""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise UserError(
            f"{_name(Path(path), flag)}: cannot read{w}: a binary file (NUL byte at offset {nul}), not text"
        )
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{_name(Path(path), flag)}: cannot read{w}: not UTF-8 text (byte {e.start})") from None


_warned_old_orjson = False


def _version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def orjson_problem() -> str | None:
    """One line when the orjson that imports is older than :data:`ORJSON_FLOOR` (or missing):
    which copy, from where, and the fix; None when it is safe to use."""
    try:
        import orjson
    except ImportError:
        return f"orjson is not installed; fix: pip install 'orjson>={'.'.join(map(str, ORJSON_FLOOR))}'"
    ver = getattr(orjson, "__version__", "0")
    if _version(ver) >= ORJSON_FLOOR:
        return None
    where = os.path.dirname(getattr(orjson, "__file__", "") or "?")
    return (
        f"orjson {ver} from {where} shadows the required >={'.'.join(map(str, ORJSON_FLOOR))} "
        f"(it crashes on deeply nested JSON); using the slower standard json parser. "
        f"Fix: {sys.executable} -m pip install 'orjson>={'.'.join(map(str, ORJSON_FLOOR))}'"
    )


def _not_json(name: str, what: str | None, detail: str) -> UserError:
    return UserError(f"{name}: {what + ' is ' if what else ''}not valid JSON ({detail})")


def _too_large(name: str, what: str | None) -> UserError:
    """The one line for an integer Python will not convert (over ``sys.get_int_max_str_digits()``
    digits), instead of the parser's advice to raise that limit."""
    digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300
    return UserError(
        f"{name}: {what or 'the JSON'} holds a number too large to be real (an integer of over {digits:,} digits)"
    )


class _FloatOverflow(ValueError):
    """A JSON number past a float's range (``1e999``), which ``float()`` turns into infinity."""


def _finite_float(text: str) -> float:
    """``parse_float`` for :func:`json.loads`: the number, or :class:`_FloatOverflow` where it
    overflows (the literals ``Infinity`` and ``NaN`` are ``parse_constant``'s, not this)."""
    value = float(text)
    if math.isinf(value):
        raise _FloatOverflow(text[:40])
    return value


def _past_float(name: str, what: str | None) -> UserError:
    """The one line for a number past a float's range (msgspec: "Number out of range")."""
    return UserError(f"{name}: {what or 'the JSON'} holds a number past a float's range (such as 1e999)")


def _huge_int(e: BaseException) -> bool:
    """Whether ``e`` is a parser's refusal of an integer over Python's digit limit: the standard
    library's "Exceeds the limit (4300 digits) for integer string conversion", msgspec's "Integer
    value out of range"."""
    text = str(e)
    return "integer string conversion" in text or text.startswith("Integer value out of range")


def _check_unique_keys(data: bytes | str, name: str, what: str | None) -> None:
    """Refuse a JSON object of ``data`` (already parsed once, so valid and bounded) giving a key twice."""
    if (key := duplicate_json_key(data)) is not None:
        raise UserError(
            f"{name}: {what + ': ' if what else ''}the key {shown(repr(key), 80)} is given twice in one "
            "object; which value holds is not known"
        )


def loads_json(
    data: bytes | str,
    path: str | Path,
    *,
    flag: str | None = None,
    what: str | None = None,
    exact_ints: bool = False,
    unique_keys: bool = True,
):
    """Parse JSON text from ``path`` with nesting bounded; every decode error is one line.

    Uses orjson when it is at least :data:`ORJSON_FLOOR`; otherwise warns once on stderr
    (:func:`orjson_problem`) and uses :func:`json.loads`. NaN, which orjson rejects, falls back to
    :func:`json.loads` too. orjson reads an integer wider than 64 bits as a float (measured: 3.13.0
    reads ``10**20`` as ``1e+20``); ``exact_ints`` parses with :func:`json.loads` alone, for small
    documents whose integers must stay exact (a size in a box description, a model's shapes).
    ``what`` names the document in the error (``"the box description"``); ``path`` may be any
    label (``"--describe-box"``, ``"x.jsonl line 3"``). ``unique_keys`` (default) refuses an object
    giving a key twice, which costs a second parse (about as long as the first): a caller reading
    a large document whose keys do not matter that way (a profiler trace) passes False.

    Raises
    ------
    UserError
        ``<path>: [<what> is ]not valid JSON (<parser's words>)``, nested deeper than the parser
        allows, an integer of over Python's 4,300 digits ("too large"), or a key given twice.
    """
    name = _name(Path(path), flag)
    doc = _loads(data, name, what, exact_ints)
    if unique_keys:
        _check_unique_keys(data, name, what)
    return doc


def _loads(data: bytes | str, name: str, what: str | None, exact_ints: bool):
    """:func:`loads_json`'s parse, without the key check."""
    global _warned_old_orjson
    problem = None if exact_ints else orjson_problem()
    if not exact_ints and problem is None:
        import orjson

        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as e:
            if "recursion" in str(e) or "depth" in str(e):  # 3.9.15: "recursion depth", 3.13: "depth limit"
                raise UserError(f"{name}: JSON nested too deeply ({_first_line(e)})") from None
    elif problem is not None and not _warned_old_orjson:
        _warned_old_orjson = True
        print(f"fastverify: warning: {one_line(problem)}", file=sys.stderr)
    try:
        return json.loads(data, parse_float=_finite_float)
    except RecursionError:
        raise UserError(f"{name}: JSON nested too deeply (over Python's recursion limit)") from None
    except _FloatOverflow:
        raise _past_float(name, what) from None
    except (ValueError, TypeError) as e:
        if _huge_int(e):
            raise _too_large(name, what) from None
        raise _not_json(name, what, _first_line(e)) from None


def decode_json(
    data: bytes,
    path: str | Path,
    type: Any = Any,
    *,
    flag: str | None = None,
    what: str | None = None,
    unique_keys: bool = True,
):
    """Decode JSON ``data`` from ``path`` with msgspec, into ``type`` (default: plain objects);
    :func:`loads_json`'s one line for text that is not JSON, nests too deeply, holds an integer of
    over Python's 4,300 digits or (``unique_keys``, as there) gives a key twice in one object.

    Raises
    ------
    UserError
        Not JSON, nested deeper than msgspec allows, a number too large, or a key given twice.
    msgspec.ValidationError
        Valid JSON that is not a ``type``: the caller names the schema it wanted.
    """
    name = _name(Path(path), flag)
    try:
        doc = msgspec.json.decode(data, type=type)
    except msgspec.ValidationError as e:
        if _huge_int(e):
            raise _too_large(name, what) from None
        if str(e).startswith("Number out of range"):
            raise _past_float(name, what) from None
        raise
    except msgspec.DecodeError as e:
        raise _not_json(name, what, _first_line(e)) from None
    except RecursionError:  # msgspec bounds nesting (see the module docstring)
        raise UserError(f"{name}: JSON nested too deeply (over the decoder's limit)") from None
    if unique_keys:
        _check_unique_keys(data, name, what)
    return doc


def read_json(path: str | Path, *, kind: str = "json", flag: str | None = None, what: str | None = None):
    """:func:`read_bytes` then :func:`loads_json`."""
    return loads_json(read_bytes(path, kind=kind, flag=flag, what=what), path, flag=flag)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
