"""The one exception type for user mistakes.

A :class:`UserError` reaches the command line as one line on stderr and exit code 2, never as a
traceback. Raise it for bad input (a truncated trace, an unknown preset, a config missing a field);
let programming errors raise anything else.
:func:`schema_error` says a msgspec validation error of a hand-written JSON document in that one
line: the field, the expected type in words and an example.
:func:`shown` is the one way a printer shows text that came from an input (one escaped line), and
:func:`print_guarded` the one place a closed or full standard output becomes that one line.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable, Mapping


class UserError(Exception):
    """Bad input from the user. ``str(err)`` is the one line printed; it names the file or value."""


EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 128 + 13
"""A reader that left (``fastverify report B | head``): the shell's code for a process killed by
SIGPIPE (13), with no message, as ``cat`` or ``git log`` end there."""


class StdoutError(OSError):
    """Standard output refused a write: a full device (``>/dev/full``), a closed pipe. Keeps the
    errno and strerror of the write's own error."""


class _GuardedStdout:
    """``sys.stdout`` during a command: the same stream, whose failed writes raise :class:`StdoutError`
    (and so are told apart from a failed write of an output file)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as err:
            raise StdoutError(err.errno, err.strerror) from None

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as err:
            raise StdoutError(err.errno, err.strerror) from None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _devnull_on(fd: int) -> None:
    """Put ``/dev/null`` on file descriptor ``fd`` (1 or 2), so that no file this process opens
    next takes the free number."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _hold_closed_stdout(*, always: bool = False) -> None:
    """Where the shell closed file descriptor 1 (``>&-``), put ``/dev/null`` there, so that no file
    this process opens lands on it and no child process writes its output into such a file.
    ``sys.stdout`` stays None (what ``>&-`` means to Python). ``always``: also over a broken pipe,
    so that nothing buffered is written to it again at exit."""
    if always or not _is_open(1):
        _devnull_on(1)


def _hold_closed_stderr() -> None:
    """Where the shell closed file descriptor 2 (``2>&-``: ``sys.stderr`` is None), put ``/dev/null``
    there and make ``sys.stderr`` write to it: what is meant for stderr goes nowhere, never onto
    stdout (a rich console given ``file=None`` writes to stdout) nor into a file this process
    opens next (which would take the free descriptor 2)."""
    if sys.stderr is not None:
        return
    if not _is_open(2):
        _devnull_on(2)
    sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's stderr from now on


def print_guarded(command: Callable[[], int]) -> int:
    """Run ``command`` (a CLI command; returns its exit code) with a standard output that says why
    it cannot be written: a closed one (``>&-``: ``sys.stdout`` is None) or one whose write fails
    (a full device) ends the command with ONE line on stderr and exit code
    :data:`EXIT_USER_ERROR`, never a traceback; a reader that left (a broken pipe) ends it silently
    with :data:`EXIT_BROKEN_PIPE`. A command that handles this itself (``profile``,
    whose files are its output) keeps its own answer. A closed stderr (``2>&-``) becomes
    ``/dev/null``: what is meant for it never lands on stdout."""
    _hold_closed_stderr()
    original = sys.stdout
    if original is None:
        _hold_closed_stdout()
    else:
        sys.stdout = _GuardedStdout(original)
    why = None
    try:
        return command()
    except StdoutError as err:
        if err.errno == errno.EPIPE:  # the reader left (``| head``): silent, as a tool killed by SIGPIPE
            _hold_closed_stdout(always=True)
            return EXIT_BROKEN_PIPE
        why = err.strerror or str(err)
    except AttributeError as err:  # None.write / None.isatty / None.flush: the output was closed
        if sys.stdout is not None or "'NoneType'" not in str(err):
            raise
        why = "it is closed"
    finally:
        if isinstance(sys.stdout, _GuardedStdout):
            sys.stdout = original
    sys.stderr.write(f"fastverify: error: cannot write to standard output ({printable(why)})\n")
    return EXIT_USER_ERROR


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


MAX_SHOWN_CHARS = 1000
"""Longest text from an input (a file, a record, a bundle, a server reply, a description) printed
in one piece: a longer one is cut in the middle with a marker saying how much was left out."""


def shown(text: object, limit: int | None = MAX_SHOWN_CHARS) -> str:
    """``text`` that came from an input, as ONE terminal-safe line for the printers.

    Control characters (C0, DEL, C1, the bidi and other format characters, line and paragraph
    separators, carriage return) are ``\\x..``/``\\u....`` escapes as in :func:`printable`, and a
    newline or tab is ``\\n``/``\\t``, so a note can neither move the cursor nor forge a line of
    its own. A text longer than ``limit`` characters (after escaping) keeps its start and end and
    says how many characters were left out; ``limit=None``: never cut (a command line to copy)."""
    s = printable(text)
    if "\n" in s or "\t" in s:
        s = s.replace("\n", "\\n").replace("\t", "\\t")
    if limit is None or len(s) <= limit:
        return s
    head, tail = limit * 2 // 3, limit // 4
    return f"{s[:head]} … [{len(s) - head - tail:,} characters left out] … {s[-tail:]}"


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
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "null": "null",
    "object": "an object",
    "array": "an array",
    "bytes": "a base64 string",
    "datetime": "an ISO 8601 date-time",
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
