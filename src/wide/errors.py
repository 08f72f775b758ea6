"""The one exception type `wide` raises for bad user input, and the warning type for doubtful input.

The CLI turns a :class:`WideError` into a single line on stderr and exit code 2, with no traceback, and a
:class:`WideWarning` into a single line ``wide <command>: warning: <message>`` (the command goes on).
"""


class WideError(ValueError):
    """Bad input: the message names the offending value and what is allowed."""


class WideWarning(UserWarning):
    """Input that works but is probably not what was meant: the message names the file or value and what to do."""
