"""The project's one user-facing error type."""


class SiftError(Exception):
    """One-line, user-facing error naming the problem and the fix; the CLI prints it without a traceback."""
