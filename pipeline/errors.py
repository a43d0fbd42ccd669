"""Every error quern raises on purpose, in one place; every other module imports them from here.

Each message names what failed: the step and host slice, the stage, the
record ids and source, the file, or the config key.
"""

from __future__ import annotations

__all__ = [
    "StepError",
    "SourceError",
    "WorkerError",
    "CollateError",
    "ConfigError",
    "FingerprintError",
    "ScanError",
    "PrepareError",
]


class StepError(RuntimeError):
    """A stage failed while computing a step; the message names the step, host slice,
    stage and records, and ``__cause__`` is the original exception."""


class SourceError(RuntimeError):
    """A source could not be opened or read; the message names the file and record."""


class WorkerError(RuntimeError):
    """Worker processes cannot make progress: they cannot start, or keep dying."""


class CollateError(ValueError):
    """Records could not be collated; ``row`` is the offending row when one is to blame."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row


class ConfigError(ValueError):
    """A config is invalid; the message names every bad key path, value and expectation."""


class FingerprintError(TypeError):
    """A transform reads a value whose content the fingerprint cannot describe; the
    message names it and says how to declare it."""


class ScanError(RuntimeError):
    """A one-time scan over a source's records (a filter's predicate) failed; the
    message names the stage, the record and the source, and ``__cause__`` is the
    original exception."""


class PrepareError(RuntimeError):
    """``quern prepare`` met bad input (an unreadable file, an invalid JSON line, a map
    that raised or returned what cannot be a record, no record at all) or an output
    folder it must not write to; the message names the file and line or record."""


class RecordError(Exception):
    """One input record of ``quern prepare`` (or a whole piece of a file) that cannot
    be read or mapped: ``where`` names it (file and line, row or record), ``message``
    says why. Raised as a :class:`PrepareError`, or counted with ``--skip-errors``."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message
