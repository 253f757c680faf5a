"""The project's one user-facing error type, and the one-line description of any other failure."""
from __future__ import annotations


class SiftError(Exception):
    """One-line, user-facing error naming the problem and the fix; the CLI prints it without a traceback."""


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error behind wrappers: Ray's task errors carry theirs in `.cause`, others in `__cause__`."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)
        if not isinstance(inner, BaseException):
            inner = exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` of the innermost error (a Ray traceback never reaches the user)."""
    cause = root_cause(exc)
    if isinstance(cause, SiftError):
        return str(cause).splitlines()[0] if str(cause) else "SiftError"
    if isinstance(cause, OSError) and cause.strerror:
        where = f": {cause.filename}" if cause.filename else ""
        return f"{type(cause).__name__}: {cause.strerror}{where}"
    text = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
