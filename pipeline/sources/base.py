"""The source protocol and what every source shares: paths, ids, handles, file identity and file stats.

What identities cover and why files are checked after every read is in
``docs/design/sources.md``.
"""

from __future__ import annotations

import collections
import glob as _glob
import hashlib
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..core.errors import SourceError

__all__ = [
    "FileStats",
    "HandlePool",
    "Source",
    "Stat",
    "ThreadLocalHandles",
    "check_ids",
    "expand_paths",
    "file_identity",
    "group_by",
    "host_name",
    "sample_hash",
    "sample_ids",
    "sample_ranges",
]


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[str]:
    """The files named by a glob, a path, or a list of paths and globs.

    Args:
        paths: a path or glob, or a list of them.
        what: the source's name, for the messages.

    Returns:
        The files, in the order given, each glob's matches sorted.

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        ValueError: no path is given.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if any(c in p for c in "*?["):
            matches = sorted(_glob.glob(p))
            if not matches:
                raise FileNotFoundError(f"{what}: no file matches {p!r}")
            out.extend(matches)
        else:
            if not os.path.exists(p):
                raise FileNotFoundError(f"{what}: file not found: {p!r}")
            out.append(p)
    if not out:
        raise ValueError(f"{what}: no files given")
    return out


def group_by(keys: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """The positions of each distinct key.

    Args:
        keys: an integer array.

    Yields:
        ``(key, positions)`` for each distinct key, keys ascending, each key's
        positions ascending.

    Example:
        >>> [(k, p.tolist()) for k, p in group_by(np.array([2, 0, 2]))]
        [(0, [1]), (2, [0, 2])]
    """
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    bounds = np.flatnonzero(np.diff(sorted_keys)) + 1
    for chunk in np.split(order, bounds):
        if chunk.size:
            yield int(keys[chunk[0]]), chunk


def check_ids(ids: np.ndarray | Sequence[int], n: int, name: str) -> np.ndarray:
    """Record ids as a flat ``int64`` array, checked to lie in ``[0, n)``.

    Args:
        ids: the record ids asked for.
        n: the number of records of the source.
        name: the source, for the message.

    Returns:
        The ids, flattened.

    Raises:
        IndexError: an id is out of range (the first, named).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)][0]
        raise IndexError(f"{name}: record {int(bad)} out of range [0, {n})")
    return ids


class Source:
    """Base class of sources: subclasses set ``name`` and implement ``__len__`` and ``read_many``.

    Attributes:
        name: the source's name in ``explain`` and messages.
    """

    name: str = "source"

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_many(self, ids: np.ndarray) -> Sequence[Any]:  # pragma: no cover - abstract
        """The records ``ids``, in that order, read in bulk.

        Args:
            ids: record ids in ``[0, len(self))``; they may repeat.

        Returns:
            One record per id: a list, or rows already stacked (``CollatedRows``).

        Raises:
            IndexError: an id is out of range.
            SourceError: the data cannot be read.
        """
        raise NotImplementedError

    def __getitem__(self, i: int) -> Any:
        return self.read_many(np.asarray([i], dtype=np.int64))[0]

    def __getitems__(self, ids: Sequence[int]) -> Sequence[Any]:
        return self.read_many(np.asarray(ids, dtype=np.int64))

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name and length; subclasses add what describes their data
            (see ``docs/design/sources.md``).
        """
        return {"type": type(self).__name__, "name": self.name, "len": len(self)}

    def record_labels(self, ids: np.ndarray) -> list[int | str]:
        """How ``explain`` names records ``ids``: by their ids (a flat map's outputs: their record and index)."""
        return np.asarray(ids, dtype=np.int64).tolist()

    def config_base(self) -> tuple[Source, tuple[Any, ...]]:
        """The source a config names for this one, and the record transforms that make its records from that one's.

        ``(self, ())``; a flat map's outputs: its inner source and the transforms up to the flat map.
        """
        return self, ()

    def block_size(self) -> int:
        """The natural read granularity in records (a row group's size).

        Returns:
            Records per block; 1 for pure random access.
        """
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, len={len(self)})"


