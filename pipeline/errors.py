"""Every error quern raises on purpose, in one place; every other module imports them from here.

Each message names what failed: the step and host slice, the stage, the
record ids and source, the file, or the config key.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "StepError",
    "StepTimeoutError",
    "SourceError",
    "WorkerError",
    "CollateError",
    "ConfigError",
    "FingerprintError",
    "ScanError",
    "PrepareError",
    "exit_if_forked",
]


class StepError(RuntimeError):
    """A stage failed while computing a step; the message names the step, host slice,
    stage and records, and ``__cause__`` is the original exception."""


class StepTimeoutError(StepError, TimeoutError):
    """A step's batch did not come within the iterator's ``step_timeout`` seconds
    (``pipe.iterator(step_timeout=...)``); the message names the step, host slice, the
    stage it was stuck in, the timeout, and what became of the process or thread
    computing it (a worker is killed and replaced; a thread is left running). Both a
    :class:`StepError` and a ``TimeoutError``."""


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


def exit_if_forked(owner: int, role: str) -> None:
    """End this process at once (``os._exit(1)``, after saying why on stderr) if it is
    not process ``owner``: a process that a transform forked (``os.fork``) and that
    came back from the transform into quern's code instead of ending. Such a copy of
    ``role`` (``"worker process"``, say) would otherwise compute steps and answer in
    its place (two processes reading and writing one worker's socket), or wait
    forever for threads that do not exist in it."""
    pid = os.getpid()
    if pid == owner:
        return
    try:
        print(
            f"quern: process {pid} was forked (os.fork) by a transform in {role} {owner} and came back from the "
            "transform into quern's code instead of ending; it is ended now, so that it computes and sends nothing "
            f"in the place of process {owner}. End a forked child with os._exit(), or start processes with "
            "subprocess or multiprocessing",
            file=sys.stderr,
            flush=True,
        )
    finally:
        os._exit(1)
