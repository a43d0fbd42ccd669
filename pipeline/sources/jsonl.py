"""JSON-lines files read in place: each line parsed, found by offset.

A record is a line holding a JSON value; lines holding only whitespace are no
records (they stay in the bytes of the record before them, where ``json.loads``
ignores them). The index (:mod:`quern.pipeline.sources.offsets`) is made by one
scan for newlines with NumPy, block by block, over the bytes it hashes. A line is parsed when
read: one that does not parse (nested past Python's recursion limit too), or lacks
``field``, is a :class:`~quern.pipeline.core.errors.SourceError` naming the file and the
line number.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

from ..core.errors import SourceError
from ..remote.cache import ShardCache
from .contents import HashedFile, hashed
from .indexed import IndexedSource

__all__ = ["JsonlSource"]

_BLOCK = 16 << 20  # bytes searched for newlines at once
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[9, 10, 13, 32]] = True  # what JSON calls whitespace


def _records(buf: bytes, base: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The starts and ends of the whole lines of ``buf`` (file bytes from ``base``) that hold more than whitespace.

    Returns:
        Their starts and ends (exclusive, newline excluded) in the file, and where in ``buf`` the
        bytes after its last newline (a line not yet whole) begin.
    """
    a = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.flatnonzero(a == 10)
    starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64) if len(newlines) else newlines
    ends = newlines.astype(np.int64)
    keep = ends > starts
    keep[keep] = ~_WHITESPACE[a[starts[keep]]]  # a line starting with other than whitespace holds more
    for i in np.flatnonzero((ends > starts) & ~keep).tolist():  # one starting with whitespace: looked at whole
        keep[i] = bool(buf[int(starts[i]) : int(ends[i])].strip(b" \t\r\n"))  # JSON's whitespace only
    rest = int(newlines[-1]) + 1 if len(newlines) else 0
    return starts[keep] + base, ends[keep] + base, rest