_WHOLE_FILE_MAX = 1 << 20  # files up to this size are hashed whole
_HEAD = 64 << 10  # bigger files: their first _HEAD bytes,
_TAIL = 128 << 10  # their last _TAIL bytes (ArrayRecord's zero padding is under 64 KiB),
_BLOCKS, _BLOCK = 16, 4 << 10  # and _BLOCKS blocks of _BLOCK bytes, one centred in each 1/_BLOCKS of the file


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges of a file of ``size`` bytes that :func:`sample_hash` reads.

    Args:
        size: the file's size in bytes.

    Returns:
        ``[(start, stop), ...]``: the whole file up to 1 MiB, else its first 64 KiB,
        16 blocks of 4 KiB (one centred in each sixteenth) and its last 128 KiB.

    Example:
        >>> sample_ranges(10), len(sample_ranges(1 << 30))
        ([(0, 10)], 18)
    """
    if size <= _WHOLE_FILE_MAX:
        return [(0, size)]
    centres = [(2 * j + 1) * size // (2 * _BLOCKS) for j in range(_BLOCKS)]
    return [(0, _HEAD), *((c - _BLOCK // 2, c + _BLOCK // 2) for c in centres), (size - _TAIL, size)]


def sample_hash(path: str, size: int) -> str:
    """A hash of the bytes of ``path`` in :func:`sample_ranges` of ``size``.

    A file of at most 1 MiB is hashed whole, so any byte changed in it changes
    the hash; a bigger one over 256 KiB of sampled ranges, so a change confined
    to its other bytes does not (see ``docs/design/sources.md``).

    Args:
        path: the file.
        size: its size in bytes.

    Returns:
        32 hex digits, depending only on the sampled bytes (not on the path's
        folder or the modification time).
    """
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for start, stop in sample_ranges(size):
            f.seek(start)
            h.update(f.read(stop - start))
    return h.hexdigest()


def file_identity(
    paths: list[str], counts: Sequence[int] | np.ndarray, *, names: Sequence[str] | None = None
) -> list[dict]:
    """The identity of a source's files: name, size, record count and sampled hash of each.

    Any change of a file's name, size or record count changes it, as does any
    change touching a range :func:`sample_hash` reads. The folder and the
    modification time are not part of it: a copy of the files elsewhere keeps
    the identity.

    Args:
        paths: the files.
        counts: the record count of each.
        names: the files' URLs when ``paths`` are their copies in the disk cache
            (their base names are used).

    Returns:
        ``[{"file", "size", "records", "sample"}, ...]``, one per file, in order.
    """
    out = []
    for k, (p, c) in enumerate(zip(paths, counts)):
        size = os.path.getsize(p)
        name = os.path.basename(p) if names is None else names[k].rstrip("/").rsplit("/", 1)[-1]
        out.append({"file": name, "size": size, "records": int(c), "sample": sample_hash(p, size)})
    return out


def sample_ids(n: int, k: int = 5) -> list[int]:
    """Record ids sampled for an identity: the first, the last and one keyed id per stratum.

    Args:
        n: the number of records.
        k: the number of equal strata of ``[0, n)``; each holds one id placed by a
            hash of ``n``.

    Returns:
        Sorted distinct ids, depending only on ``n`` and ``k`` (the same in every
        process and session).

    Example:
        >>> sample_ids(3), sample_ids(0)
        ([0, 1, 2], [])
    """
    if n <= 0:
        return []
    key = hashlib.blake2b(f"quern.sample_ids:{n}".encode(), digest_size=8 * k).digest()
    ids = {0, n - 1}
    for j in range(k):
        lo, hi = j * n // k, (j + 1) * n // k
        if hi > lo:
            ids.add(lo + int.from_bytes(key[8 * j : 8 * j + 8], "little") % (hi - lo))
    return sorted(ids)


class ThreadLocalHandles:
    """Per-process, per-thread dicts of open handles, dropped on pickling and after a fork."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._pid = os.getpid()

    def get(self) -> dict:
        """This thread's dict of handles (empty in a new thread or process).

        Returns:
            A dict the caller fills (key -> open handle).
        """
        if self._pid != os.getpid():  # forked: never share handles with the parent
            self._local = threading.local()
            self._pid = os.getpid()
        d = getattr(self._local, "handles", None)
        if d is None:
            d = self._local.handles = {}
        return d

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()
        self._pid = os.getpid()


