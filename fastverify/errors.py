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


def one_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` on one line (newlines shown as spaces) and at most ``limit`` characters: a longer
    one keeps its start (the file and the value's beginning) and its end (the reason), and says how
    many characters were left out."""
    text = " ".join(str(message).splitlines())
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 4
    return f"{text[:head]} … [{len(text) - head - tail:,} characters left out] … {text[-tail:]}"
