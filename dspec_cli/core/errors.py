"""Errors that the CLI reports as one line and a non-zero exit."""


class DspecError(Exception):
    """A user-facing error: bad input, mismatch, missing file. Message is one line."""

    exit_code = 1