class HandlePool:
    """Idle open handles per key, shared by the threads of one process.

    A thread borrows a handle for one call (:meth:`take`) and gives it back
    (:meth:`give`), so no handle is used by two threads at once and handles
    opened once are reused by every thread. Dropped on pickling and after a
    fork.

    Args:
        limit: the most idle handles kept; beyond it the least recently given
            back are dropped (which closes them).
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._idle: collections.OrderedDict = collections.OrderedDict()  # key -> [handles], least recent first
        self._count = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, key: Any) -> Any:
        """Borrow an idle handle of ``key``.

        Args:
            key: what the handle opens (a file index).

        Returns:
            The handle, now this caller's alone, or ``None`` when none is idle.
        """
        with self._lock:
            if self._pid != os.getpid():
                self._idle.clear()
                self._count, self._pid = 0, os.getpid()
            handles = self._idle.get(key)
            if not handles:
                return None
            self._count -= 1
            return handles.pop()

    def give(self, key: Any, handle: Any) -> None:
        """Give back (or lend for the first time) an idle handle of ``key``.

        Args:
            key: what the handle opens.
            handle: the handle; the caller uses it no more.
        """
        with self._lock:
            if self._pid != os.getpid():
                return
            self._idle.setdefault(key, []).append(handle)
            self._idle.move_to_end(key)
            self._count += 1
            while self._count > self.limit:
                oldest, handles = next(iter(self._idle.items()))
                if handles:
                    handles.pop(0)
                    self._count -= 1
                if not handles:
                    del self._idle[oldest]

    def __getstate__(self) -> dict:
        return {"limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        HandlePool.__init__(self, state["limit"])


def host_name() -> str:
    """This machine's name: file stats (inodes, times) are compared only on the machine that took them.

    Returns:
        ``os.uname().nodename``.
    """
    return os.uname().nodename


Stat = tuple[int, int | None, int | None, int | None, int | None]  # size, mtime_ns, ctime_ns, inode, device


class FileStats:
    """What a source's files were when it opened them, to refuse reading them once changed.

    Holds each file's ``(size, mtime_ns, ctime_ns, inode, device)``, taken
    before the source reads it: a reader of a file truncated, rewritten or
    replaced under it returns empty, stale or other records without an error.
    The change time is there because the modification time can be set back
    (``os.utime``, ``touch -d``, ``rsync -t``) and the change time cannot: a
    ``write()`` or ``truncate()`` sets it, and so does a change of the file's
    metadata (mode, owner, links, times), which is refused too. Pickled to
    another machine (where inodes and times differ), the size is kept and the
    rest is taken at the first check there. Not seen: a same-size rewrite that
    keeps the inode within one tick of the file system's clock (coarse clocks;
    kernels from 6.13 use fine-grained change times once a file's times were
    read), and a write through a shared writable mapping to a page already
    dirty, which changes no time.

    Args:
        what: the source, for the messages.
        paths: its files.
        ctime: whether the change time is compared (``False`` for files of the
            disk cache, whose access time, and so change time, a hit sets; they
            are verified when fetched and never written in place).

    Raises:
        SourceError: a file cannot be stat'ed.
    """

    def __init__(self, what: str, paths: Sequence[str], *, ctime: bool = True) -> None:
        self.what, self.paths, self.host, self.ctime = what, list(paths), host_name(), ctime
        self.stats: list[Stat] = [self._stat(i) for i in range(len(self.paths))]

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        if self.host != host_name():  # another machine: other inodes and times; the size stays
            self.stats = [(size, None, None, None, None) for size, *_ in self.stats]
            self.host = host_name()

    def _stat(self, i: int, gone: str = "cannot stat it") -> Stat:
        try:
            st = os.stat(self.paths[i])
        except OSError as e:
            raise SourceError(f"{self.what}: {self.paths[i]!r}: {gone}: {e}") from e
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns if self.ctime else 0, st.st_ino, st.st_dev

    def check(self, i: int) -> None:
        """Check that file ``i`` is still the file the source opened (one ``os.stat``).

        Args:
            i: the file's index in ``paths``.

        Raises:
            SourceError: naming the file, if it was removed, resized, modified or replaced.
        """
        want = self.stats[i]
        now = self._stat(i, "it was removed since the source opened it")
        if want[1] is None and now[0] == want[0]:  # first check on this machine: its own times and inode
            self.stats[i] = now
            return
        if now != want:
            what = (
                f"its size went from {want[0]} to {now[0]} bytes"
                if now[0] != want[0]
                else (
                    "it was replaced by another file"
                    if now[3:] != want[3:]
                    else ("it was modified" if now[1] != want[1] else "it was written, or its metadata changed")
                )
            )
            raise SourceError(
                f"{self.what}: {self.paths[i]!r} changed since the source opened it ({what}): reads of a file "
                "truncated or rewritten under an open reader return empty or wrong records; open a new source "
                "to read it"
            )
