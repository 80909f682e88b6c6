"""The one exception type for user mistakes.

A :class:`UserError` reaches the command line as one line on stderr and exit code 2, never as a
traceback. Raise it for bad input (a truncated trace, an unknown preset, a config missing a field);
let programming errors raise anything else.
"""


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
