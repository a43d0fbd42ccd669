"""What a data file read by offset holds: a hash of all its bytes, and what this host remembers of it.

An offset index (:mod:`quern.pipeline.sources.offsets`) is made for the file whose
bytes hash to its *content hash*, the XXH3-128 of the whole file
(:func:`content_hash`): any byte changed, anywhere, gives another hash, so the
index is not used for it. Reading every file whole at every open would cost
more than the index saves, so the cache folder keeps a *record* per file (by
device and inode): the file's stat identity when it was hashed (size,
modification and change times in nanoseconds, inode, device) and the hash
(:func:`know`). While a file's stat identity is the one recorded, the hash is
taken from the record and the file is not read; a file written in place
changes its change time (``st_ctime_ns``, which no program can set back), and
is then hashed again. A record is trusted only if the file's times were at
least :data:`RACY_NS` older than the hash when it was taken: a file changed
within one tick of the file system's clock after being hashed keeps its times,
so a file that recent is hashed again at every open until it is older.

A record is a hint that saves reading: a missing, damaged or unwritable one
costs one read of the file, never a wrong hash. Records are made only here,
from a hash of the file this host just read; nothing fetched is one.

The hash and an index's scan are two reads of the file; a write between them
could give an index of other bytes than those hashed. So a scan reads the file
through a :class:`HashedFile`, which hashes every byte as it passes (the bytes
the scan skips are read and hashed too): the index is kept only if that hash is
the one the source looked it up by. What no stat field shows (a write through a
shared writable mapping to a page already dirty changes no time) is not seen
between two opens: a trusted record then gives the old hash for new bytes.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import time
import warnings
from collections.abc import Sequence
from typing import BinaryIO, NamedTuple

import xxhash

from ..core.errors import SourceError
from ..order.indexfile import cache_dir, write_atomically

__all__ = ["RACY_NS", "HashedFile", "Known", "content_hash", "hashed", "know", "record_path", "remember", "unchanged"]

RACY_NS = 2_000_000_000
"""How much older than its hash (ns) a file's times must be for its record to be trusted (clock ticks, skew)."""
_MAGIC = b"QUERNFS1"
_FIELDS = struct.Struct("<8sQqqQQ16s?7x")  # magic, size, mtime_ns, ctime_ns, inode, device, hash, trusted
_RECORD = struct.Struct(f"<{_FIELDS.size}s16s")  # the fields and their XXH3-128
_BLOCK = 8 << 20  # bytes hashed per read


class Known(NamedTuple):
    """A file's content hash and how it was known (:func:`know`)."""

    content: str
    """Its content hash (32 hex digits)."""
    stat: os.stat_result
    """Its stat when hashed (or when its record was found)."""
    hashed: bool
    """Whether it was read to hash it (``False``: its record gave the hash)."""
    before: str | None
    """The other hash the record of this file (its device and inode) held, if it held another: the file
    was changed in place since this host last hashed it."""


