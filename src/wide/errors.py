"""The exception `wide` raises for bad input, and the warning for doubtful input (the CLI prints each as one line)."""


class WideError(ValueError):
    """Bad input: the message names the offending value and what is allowed."""


class WideWarning(UserWarning):
    """Input that works but is probably not what was meant."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
