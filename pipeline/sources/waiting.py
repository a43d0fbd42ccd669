"""How long a read of a live source may wait for entries that do not exist yet.

A consumer that asks for a step (``pipe.batch_at(s)``, or ``next(it)``) waits at
most the source's ``timeout`` from when it asked. So a read made for the
consumer itself has that deadline, while a read made ahead of it (a prefetch
thread, a worker process) waits as long as it takes: the iterator times out
where the consumer waits, and prefetching never times out by itself. The threads
that compute ahead mark themselves :func:`patient`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["deadline", "gave_up", "patient"]

_LOCAL = threading.local()


@contextlib.contextmanager
def patient(stop: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within this block, this thread's reads of live sources wait without a deadline.

    Args:
        stop: called while waiting: when it returns true the read gives up
            (:class:`RuntimeError`), as when the iterator computing ahead is closed.

    Yields:
        Nothing.
    """
    before = getattr(_LOCAL, "stop", None), getattr(_LOCAL, "patient", False)
    _LOCAL.patient, _LOCAL.stop = True, stop
    try:
        yield
    finally:
        _LOCAL.stop, _LOCAL.patient = before


def deadline(timeout: float) -> float | None:
    """When a read starting now gives up: ``timeout`` seconds from now, or never on a patient thread.

    Args:
        timeout: the source's seconds.

    Returns:
        A ``time.monotonic()`` value, or ``None``.
    """
    return None if getattr(_LOCAL, "patient", False) else time.monotonic() + timeout


def gave_up() -> bool:
    """Whether a patient thread's ``stop`` says to give up now.

    Returns:
        ``stop()``, or ``False`` without one.
    """
    stop = getattr(_LOCAL, "stop", None)
    return bool(stop()) if stop is not None else False
