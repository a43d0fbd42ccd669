"""TFRecord files read in place: each record's bytes, found by offset, with both CRCs checked.

A TFRecord file is a run of records, each framed as TensorFlow writes it: the
data's length (8 bytes, little-endian), the masked CRC-32C of those 8 bytes
(4 bytes), the data, and the masked CRC-32C of the data (4 bytes); a mask is
``((crc >> 15) | (crc << 17)) + 0xa282ead8`` modulo ``2**32``. The index
(:mod:`quern.pipeline.sources.offsets`) is made by one scan that checks every
length's CRC; a read checks both CRCs of the records it returns.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from ..core.errors import SourceError
from .contents import HashedFile, hashed
from .indexed import IndexedSource

__all__ = ["TFRecordSource", "masked_crc"]

_LENGTH = struct.Struct("<QI")  # the length and its masked CRC
_BLOCK = 4 << 20  # bytes the scan reads at once
_CHAIN = 1 << 20  # record boundaries checked at once at open


def _first_crc32c(data: bytes | memoryview) -> int:
    """``crc32c.crc32c(data)``, importing ``crc32c`` first and binding :data:`_crc32c` to it.

    Importing ``crc32c`` imports ``importlib.metadata``: about 40 ms that every ``import quern`` (each
    command) would otherwise pay. After the first call, a CRC costs a global lookup, as before.
    """
    global _crc32c
    import crc32c

    _crc32c = crc32c.crc32c
    return _crc32c(data)


_crc32c: Callable[[bytes | memoryview], int] = _first_crc32c


def masked_crc(data: bytes | memoryview) -> int:
    """The masked CRC-32C TFRecord frames hold.

    Args:
        data: the bytes.

    Returns:
        ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` modulo ``2**32``, ``crc`` their CRC-32C.

    Example:
        >>> hex(masked_crc(b""))
        '0xa282ead8'
    """
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class TFRecordSource(IndexedSource):
    """TFRecord files, read in place by offset; records are each record's data as ``bytes``.

    The files are indexed on first open (one sequential scan per file, in parallel
    over files, that checks each record's length CRC) and the index is kept in the
    cache, or taken from a sidecar written by ``quern index``
    (:mod:`quern.pipeline.sources.offsets`). Reads are grouped per file, one
    ``pread`` per run of consecutive records, and check both CRCs of every record:
    a bad CRC is a :class:`~quern.pipeline.core.errors.SourceError` naming the file and
    the record. GZIP- or ZLIB-compressed TFRecord files cannot be read by offset:
    they are refused, with what to do instead. Parse ``tf.train.Example`` records
    in a map (the bytes are what ``tf.data.TFRecordDataset`` yields).

    Args:
        paths: a path or glob, or a list of them; or URLs, fetched whole into the disk cache.
        name: the source's name (default: the first file's name without ``.tfrecord``).
        cache: the disk cache of remote files.
        index_cache: the folder of cached indexes (default: ``$QUERN_CACHE_DIR``, else ``~/.cache/quern``).
        index_threads: files scanned at once when indexes are built.

    Raises:
        FileNotFoundError: a glob matches nothing, or a path does not exist.
        SourceError: a file is empty, compressed, not TFRecord, has a bad length CRC or a
            truncated last record (naming the file and the record's byte offset).

    Example:
        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "a.tfrecord")
        ...     with open(path, "wb") as f:
        ...         for data in (b"ab", b"c"):
        ...             head = struct.pack("<Q", len(data))
        ...             _ = f.write(head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data)))
        ...     src = TFRecordSource(path, index_cache=d)
        ...     print(src.name, len(src), src.read_many(np.array([1, 0])))
        a 2 [b'c', b'ab']
    """

    FORMAT = "tfrecord"
    SUFFIXES = (".tfrecords", ".tfrecord", ".tfrec")

    @classmethod
    def check_inside(cls, fd: int, size: int, off: np.ndarray, content: str, name: str) -> str | None:
        """Why the index's boundaries are not the file's frames (``None``: they are).

        Frames chain: each record's frame is 16 bytes and its length (the little-endian u64 at
        its start) long, so ``offsets[k + 1] == offsets[k] + 16 + length[k]`` for every ``k``.
        With the ends checked (from byte 0 to the file's end), an index that passes is the
        scan's. The lengths are gathered with NumPy over a memory map, a million at once.

        Args:
            fd: the file, open for reading.
            size: its size.
            off: the index's offsets.
            content: its content hash (unused).
            name: how messages name it.

        Returns:
            ``None``, or the first record whose frame does not end where the next starts.
        """
        gaps = np.diff(off)
        short = np.flatnonzero(gaps < 16)
        if short.size:
            k = int(short[0])
            return (
                f"its record {k} at byte {int(off[k])} is {int(gaps[k])} bytes long, shorter than a frame's 16 "
                "(a record split: a forged or damaged index?)"
            )
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
            a = np.frombuffer(m, dtype=np.uint8)
            try:
                for lo in range(0, len(gaps), _CHAIN):
                    starts = off[lo : lo + _CHAIN]
                    starts = starts[: len(gaps[lo : lo + _CHAIN])]
                    lengths = a[starts[:, None] + np.arange(8)].view("<u8").ravel()
                    bad = np.flatnonzero(lengths != (gaps[lo : lo + _CHAIN] - 16).astype(np.uint64))
                    if bad.size:
                        k = lo + int(bad[0])
                        return (
                            f"its record {k} at byte {int(off[k])} ends at byte {int(off[k + 1])}, and the frame "
                            f"there ends at byte {int(off[k]) + 16 + int(lengths[bad[0]])} (records split or merged: "
                            "a forged or damaged index?)"
                        )
            finally:
                del a
        return None

    @classmethod
    def scan(cls, f: HashedFile | BinaryIO, size: int, name: str) -> np.ndarray:
        """The offsets of a TFRecord file's records, each length's CRC checked.

        Args:
            f: the file.
            size: its size.
            name: how messages name it.

        Returns:
            ``n + 1`` offsets.

        Raises:
            SourceError: a bad length CRC, or a last record cut short.
        """
        f = hashed(f, size, name)
        starts = [0]
        buf, at = b"", 0  # buf holds the file's bytes [at, at + len(buf))
        pos = 0
        while pos < size:
            if pos + 12 > at + len(buf):  # the next frame's head is not in the buffer
                f.seek(pos)
                buf, at = f.read(min(_BLOCK, size - pos)), pos
            if pos + 12 > at + len(buf):
                raise SourceError(
                    f"TFRecordSource: {name!r}: record {len(starts) - 1} at byte {pos} is cut short: the file ends "
                    f"{size - pos} bytes into its 12-byte length frame (truncated file?)"
                )
            length, crc = _LENGTH.unpack_from(buf, pos - at)
            if masked_crc(buf[pos - at : pos - at + 8]) != crc:
                raise SourceError(
                    f"TFRecordSource: {name!r}: record {len(starts) - 1} at byte {pos}: its length's CRC does not "
                    "match: the file is damaged, or not a TFRecord file (a compressed one must be decompressed first)"
                )
            end = pos + 16 + length
            if end > size:
                raise SourceError(
                    f"TFRecordSource: {name!r}: record {len(starts) - 1} at byte {pos} is cut short: it needs "
                    f"{16 + length} bytes and the file ends {size - pos} bytes after its start (truncated file?)"
                )
            starts.append(end)
            pos = end
        return np.asarray(starts, dtype=np.int64)

    def decode(self, file_index: int, record: int, data: memoryview) -> Any:
        """A record's data, both CRCs checked.

        Args:
            file_index: the file.
            record: the record's number in it.
            data: its frame.

        Returns:
            The data, as ``bytes``.

        Raises:
            SourceError: a CRC does not match, or the frame does not fit the index.
        """
        length, crc = _LENGTH.unpack_from(data)
        if len(data) != 16 + length or masked_crc(data[:8]) != crc:
            raise SourceError(
                f"TFRecordSource: {self.where(file_index, record)}: not a TFRecord frame where the index says "
                "(the file changed since it was indexed?)"
            )
        body = data[12 : 12 + length]
        if masked_crc(body) != struct.unpack_from("<I", data, 12 + length)[0]:
            raise SourceError(
                f"TFRecordSource: {self.where(file_index, record)}: its data's CRC does not match: the record is damaged"
            )
        return bytes(body)

    def config(self) -> dict[str, Any]:
        """This source's config section (``source: {type: tfrecord, ...}``).

        Returns:
            ``{"type": "tfrecord", "paths": ..., "name": ...}`` (URLs as given).
        """
        return {"type": "tfrecord", "paths": list(self.urls or self.paths), "name": self.name}