class JsonlSource(IndexedSource):
    r"""JSON-lines files, read in place by offset; a record is a line parsed with :func:`json.loads`.

    The files are indexed on first open (one scan per file for its newlines, in
    parallel over files), kept in the cache or taken from a sidecar written by
    ``quern index`` (:mod:`quern.pipeline.sources.offsets`); reads are grouped per
    file, one ``pread`` per run of consecutive lines. Lines of whitespace only hold no
    record and get no id. Gzip-compressed files (``.jsonl.gz``) cannot be read by
    offset: they are refused, with what to do instead.

    Args:
        paths: a path or glob, or a list of them; or URLs, fetched whole into the disk cache.
        field: the record is this key's value of each line's object (``None``: the whole
            parsed line).
        name: the source's name (default: the first file's name without ``.jsonl``).
        cache: the disk cache of remote files.
        index_cache: the folder of cached indexes (default: ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``).
        index_threads: files scanned at once when indexes are built.

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a file is empty, holds no line, or is compressed (naming it).

    Example:
        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "docs.jsonl")
        ...     with open(path, "w") as f:
        ...         _ = f.write('{"text": "a"}\n\n{"text": "b"}\n')
        ...     src = JsonlSource(path, field="text", index_cache=d)
        ...     print(src.name, len(src), src.read_many(np.array([1, 0])))
        docs 2 ['b', 'a']
    """

    FORMAT = "jsonl"
    SUFFIXES = (".jsonl", ".ndjson", ".json")
    FILLER = b" \t\r\n"  # JSON's whitespace: the lines before the first record and after the last

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        field: str | None = None,
        *,
        name: str | None = None,
        cache: ShardCache | None = None,
        index_cache: str | os.PathLike | None = None,
        index_threads: int | None = None,
    ) -> None:
        if field is not None and not isinstance(field, str):
            raise TypeError(f"JsonlSource: field must be a str or None, got {type(field).__name__}")
        self.field = field
        super().__init__(paths, name=name, cache=cache, index_cache=index_cache, index_threads=index_threads)

    @classmethod
    def check_inside(cls, fd: int, size: int, off: np.ndarray, content: str, name: str) -> str | None:
        """Why the index's boundaries are not the file's lines (``None``: they are).

        Every record but the first must start after a newline (NumPy over a memory map). If
        the file holds no other newline than those ending the records (counted with
        ``bytes.count``, about the cost of the hash), each record is one line and the index is
        the scan's. Else (blank lines, or a record of two lines) the file is scanned again and
        the offsets compared: about 20 times the cost of the hash. Done once per file content
        and index on a host (:meth:`~quern.sources.IndexedSource.fits`).

        Args:
            fd: the file, open for reading.
            size: its size.
            off: the index's offsets.
            content: its content hash: the bytes scanned again must have it.
            name: how messages name it.

        Returns:
            ``None``, or the first record whose boundaries differ from the file's lines.
        """
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
            a = np.frombuffer(m, dtype=np.uint8)
            bad = np.flatnonzero(a[off[1:-1] - 1] != 10)
            ends_line = bool(a[int(off[-1]) - 1] == 10)
            del a
        if bad.size:
            k = int(bad[0]) + 1
            return (
                f"its record {k} starts at byte {int(off[k])}, which does not follow a newline (a line split: a "
                "forged or damaged index?)"
            )
        newlines = sum(os.pread(fd, min(_BLOCK, size - at), at).count(b"\n") for at in range(0, size, _BLOCK))
        if newlines == len(off) - 2 + ends_line:
            return None
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            f.seek(0)
            hashed = HashedFile(f, size, name)
            lines = cls.scan(hashed, size, name)
            scanned = hashed.finish()
        if scanned != content:
            return "the file changed while it was checked"
        if len(lines) == len(off) and np.array_equal(lines, off):
            return None
        n = min(len(lines), len(off))
        k = int(np.flatnonzero(lines[:n] != off[:n])[0]) if np.any(lines[:n] != off[:n]) else n
        return (
            f"its {len(off) - 1} records are not the file's {len(lines) - 1} lines of JSON: its boundary {k} is at "
            f"byte {int(off[k]) if k < len(off) else size}, the line's at byte {int(lines[k]) if k < len(lines) else size} "
            "(lines split or merged: a forged or damaged index?)"
        )

    @classmethod
    def scan(cls, f: HashedFile | BinaryIO, size: int, name: str) -> np.ndarray:
        """The offsets of a JSON-lines file's records (its lines that hold more than whitespace).

        Args:
            f: the file.
            size: its size.
            name: how messages name it.

        Returns:
            ``n + 1`` offsets: record ``k`` runs from its line's start to the next record's
            (the lines of whitespace between them included), the last to its line's newline.
        """
        f = hashed(f, size, name)
        firsts, lasts = [], []
        carry, base = b"", 0  # the bytes from ``base`` after the last newline read: a line not yet whole
        while True:
            block = f.read(_BLOCK)
            buf = carry + block if block else carry + b"\n"  # the last line, newline or not
            first, last, rest = _records(buf, base)
            firsts.append(first)
            lasts.append(last)
            carry, base = buf[rest:], base + rest
            if not block:
                break
        first, last = np.concatenate(firsts), np.concatenate(lasts)
        if not len(first):
            return np.zeros(1, dtype=np.int64)
        stop = min(int(last[-1]) + 1, size)  # the last record's newline, if it has one
        return np.concatenate([first, [stop]]).astype(np.int64)

    def line_number(self, file_index: int, record: int) -> int:
        """The 1-based line number of a record in its file (counted by reading the file up to it).

        Args:
            file_index: the file.
            record: the record's number in it.

        Returns:
            Its line's number.
        """
        at = int(self._offsets[file_index][record])
        n = 0
        with open(self.paths[file_index], "rb") as f:
            while at > 0:
                block = f.read(min(at, 1 << 20))
                if not block:
                    break
                n += block.count(b"\n")
                at -= len(block)
        return n + 1

    def decode(self, file_index: int, record: int, data: memoryview) -> Any:
        """A line parsed (its ``field``'s value, with ``field``).

        Args:
            file_index: the file.
            record: the record's number in it.
            data: its line (and the blank lines after it).

        Returns:
            The parsed JSON value.

        Raises:
            SourceError: the line does not parse (or nests too deep to), lacks ``field``, or does
                not end where the index says (naming the file and the line).
        """
        off = self._offsets[file_index]
        if data[-1:] != b"\n" and int(off[record + 1]) != self.sizes[file_index]:
            raise SourceError(
                f"JsonlSource: {self.where(file_index, record)} does not end with a newline where the index says "
                "(the file changed since it was indexed?)"
            )
        try:
            obj = json.loads(bytes(data))
        except ValueError as e:
            line = self.line_number(file_index, record)
            raise SourceError(
                f"JsonlSource: {self.names[file_index]!r} line {line} (record {record}) is not valid JSON: {e}"
            ) from e
        except RecursionError:  # arrays or objects nested past what Python's parser recurses into
            line = self.line_number(file_index, record)
            raise SourceError(
                f"JsonlSource: {self.names[file_index]!r} line {line} (record {record}) nests arrays or objects "
                f"too deep to parse (past Python's recursion limit, {sys.getrecursionlimit()})"
            ) from None
        if self.field is None:
            return obj
        if not isinstance(obj, dict) or self.field not in obj:
            line = self.line_number(file_index, record)
            has = f"its keys: {sorted(obj)[:8]}" if isinstance(obj, dict) else f"it holds a {type(obj).__name__}"
            raise SourceError(
                f"JsonlSource: {self.names[file_index]!r} line {line} (record {record}) has no field "
                f"{self.field!r} ({has})"
            )
        return obj[self.field]

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The files' identity (:meth:`~quern.sources.IndexedSource.identity`) and ``field``.
        """
        return {**super().identity(), "field": self.field}

    def config(self) -> dict[str, Any]:
        """This source's config section (``source: {type: jsonl, ...}``).

        Returns:
            ``{"type": "jsonl", "paths": ..., "field": ..., "name": ...}`` (URLs as given).
        """
        return {"type": "jsonl", "paths": list(self.urls or self.paths), "field": self.field, "name": self.name}
