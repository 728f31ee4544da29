"""Errors the commands turn into a one-line message and a non-zero exit."""


class NotFound(Exception):
    """A run, job or file the user named does not exist (or has no such output)."""
