"""Open files of a process, one descriptor per file, shared by the threads reading it by offset.

:class:`Descriptors` keeps at most :data:`MAX_FDS` files open; the sources read by
offset (:mod:`quern.pipeline.sources.indexed`) read through it with ``os.pread``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["MAX_FDS", "Descriptors"]

MAX_FDS = 256
"""Open files kept per process."""


class Descriptors:
    """This process's open files, by file index, each counted while in use (``pread`` needs no lock).

    At most :data:`MAX_FDS` are kept; beyond that the least recently used ones not in use are closed.
    A file dropped (or evicted) while a thread reads it is closed when that thread is done. After a fork
    the inherited descriptors (the child's own copies) are closed and files are opened again.
    """

    def __init__(self) -> None:
        self._fds: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # k -> [fd, users]
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forked(self) -> None:
        if self._pid != os.getpid():
            for fd, _ in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._pid = os.getpid()

    @contextlib.contextmanager
    def use(self, k: int, path: str) -> Iterator[int]:
        """The open descriptor of file ``k`` (``path``), held open while the block runs."""
        with self._lock:
            self._forked()
            entry = self._fds.get(k)
            if entry is None:
                entry = self._fds[k] = [os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), 0]
            entry[1] += 1
            self._fds.move_to_end(k)
            while len(self._fds) > MAX_FDS:
                idle = next((j for j, e in self._fds.items() if e[1] == 0), None)
                if idle is None:
                    break
                os.close(self._fds.pop(idle)[0])
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                gone = self._fds.get(k) is not entry  # dropped or evicted meanwhile: closed by its last user
                if gone and entry[1] == 0 and self._pid == os.getpid():
                    os.close(entry[0])

    def drop(self, k: int) -> None:
        """Forget file ``k``'s descriptor (closed now, or by the thread using it when it is done)."""
        with self._lock:
            entry = self._fds.pop(k, None) if self._pid == os.getpid() else None
            if entry is not None and entry[1] == 0:
                os.close(entry[0])

    def close(self) -> None:
        """Close every descriptor not in use (one in use is closed by its last user)."""
        with self._lock:
            entries = list(self._fds.values()) if self._pid == os.getpid() else []
            self._fds.clear()
            for fd, users in entries:
                if users == 0:
                    os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
