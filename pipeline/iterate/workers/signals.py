"""Critical sections that a Ctrl-C cannot cut in two (:func:`sigint_deferred`)."""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["sigint_deferred"]


class _SigintDeferred:
    """See :func:`sigint_deferred`."""

    def __init__(self) -> None:
        self._old: Any = None
        self._got: list[tuple[int, Any]] = []

    def __enter__(self) -> _SigintDeferred:
        if threading.current_thread() is not threading.main_thread():
            return self  # KeyboardInterrupt is raised in the main thread only
        try:
            old = signal.getsignal(signal.SIGINT)
            if not callable(old):
                return self  # SIG_IGN or SIG_DFL: no Python code runs on Ctrl-C
            got = self._got

            def hold(signum: int, frame: Any) -> None:
                got.append((signum, frame))

            signal.signal(signal.SIGINT, hold)
        except ValueError:  # not the main interpreter
            return self
        self._old = old
        return self

    def __exit__(self, *exc: object) -> None:
        old, self._old = self._old, None
        if old is None:
            return
        signal.signal(signal.SIGINT, old)
        if self._got:  # the Ctrl-C that came meanwhile, now (KeyboardInterrupt by default)
            old(*self._got[0])


def sigint_deferred() -> _SigintDeferred:
    """A context manager inside which a Ctrl-C (SIGINT) cannot interrupt the main thread.

    The SIGINT handler runs when the block ends (by default raising
    ``KeyboardInterrupt`` there), once, if a Ctrl-C came meanwhile. For the short
    critical sections that must run to the end once started (stopping the workers,
    a message to the fork server). Nests; a no-op outside the main thread (no
    ``KeyboardInterrupt`` is raised there) or when SIGINT has no Python handler.

    Returns:
        The context manager (a fresh one per call).

    Example:
        >>> with sigint_deferred():
        ...     pass  # a Ctrl-C here is handled after the block
    """
    return _SigintDeferred()
