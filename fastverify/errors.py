"""The one exception type for user mistakes.

A :class:`UserError` reaches the command line as one line on stderr and exit code 2, never as a
traceback. Raise it for bad input (a truncated trace, an unknown preset, a config missing a field);
let programming errors raise anything else.
:func:`schema_error` says a msgspec validation error of a hand-written JSON document in that one
line: the field, the expected type in words and an example.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class UserError(Exception):
    """Bad input from the user. ``str(err)`` is the one line printed; it names the file or value."""


EXIT_USER_ERROR = 2


MAX_ERROR_CHARS = 600
"""Longest error line printed. A message that quotes an input (a 10 MB env-file line, a huge JSON
value) is cut in the middle so the one line stays readable and still names the file first."""


def printable(text: object) -> str:
    """``text`` safe for a terminal: control characters (C0 but tab and newline, DEL, C1: the
    ``ESC[2J`` of a hostile file name) as ``\\x..`` escapes, and the undecodable bytes of a
    non-UTF-8 path (``os.fsdecode``'s lone surrogates) as the ``\\x..`` of each byte."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # surrogateescape: the original byte
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch in "\t\n" or ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
    return "".join(out)


def path_text(path: object) -> str:
    """A path as valid UTF-8 text for records and JSON: the undecodable bytes of a non-UTF-8 name
    (``os.fsdecode``'s lone surrogates) as ``\\x..`` escapes; any other path as it is."""
    s = str(path)
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def one_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` on one line (newlines shown as spaces), terminal-safe (:func:`printable`) and at
    most ``limit`` characters: a longer one keeps its start (the file and the value's beginning)
    and its end (the reason), and says how many characters were left out."""
    text = " ".join(printable(message).splitlines())
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 4
    return f"{text[:head]} … [{len(text) - head - tail:,} characters left out] … {text[-tail:]}"


_TYPE_WORDS = {
    "str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "null": "null",
    "object": "an object", "array": "an array", "bytes": "a base64 string", "datetime": "an ISO 8601 date-time",
}
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`(?P<rest>.*?)(?:, got (?:`(?P<got>[^`]+)`|(?P<got_n>\S+)))?$", re.S)
_FIELD_MSG = re.compile(r"^Object (?P<kind>missing required|contains unknown) field `(?P<name>[^`]*)`$", re.S)
_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$", re.S)
_INDEX = re.compile(r"\[[0-9]+\]|\[<key>\]")
MAX_FIELD_CHARS = 80
"""Longest field path said in a schema error (a hostile key is cut, never printed whole)."""


def _type_words(spec: str) -> str:
    """msgspec's type name (``int | null``) in words (``an integer or null``)."""
    return " or ".join(_TYPE_WORDS.get(part.strip(), f"`{part.strip()}`") for part in spec.split("|"))


def _example(path: str, examples: Mapping[str, str]) -> str:
    """``"<key>": <example>`` for the field at ``path`` (``ranks[0].window_us``), or ``""``: the
    normalised path (``ranks.window_us``), then its shorter suffixes (``window_us``), then its
    prefixes (``ranks``) are looked up in ``examples``."""
    parts = [p for p in _INDEX.sub("", path).split(".") if p]
    keys = [".".join(parts[i:]) for i in range(len(parts))]
    keys += [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    for key in keys:
        if key in examples:
            return f'"{key.rsplit(".", 1)[-1]}": {examples[key]}'
    return ""


def schema_error(where: str, err: Exception, examples: Mapping[str, str]) -> UserError:
    """One line for a hand-written JSON document that does not fit its schema.

    Parameters
    ----------
    where : str
        What the line starts with: the file (and line, ``verify-rank0.jsonl:4``), optionally
        with what the document is (``x.deploy.json: invalid deployment record``).
    err : msgspec.ValidationError
        The error of ``msgspec.json.decode(..., type=...)`` or ``msgspec.convert``.
    examples : mapping of str to str
        Field name (or dotted path, ``shapes.hidden``) → an example value as JSON text
        (``'"0"'``, ``"4096"``); the keys of a top-level record are listed for an unknown field.

    Returns
    -------
    UserError
        ``<where>: field "rank": expected a string, got an integer (e.g. "rank": "0")``: the
        field path (``[...]`` for a dict key), the expected type in words, what was found, and an
        example when ``examples`` has one for that field; an error not about one field (the
        document is not an object) is ``<where>: expected an object, got an array``.
    """
    m = _AT.match(" ".join(str(err).split()))
    msg, path = m.group("msg"), (m.group("path") or "").lstrip(".").replace("[...]", "[<key>]")
    what = msg[:1].lower() + msg[1:]
    if (f := _FIELD_MSG.match(msg)) is not None:
        path = f"{path}.{f.group('name')}".lstrip(".")
        if f.group("kind") == "missing required":
            what = "missing"
        else:
            top = [k for k in examples if "." not in k]
            what = "unknown" + (f" (the fields are {', '.join(top)})" if "." not in path and top else "")
    elif (e := _EXPECTED.match(msg)) is not None:
        got = e.group("got")
        what = f"expected {_type_words(e.group('want'))}{e.group('rest')}"
        if got or e.group("got_n"):
            what += f", got {_type_words(got) if got else e.group('got_n')}"
    elif (v := _ENUM.match(msg)) is not None:
        what = f"{v.group('value')} is not one of the allowed values"
    if not path:
        return UserError(f"{where}: {what}")
    shown = printable(path)
    if len(shown) > MAX_FIELD_CHARS:
        shown = shown[:MAX_FIELD_CHARS] + "…"
    ex = _example(path, examples) if len(path) <= MAX_FIELD_CHARS else ""
    return UserError(f'{where}: field "{shown}": {what}' + (f" (e.g. {ex})" if ex else ""))
