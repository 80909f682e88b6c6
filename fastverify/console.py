"""The printers' rich console and the two ways they print text that came from an input.

Text from a file, a record, a bundle, a server reply or a description reaches the terminal only
through :func:`say` (a line) or :func:`cell` (a table cell): escaped to one line and capped by
:func:`fastverify.errors.shown`, as a :class:`rich.text.Text`, so rich neither reads ``[...]`` in it
as markup (a stray ``[/bold]`` raises) nor runs its highlighter over it (quadratic in the length of
some texts: a 300,000-character line took over a minute). The consoles of :func:`stdout_console`
highlight nothing either.
"""

from __future__ import annotations

import errno
import sys

from rich.console import Console
from rich.text import Text

from fastverify.errors import StdoutError, shown


def stdout_console(piped_width: int = 150) -> Console:
    """A console on stdout: the terminal's width, or ``piped_width`` columns where stdout is not a
    terminal (a pipe, a file); no highlighting.

    Raises
    ------
    StdoutError
        Stdout was closed by the shell (``>&-``), where rich would print to nowhere and succeed.
    """
    if sys.stdout is None:
        raise StdoutError(errno.EBADF, "it is closed")
    return Console(width=None if sys.stdout.isatty() else piped_width, highlight=False)


def cell(text: object) -> Text:
    """A table cell holding ``text`` (:func:`fastverify.errors.shown`: one escaped, capped line)."""
    return Text(shown(text))


def say(console: Console, text: object, style: str | None = None) -> None:
    """Print ``text`` as one line (:func:`cell`'s text), in ``style`` (``"yellow"``) when given. The
    line is never broken by rich (the terminal wraps it), so no part of an input starts a line."""
    console.print(Text(shown(text), style=style or ""), soft_wrap=True)
