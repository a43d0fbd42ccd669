"""How a failed command ends: one bounded message on stderr, and the exit status of its error.

A message is ``quern: ...``: quern's own errors as they are, others with their
class name, without the worker traceback a worker's error carries, and at most
:data:`MAX_MESSAGE` characters (``--traceback`` shows all of it). The status of an
error is :data:`~quern.pipeline.cli.parser.EXIT_DATA` for the data's errors and
unexpected ones, :data:`~quern.pipeline.cli.parser.EXIT_USAGE` for bad arguments,
configs and state files.
"""

from __future__ import annotations

import re

from ..core.errors import (
    CollateError,
    ConfigError,
    FingerprintError,
    PrepareError,
    ScanError,
    ServiceError,
    SourceError,
    StepError,
    WorkerError,
)
from .parser import EXIT_DATA, EXIT_USAGE

__all__ = ["MAX_MESSAGE", "clip", "expected", "message", "status"]

MAX_MESSAGE = 4000
"""The most characters of one error message (the rest is left out; ``--traceback`` shows it)."""

_DATA_ERRORS = (StepError, SourceError, WorkerError, CollateError, ScanError, PrepareError, ServiceError)
_USAGE_ERRORS = (ValueError, IndexError, OSError, FingerprintError)  # ConfigError is a ValueError
_OWN_ERRORS = (*_DATA_ERRORS, ConfigError, FingerprintError)  # their messages say what failed without the class name


def clip(text: str) -> str:
    """``text`` in at most :data:`MAX_MESSAGE` characters, saying how many were left out.

    Args:
        text: a message.

    Returns:
        ``text``, or its first :data:`MAX_MESSAGE` characters and the count of the others.
    """
    if len(text) <= MAX_MESSAGE:
        return text
    return f"{text[:MAX_MESSAGE]}... ({len(text) - MAX_MESSAGE:,} more characters left out)"


def message(error: BaseException) -> str:
    """``error`` as one message (without the ``quern:`` prefix).

    Args:
        error: what a command raised.

    Returns:
        quern's own errors as they are, others with their class name; without the
        worker traceback a worker's error carries (``--traceback`` shows it); at most
        :data:`MAX_MESSAGE` characters.
    """
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = re.split(r"\n\n(?=[^\n]*traceback:\n)", text, maxsplit=1)[0]
    return clip(text if isinstance(error, _OWN_ERRORS) else f"{type(error).__name__}: {text}")


def expected(error: BaseException) -> bool:
    """Whether ``error`` is one a command expects: the data's, or bad arguments, config or state.

    An unexpected one's message says that ``--traceback`` shows where.

    Args:
        error: What the command raised.

    Returns:
        ``True`` for quern's data errors and the usage errors (``ValueError``,
        ``IndexError``, ``OSError``, :class:`FingerprintError`).
    """
    return isinstance(error, _DATA_ERRORS + _USAGE_ERRORS)


def status(error: BaseException) -> int:
    """The exit status of a command that raised ``error``.

    Args:
        error: what the command raised.

    Returns:
        :data:`EXIT_USAGE` for bad arguments, configs and state files; :data:`EXIT_DATA`
        for the data's errors (a :class:`CollateError` is a ``ValueError``, but the
        data's: data errors take precedence) and unexpected ones.

    Example:
        >>> status(ValueError("bad step")), status(StepError("step 3: ...")), status(RuntimeError())
        (2, 1, 1)
    """
    return EXIT_USAGE if expected(error) and not isinstance(error, _DATA_ERRORS) else EXIT_DATA
