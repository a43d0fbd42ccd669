"""Every error quern raises on purpose, in one place; every other module imports them from here.

Each message names what failed: the step and host slice, the stage, the
record ids and source, the file, or the config key.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "StepError",
    "StreamTimeoutError",
    "ServiceError",
    "StepTimeoutError",
    "SourceError",
    "WorkerError",
    "CollateError",
    "ConfigError",
    "FingerprintError",
    "ScanError",
    "PrepareError",
    "CapabilityError",
    "exit_if_forked",
]


class StepError(RuntimeError):
    """A stage failed while computing a step.

    The message names the step, the host slice, the stage and the records;
    ``__cause__`` is the original exception.
    """


class CapabilityError(TypeError, ValueError):
    """A stream lacks the capability a call needs (:mod:`quern.pipeline.streams.capabilities`).

    The message names the call, the kind of stream and the capability
    (``where() is not supported on a BucketedStream: it cannot be inverted``). Both
    a ``TypeError`` and a ``ValueError``, as the refusals it replaces were one or the other.
    """


class StepTimeoutError(StepError, TimeoutError):
    """A step's batch did not come within the iterator's ``step_timeout`` seconds.

    Raised by ``pipe.iterator(step_timeout=...)``. The message names the step,
    the host slice, the stage it was stuck in, the timeout, and what became of
    the process or thread computing it (a worker is killed and replaced; a
    thread is left running). Both a :class:`StepError` and a ``TimeoutError``.
    """


class StreamTimeoutError(StepError, TimeoutError):
    """A live stream did not hold a step's entries within its source's ``timeout`` seconds.

    Raised where the consumer waits (``batch_at``, ``next``); an iterator goes on
    waiting for the step when ``next()`` is called again.
    """


class EntriesTimeoutError(TimeoutError):
    """A live source's entries did not all exist within its ``timeout`` of a consumer's read.

    Internal, as :class:`RecordError` is: raised by the source (see :mod:`quern.pipeline.sources.waiting`);
    the step runner turns it into :class:`StreamTimeoutError`, naming the step.
    """


class SourceError(RuntimeError):
    """A source could not be opened or read.

    The message names the file (or URL) and, where one is to blame, the record.
    """


class WorkerError(RuntimeError):
    """Worker processes cannot make progress: they cannot start, or keep dying."""


class ServiceError(RuntimeError):
    """The preprocessing service cannot serve: its cluster is gone or too small, or its actors disagree.

    Raised by :class:`quern.RayService` and by an iterator that uses one; the
    message names the cluster's address (a step's own failure is a :class:`StepError`).
    """


class CollateError(ValueError):
    """Records could not be collated into one batch.

    Args:
        message: what disagrees, naming the key path and the row.
        row: the offending row, when one is to blame (kept as :attr:`row`).

    Attributes:
        row: the index of the offending row in the records, or ``None``.
    """

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row


class ConfigError(ValueError):
    """A config is invalid; the message names every bad key path, value and expectation."""


class FingerprintError(TypeError):
    """A value's content cannot be described for the fingerprint.

    Raised for a transform argument or a source record that is neither plain
    data nor an object with a ``fingerprint()`` method; the message names it
    and says how to declare it.
    """


class ScanError(RuntimeError):
    """A one-time scan over a source's records (a filter's predicate) failed.

    The message names the stage, the record and the source; ``__cause__`` is
    the original exception.
    """


class PrepareError(RuntimeError):
    """``quern prepare`` met bad input or an output folder it must not write to.

    Bad input: an unreadable file, an invalid JSON line, a map that raised or
    returned what cannot be a record, no record at all. The message names the
    file and the line or record.
    """


class RecordError(Exception):
    """One input record of ``quern prepare`` (or a whole piece of a file) that cannot be read or mapped.

    Internal to ``quern prepare``: it is raised as a :class:`PrepareError`, or
    counted with ``--skip-errors``.

    Args:
        where: names the record (file and line, row or record).
        message: says why it cannot be read or mapped.

    Attributes:
        where: as given.
        message: as given.
    """

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


def exit_if_forked(owner: int, role: str) -> None:
    """End this process at once if it is not process ``owner``.

    Such a process was forked (``os.fork``) by a transform and came back from
    the transform into quern's code instead of ending. A copy of ``role`` would
    otherwise compute steps and answer in its place (two processes reading and
    writing one worker's socket), or wait forever for threads that do not exist
    in it. It ends with ``os._exit(1)`` after saying why on stderr.

    Args:
        owner: the pid of the process that may go on.
        role: what ``owner`` is, for the message (``"worker process"``, say).
    """
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
