"""The files beside a cache entry by which processes coordinate: ``.lock``, ``.use`` and ``.part``.

- ``NAME.lock``: a download of ``NAME`` holds an exclusive ``flock`` on it
  (:func:`flock`), so a file is fetched once however many processes want it.
- ``NAME.use``: a reader holds a shared ``flock`` on it (:func:`pin`, or
  :func:`flock`); eviction takes it exclusively without waiting
  (:func:`unused`), or leaves the entry.
- ``NAME.PID.THREAD.part``: a download in progress; :func:`remove_part` removes
  one whose process is gone.

Lock and use files are opened with ``O_NOFOLLOW``: one planted as a link is
never followed. The design is in ``docs/design/remote-cache.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

__all__ = ["LOCK_FLAGS", "Pin", "flock", "pin", "remove_part", "unused"]

LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # a lock or use file planted as a link is never followed


@contextlib.contextmanager
def flock(path: str, mode: int) -> Iterator[int]:
    """Context manager: ``path`` (made if missing) locked with ``flock`` for the block.

    Args:
        path: the lock or use file.
        mode: ``fcntl.LOCK_EX`` or ``fcntl.LOCK_SH``.

    Yields:
        The file descriptor holding the lock (closing it releases the lock).
    """
    fd = os.open(path, LOCK_FLAGS, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


class Pin:
    """A shared lock on a cache entry's use file, released by :meth:`close` (or when collected).

    Args:
        fd: the file descriptor holding the lock.
    """

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


def pin(entry: str) -> Pin:
    """Hold ``entry`` in use (never evicted): a shared ``flock`` on ``entry.use``.

    Args:
        entry: the entry's path.

    Returns:
        The pin; its ``close()`` releases it.

    Raises:
        FileNotFoundError: the entry's folder is missing.
    """
    fd = os.open(entry + ".use", LOCK_FLAGS, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return Pin(fd)


@contextlib.contextmanager
def unused(entry: str) -> Iterator[bool]:
    """Context manager: whether ``entry`` is in use by nobody, kept so for the block.

    The exclusive lock on ``entry.use`` is tried without waiting and held for
    the block when taken.

    Args:
        entry: the entry's path.

    Yields:
        ``True`` when the lock was taken (the entry may be removed), ``False``
        when the entry is in use or its use file cannot be opened.
    """
    try:
        fd = os.open(entry + ".use", LOCK_FLAGS, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except BlockingIOError:
            free = False  # in use
        yield free
    finally:
        os.close(fd)


def remove_part(part: str) -> None:
    """Remove ``part`` (``NAME.PID.THREAD.part``) unless its download may still run.

    It may while its process is this one, or is alive.

    Args:
        part: the path of the part file.
    """
    try:
        pid = int(part.rsplit(".", 3)[-3])
    except (IndexError, ValueError):
        pid = -1
    if pid == os.getpid():
        return
    if pid > 0:
        try:
            os.kill(pid, 0)
            return  # still downloading
        except (ProcessLookupError, OverflowError):
            pass
        except PermissionError:
            return
    with contextlib.suppress(FileNotFoundError):
        os.remove(part)
