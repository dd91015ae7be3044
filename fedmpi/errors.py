"""Exceptions that the CLI turns into a one-line message and exit status 2."""
from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a config key, a file, a dataset, a log.

    The CLI prints ``fedmpi: error: <message>`` (no traceback) and exits with
    :data:`EXIT_USAGE`. The message must name the key or file and say what is
    expected.
    """


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or is out of range."""


class DataError(UserError):
    """A dataset or partition file is missing or malformed."""


class LogFormatError(UserError):
    """A file is not a readable fedmpi HDF5 log."""


EXIT_USAGE = 2
