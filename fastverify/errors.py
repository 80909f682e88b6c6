"""The one exception type for user mistakes.

A :class:`UserError` reaches the command line as one line on stderr and exit code 2, never as a
traceback. Raise it for bad input (a truncated trace, an unknown preset, a config missing a field);
let programming errors raise anything else.
"""


class UserError(Exception):
    """Bad input from the user. ``str(err)`` is the one line printed; it names the file or value."""


EXIT_USER_ERROR = 2