def _identity(st: os.stat_result, ctime: bool = True) -> tuple[int, int, int, int, int]:
    """Size, mtime, ctime (0 when ``ctime`` is false), inode and device: what a record is valid for."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns if ctime else 0, st.st_ino, st.st_dev


def content_hash(path: str, size: int, name: str | None = None) -> str:
    """The XXH3-128 of every byte of a file.

    Args:
        path: the file.
        size: its size in bytes (from the stat the caller took).
        name: how messages name it (default: ``path``).

    Returns:
        32 hex digits.

    Raises:
        SourceError: the file holds another number of bytes than ``size`` (it changed), or cannot be read.

    Example:
        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "a")
        ...     with open(path, "wb") as f:
        ...         _ = f.write(b"abc")
        ...     content_hash(path, 3) == xxhash.xxh3_128(b"abc").hexdigest()
        True
    """
    h = xxhash.xxh3_128()
    buf = bytearray(min(_BLOCK, max(size, 1)))
    view = memoryview(buf)
    total = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                h.update(view[:n])
                total += n
    except OSError as e:
        raise SourceError(f"{name or path!r}: cannot read it to hash its contents: {e}") from e
    if total != size:
        raise SourceError(f"{name or path!r} holds {total} bytes, not the {size} it had when opened: it changed")
    return h.hexdigest()


class HashedFile:
    """A file read forward once, every byte hashed as it passes: what a scan reads is what is hashed.

    The bytes returned are private copies (not a map of the page cache), and the bytes a
    scan skips are read and hashed too, so :meth:`finish` gives the XXH3-128 of exactly the
    bytes the scan's offsets were found in. Reads ahead :data:`_BLOCK` bytes at a time.

    Args:
        f: the file, open for reading from byte 0 (unbuffered).
        size: its size in bytes (from the stat the caller took).
        name: how messages name it.

    Example:
        >>> import io
        >>> h = HashedFile(io.BytesIO(b"abcdef"), 6, "x")
        >>> h.read_at(1, 2), h.read_at(4, 9)
        (b'bc', b'ef')
        >>> h.finish() == xxhash.xxh3_128(b"abcdef").hexdigest()
        True
    """

    def __init__(self, f: BinaryIO, size: int, name: str) -> None:
        self._f, self.size, self.name = f, size, name
        self._hash = xxhash.xxh3_128()
        self._buf, self._at = b"", 0  # the bytes [_at, _at + len(_buf)) of the file
        self._end = 0  # every byte before it was hashed
        self._pos = 0

    def _take(self, n: int) -> bytes:
        data = self._f.read(n)
        self._hash.update(data)
        self._end += len(data)
        return data

    def read_at(self, at: int, n: int) -> bytes:
        """The bytes ``[at, at + n)`` (fewer at the file's end); ``at`` never before an earlier read's start.

        Raises:
            ValueError: ``at`` lies before the start of the last read (a scan reads forward).
        """
        if at < self._at:
            raise ValueError(f"{self.name!r}: a read at byte {at} after one at byte {self._at}: scans read forward")
        end = min(at + n, self.size)
        if end > self._end:
            keep = self._buf[at - self._at :] if at < self._end else b""
            while self._end < at and self._take(min(_BLOCK, at - self._end)):  # skipped: hashed all the same
                pass
            self._at = min(at, self._end)
            parts, goal = [keep], max(end, min(self._end + _BLOCK, self.size))
            while self._end < goal and (chunk := self._take(goal - self._end)):
                parts.append(chunk)
            self._buf = b"".join(parts)
        return self._buf[at - self._at : max(at, end) - self._at]

    def seek(self, pos: int) -> int:
        """Where the next :meth:`read` starts."""
        self._pos = pos
        return pos

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes from the position (fewer at the file's end)."""
        data = self.read_at(self._pos, n)
        self._pos += len(data)
        return data

    def finish(self) -> str:
        """The content hash of the file: the bytes read, and the rest of the file read and hashed now.

        Raises:
            SourceError: the file holds another number of bytes than ``size`` (it changed).
        """
        self._buf = b""
        while self._end < self.size and self._take(min(_BLOCK, self.size - self._end)):
            pass
        if self._end != self.size or self._f.read(1):
            raise SourceError(
                f"{self.name!r} changed while it was indexed (its size): open it again once it is written"
            )
        return self._hash.hexdigest()


def hashed(f: HashedFile | BinaryIO, size: int, name: str) -> HashedFile:
    """``f`` as a :class:`HashedFile` (a plain file, open at byte 0, is wrapped in one): what a scan reads from.

    Args:
        f: a :class:`HashedFile`, or a file open for reading at byte 0 (unbuffered).
        size: its size in bytes.
        name: how messages name it.

    Returns:
        ``f`` itself, or a :class:`HashedFile` reading it.
    """
    return f if isinstance(f, HashedFile) else HashedFile(f, size, name)


def record_path(st: os.stat_result, folder: str | os.PathLike | None = None) -> str:
    """Where the record of the file of stat ``st`` is kept.

    Args:
        st: the file's stat.
        folder: the cache folder (default: ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``).

    Returns:
        ``offsets/files/<device>-<inode>`` in the cache folder.
    """
    return os.path.join(cache_dir(folder), "offsets", "files", f"{st.st_dev}-{st.st_ino}")


def _recall(st: os.stat_result, folder: str | os.PathLike | None, ctime: bool = True) -> tuple[str | None, bool]:
    """The hash the record of this file holds (``None``: none, or damaged) and whether it is for ``st`` and trusted."""
    try:
        with open(record_path(st, folder), "rb") as f:
            data = f.read(_RECORD.size + 1)
    except OSError:
        return None, False
    if len(data) != _RECORD.size:
        return None, False
    fields, digest = _RECORD.unpack(data)
    if xxhash.xxh3_128_digest(fields) != digest:
        return None, False
    magic, *ident, content, trusted = _FIELDS.unpack(fields)
    if magic != _MAGIC:
        return None, False
    return content.hex(), trusted and tuple(ident) == _identity(st, ctime)


def remember(
    st: os.stat_result, content: str, started_ns: int, folder: str | os.PathLike | None = None, *, ctime: bool = True
) -> bool:
    """Keep the record of a file hashed at stat ``st``.

    Args:
        st: the file's stat, taken before the hash (and found again after it).
        content: its content hash.
        started_ns: when the hash began (``time.time_ns()``): the record is trusted only if the
            file's times are at least :data:`RACY_NS` older.
        folder: the cache folder.
        ctime: whether the file's change time is part of what the record is valid for (``False``
            for files of the disk cache of remote files, whose change time moves at every use).

    Returns:
        Whether it was written (``False``: the cache folder cannot be written; the file will be
        hashed again at its next open).
    """
    trusted = max(st.st_mtime_ns, st.st_ctime_ns if ctime else 0) < started_ns - RACY_NS
    fields = _FIELDS.pack(_MAGIC, *_identity(st, ctime), bytes.fromhex(content), trusted)
    try:
        write_atomically(record_path(st, folder), [_RECORD.pack(fields, xxhash.xxh3_128_digest(fields))], durable=False)
    except OSError:
        return False
    return True


def unchanged(path: str, st: os.stat_result, name: str, *, ctime: bool = True) -> None:
    """Check that a file's stat identity (size, times, inode, device) is still ``st``.

    Args:
        path: the file.
        st: its stat when it was hashed.
        name: how messages name it.
        ctime: whether a new change time counts as a change (``False``: files of the disk cache).

    Raises:
        SourceError: it changed (or cannot be stat'ed).
    """
    try:
        now = os.stat(path)
    except OSError as e:
        raise SourceError(f"{name!r}: cannot stat it: {e}") from e
    if _identity(now, ctime) != _identity(st, ctime):
        raise SourceError(f"{name!r} changed while it was hashed or indexed: open it again once it is written")


def _hash(
    path: str, name: str, st: os.stat_result, before: str | None, folder: str | os.PathLike | None, ctime: bool
) -> Known:
    started = time.time_ns()
    content = content_hash(path, st.st_size, name)
    unchanged(path, st, name, ctime=ctime)
    if not remember(st, content, started, folder, ctime=ctime):
        warnings.warn(
            f"cannot keep the content hash of {name!r} in {os.path.dirname(record_path(st, folder))}: the file "
            "will be read whole to hash it again at every open",
            stacklevel=4,
        )
    return Known(content, st, True, before if before is not None and before != content else None)


def know(
    paths: Sequence[str],
    names: Sequence[str],
    folder: str | os.PathLike | None = None,
    *,
    threads: int | None = None,
    ctime: bool = True,
) -> list[Known]:
    """The content hash of each file: from its record while its stat identity is the record's, else read.

    Files without a trusted record for their stat identity are hashed in parallel, and
    their records written.

    Args:
        paths: the files.
        names: how messages name them.
        folder: the cache folder of the records.
        threads: files hashed at once (default: up to 8).
        ctime: whether a file's change time is part of its stat identity. ``False`` for files of the
            disk cache of remote files: the cache sets their times at every use (its eviction order),
            which moves the change time, and they are checked when fetched and never written in
            place; with ``True`` they would be read whole again at every open.

    Returns:
        One :class:`Known` per file, in order.

    Raises:
        SourceError: a file cannot be stat'ed or read, or changed while it was hashed.
    """
    out: list[Known | None] = []
    todo: list[tuple[int, os.stat_result, str | None]] = []
    for k, path in enumerate(paths):
        try:
            st = os.stat(path)
        except OSError as e:
            raise SourceError(f"{names[k]!r}: cannot stat it: {e}") from e
        content, trusted = _recall(st, folder, ctime)
        out.append(Known(content, st, False, None) if trusted and content is not None else None)
        if not trusted or content is None:
            todo.append((k, st, content))
    if len(todo) == 1:
        k, st, before = todo[0]
        out[k] = _hash(paths[k], names[k], st, before, folder, ctime)
    elif todo:
        workers = threads or max(1, min(8, os.cpu_count() or 1, len(todo)))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="quern-hash") as pool:
            done = pool.map(lambda t: _hash(paths[t[0]], names[t[0]], t[1], t[2], folder, ctime), todo)
            for (k, _, _), known in zip(todo, done):
                out[k] = known
    assert all(k is not None for k in out)
    return [k for k in out if k is not None]
