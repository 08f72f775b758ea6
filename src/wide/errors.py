"""The one exception type `wide` raises for bad user input.

The CLI turns a :class:`WideError` into a single line on stderr and exit code 2, with no traceback.
"""


class WideError(ValueError):
    """Bad input: the message names the offending value and what is allowed."""
